#!/bin/bash
# Inside the guest (in the chroot, rxe0 up): justitiad's scan for unshaped processes, the
# applications that escape the shaper. Run from suite.sh's daemon section, or alone:
#
#   tests/vm/guest.sh --timeout 300 -- tests/vm/guest/escapees.sh RESULTS BIN_DIR SHAPER_LIB
#
# BIN_DIR holds justitiad, justitia and examples/scrape (cargo build --release); SHAPER_LIB
# is libjustitia.so. The daemon starts from packaging/justitiad.toml with its sockets and
# metrics address moved (daemon-lib.sh) and its scan at the packaged interval. Two
# ib_write_bw pairs run on rxe0's loopback: one plain (no LD_PRELOAD: an escapee), one
# under the shaper following the daemon (LD_PRELOAD, JUSTITIA_CLASS=bandwidth,
# JUSTITIA_SOCKET). Then:
#
# 1. `justitia flows --unshaped --json` lists the plain client and server by pid, as
#    ib_write_bw with RC queue pairs on rxe0, and neither shaped process (those are
#    registered, in `justitia flows --json`); `justitia flows` marks the plain ones
#    `unshaped` under the flows. A process is listed once found unshaped for 100 ms, so
#    within about an interval (100 ms as packaged) and 100 ms of its first queue pair.
#    The plain pair is started alone and must be listed within UNSHAPED_WITHIN seconds
#    of its client's start (15 by default), the time printed. Under emulation a scan
#    takes 4 to 18 ms, so the scan waits 0.2 to 0.9 s after each (50 times its duration):
#    the pair was listed 1.4 s and 4.2 s after its client started (the client's own
#    start-up included; the daemon's log said 0.88 s and 0.28 s after the first scan that
#    found it), with another guest and then also a build on the same two cores; the bound
#    leaves room for a busier machine. Then the shaped pair starts, must be registered
#    (within 60 s) and not listed, and is looked at again two seconds later.
# 2. The metrics: justitia_unshaped_processes and justitia_unshaped_qps count them (at
#    least the two processes and two queue pairs), and justitia_unshaped_scans_total
#    {value="completed"} grows.
# 3. The daemon's log has one line for each plain process, not one per scan.
#
# One line per check goes to RESULTS/results.txt, as in suite.sh; the daemon's log, the
# answers, the scrape and the tools' output go to RESULTS/logs/escapees.*. About a minute
# under emulation.
set -uo pipefail

RESULTS=$1
BIN=$2
LIB=$3
LOGS=$RESULTS/logs
L=$LOGS/escapees
DEV=rxe0
GID=0
PORT=19700
WITHIN=${UNSHAPED_WITHIN:-15}
REGISTERED_WITHIN=60
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/vm/guest/daemon-lib.sh
source "$HERE/daemon-lib.sh"
mkdir -p "$LOGS"
touch "$RESULTS/results.txt"

# shellcheck source=tests/vm/guest/checks-lib.sh
source "$(dirname "$0")/checks-lib.sh"

CHECKS=("escapees: a plain ib_write_bw is listed unshaped, a shaped one is not (justitia flows)"
  "escapees: the unshaped metrics count it"
  "escapees: one log line per unshaped process")

run=$(mktemp -d /tmp/justitiad-escapees.XXXXXX)
metrics=127.0.0.1:19467
dpid=""
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  [ -n "$dpid" ] && kill -KILL "$dpid" 2>/dev/null
  wait 2>/dev/null
  rm -rf "$run"
}
# Stopped by suite.sh's timeout: take the daemon and the applications down too.
trap 'cleanup; exit 124' TERM

for f in "$BIN/justitiad" "$BIN/justitia" "$BIN/examples/scrape" "$LIB"; do
  [ -e "$f" ] || fail_rest "$f is not built"
done

config=$run/justitiad.toml
daemon_config "$config" "$run/justitiad.sock" "$run/admin.sock" "$metrics" || fail_rest "$DAEMON_ERR"
cp "$config" "$L.justitiad.toml"
daemon_start "$config" "$L.justitiad.log"
dpid=$DAEMON_PID
daemon_wait "$L.justitiad.log" "$run/admin.sock" 30 || fail_rest "$DAEMON_ERR"

