#!/bin/bash
# Inside the guest (in the chroot, rxe0 up): a control-verb storm from one tenant paced by
# the shaper, while another tenant's latency flow and registrations proceed. Run from
# suite.sh's daemon section, or alone:
#
#   tests/vm/guest.sh --timeout 300 -- tests/vm/guest/control-verbs.sh RESULTS BIN_DIR SHAPER_LIB APPS
#
# BIN_DIR holds justitiad, justitia and examples/scrape; SHAPER_LIB is libjustitia.so; APPS
# holds ctl_storm (tests/vm/apps). The daemon starts from packaging/justitiad.toml with
# control_verbs_per_sec = BUDGET and control_verb_burst = 16, tenants by uid, and its
# metrics on a Unix socket (where the per-tenant series are). Two tenants: the attacker,
# uid 1000 (setpriv), registering a 4 KiB region and deregistering it back to back for
# STORM seconds; the victim, root, registering one every 100 ms for as long, while its
# ib_write_lat pair (latency class) runs on rxe0. All of them shaped and following the
# daemon.
#
# 1. Natively (no shaper) the attacker's storm runs at its own rate, which must exceed
#    twice its share (the tenant's half of BUDGET) for the check to mean anything; under
#    the daemon it is held to its share: at most share x 1.1 + burst / STORM verbs/s, and
#    at least share x 0.7 (paced, not starved), with at least half of its verbs told to
#    wait (its shaper's statistics). The victim's registrations never wait
#    (control_verbs_delayed = 0) and its ib_write_lat completes.
# 2. During the storm `justitia flows` lists both tenants with their budgets (the share
#    each) and counts; `--tenants --json` says the same, and after the storm still has
#    uid 1000's counts, its verbs delayed, root's none.
# 3. The metrics: justitia_tenant_control_verbs_total{tenant="1000"} has at least 90% of
#    the storm's verbs (a process's last few are not reported when it exits) and at most
#    all of them, justitia_tenant_control_verbs_delayed_total{tenant="1000"} grows (both
#    kept after the tenant's last process exits), and during the storm
#    justitia_tenant_control_verb_budget{tenant="1000"} is the share.
#
# 4. A storm of RC QP creations (ibv_create_qp, then ibv_destroy_qp) by uid 1000 alone,
#    natively and under the daemon: held to the whole budget (its tenant is the only one
#    connected), within the same bounds.
# 5. The same for one RC QP brought up again and again (reset, then init, ready to receive
#    and ready to send: each move to ready-to-receive after the first waits as a creation),
#    and for registrations through ibv_reg_mr_iova2 looked up with dlvsym on a handle of
#    libibverbs, as NCCL's verbs wrapper finds it.
#
# BUDGET is 200 verbs/s, or less where the emulated CPUs are slow: every storm runs natively
# first, before the daemon starts, and BUDGET is the slowest storm's rate / 2.5 rounded down
# to tens (at most 200, at least 40, below which the host is too slow to tell pacing from
# its own speed), so that each storm has something to pace. CONTROL_BUDGET sets it outright.
#
# 6. QP turns: the daemon's qp_turns is 2 (qp_turn_bytes 256 KiB), so uid 1000's one
#    process (it alone connected) may post on 2 of its QPs at once. Its ib_write_bw -q 8
#    (bandwidth class, 25 WRITEs of 1 MiB a QP, against an unshaped server of root's)
#    completes every WRITE with its QPs beyond 2 waiting in line (turn_waits > 0 in its
#    shaper's statistics). While it runs, `justitia flows` shows the tenant's 2 turns (the
#    table's column and `--tenants --json`) and so does justitia_tenant_qp_turns; after
#    it, the tenant's reported waits and yields are positive and at most the shaper's own
#    counts (the last tick's may not be reported at exit), and the metrics
#    justitia_tenant_qp_turn_waits_total and _yields_total say the same.
#
# One line per check goes to RESULTS/results.txt, as in suite.sh; logs go to
# RESULTS/logs/control-verbs.*. About 60 s under emulation.
set -uo pipefail

RESULTS=$1
BIN=$2
LIB=$3
APPS=$4
LOGS=$RESULTS/logs
L=$LOGS/control-verbs
DEV=rxe0
GID=0
PORT=19750
BURST=16
STORM=${CONTROL_STORM_SECONDS:-4}
ATTACKER=1000
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/vm/guest/daemon-lib.sh
source "$HERE/daemon-lib.sh"
mkdir -p "$LOGS"
touch "$RESULTS/results.txt"

