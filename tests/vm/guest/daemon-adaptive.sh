#!/bin/bash
# Inside the guest (in the chroot, rxe0 up): justitiad with `policy = "adaptive"` steering a
# latency and a bandwidth application under the shaper. Run from suite.sh's daemon
# section, or alone:
#
#   tests/vm/guest.sh --timeout 300 -- tests/vm/guest/daemon-adaptive.sh RESULTS BIN_DIR SHAPER_LIB INTEGRITY_BIN
#
# BIN_DIR holds justitiad and justitia (cargo build --release); SHAPER_LIB is
# libjustitia.so, INTEGRITY_BIN justitia-integrity. The daemon starts from
# packaging/justitiad.toml with its sockets and metrics moved (daemon-lib.sh),
# `policy = "adaptive"` and Target99 at 5 s: under emulation the reference flow's p99 is
# tens of milliseconds and swings several-fold with the guest's scheduling, so a nearer
# target is violated on most updates and the law's fraction moves every RefPeriod, faster
# than two answers of `justitia` (seconds apart in the guest) can be compared; far above
# it the law's state holds still (fraction 1) and the check compares figures. Both applications run under the shaper with
# JUSTITIA_POLICY=adaptive and JUSTITIA_SOCKET, no JUSTITIA_RATE:
#
# 1. ib_write_lat (16 B, latency class) and ib_write_bw (1 MiB, bandwidth class), with
#    justitia-integrity (bandwidth class) beside them:
#    `justitia flows --json` and `justitia status --json` must show the allotments the
#    adaptive law gives, worked out by adaptive_check.py from the law's documented formula
#    (justitia_core::adaptive): the bandwidth flow paced at its tenant's part of
#    max(headroom x fraction x (MaxRate - the others' load), B/(L+B+T) x MaxRate), in chunks
#    no larger than the target's slack at MaxRate; the latency flow unshaped.
#    The latency flow counts while any latency flow of its tenant is active (the pair's
#    server posts too).
# 2. The law reads the latency application's own round trips: ib_write_lat's shaper times
#    its WRITEs and reports them, and `justitia status --json` shows round trips reported
#    and updates at which the law read them (the applications' tail, not the probe's).
# 3. The checker finishes with zero mismatches, its shaper having followed the daemon.
#
# One line per check goes to RESULTS/results.txt as in suite.sh; the tools' output, the
# daemon's log, each status and flows answer go to RESULTS/logs/daemon-adaptive.*. About
# a minute under emulation.
set -uo pipefail

RESULTS=$1
BIN=$2
LIB=$3
INTEGRITY=$4
LOGS=$RESULTS/logs
mkdir -p "$LOGS"
touch "$RESULTS/results.txt"
DEV=rxe0
GID=0
PORT=19700
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/vm/guest/daemon-lib.sh
source "$HERE/daemon-lib.sh"
L=$LOGS/daemon-adaptive

# shellcheck source=tests/vm/guest/checks-lib.sh
source "$(dirname "$0")/checks-lib.sh"

CHECKS=("daemon adaptive: ib_write_lat and ib_write_bw follow the adaptive law (justitia flows)"
  "daemon adaptive: the law reads ib_write_lat's own round trips, reported by its shaper"
  "daemon adaptive: integrity under the adaptive allotments, zero mismatches")

run=$(mktemp -d /tmp/justitiad-adaptive.XXXXXX)
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

for f in "$BIN/justitiad" "$BIN/justitia" "$LIB" "$INTEGRITY"; do
  [ -e "$f" ] || fail_rest "$f is not built"
done

config=$run/justitiad.toml
daemon_config "$config" "$run/justitiad.sock" "$run/admin.sock" "" 'policy="adaptive"' 'target="5000ms"' \
  || fail_rest "$DAEMON_ERR"
cp "$config" "$L.justitiad.toml"
daemon_start "$config" "$L.justitiad.log"
dpid=$DAEMON_PID
# An absolute target needs no idle measurement: the probe starts with the latency flow.
daemon_wait "$L.justitiad.log" "$run/admin.sock" 30 || fail_rest "$DAEMON_ERR"

# The shaper's environment: following the scratch daemon under adaptive.
shaped() { # CLASS
  echo "LD_PRELOAD=$LIB JUSTITIA_CLASS=$1 JUSTITIA_POLICY=adaptive JUSTITIA_SOCKET=$run/justitiad.sock"
}

