#!/usr/bin/python3
"""Reads justitiad's metrics and flow table for tests/vm/guest/daemon-apps.sh.

  daemon_check.py scrape HOST:PORT OUT.json   fetch /metrics, parse it, save the samples
  daemon_check.py value OUT.json SAMPLE       print one sample's value (exit 1: absent)
  daemon_check.py p99 A.json B.json           probe p99 between two scrapes
  daemon_check.py flows FLOWS.json PID...     one line per pid from `justitia flows --json`

The exposition is parsed by python3-prometheus-client: by its OpenMetrics parser, which is
strict (it requires "# EOF", suffixes that match each family's type, cumulative buckets),
because the endpoint declares application/openmetrics-text, and by its Prometheus text
parser (prometheus_client.parser), the one a Prometheus-format scraper would use. Both must
accept the text and agree on every sample; the values saved are the text parser's.
A sample is saved as `name{label="value",...}` with its labels sorted, so the shell can
name it exactly. The raw text is saved beside OUT.json as OUT.txt.
"""

import json
import math
import sys
import urllib.request

PROBE_HISTOGRAM = "justitia_probe_latency_seconds"


def fail(message):
    print(f"daemon_check: {message}", file=sys.stderr)
    sys.exit(1)


def key(name, labels):
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}" if inner else name


def samples(families):
    out = {}
    for family in families:
        for s in family.samples:
            out[key(s.name, s.labels)] = s.value
    return out


def same(a, b):
    """Equal sample sets, a NaN equal to a NaN (Current99 is NaN until probes complete)."""
    if a.keys() != b.keys():
        return False
    return all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def scrape(addr, path):
    # Imported here: the other commands do not need the parsers, and under emulation every
    # import costs time.
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as openmetrics_families,
    )
    from prometheus_client.parser import text_string_to_metric_families as text_families

    try:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as response:
            status = response.status
            content_type = response.headers.get("Content-Type", "")
            text = response.read().decode("utf-8")
    except OSError as e:
        fail(f"fetching http://{addr}/metrics: {e}")
    raw = path[: -len(".json")] + ".txt" if path.endswith(".json") else path + ".txt"
    with open(raw, "w", encoding="utf-8") as f:
        f.write(text)
    if status != 200:
        fail(f"status {status} from http://{addr}/metrics")
    try:
        parsed = samples(text_families(text))
    except Exception as e:  # the parser raises ValueError and others on bad text
        fail(f"the Prometheus text parser refused the exposition ({raw}): {e!r}")
    if "openmetrics" in content_type:
        try:
            strict = samples(openmetrics_families(text))
        except Exception as e:
            fail(f"the OpenMetrics parser refused the exposition ({raw}): {e!r}")
        if not same(strict, parsed):
            differ = sorted(set(strict.items()) ^ set(parsed.items()))[:4]
            fail(f"the two parsers disagree on {differ} ({raw})")
    if not parsed:
        fail(f"no sample in the exposition ({raw})")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"content_type": content_type, "samples": parsed}, f, indent=1, sort_keys=True)


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["samples"]
    except (OSError, ValueError, KeyError) as e:
        fail(f"reading {path}: {e}")


def buckets(s):
    """The probe histogram's cumulative buckets as (upper bound, count), sorted."""
    prefix = PROBE_HISTOGRAM + '_bucket{le="'
    out = []
    for k, v in s.items():
        if k.startswith(prefix):
            out.append((float(k[len(prefix) : -2]), v))
    if not out:
        fail(f"no {PROBE_HISTOGRAM} buckets")
    return sorted(out)


def p99(a_path, b_path):
    """The p99 of the probes completed between two scrapes: the upper bound of the bucket
    holding the sample of rank ceil(0.99 n), from the buckets' differences. Prints
    "P99_SECONDS N"; P99 is inf when that sample is past the last finite bucket."""
    a, b = buckets(load(a_path)), buckets(load(b_path))
    if [le for le, _ in a] != [le for le, _ in b]:
        fail("the two scrapes have different histogram buckets")
    delta = [(le, cb - ca) for (le, ca), (_, cb) in zip(a, b)]
    n = delta[-1][1]
    if n <= 0:
        fail("no probe completed between the two scrapes")
    rank = math.ceil(0.99 * n)
    for le, c in delta:
        if c >= rank:
            print(f"{le:g} {n:g}")
            return
    fail("the +Inf bucket holds fewer probes than the rank")


def flows(path, pids):
    """For each pid: "PID CLASS ACTIVE ADMISSION ALLOT_BYTES_PER_SEC" of its flow (the
    allotment "-" when it has none), or "PID absent"."""
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"reading {path}: {e}")
    if not isinstance(table, list):
        fail(f"{path} is not a list of flows")
    for pid in pids:
        mine = [f for f in table if str(f.get("pid")) == pid]
        if not mine:
            print(f"{pid} absent")
            continue
        for f in mine:
            allot = f.get("allot_bytes_per_sec")
            allot = "-" if allot is None else f"{allot:.0f}"
            print(f"{pid} {f['class']} {str(f['active']).lower()} {f['admission']} {allot}")


def main(argv):
    if len(argv) == 3 and argv[0] == "scrape":
        scrape(argv[1], argv[2])
    elif len(argv) == 3 and argv[0] == "value":
        s = load(argv[1])
        if argv[2] not in s:
            fail(f"no sample {argv[2]} in {argv[1]}")
        v = s[argv[2]]
        # Integers as integers, so the shell can do arithmetic on counts.
        print(int(v) if float(v).is_integer() else repr(v))
    elif len(argv) == 3 and argv[0] == "p99":
        p99(argv[1], argv[2])
    elif len(argv) >= 2 and argv[0] == "flows":
        flows(argv[1], argv[2:])
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