# shellcheck source=tests/vm/guest/checks-lib.sh
source "$(dirname "$0")/checks-lib.sh"

CHECKS=("control verbs: a tenant's registration storm is held to its share, another tenant's registrations and latency flow proceed"
  "control verbs: justitia flows shows each tenant's budget and counts"
  "control verbs: the per-tenant metrics count the storm"
  "control verbs: a storm of QP creations is held to the tenant's budget"
  "control verbs: a storm of QP re-bring-ups and one of registrations looked up as NCCL does are held to the tenant's budget"
  "QP turns: a tenant's QPs beyond its turns wait in line, seen in justitia flows and the metrics")

run=$(mktemp -d /tmp/justitiad-control.XXXXXX)
chmod 755 "$run"
dpid=""
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  [ -n "$dpid" ] && kill -KILL "$dpid" 2>/dev/null
  wait 2>/dev/null
  rm -rf "$run"
}
trap 'cleanup; exit 124' TERM

for f in "$BIN/justitiad" "$BIN/justitia" "$BIN/examples/scrape" "$LIB" "$APPS/ctl_storm"; do
  [ -e "$f" ] || fail_rest "$f is not built"
done

# as_attacker CMD...: CMD as uid 1000 (its own tenant), with no supplementary groups.
as_attacker() { setpriv --reuid="$ATTACKER" --regid="$ATTACKER" --clear-groups "$@"; }

# --- native: each storm's own rate, and the budget -----------------------------------------
as_attacker "$APPS/ctl_storm" "$DEV" reg "$STORM" > "$L.native.json" 2> "$L.native.err" \
  || fail_rest "the native storm failed ($L.native.err)"
native=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["per_sec"])' "$L.native.json") \
  || fail_rest "unreadable native result ($L.native.json)"
echo "control verbs: the storm alone, unshaped: $native registrations/s"
# The storms of checks 4 and 5, natively, for 2 s each: $L.MODE.native.json, and their
# exit statuses in $L.MODE.native.rc.
ALONE_MODES=(qp modify reg-dlvsym)
for mode in "${ALONE_MODES[@]}"; do
  as_attacker env CTL_STORM_GID="$GID" "$APPS/ctl_storm" "$DEV" "$mode" 2 > "$L.$mode.native.json" 2> "$L.$mode.native.err"
  echo $? > "$L.$mode.native.rc"
done
if [ -n "${CONTROL_BUDGET:-}" ]; then
  BUDGET=$CONTROL_BUDGET