# --- 1. the allotments follow the law -------------------------------------------------------
# start_pair NAME ENV CLASS TOOL ARGS...: a perftest server and its client under the
# shaper, in the background, each under timeout; sets CPID (the client's timeout) and CAPP
# (the client itself), or fails the run.
start_pair() {
  local name=$1 envs=$2 class=$3 tool=$4 port=$((PORT++))
  shift 4
  # shellcheck disable=SC2046 # the environment is NAME=value words without spaces
  env $(shaped "$class") $envs timeout 150 "$tool" -d "$DEV" -x "$GID" "$@" -p "$port" > "$L.$name.server.log" 2>&1 &
  PIDS+=("$!")
  wait_tcp_listen "$port" || fail_rest "the $tool server did not listen within 30 s ($L.$name.server.log)"
  # shellcheck disable=SC2046
  env $(shaped "$class") $envs timeout 150 "$tool" -d "$DEV" -x "$GID" "$@" -p "$port" localhost > "$L.$name.client.log" 2>&1 &
  CPID=$!
  PIDS+=("$CPID")
  CAPP=$(child_of "$CPID")
}
# The latency pair at the lowest priority (busy-polling perftest would slow the daemon and
# justitia to tens of seconds a command); ib_write_bw, 1 MiB WRITEs posted without pause,
# at normal priority, so that its flow stays active (a shaper reports its flow idle after
# two ticks without a post, and a niced process is descheduled for longer).
start_pair lat "nice -n 19" latency ib_write_lat -s 16 -D 120
LAT=$CPID LAT_APP=$CAPP
start_pair bw "" bandwidth ib_write_bw -s 1048576 -D 100
BW=$CPID BW_APP=$CAPP
# The checker beside them (a second bandwidth flow of the same tenant, niced: between
# transfers it compares buffers and posts nothing, so its flow comes and goes).
TRANSFERS=${DAEMON_ADAPTIVE_TRANSFERS:-20}
# shellcheck disable=SC2046
env JUSTITIA_LOG=info JUSTITIA_STATS="$L.integrity.stats.json" $(shaped bandwidth) nice -n 19 timeout 200 "$INTEGRITY" \
  -d "$DEV" -x "$GID" -n "$TRANSFERS" > "$L.integrity.log" 2>&1 &
INT=$!
PIDS+=("$INT")

# Status and flows are two answers, the law plans again whenever a flow's activity changes
# (the niced applications' shapers report idle when they are descheduled for two ticks),
# and the others' load moves, so a pair that does not show both flows active with the
# law's allotment is asked again; the check passes on the first that does.
: > "$L.tries.log"
verdict="" deadline=$((SECONDS + 120)) tries=0
while [ "$SECONDS" -lt "$deadline" ]; do
  tries=$((tries + 1))
  "$BIN/justitia" status --socket "$run/admin.sock" --json > "$L.status.json" 2>&1
  "$BIN/justitia" flows --socket "$run/admin.sock" --json > "$L.flows.json" 2>&1
  if verdict=$(/usr/bin/python3 "$HERE/adaptive_check.py" "$L.status.json" "$L.flows.json" "$LAT_APP" "$BW_APP" 2>&1); then
    break
  fi
  echo "try $tries at $SECONDS s: $verdict" >> "$L.tries.log"
  kill -0 "$BW_APP" 2>/dev/null || break
  sleep 0.5
done
if [ -n "$verdict" ] && [ "${verdict#ok}" != "$verdict" ]; then
  pass "${verdict#ok } (try $tries)"
else
  fail_one "not the law's allotments within 120 s: $verdict ($L.tries.log, $L.status.json, $L.flows.json)"
fi

# --- 2. the law reads the latency application's round trips --------------------------------
# Asked until an answer shows them, while ib_write_lat runs (120 s from its start).
tail_read="" tail_ok=""
deadline=$((SECONDS + 60))
while [ "$SECONDS" -lt "$deadline" ]; do
  "$BIN/justitia" status --socket "$run/admin.sock" --json > "$L.status-tail.json" 2>&1
  if tail_read=$(/usr/bin/python3 - "$L.status-tail.json" <<'PY'
import json, sys
a = (json.load(open(sys.argv[1])).get("adaptive") or {})
trips, updates = a.get("round_trips", 0), a.get("applications_tail_updates", 0)
print(f"{trips} round trips reported, the law read them at {updates} updates; "
      f"last tail {a.get('tail_ns')} ns from the {a.get('tail_source')}")
sys.exit(0 if trips >= 20 and updates >= 1 else 1)
PY
  ); then
    tail_ok=1
    break
  fi
  kill -0 "$LAT_APP" 2>/dev/null || break
  sleep 1
done
if [ -n "$tail_ok" ]; then
  pass "$tail_read"
else
  fail_one "ib_write_lat's round trips not read by the law: ${tail_read:-no answer} ($L.status-tail.json)"
fi

# --- 3. the checker finishes clean ----------------------------------------------------------
wait "$INT"
rc=$?
summary=$(grep -E '^justitia-integrity: (PASS|FAIL):' "$L.integrity.log" | tail -n 1 | sed 's/^justitia-integrity: //')
followed=$(grep -c "following justitiad" "$L.integrity.log")
if [ "$rc" = 0 ] && [ "${summary#PASS}" != "$summary" ] && [ "$followed" -ge 1 ]; then
  pass "$summary; its shaper followed the adaptive daemon"
else
  fail_one "exit $rc: ${summary:-no summary}; said it followed justitiad: $followed ($L.integrity.log)"
fi

kill "$LAT" "$BW" 2>/dev/null
kill -TERM "$dpid" 2>/dev/null
wait "$dpid" 2>/dev/null
dpid=""
cleanup
exit "$failed"
