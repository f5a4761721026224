#!/bin/bash
# Inside the guest (in the chroot, rxe0 up): justitiad with `policy = "adaptive"` steering a
# latency and a bandwidth application under the shaper. Run from suite.sh's daemon
# section, or alone:
#
#   tests/vm/guest.sh --timeout 300 -- tests/vm/guest/daemon-adaptive.sh RESULTS BIN_DIR SHAPER_LIB INTEGRITY_BIN
#
# BIN_DIR holds justitiad and justitia (cargo build --release); SHAPER_LIB is
# libjustitia.so, INTEGRITY_BIN justitia-integrity. The daemon starts from
# packaging/justitiad.toml with its sockets and metrics moved (daemon-lib.sh) and
# `policy = "adaptive"`. Both applications run under the shaper with
# JUSTITIA_POLICY=adaptive and JUSTITIA_SOCKET, no JUSTITIA_RATE:
#
# 1. ib_write_lat (16 B, latency class) and justitia-integrity (bandwidth class):
#    `justitia flows --json` and `justitia status --json` must show the allotments the
#    adaptive law gives, worked out by adaptive_check.py from the law's documented formula
#    (justitia_core::adaptive): the bandwidth flow paced at its tenant's part of
#    max(headroom x fraction x (MaxRate - the others' load), B/(L+B+T) x MaxRate), in chunks
#    no larger than the target's slack at MaxRate; the latency flow unshaped.
# 2. The checker finishes with zero mismatches, its shaper having followed the daemon.
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

LAST_RESULT=$SECONDS
result() { # STATUS NAME DETAIL
  printf '%s %s: %s (%d s)\n' "$1" "$2" "$3" $((SECONDS - LAST_RESULT)) | tee -a "$RESULTS/results.txt"
  LAST_RESULT=$SECONDS
}

CHECKS=("daemon adaptive: ib_write_lat and justitia-integrity follow the adaptive law (justitia flows)"
  "daemon adaptive: integrity under the adaptive allotments, zero mismatches")
done_checks=0
pass() { result PASS "${CHECKS[$done_checks]}" "$1"; done_checks=$((done_checks + 1)); }
fail_one() { result FAIL "${CHECKS[$done_checks]}" "$1"; done_checks=$((done_checks + 1)); failed=1; }
failed=0
fail_rest() { # WHY: this check fails, the later ones are reported as not run
  result FAIL "${CHECKS[$done_checks]}" "$1"
  local i
  for ((i = done_checks + 1; i < ${#CHECKS[@]}; i++)); do
    result FAIL "${CHECKS[$i]}" "not run: ${CHECKS[$done_checks]} failed"
  done
  cleanup
  exit 1
}

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
daemon_config "$config" "$run/justitiad.sock" "$run/admin.sock" "" 'policy="adaptive"' \
  || fail_rest "$DAEMON_ERR"
cp "$config" "$L.justitiad.toml"
daemon_start "$config" "$L.justitiad.log"
dpid=$DAEMON_PID
daemon_wait "$L.justitiad.log" "$run/admin.sock" 30 probing || fail_rest "$DAEMON_ERR"

# The shaper's environment: following the scratch daemon under adaptive, at the lowest
# priority (perftest and the checker poll without pause; niced they leave the emulated
# CPUs to the daemon and justitia).
shaped() { # CLASS
  echo "LD_PRELOAD=$LIB JUSTITIA_CLASS=$1 JUSTITIA_POLICY=adaptive JUSTITIA_SOCKET=$run/justitiad.sock nice -n 19"
}

# The pid of the program a `timeout` (PID) runs: the one the daemon sees register.
child_of() { # PID
  local _ c
  for _ in $(seq 100); do
    c=$(pgrep -P "$1" | head -n 1)
    [ -n "$c" ] && { echo "$c"; return; }
    sleep 0.05
  done
  echo "$1"
}

wait_tcp_listen() { # PORT
  local _
  for _ in $(seq 300); do
    ss -Hltn "sport = :$1" 2>/dev/null | grep -q . && return 0
    sleep 0.1
  done
  return 1
}

# --- 1. the allotments follow the law -------------------------------------------------------
# shellcheck disable=SC2046 # shaped prints NAME=value words without spaces
env $(shaped latency) timeout 150 ib_write_lat -d "$DEV" -x "$GID" -s 16 -D 120 -p "$PORT" > "$L.lat.server.log" 2>&1 &
PIDS+=("$!")
wait_tcp_listen "$PORT" || fail_rest "the ib_write_lat server did not listen within 30 s ($L.lat.server.log)"
# shellcheck disable=SC2046
env $(shaped latency) timeout 150 ib_write_lat -d "$DEV" -x "$GID" -s 16 -D 120 -p "$PORT" localhost > "$L.lat.client.log" 2>&1 &
LAT=$!
PIDS+=("$LAT")
LAT_APP=$(child_of "$LAT")
TRANSFERS=${DAEMON_ADAPTIVE_TRANSFERS:-400}
# shellcheck disable=SC2046
env JUSTITIA_LOG=info JUSTITIA_STATS="$L.integrity.stats.json" $(shaped bandwidth) timeout 150 "$INTEGRITY" \
  -d "$DEV" -x "$GID" -n "$TRANSFERS" > "$L.integrity.log" 2>&1 &
INT=$!
PIDS+=("$INT")
INT_APP=$(child_of "$INT")

# Status and flows are two answers, and the law plans again every RefPeriod (the others'
# load and the fraction move), so a pair that disagrees is asked again; the check passes
# on the first pair in which both flows are active and the allotment is the law's.
verdict="" deadline=$((SECONDS + 90)) tries=0
while [ "$SECONDS" -lt "$deadline" ]; do
  tries=$((tries + 1))
  "$BIN/justitia" status --socket "$run/admin.sock" --json > "$L.status.json" 2>&1
  "$BIN/justitia" flows --socket "$run/admin.sock" --json > "$L.flows.json" 2>&1
  if verdict=$(/usr/bin/python3 "$HERE/adaptive_check.py" "$L.status.json" "$L.flows.json" "$LAT_APP" "$INT_APP" 2>&1); then
    break
  fi
  echo "try $tries at $SECONDS s: $verdict" >> "$L.tries.log"
  kill -0 "$INT_APP" 2>/dev/null || break
  sleep 0.5
done
if [ -n "$verdict" ] && [ "${verdict#ok}" != "$verdict" ]; then
  pass "${verdict#ok } (try $tries)"
else
  fail_one "not the law's allotments within 90 s: $verdict ($L.tries.log, $L.status.json, $L.flows.json)"
fi

# --- 2. the checker finishes clean ----------------------------------------------------------
wait "$INT"
rc=$?
summary=$(grep -E '^justitia-integrity: (PASS|FAIL):' "$L.integrity.log" | tail -n 1 | sed 's/^justitia-integrity: //')
followed=$(grep -c "following justitiad" "$L.integrity.log")
if [ "$rc" = 0 ] && [ "${summary#PASS}" != "$summary" ] && [ "$followed" -ge 1 ]; then
  pass "$summary; its shaper followed the adaptive daemon"
else
  fail_one "exit $rc: ${summary:-no summary}; said it followed justitiad: $followed ($L.integrity.log)"
fi

kill "$LAT" 2>/dev/null
kill -TERM "$dpid" 2>/dev/null
wait "$dpid" 2>/dev/null
dpid=""
cleanup
exit "$failed"