else
  BUDGET=$(python3 - "$L" "$native" "${ALONE_MODES[@]}" <<'EOF'
import json, sys
L, native, *modes = sys.argv[1:]
rates = [float(native)]
for mode in modes:
    try:
        rates.append(json.load(open(f"{L}.{mode}.native.json"))["per_sec"])
    except (OSError, ValueError, KeyError):
        pass  # judged in check 4 or 5, with its exit status
print(min(200, int(min(rates) / 2.5) // 10 * 10))
EOF
  ) || fail_rest "the budget could not be read off the native storms ($L.*.native.json)"
  [ "$BUDGET" -ge 40 ] || fail_rest "the native storms are too slow to pace (the slowest / 2.5 gives a budget of $BUDGET verbs/s, below 40; $L.*.native.json)"
fi
SHARE=$((BUDGET / 2))
echo "control verbs: budget $BUDGET verbs/s, a share of $SHARE"
if ! awk -v n="$native" -v s="$SHARE" 'BEGIN { exit !(n > 2 * s) }'; then
  fail_rest "the storm alone makes $native registrations/s, not above twice the share of $SHARE: no storm to pace"
fi

config=$run/justitiad.toml
metrics_sock=$run/metrics.sock
daemon_config "$config" "$run/justitiad.sock" "$run/admin.sock" "unix:$metrics_sock" \
  control_verbs_per_sec="$BUDGET" control_verb_burst="$BURST" qp_turns=2 qp_turn_bytes=262144 \
  || fail_rest "$DAEMON_ERR"
cp "$config" "$L.justitiad.toml"
daemon_start "$config" "$L.justitiad.log"
dpid=$DAEMON_PID
daemon_wait "$L.justitiad.log" "$run/admin.sock" 30 || fail_rest "$DAEMON_ERR"
# Another uid must reach the registration socket (the packaged mode is 0666).
chmod 755 "$run"

shaped=(env LD_PRELOAD="$LIB" JUSTITIA_SOCKET="$run/justitiad.sock")
# The victim's latency flow first (its two processes are root's), then the storm and the
# victim's own registrations side by side.
"${shaped[@]}" JUSTITIA_CLASS=latency timeout 120 ib_write_lat -d "$DEV" -x "$GID" -p "$PORT" -n 2000 \
  > "$L.lat.server.log" 2>&1 &
lat_s=$!
PIDS+=("$lat_s")
wait_tcp_listen "$PORT" || fail_rest "the ib_write_lat server did not listen ($L.lat.server.log)"
"${shaped[@]}" JUSTITIA_CLASS=latency timeout 120 ib_write_lat -d "$DEV" -x "$GID" -p "$PORT" -n 2000 localhost \
  > "$L.lat.client.log" 2>&1 &
lat_c=$!
PIDS+=("$lat_c")
# The attacker's statistics go where its uid may write.
mkdir "$run/attacker" && chown "$ATTACKER:$ATTACKER" "$run/attacker"
as_attacker "${shaped[@]}" JUSTITIA_STATS="$run/attacker/%p.json" "$APPS/ctl_storm" "$DEV" reg "$STORM" \
  > "$L.attacker.json" 2> "$L.attacker.err" &
att=$!
PIDS+=("$att")
# The victim's registrations outlast the storm, so that the storm's tenant shares the
# budget with it throughout.
"${shaped[@]}" JUSTITIA_STATS="$run/victim.%p.json" "$APPS/ctl_storm" "$DEV" reg $((STORM + 2)) 100000 \
  > "$L.victim.json" 2> "$L.victim.err" &
vic=$!
PIDS+=("$vic")
# The tables while everyone is connected, half-way through the storm.
sleep $((STORM / 2))
"$BIN/justitia" flows --socket "$run/admin.sock" > "$L.flows.txt" 2>&1
"$BIN/justitia" flows --socket "$run/admin.sock" --tenants --json > "$L.tenants.mid.json" 2>&1
"$BIN/examples/scrape" "unix:$metrics_sock" > "$L.metrics.mid.txt" 2>&1
wait "$att" || fail_rest "the shaped storm failed ($L.attacker.err)"
wait "$vic" || fail_rest "the victim's registrations failed ($L.victim.err)"
wait "$lat_c"
lat_rc=$?
wait "$lat_s"
cp "$run"/attacker/*.json "$L.attacker.stats.json" 2>/dev/null
cp "$run"/victim.*.json "$L.victim.stats.json" 2>/dev/null
"$BIN/justitia" flows --socket "$run/admin.sock" --tenants --json > "$L.tenants.json" 2>&1
"$BIN/examples/scrape" "unix:$metrics_sock" > "$L.metrics.txt" 2>&1
# The storms of QP creations, re-bring-ups and registrations under the daemon, the
# attacker alone now: its tenant's share is the whole budget. $L.MODE.json, and the exit
# status in $L.MODE.rc.
for mode in "${ALONE_MODES[@]}"; do
  as_attacker "${shaped[@]}" CTL_STORM_GID="$GID" "$APPS/ctl_storm" "$DEV" "$mode" 2 > "$L.$mode.json" 2> "$L.$mode.err"
  echo $? > "$L.$mode.rc"
done
# QP turns: uid 1000's ib_write_bw -q 8 against root's unshaped server, the tenant's
# tables and metrics read while it runs (first seen with its turns) and after.
TURNS_PORT=$((PORT + 1)) TURNS_ITERS=25
timeout 120 ib_write_bw -d "$DEV" -x "$GID" -p "$TURNS_PORT" -q 8 -s 1048576 -n "$TURNS_ITERS" \
  > "$L.turns.server.log" 2>&1 &
turns_s=$!
PIDS+=("$turns_s")
wait_tcp_listen "$TURNS_PORT" || fail_rest "the turns' ib_write_bw server did not listen ($L.turns.server.log)"
# Its 8 QPs' buffers exceed an unprivileged user's default locked-memory limit.
(ulimit -l unlimited && as_attacker "${shaped[@]}" JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=64K \
  JUSTITIA_STATS="$run/attacker/turns.%p.json" \
  timeout 120 ib_write_bw -d "$DEV" -x "$GID" -p "$TURNS_PORT" -q 8 -s 1048576 -n "$TURNS_ITERS" localhost) \
  > "$L.turns.client.log" 2>&1 &
turns_c=$!
PIDS+=("$turns_c")
for _ in $(seq 100); do
  "$BIN/justitia" flows --socket "$run/admin.sock" --tenants --json > "$L.turns.mid.json" 2>&1
  grep -q '"qp_turns": *[0-9]' "$L.turns.mid.json" && break
  kill -0 "$turns_c" 2>/dev/null || break
  sleep 0.1
done
"$BIN/justitia" flows --socket "$run/admin.sock" > "$L.turns.flows.txt" 2>&1
"$BIN/examples/scrape" "unix:$metrics_sock" > "$L.turns.metrics.mid.txt" 2>&1
wait "$turns_c"
turns_rc=$?
wait "$turns_s"
cp "$run"/attacker/turns.*.json "$L.turns.stats.json" 2>/dev/null
# The last reports reach the daemon within a pass of the client's exit.
sleep 1
"$BIN/justitia" flows --socket "$run/admin.sock" --tenants --json > "$L.turns.json" 2>&1
"$BIN/examples/scrape" "unix:$metrics_sock" > "$L.turns.metrics.txt" 2>&1

# --- 1. the storm held to its share, the victim unhindered --------------------------------
v=$(python3 - "$L" "$SHARE" "$BURST" "$STORM" "$lat_rc" "$native" <<'EOF'
import json, sys
L, share, burst, storm, lat_rc, native = sys.argv[1:]
share, burst, storm, native = float(share), int(burst), float(storm), float(native)
try:
    att = json.load(open(f"{L}.attacker.json"))
    vic = json.load(open(f"{L}.victim.json"))
    att_stats = json.load(open(f"{L}.attacker.stats.json"))
    vic_stats = json.load(open(f"{L}.victim.stats.json"))
except (OSError, ValueError) as e:
    print(f"unreadable result: {e}")
    sys.exit()
high = share * 1.1 + burst / storm
low = share * 0.7
problems = []
if not low <= att["per_sec"] <= high:
    problems.append(f"the storm made {att['per_sec']}/s under the daemon, outside [{low:.1f}, {high:.1f}]")
# A verb issued late (the emulated CPUs busy elsewhere) may find its turn already come and
# not wait: at least half of the storm's verbs wait, not all (309 of 410 were seen with a
# compiler beside the guest).
if att_stats["control_verbs"] != att["count"] or att_stats["control_verbs_delayed"] < 0.5 * att["count"]:
    problems.append(f"the storm's shaper counted {att_stats} for {att['count']} registrations")
if vic_stats["control_verbs"] < vic["count"] or vic_stats["control_verbs_delayed"] != 0:
    problems.append(f"the victim's registrations waited: {vic_stats} for {vic['count']}")
if lat_rc != "0":
    problems.append(f"ib_write_lat exited {lat_rc}")
if problems:
    print("; ".join(problems))
else:
    print(f"ok storm {native:.0f}/s alone, {att['per_sec']:.1f}/s under the daemon (share {share:.0f}/s, "
          f"bound [{low:.1f}, {high:.1f}]; {att_stats['control_verbs_delayed']} of {att['count']} waited, "
          f"{att_stats['control_wait_ns'] / 1e9:.2f} s in all); victim {vic['count']} registrations, none waited, "
          f"p50 {vic['p50_us']} us, max {vic['max_us']} us; ib_write_lat completed")
EOF
)
case $v in ok*) pass "${v#ok }" ;; *) fail_one "$v ($L.*)" ;; esac

# --- 2. justitia flows ----------------------------------------------------------------------
v=$(python3 - "$L.tenants.mid.json" "$L.tenants.json" "$L.flows.txt" "$ATTACKER" "$SHARE" <<'EOF'
import json, sys
mid_path, path, table, attacker, share = sys.argv[1:]
try:
    mid = {t["tenant"]: t for t in json.load(open(mid_path))}
    tenants = {t["tenant"]: t for t in json.load(open(path))}
    text = open(table).read()
except (OSError, ValueError) as e:
    print(f"unreadable answer: {e}")
    sys.exit()
# During the storm both tenants are connected, each with half the host's budget; after it
# the storm's tenant is remembered with its counts (processes 0, no budget).
a, r = tenants.get(attacker), tenants.get("0")
problems = []
for name in (attacker, "0"):
    t = mid.get(name)
    if t is None or t["control_verbs_per_sec"] != float(share) or t["processes"] < 1:
        problems.append(f"during the storm, tenant {name}: {t}")
if a is None or r is None:
    problems.append(f"tenants {sorted(tenants)}, expected 0 and {attacker}")
else:
    if a["control_verbs_delayed"] == 0:
        problems.append(f"tenant {attacker}: {a}")
    if r["control_verbs_delayed"] != 0 or r["control_verbs"] == 0:
        problems.append(f"tenant 0: {r}")
rows = [l.split() for l in text.splitlines()]
if not any(row[-1:] == [attacker] and row[2:3] == [f"{float(share):.1f}"] for row in rows):
    problems.append(f"no row for tenant {attacker} with budget {share} in the table")
if problems:
    print("; ".join(problems))
else:
    print(f"ok tenant {attacker}: {a['control_verbs']} verbs, {a['control_verbs_delayed']} delayed, budget {share}/s; "
          f"tenant 0: {r['control_verbs']} verbs, none delayed, budget {r['control_verbs_per_sec']}/s")
EOF
)
case $v in ok*) pass "${v#ok }" ;; *) fail_one "$v ($L.tenants*.json, $L.flows.txt)" ;; esac

# --- 3. the metrics -------------------------------------------------------------------------
v=$(python3 - "$L.metrics.txt" "$L.metrics.mid.txt" "$L.attacker.json" "$ATTACKER" "$SHARE" <<'EOF'
import json, re, sys
path, mid_path, att_path, attacker, share = sys.argv[1:]
try:
    text = open(path).read()
    mid = open(mid_path).read()
    count = json.load(open(att_path))["count"]
except (OSError, ValueError) as e:
    print(f"unreadable: {e}")
    sys.exit()
def sample(name, text=text):
    m = re.search(r'^justitia_%s\{tenant="%s"\} (\S+)$' % (name, attacker), text, re.M)
    return float(m.group(1)) if m else None
verbs = sample("tenant_control_verbs_total")
delayed = sample("tenant_control_verbs_delayed_total")
# The budget is a connected tenant's: read during the storm.
budget = sample("tenant_control_verb_budget", mid)
problems = []
if verbs is None or not 0.9 * count <= verbs <= count:
    problems.append(f"verbs {verbs} for {count} issued")
if not delayed:
    problems.append(f"delayed {delayed}")
if budget != float(share):
    problems.append(f"budget {budget}, expected {share}")
if problems:
    print("; ".join(problems))
else:
    print(f"ok tenant {attacker}: {verbs:.0f} of {count} verbs reported, {delayed:.0f} delayed, budget {budget}/s")
EOF
)
case $v in ok*) pass "${v#ok }" ;; *) fail_one "$v ($L.metrics*.txt)" ;; esac

# --- 4. and 5. storms of one tenant alone ---------------------------------------------------
# judge_alone MODE...: "ok ..." when each MODE's storm ran above twice the budget natively
# and within its bounds under the daemon.
judge_alone() {
  python3 - "$L" "$BUDGET" "$BURST" "$@" <<'EOF'
import json, sys
L, budget, burst, *modes = sys.argv[1:]
budget, burst = float(budget), int(burst)
names = {"qp": "QP creations", "modify": "QP re-bring-ups", "reg-dlvsym": "registrations found with dlvsym"}
seen = []
for mode in modes:
    try:
        native_rc = open(f"{L}.{mode}.native.rc").read().strip()
        rc = open(f"{L}.{mode}.rc").read().strip()
        if native_rc != "0" or rc != "0":
            print(f"ctl_storm {mode} exited {native_rc} natively, {rc} shaped ({L}.{mode}*.err)")
            sys.exit()
        native = json.load(open(f"{L}.{mode}.native.json"))
        shaped = json.load(open(f"{L}.{mode}.json"))
    except (OSError, ValueError) as e:
        print(f"unreadable result of {mode}: {e}")
        sys.exit()
    high = budget * 1.1 + burst / shaped["seconds"]
    low = budget * 0.7
    if native["per_sec"] <= 2 * budget:
        print(f"the {mode} storm alone makes {native['per_sec']}/s, not above twice the budget of {budget:.0f}: no storm to pace")
        sys.exit()
    if not low <= shaped["per_sec"] <= high:
        print(f"the {mode} storm made {shaped['per_sec']}/s under the daemon, outside [{low:.1f}, {high:.1f}]")
        sys.exit()
    seen.append(f"{native['per_sec']:.0f} {names[mode]}/s alone, {shaped['per_sec']:.1f}/s under the daemon")
print(f"ok {'; '.join(seen)} (the tenant alone: the whole budget, {budget:.0f}/s; "
      f"bound [{budget * 0.7:.1f}, {budget * 1.1:.1f} + burst / seconds])")
EOF
}
v=$(judge_alone qp)
case $v in ok*) pass "${v#ok }" ;; *) fail_one "$v" ;; esac
v=$(judge_alone modify reg-dlvsym)
case $v in ok*) pass "${v#ok }" ;; *) fail_one "$v" ;; esac

# --- 6. QP turns ----------------------------------------------------------------------------
v=$(python3 - "$L" "$ATTACKER" "$turns_rc" "$TURNS_ITERS" <<'EOF'
import json, re, sys
L, attacker, rc, iters = sys.argv[1:]
want_bytes = 8 * int(iters) << 20
try:
    stats = json.load(open(f"{L}.turns.stats.json"))
    mid = {t["tenant"]: t for t in json.load(open(f"{L}.turns.mid.json"))}
    after = {t["tenant"]: t for t in json.load(open(f"{L}.turns.json"))}
    table = open(f"{L}.turns.flows.txt").read()
    metrics_mid = open(f"{L}.turns.metrics.mid.txt").read()
    metrics = open(f"{L}.turns.metrics.txt").read()
    client = open(f"{L}.turns.client.log").read()
except (OSError, ValueError) as e:
    print(f"unreadable: {e}")
    sys.exit()
def sample(name, text):
    m = re.search(r'^justitia_%s\{tenant="%s"\} (\S+)$' % (name, attacker), text, re.M)
    return float(m.group(1)) if m else None
problems = []
# perftest reports only after every WRITE completed; its clock calibration may still fail
# under emulation (exit 1, "Can't produce a report").
if "Failed status" in client or (rc != "0" and "Can't produce a report" not in client):
    problems.append(f"ib_write_bw exited {rc}")
if stats.get("bytes") != want_bytes or not stats.get("turn_waits", 0) > 0:
    problems.append(f"the shaper posted {stats.get('bytes')} B of {want_bytes} with {stats.get('turn_waits')} turn waits")
m = mid.get(attacker)
if m is None or m.get("qp_turns") != 2:
    problems.append(f"during the run, tenant {attacker}: {m}")
rows = [l.split() for l in table.splitlines()]
# The tenants table: weight, processes, ctl budget/s, control verbs, delayed, waited s,
# QP turns, turn waits, yields, tenant.
if not any(r[-1:] == [attacker] and r[6:7] == ["2"] for r in rows):
    problems.append(f"no row for tenant {attacker} with 2 QP turns in the table")
a = after.get(attacker)
if a is None or not 0 < a["qp_turn_waits"] <= stats.get("turn_waits", 0) \
        or not 0 < a["qp_turn_yields"] <= stats.get("turn_yields", 0):
    problems.append(f"after the run, tenant {attacker}: {a}, its shaper's: {stats}")
gauge = sample("tenant_qp_turns", metrics_mid)
waits = sample("tenant_qp_turn_waits_total", metrics)
yields = sample("tenant_qp_turn_yields_total", metrics)
if gauge != 2 or a is None or (waits, yields) != (a["qp_turn_waits"], a["qp_turn_yields"]):
    problems.append(f"metrics: turns {gauge}, waits {waits}, yields {yields}")
if problems:
    print("; ".join(problems))
else:
    print(f"ok ib_write_bw -q 8 of uid {attacker}: {want_bytes} B posted, 2 QPs at a time; its shaper counted "
          f"{stats['turn_waits']} waits, {stats['turn_yields']} yields; the daemon {a['qp_turn_waits']} and "
          f"{a['qp_turn_yields']} (justitia flows and metrics), 2 turns shown during the run")
EOF
)
case $v in ok*) pass "${v#ok }" ;; *) fail_one "$v ($L.turns*)" ;; esac

cleanup