# start_pair NAME [ENV...]: an ib_write_bw server and client on rxe0 under `env ENV...`,
# timed (-D) so that they hold their queue pairs for the whole check, niced (their figures
# are not checked, and busy-polling perftest otherwise slows the daemon and justitia on the
# guest's two emulated CPUs); sets SAPP and CAPP (the tools themselves), or ERR and
# returns 1. Logs: $L.NAME.{server,client}.log.
start_pair() {
  local name=$1 port=$((PORT++)) s c
  shift
  env "$@" nice -n 19 timeout 150 ib_write_bw -d "$DEV" -x "$GID" -D 100 -p "$port" > "$L.$name.server.log" 2>&1 &
  s=$!
  PIDS+=("$s")
  if ! wait_tcp_listen "$port"; then
    ERR="the $name ib_write_bw server did not listen within 30 s ($L.$name.server.log)"
    return 1
  fi
  env "$@" nice -n 19 timeout 150 ib_write_bw -d "$DEV" -x "$GID" -D 100 -p "$port" localhost > "$L.$name.client.log" 2>&1 &
  c=$!
  PIDS+=("$c")
  SAPP=$(child_of "$s")
  CAPP=$(child_of "$c")
}

start_pair plain || fail_rest "$ERR"
PLAIN_S=$SAPP PLAIN_C=$CAPP
t_plain=$(date +%s.%N)

# --- 1a. the plain pair listed within UNSHAPED_WITHIN s of its client's start -----------
plain_listed() { # FILE: whether both plain pids are in the unshaped report
  /usr/bin/python3 - "$1" "$PLAIN_S" "$PLAIN_C" <<'EOF'
import json, sys
try:
    listed = {str(p["pid"]) for p in json.load(open(sys.argv[1])).get("processes", [])}
except (OSError, ValueError):
    sys.exit(1)
sys.exit(0 if set(sys.argv[2:]) <= listed else 1)
EOF
}
while :; do
  "$BIN/justitia" flows --socket "$run/admin.sock" --unshaped --json > "$L.plain.unshaped.json" 2>&1
  now=$(date +%s.%N)
  plain_listed "$L.plain.unshaped.json" && break
  if awk -v a="$now" -v b="$t_plain" -v w="$WITHIN" 'BEGIN { exit !(a - b > w) }'; then
    fail_rest "the plain pair not listed within $WITHIN s of its client's start ($L.plain.unshaped.json)"
  fi
  for p in "$PLAIN_S" "$PLAIN_C"; do
    kill -0 "$p" 2>/dev/null || fail_rest "ib_write_bw $p exited before the check ($L.plain.*.log)"
  done
  sleep 0.1
done
plain_after=$(awk -v a="$now" -v b="$t_plain" 'BEGIN { printf "%.2f", a - b }')
echo "escapees: the plain pair listed $plain_after s after its client started (bound $WITHIN s)"
start_pair shaped LD_PRELOAD="$LIB" JUSTITIA_CLASS=bandwidth JUSTITIA_SOCKET="$run/justitiad.sock" || fail_rest "$ERR"
SHAPED_S=$SAPP SHAPED_C=$CAPP

# verdict UNSHAPED_JSON FLOWS_JSON: one line, "ok ..." when the plain pair is listed
# unshaped (ib_write_bw, RC queue pairs on rxe0) and the shaped pair is registered and not
# listed; otherwise what is missing.
verdict() {
  /usr/bin/python3 - "$1" "$2" "$PLAIN_S" "$PLAIN_C" "$SHAPED_S" "$SHAPED_C" "$DEV" <<'EOF'
import json, sys
unshaped_path, flows_path, plain_s, plain_c, shaped_s, shaped_c, dev = sys.argv[1:]
try:
    report = json.load(open(unshaped_path))
    flows = json.load(open(flows_path))
except (OSError, ValueError) as e:
    print(f"unreadable answer: {e}")
    sys.exit()
listed = {str(p["pid"]): p for p in report.get("processes", [])}
registered = {str(f["pid"]) for f in flows}
problems = []
if report.get("scan") != "scanning":
    problems.append(f"scan {report.get('scan')} ({report.get('error')})")
for pid in (plain_s, plain_c):
    p = listed.get(pid)
    if p is None:
        problems.append(f"plain pid {pid} not listed")
    elif p["comm"] != "ib_write_bw" or p["qps"] < 1 or not any(
        q["device"] == dev and q["qp_type"] == "RC" for q in p["listed"]
    ):
        problems.append(f"plain pid {pid} listed as {p}")
for pid in (shaped_s, shaped_c):
    if pid in listed:
        problems.append(f"shaped pid {pid} listed unshaped: {listed[pid]}")
    if pid not in registered:
        problems.append(f"shaped pid {pid} not registered")
if problems:
    print("; ".join(problems))
else:
    c = listed[plain_c]
    qps = ", ".join(f"{q['device']}/{q['qpn']} {q['qp_type']} {q['state']}" for q in c["listed"])
    print(f"ok plain client {plain_c} listed with {c['qps']} queue pair(s) ({qps}), tenant {c['tenant']}; "
          f"{len(listed)} unshaped process(es) in all; shaped {shaped_s} and {shaped_c} registered, not listed")
EOF
}

