#!/bin/bash
# Inside the guest (in the chroot, rxe0 up): the isolation benchmark. A 16 B ib_write_lat
# (the latency flow) runs alone, beside a 1 MiB ib_write_bw (the bandwidth flow), and
# beside the bandwidth flow under the shaper: bandwidth class paced at fractions of its
# alone bandwidth, split but unpaced, and preempt. Every case runs REPEATS times.
#
#   isolation.sh RESULTS SHAPER_LIB
#
# Appends "case|repeat|typical_us|p99_us|p999_us|bw_MBps" lines to RESULTS/isolation.txt
# ("-" where a case has no such figure); tool output goes to RESULTS/logs/.
#
# perftest turns cycle counts into times with a CPU frequency it samples at run time; under
# emulation on a busy host that sampling sometimes fails ("Correlation coefficient r^2 <
# 0.9"), and the tool then reports "inf" or no figures at all. Such a measurement is taken
# again (the latency flow while the bandwidth flow still runs; a whole case otherwise).
set -uo pipefail

RESULTS=$1
LIB=$2
LOGS=$RESULTS/logs
mkdir -p "$LOGS"
: > "$RESULTS/isolation.txt"
DEV=rxe0
GID=0
REPEATS=${REPEATS:-3}
LAT_ITERS=${LAT_ITERS:-2000}
BW_SECONDS=${BW_SECONDS:-15}
ATTEMPTS=3
PORT=20000

wait_tcp_listen() {
  local _
  for _ in $(seq 200); do
    ss -Hltn "sport = :$1" 2>/dev/null | grep -q . && return 0
    sleep 0.1
  done
  return 1
}

# The result row of a perftest log (the line after the "#bytes" header).
result_row() {
  awk '/#bytes/ {h = 1; next} h && $1 ~ /^[0-9]+$/ {print; exit}' "$1"
}

# start_bw NAME ENV...: a 1 MiB ib_write_bw for BW_SECONDS in the background, the client
# with ENV (NAME=value words); sets BW_PIDS and BW_LOG.
start_bw() {
  local name=$1 port=$((PORT++))
  shift
  timeout $((BW_SECONDS + 60)) ib_write_bw -d "$DEV" -x "$GID" -s 1048576 -D "$BW_SECONDS" -p "$port" \
    > "$LOGS/$name.bw-server.log" 2>&1 &
  BW_PIDS=$!
  wait_tcp_listen "$port" || echo "isolation: bandwidth server did not listen ($name)" >&2
  env "$@" timeout $((BW_SECONDS + 60)) ib_write_bw -d "$DEV" -x "$GID" -s 1048576 -D "$BW_SECONDS" \
    -p "$port" localhost > "$LOGS/$name.bw-client.log" 2>&1 &
  BW_PIDS="$BW_PIDS $!"
  BW_LOG=$LOGS/$name.bw-client.log
}

# run_lat NAME: the 16 B latency flow, unshaped; prints "typical|p99|p99.9" (us), or
# nothing when perftest could not time it.
run_lat_once() {
  local name=$1 port=$((PORT++))
  timeout 300 ib_write_lat -d "$DEV" -x "$GID" -s 16 -n "$LAT_ITERS" -p "$port" \
    > "$LOGS/$name.lat-server.log" 2>&1 &
  local spid=$!
  wait_tcp_listen "$port" || echo "isolation: latency server did not listen ($name)" >&2
  timeout 300 ib_write_lat -d "$DEV" -x "$GID" -s 16 -n "$LAT_ITERS" -p "$port" localhost \
    > "$LOGS/$name.lat-client.log" 2>&1
  wait "$spid"
  # Columns: bytes iterations t_min t_max t_typical t_avg t_stdev p99 p99.9.
  result_row "$LOGS/$name.lat-client.log" | awk '$5 + 0 > 0 && $5 != "inf" {print $5 "|" $8 "|" $9}'
}

run_lat() {
  local name=$1 attempt lat
  for attempt in $(seq "$ATTEMPTS"); do
    lat=$(run_lat_once "$name.try$attempt")
    [ -n "$lat" ] && break
  done
  echo "$lat"
}

bw_of() { # CLIENT_LOG: average MB/s, from the client's report or else the server's
  local row
  row=$(result_row "$1")
  [ -n "$row" ] || row=$(result_row "${1%-client.log}-server.log")
  echo "$row" | awk 'NF {print $4}'
}

record() { # CASE REPEAT LAT BW
  echo "$1|$2|${3:-"-|-|-"}|${4:--}" | tee -a "$RESULTS/isolation.txt"
}

