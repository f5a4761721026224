#!/bin/bash
# On host A of the two-host pair (tests/vm/two-hosts.sh, as tests/vm/guest/two-hosts.sh):
# shaped RDMA WRITE streams across the cable must end as they do natively. Each round runs
# two ib_write_bw clients on A at once (150 x 64 KiB each, the incast of two-hosts.sh
# section 5), each against its own unshaped server on B, under the shaper (bandwidth
# class); every client must exit 0 with a bandwidth figure (or, when perftest could not
# calibrate its cycle counter three times in a row, which it tries only after every WRITE
# completed, say so with no completion error). Modes:
#
#   daemon-64K      following A's justitiad, JUSTITIA_CHUNK=64K (no splitting)
#   daemon-default  following A's justitiad, its chunk size
#   static-64K      no daemon, JUSTITIA_RATE=2M, JUSTITIA_CHUNK=64K
#
# Paced 64 KiB WRITEs used to fail here with IBV_WC_REM_INV_REQ_ERR (status 9), an rxe
# defect the shaper's pacing made the rule: under the pair's load rxe's retransmission
# timer fires while a WRITE's acknowledgement is still on its way; the acknowledgement of
# the WRITE's last packet then arrives while the WRITE is being resent, rxe takes that PSN
# as acknowledged without completing the WRITE, and its next retry replays the WRITE as a
# zero-length WRITE ONLY one PSN past its end. Every later packet is one PSN late, and the
# responder, which had the next WRITE's first packets, gets one packet more than that
# WRITE's RETH length and answers "invalid request" (packet captures of A's eth0 show that
# sequence in every failure, unshaped ones included). The shaper now posts a bandwidth
# flow's WRITE on rxe one path MTU a work request, paced or not (a flow whose daemon is
# slow falls back to unpaced) (crates/preload, QpState::chunk_bytes_for). With 4 rounds a
# mode, the library before it failed 1, 2 (one a hang) and 3 of 8 clients in the three
# modes, the library with it none of 24.
#
#   pair-write.sh RESULTS SHAPER_LIB BIN_DIR     # PAIR_WRITE_ROUNDS rounds a mode (6)
#
# One line per mode goes to RESULTS/results.txt; logs to RESULTS/logs/pair-write.*, B's
# to RESULTS/b/logs/.
set -uo pipefail

RESULTS=$1
LIB=$2
BIN=$3
HERE=$(cd "$(dirname "$0")" && pwd)
LOGS=$RESULTS/logs
BLOGS=$RESULTS/b/logs
L=$LOGS/pair-write
mkdir -p "$LOGS" "$BLOGS"
touch "$RESULTS/results.txt"
# shellcheck source=tests/vm/guest/daemon-lib.sh
source "$HERE/daemon-lib.sh"

A_DEV=rxea B_DEV=rxeb
B_ADDR=10.77.0.2
GID=1
STEP=${STEP_TIMEOUT:-120}
ROUNDS=${PAIR_WRITE_ROUNDS:-6}
PORT=19800

LAST_RESULT=$SECONDS
result() { # STATUS NAME DETAIL
  printf '%s %s: %s (%d s)\n' "$1" "pair write: $2" "$3" $((SECONDS - LAST_RESULT)) | tee -a "$RESULTS/results.txt"
  LAST_RESULT=$SECONDS
}
onb() { # SECONDS COMMAND: COMMAND on host B
  python3 "$HERE/remote.py" run "$B_ADDR" 7770 "$1" "$2"
}
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  onb 20 "pkill -KILL -f '^(timeout [0-9]+ )?ib_write_bw'" > /dev/null 2>&1
  wait 2>/dev/null
}
trap 'cleanup; exit 124' TERM

dir=$(mktemp -d /tmp/pair-write.XXXXXX)
if ! daemon_config "$dir/justitiad.toml" "$dir/justitiad.sock" "$dir/admin.sock" 127.0.0.1:19468 "device=\"$A_DEV\""; then
  result FAIL "a justitiad on A" "$DAEMON_ERR"
  exit 0
fi
daemon_start "$dir/justitiad.toml" "$L.justitiad.log"
PIDS+=("$DAEMON_PID")
if ! daemon_wait "$L.justitiad.log" "$dir/admin.sock" 60; then
  result FAIL "a justitiad on A" "$DAEMON_ERR"
  cleanup
  exit 0
fi

