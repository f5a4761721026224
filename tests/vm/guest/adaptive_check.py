#!/usr/bin/env python3
"""Whether justitiad's answers show the adaptive law's allotments (daemon-adaptive.sh).

    adaptive_check.py STATUS.json FLOWS.json LATENCY_PID BANDWIDTH_PID

STATUS.json and FLOWS.json are `justitia status --json` and `justitia flows --json`. The
expected allotment is worked out here from the law's documented formula
(justitia_core::adaptive, steps 2-4), not taken from the daemon: with L, B and T the
tenants with active flows of each class (every weight 1), the bandwidth flows are paced
together at max(headroom x fraction x max(MaxRate - others' load, 0), B/(L+B+T) x MaxRate),
a tenant's part split equally among its active bandwidth flows; the chunk is at most the
target's slack, (band - 1) / band of Target99 at MaxRate, and never below 512 B; latency
flows get no allotment. The fraction and the others' load are the law's state, read from
the status; the allotment must be within 1 % of the figure (the others' load, a few KB/s
from the latency flow, moves between the two answers; unpaced, the flow would have all of
MaxRate, 2.5 % more). Prints "ok DETAIL" and exits 0, or prints why not and exits 1.
"""

import json
import sys

BAND = 1.2  # justitia_core::adaptive::DEFAULT_BAND
HEADROOM = 0.975  # justitia_core::adaptive::DEFAULT_HEADROOM
MIN_CHUNK = 512  # AdaptiveConfig::for_rnic's min_chunk_bytes


def fail(message):
    print(message)
    sys.exit(1)


def main(argv):
    if len(argv) != 4:
        fail("usage: adaptive_check.py STATUS.json FLOWS.json LATENCY_PID BANDWIDTH_PID")
    try:
        with open(argv[0]) as f:
            status = json.load(f)
        with open(argv[1]) as f:
            flows = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"unreadable answer: {e}")
    lat_pid, bw_pid = int(argv[2]), int(argv[3])
    law = status.get("adaptive")
    if not law:
        fail("the status has no adaptive state: the daemon does not run policy adaptive")
    by_pid = {f["pid"]: f for f in flows}
    lat, bw = by_pid.get(lat_pid), by_pid.get(bw_pid)
    if not lat or lat["class"] != "latency":
        fail(f"pid {lat_pid} is not a latency flow: {lat}")
    if not any(f["active"] and f["class"] == "latency" and f["tenant"] == lat["tenant"] for f in flows):
        fail(f"no latency flow of pid {lat_pid}'s tenant is active")
    if not bw or bw["class"] != "bandwidth" or not bw["active"]:
        fail(f"pid {bw_pid} is not an active bandwidth flow: {bw}")
    shaped = [f for f in flows if f["class"] == "latency" and f["allot_bytes_per_sec"] is not None]
    if shaped:
        fail(f"a latency flow has an allotment: {shaped[0]}")
    max_rate = status["max_rate"]
    target_ns = status["target_p99_ns"]
    if not target_ns:
        fail("Target99 not known yet")
    if abs(law["headroom"] - HEADROOM) > 1e-12:
        fail(f"headroom {law['headroom']}, not the law's {HEADROOM}")
    active = [f for f in flows if f["active"]]
    tenants = {
        c: len({f["tenant"] for f in active if f["class"] == c})
        for c in ("latency", "bandwidth", "throughput")
    }
    everyone = sum(tenants.values())
    floor = tenants["bandwidth"] / everyone * max_rate
    left = max(max_rate - law["other_bytes_per_sec"], 0.0)
    pace = max(HEADROOM * law["fraction"] * left, floor)
    own = [f for f in active if f["class"] == "bandwidth" and f["tenant"] == bw["tenant"]]
    expected = pace / tenants["bandwidth"] / len(own)
    got = bw["allot_bytes_per_sec"]
    if got is None or abs(got - expected) > 0.01 * expected:
        fail(
            f"bandwidth flow allotted {got} B/s, the law gives {expected:.0f} "
            f"(fraction {law['fraction']}, others' load {law['other_bytes_per_sec']:.0f} B/s, "
            f"L/B/T tenants {tenants['latency']}/{tenants['bandwidth']}/{tenants['throughput']}, "
            f"{len(own)} flows of its tenant)"
        )
    slack = target_ns * 1e-9 * (BAND - 1.0) / BAND * max_rate
    chunk = law["chunk_bytes"]
    if not MIN_CHUNK <= chunk <= max(slack, MIN_CHUNK) + 1:
        fail(f"chunk {chunk} B outside [{MIN_CHUNK}, slack {slack:.0f} B]")
    print(
        f"ok bandwidth flow at {got * 8e-9:.3f} Gb/s = max({HEADROOM} x {law['fraction']:.3f} x "
        f"(MaxRate {max_rate * 8e-9:.2f} - others {law['other_bytes_per_sec'] * 8e-9:.3f} Gb/s), "
        f"{tenants['bandwidth']}/{everyone} x MaxRate) / {len(own)}; chunk {chunk} B within the "
        f"slack of Target99 {target_ns / 1e3:.1f} us ({slack:.0f} B); latency flow unshaped"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