# contended CASE REPEAT ENV...: the latency flow while the bandwidth flow runs with ENV.
contended() {
  local case=$1 rep=$2 name lat bw attempt
  shift 2
  for attempt in $(seq "$ATTEMPTS"); do
    name=$(echo "$case.$rep.try$attempt" | tr -c 'A-Za-z0-9_.=-' '_')
    start_bw "$name" "$@"
    # Let the bandwidth flow reach its steady state before measuring.
    sleep 2
    lat=$(run_lat "$name")
    # shellcheck disable=SC2086 # a list of pids
    wait $BW_PIDS
    bw=$(bw_of "$BW_LOG")
    [ -n "$lat" ] && [ -n "$bw" ] && break
  done
  record "$case" "$rep" "$lat" "$bw"
}

for rep in $(seq "$REPEATS"); do
  record "latency flow alone" "$rep" "$(run_lat "alone.$rep")" ""
  for attempt in $(seq "$ATTEMPTS"); do
    start_bw "bw-alone.$rep.try$attempt"
    # shellcheck disable=SC2086
    wait $BW_PIDS
    bw=$(bw_of "$BW_LOG")
    [ -n "$bw" ] && break
  done
  record "bandwidth flow alone" "$rep" "" "$bw"
done
alone=$(grep '^bandwidth flow alone|' "$RESULTS/isolation.txt" | cut -d'|' -f6 | sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}')
echo "isolation: bandwidth flow alone, median ${alone} MB/s"

have_shaper=0
[ "$LIB" != - ] && [ -e "$LIB" ] && have_shaper=1
for rep in $(seq "$REPEATS"); do
  contended "with the bandwidth flow (no shaper)" "$rep"
  if [ "$have_shaper" = 1 ]; then
    for pct in 75 50 25; do
      # perftest's MB/s are 2^20 bytes per second; JUSTITIA_RATE takes bytes per second.
      rate=$(awk -v a="$alone" -v p="$pct" 'BEGIN {printf "%d", a * 1048576 * p / 100}')
      contended "shaped: bandwidth class, rate ${pct}% of alone" "$rep" \
        LD_PRELOAD="$LIB" JUSTITIA_CLASS=bandwidth JUSTITIA_RATE="$rate"
    done
    contended "shaped: bandwidth class, split, unpaced" "$rep" LD_PRELOAD="$LIB" JUSTITIA_CLASS=bandwidth
    contended "shaped: preempt" "$rep" LD_PRELOAD="$LIB" JUSTITIA_CLASS=bandwidth JUSTITIA_POLICY=preempt
  fi
done
[ "$have_shaper" = 1 ] || echo "isolation: the shaper is not built; only the unshaped cases ran"

# The same experiment as a scenario file through `justitia run` (RUN_BIN holds justitia and
# justitia-loadgen): natively and under the shaper following a scratch justitiad, with the
# model beside it and the isolation verdict (p99 at most x1.2 of alone, rate at least 0.8).
RUN_BIN=${RUN_BIN:-}
if [ "$have_shaper" = 1 ] && [ -x "$RUN_BIN/justitia" ] && [ -x "$RUN_BIN/justitiad" ]; then
  dir=$(mktemp -d /tmp/justitia-bench.XXXXXX)
  sed -e "s|^socket = .*|socket = \"$dir/justitiad.sock\"|" \
    -e "s|^admin_socket = .*|admin_socket = \"$dir/admin.sock\"|" \
    -e "s|^metrics = .*|metrics = \"127.0.0.1:9478\"|" packaging/justitiad.toml > "$dir/justitiad.toml"
  "$RUN_BIN/justitiad" --config "$dir/justitiad.toml" > "$LOGS/justitiad.log" 2>&1 &
  dpid=$!
  sleep 3
  JUSTITIA_SOCKET=$dir/justitiad.sock timeout 600 "$RUN_BIN/justitia" run scenarios/lat-vs-1mb-bw-ib56.toml --shaper "$LIB" \
    -d "$DEV" --duration-ms $((BW_SECONDS * 1000)) --warmup-ms 1000 --compare \
    --max-p99-ratio 1.2 --min-rate-ratio 0.8 --plot "$RESULTS" --out "$RESULTS" \
    > "$RESULTS/justitia-run.txt" 2> "$LOGS/justitia-run.err"
  echo "justitia run: exit status $? (non-zero when a victim failed the verdict)" >> "$RESULTS/justitia-run.txt"
  kill "$dpid" 2>/dev/null
  wait "$dpid" 2>/dev/null
  rm -rf "$dir"
fi