# round MODE N ENV: two clients at once, on ports PORT and PORT + 1; sets RCS to their
# exit statuses.
round() {
  local mode=$1 n=$2 env_words=$3 p1=$((PORT++)) p2=$((PORT++)) p c cpids=()
  onb 30 "for p in $p1 $p2; do timeout $STEP ib_write_bw -d $B_DEV -x $GID -p \$p -s 65536 -n 150 > $BLOGS/pair-write.$mode.$n.\$p.server.log 2>&1 & done
    for p in $p1 $p2; do for _ in \$(seq 200); do ss -Hltn \"sport = :\$p\" | grep -q . && break; sleep 0.1; done; done" > /dev/null
  for p in $p1 $p2; do
    # shellcheck disable=SC2086 # NAME=value words without spaces
    env $env_words JUSTITIA_STATS="$L.$mode.$n.$p.%p.stats.json" timeout "$STEP" \
      ib_write_bw -d "$A_DEV" -x "$GID" -p "$p" -s 65536 -n 150 "$B_ADDR" > "$L.$mode.$n.$p.log" 2>&1 &
    cpids+=($!)
  done
  RCS=()
  for c in "${cpids[@]}"; do
    wait "$c"
    RCS+=($?)
  done
  onb 20 "pkill -x ib_write_bw; true" > /dev/null
}

SHAPED="LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth"
for spec in "daemon-64K:JUSTITIA_SOCKET=$dir/justitiad.sock JUSTITIA_CHUNK=64K" \
  "daemon-default:JUSTITIA_SOCKET=$dir/justitiad.sock" \
  "static-64K:JUSTITIA_DAEMON=off JUSTITIA_RATE=2M JUSTITIA_CHUNK=64K"; do
  mode=${spec%%:*}
  env_words="$SHAPED ${spec#*:}"
  failed="" figures=""
  for n in $(seq "$ROUNDS"); do
    # perftest calibrates its cycle counter for its report; under emulation that can fail
    # after a transfer that went well ("r^2 ... < 0.9", then "Can't produce a report"): a
    # round whose only failures are that is run again, up to three times in all.
    for attempt in 1 2 3; do
      p1=$PORT
      round "$mode" "$n" "$env_words"
      calibration_only=1 any_failed=0
      for i in 0 1; do
        log="$L.$mode.$n.$((p1 + i)).log"
        [ "${RCS[$i]}" = 0 ] && continue
        any_failed=1
        grep -q "Can't produce a report" "$log" && ! grep -q 'Failed status' "$log" || calibration_only=0
      done
      [ "$any_failed" = 1 ] && [ "$calibration_only" = 1 ] && [ "$attempt" -lt 3 ] || break
      echo "pair-write: $mode round $n: perftest could not calibrate ($L.$mode.$n.$p1.log): again" >> "$L.retries.txt"
    done
    for i in 0 1; do
      log="$L.$mode.$n.$((p1 + i)).log"
      status=$(grep -h -m1 -o 'Failed status [0-9]*' "$log")
      fig=$(awk '/#bytes/ {h = 1; next} h && $1 ~ /^[0-9]+$/ {print $4; exit}' "$log")
      if [ "${RCS[$i]}" = 0 ] && [ -n "$fig" ]; then
        figures="$figures $fig"
      elif [ -z "$status" ] && grep -q "Can't produce a report" "$log" && grep -q 'Correlation coefficient' "$log"; then
        # The third calibration failure in a row: perftest reports only once every WRITE
        # completed, so the transfer ended well; the round has no figure.
        figures="$figures (no report: perftest could not calibrate its cycle counter)"
      else
        # The log's last words name what went wrong when no completion did.
        last=$(grep -v '^ *$' "$log" | tail -n 2 | tr -s ' \t\n' ' ')
        failed="$failed round $n client $((i + 1)): exit ${RCS[$i]}, ${status:-no completion error}${fig:+, $fig MB/s}, last words: ${last:-none} ($log);"
      fi
    done
  done
  if [ -z "$failed" ]; then
    result PASS "$ROUNDS rounds of two shaped ib_write_bw 150 x 64 KiB A -> B at once ($mode)" "every client completed its WRITEs, MB/s:$figures"
  else
    result FAIL "$ROUNDS rounds of two shaped ib_write_bw 150 x 64 KiB A -> B at once ($mode)" "${failed%;}"
  fi
done
cleanup