answer() { # NAME: both answers into $L.NAME.{unshaped,flows}.json; VERDICT
  "$BIN/justitia" flows --socket "$run/admin.sock" --unshaped --json > "$L.$1.unshaped.json" 2>&1
  "$BIN/justitia" flows --socket "$run/admin.sock" --json > "$L.$1.flows.json" 2>&1
  VERDICT=$(verdict "$L.$1.unshaped.json" "$L.$1.flows.json")
}

# --- 1b. the shaped pair registered, never listed ---------------------------------------
t0=$SECONDS
deadline=$((SECONDS + REGISTERED_WITHIN))
while :; do
  answer first
  case $VERDICT in ok*) break ;; esac
  if [ "$SECONDS" -ge "$deadline" ]; then
    fail_rest "not within $REGISTERED_WITHIN s: $VERDICT ($L.first.unshaped.json, $L.first.flows.json)"
  fi
  for p in "$PLAIN_C" "$SHAPED_C"; do
    kill -0 "$p" 2>/dev/null || fail_rest "ib_write_bw $p exited before the check: $VERDICT ($L.*.client.log)"
  done
  sleep 0.5
done
listed_after=$((SECONDS - t0))
# More scans, well past the registration grace: a shaped process must not turn up later
# either.
interval_ms=$(/usr/bin/python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["interval_ms"])' "$L.first.unshaped.json")
sleep "$(awk -v ms="${interval_ms:-1000}" 'BEGIN { s = 2.5 * ms / 1000; printf "%.1f", (s < 2 ? 2 : s) }')"
answer again
"$BIN/justitia" flows --socket "$run/admin.sock" > "$L.table.txt" 2>&1
marked=$(awk -v p="$PLAIN_C" '$1 == "unshaped" && $2 == p' "$L.table.txt")
case $VERDICT in
  ok*)
    if [ -n "$marked" ]; then
      pass "${VERDICT#ok }; the plain pair listed $plain_after s after its client started (bound $WITHIN s), the shaped one registered within $listed_after s; justitia flows: '$(echo "$marked" | tr -s ' ')'"
    else
      fail_one "the JSON answer lists it but justitia flows has no 'unshaped $PLAIN_C' row ($L.table.txt)"
    fi
    ;;
  *) fail_one "$listed_after s after the first listing: $VERDICT ($L.again.unshaped.json)" ;;
esac

# --- 2. the metrics ----------------------------------------------------------------------
if ! "$BIN/examples/scrape" "$metrics" > "$L.metrics.txt" 2> "$L.scrape.err"; then
  fail_one "scrape: $(cat "$L.scrape.err")"
else
  m() { awk -v k="$1" '$1 == k {print $2; exit}' "$L.metrics.txt"; }
  procs=$(m justitia_unshaped_processes)
  qps=$(m justitia_unshaped_qps)
  scans=$(m 'justitia_unshaped_scans_total{value="completed"}')
  failed=$(m 'justitia_unshaped_scans_total{value="failed"}')
  took=$(m justitia_unshaped_scan_seconds)
  if awk -v p="$procs" -v q="$qps" -v s="$scans" 'BEGIN { exit !(p >= 2 && q >= 2 && s >= 3) }'; then
    pass "justitia_unshaped_processes $procs, justitia_unshaped_qps $qps, scans completed $scans, failed ${failed:-?}, the last took ${took:-?} s"
  else
    fail_one "justitia_unshaped_processes '$procs', justitia_unshaped_qps '$qps', scans completed '$scans' (want >= 2, >= 2, >= 3; $L.metrics.txt)"
  fi
fi

# --- 3. one log line per process ---------------------------------------------------------
lines_for() { grep "unshaped process: RDMA queue pairs" "$L.justitiad.log" | grep -c "pid=$1 "; }
ls_c=$(lines_for "$PLAIN_C") ls_s=$(lines_for "$PLAIN_S")
shaped_lines=$(($(lines_for "$SHAPED_C") + $(lines_for "$SHAPED_S")))
if [ "$ls_c" = 1 ] && [ "$ls_s" = 1 ] && [ "$shaped_lines" = 0 ]; then
  pass "one line each for $PLAIN_C and $PLAIN_S after $scans scans: $(grep -m1 "pid=$PLAIN_C " "$L.justitiad.log" | sed 's/^[^ ]* *//')"
else
  fail_one "lines for the plain client $ls_c, server $ls_s, the shaped pair $shaped_lines (want 1, 1, 0; $L.justitiad.log)"
fi

cleanup
