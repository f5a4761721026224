#!/bin/bash
# On host A of the two-host pair (tests/vm/two-hosts.sh; rxea on 10.77.0.1, host B's rxeb
# on 10.77.0.2, joined by a virtual cable; host C's rxec on 10.77.0.3, on a second cable
# into B, the third host of the incast check): the checks that cross between RDMA hosts.
# Hosts B and C run what A asks through tests/vm/guest/remote.py. One line per check goes
# to RESULTS/results.txt, as in suite.sh; A's logs go to RESULTS/logs/two-hosts.*, B's to
# RESULTS/b/logs/ and C's to RESULTS/c/logs/ (their own output directories, which A sees).
#
#   two-hosts.sh RESULTS SHAPER_LIB BIN_DIR
#
# BIN_DIR holds justitiad and justitia (cargo build --release). Every run is bounded;
# under emulation a WRITE or READ stream across the cable moves about 10 MB/s.
set -uo pipefail

RESULTS=$1
LIB=$2
BIN=$3
HERE=$(cd "$(dirname "$0")" && pwd)
LOGS=$RESULTS/logs
BLOGS=$RESULTS/b/logs
CLOGS=$RESULTS/c/logs
L=$LOGS/two-hosts
mkdir -p "$LOGS" "$BLOGS" "$CLOGS"
touch "$RESULTS/results.txt"
# shellcheck source=tests/vm/guest/daemon-lib.sh
source "$HERE/daemon-lib.sh"

A_DEV=rxea B_DEV=rxeb C_DEV=rxec
A_ADDR=10.77.0.1 B_ADDR=10.77.0.2 C_ADDR=10.77.0.3
GID=1 # the IPv4-mapped GID, RoCE v2
STEP=${STEP_TIMEOUT:-120}
PORT=19500

LAST_RESULT=$SECONDS
result() { # STATUS NAME DETAIL
  printf '%s %s: %s (%d s)\n' "$1" "two hosts: $2" "$3" $((SECONDS - LAST_RESULT)) | tee -a "$RESULTS/results.txt"
  LAST_RESULT=$SECONDS
}

# onb SECONDS COMMAND: COMMAND (a bash command line) on host B, from the repository root;
# its output on stdout, its status returned.
onb() {
  python3 "$HERE/remote.py" run "$B_ADDR" 7770 "$1" "$2"
}
# onc SECONDS COMMAND: the same on host C.
onc() {
  python3 "$HERE/remote.py" run "$C_ADDR" 7770 "$1" "$2"
}

PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  onb 20 "pkill -KILL -x justitiad; pkill -KILL -f '^(timeout [0-9]+ )?(ib_|rping)'" > /dev/null 2>&1
  onc 20 "pkill -KILL -x justitiad; pkill -KILL -f '^(timeout [0-9]+ )?(ib_|rping)'" > /dev/null 2>&1
  wait 2>/dev/null
}
trap 'cleanup; exit 124' TERM

# The counts of the run (bytes, iterations) and the bandwidth or latency it reports.
perftest_counts() { # LOG: "#bytes x #iterations"
  awk '/#bytes/ && /#iterations/ {h = 1; next} h && $1 ~ /^[0-9]+$/ {print $1 "x" $2; exit}' "$1"
}
perftest_figure() { # LOG: average MB/s of a bandwidth run, typical us of a latency run
  awk '/#bytes/ {h = 1; lat = /t_typical/; next}
    h && $1 ~ /^[0-9]+$/ {print (lat ? $5 " us typical" : $4 " MB/s"); exit}' "$1"
}
rx_tx() { # the bytes eth0 has received and sent, "RX TX"
  echo "$(cat /sys/class/net/eth0/statistics/rx_bytes) $(cat /sys/class/net/eth0/statistics/tx_bytes)"
}

# b_listen PORT: until a TCP server listens on PORT on host B (at most 20 s).
b_listen() {
  onb 30 "for _ in \$(seq 200); do ss -Hltn 'sport = :$1' | grep -q . && exit 0; sleep 0.1; done; exit 1" > /dev/null
}

# ---------------------------------------------------------------------------------------
# 1. Each host has its own device and sees no other; the other's address is reached over
# the cable only.
a_devs=$(ibv_devices | awk 'NR > 2 {print $1}' | paste -sd ' ')
b_devs=$(onb 60 "ibv_devices | awk 'NR > 2 {print \$1}' | paste -sd ' '")
a_gid=$(cat /sys/class/infiniband/$A_DEV/ports/1/gids/$GID 2>/dev/null)
b_gid=$(onb 20 "cat /sys/class/infiniband/$B_DEV/ports/1/gids/$GID")
if [ "$a_devs" = "$A_DEV" ] && [ "$b_devs" = "$B_DEV" ] && [ "${a_gid##*:}" = 0001 ] && [ "${b_gid##*:}" = 0002 ]; then
  result PASS "each host sees only its own device" "A: $a_devs (GID $GID $a_gid), B: $b_devs (GID $GID $b_gid)"
else
  result FAIL "each host sees only its own device" "A lists '$a_devs' (GID $a_gid), B lists '$b_devs' (GID $b_gid)"
fi
# Host C, the incast's second sender (section 6), the same way; A reaches it through B's
# emulator (see tests/vm/lib.sh, vm_boot_pair).
c_devs=$(onc 60 "ibv_devices | awk 'NR > 2 {print \$1}' | paste -sd ' '")
c_gid=$(onc 20 "cat /sys/class/infiniband/$C_DEV/ports/1/gids/$GID")
if [ "$c_devs" = "$C_DEV" ] && [ "${c_gid##*:}" = 0003 ]; then
  result PASS "host C sees only its own device" "C: $c_devs (GID $GID $c_gid)"
else
  result FAIL "host C sees only its own device" "C lists '$c_devs' (GID $c_gid)"
fi

# Messages a run of justitia-integrity --two-sided sends (sections 2b and 6).
TWO_SIDED_MESSAGES=${TWO_SIDED_MESSAGES:-12}
# two_sided_run MODE SLUG A_ENV B_ENV [MESSAGES [DURING]]: one run of MODE (send or
# write-imm) of MESSAGES (TWO_SIDED_MESSAGES) messages, the server on B under B_ENV, the
# client on A under A_ENV (empty: native); logs named after SLUG. DURING, a command, runs
# while the client does, with CLIENT_PID and CLIENT_LOG set. Sets
# TS_OK (1 when both ends passed with 0 mismatches), TS_WHAT (both verdicts and what the
# shapers counted) and TS_LOGS. TS_MAX_SIZE (16M) is the largest message; TS_CLIENT_ARGS,
# more options for the client.
two_sided_run() {
  local mode=$1 slug=$2 a_env=$3 b_env=$4 messages=${5:-$TWO_SIDED_MESSAGES} during=${6:-} iport=$((PORT++)) rc served summary
  TS_OK=0 TS_LOGS="$L.$slug.log, $BLOGS/$slug.server.log"
  onb 10 "env $b_env ${b_env:+JUSTITIA_STATS=$BLOGS/$slug.server.%p.stats.json} timeout $STEP $BIN/justitia-integrity -d $B_DEV -x $GID \
    --serve $B_ADDR:$iport > $BLOGS/$slug.server.log 2>&1 &" > /dev/null
  if ! b_listen "$iport"; then
    TS_WHAT="the server on B did not listen"
    return
  fi
  # shellcheck disable=SC2086 # NAME=value words without spaces
  env $a_env ${a_env:+JUSTITIA_STATS=$L.$slug.%p.stats.json} timeout "$STEP" "$BIN/justitia-integrity" -d "$A_DEV" -x "$GID" \
    --connect "$B_ADDR:$iport" --two-sided "$mode" -n "$messages" --max-size "${TS_MAX_SIZE:-16M}" --boundary 64K \
    ${TS_CLIENT_ARGS:-} > "$L.$slug.log" 2>&1 &
  CLIENT_PID=$! CLIENT_LOG=$L.$slug.log
  PIDS+=("$CLIENT_PID")
  [ -n "$during" ] && $during
  wait "$CLIENT_PID"
  rc=$?
  # [e]: the pattern does not match this shell's own command line.
  served=$(onb 30 "for _ in \$(seq 100); do pgrep -f 'justitia-integrity.*--serv[e] $B_ADDR:$iport' > /dev/null || break; sleep 0.2; done; \
    grep -m1 'justitia-integrity: \(PASS\|FAIL\)' $BLOGS/$slug.server.log")
  summary=$(grep -m1 'justitia-integrity: \(PASS\|FAIL\)' "$L.$slug.log" | sed 's/^justitia-integrity: //')
  TS_A_STATS="" TS_B_STATS=""
  [ -n "$a_env" ] && TS_A_STATS=$(cat "$L.$slug".*.stats.json 2>/dev/null | tr -d ' \n' \
    | grep -o '"split_requests":[0-9]*\|"chunks":[0-9]*\|"pairings_reported":[0-9]*\|"qps_paired":[0-9]*\|"qps_agreed":[0-9]*\|"side_refused":[0-9]*' | paste -sd ' ')
  [ -n "$b_env" ] && TS_B_STATS=$(onb 10 "cat $BLOGS/$slug.server.*.stats.json 2>/dev/null | tr -d ' \n' \
    | grep -o '\"qps\":[0-9]*\|\"pairings_reported\":[0-9]*\|\"qps_paired\":[0-9]*\|\"qps_agreed\":[0-9]*\|\"side_refused\":[0-9]*\|\"receiver_polls_aside\":[0-9]*\|\"cq_arms_solicited\":[0-9]*' | paste -sd ' '")
  TS_WHAT="client exit $rc: ${summary:-$(tail -n 1 "$L.$slug.log")}; server: ${served#justitia-integrity: }"
  [ -n "$a_env" ] && TS_WHAT="$TS_WHAT; shaper on A: ${TS_A_STATS:-no statistics}"
  [ -n "$b_env" ] && TS_WHAT="$TS_WHAT; shaper on B: ${TS_B_STATS:-no statistics}"
  if [ "$rc" = 0 ] && echo "$summary" | grep -q '^PASS: .* 0 mismatches' && echo "$served" | grep -q 'justitia-integrity: PASS'; then
    TS_OK=1
  fi
}

# cross NAME ENV TOOL ARGS...: sets COUNTS, FIGURE, MOVED ("rx tx" bytes) or ERROR.
cross() {
  local name=$1 env_words=$2 tool=$3 port=$((PORT++)) before after rc attempt
  shift 3
  for attempt in 1 2; do
    ERROR=""
    local b_words=${CROSS_B_ENV-$env_words}
    spid=$(onb 10 "env $b_words ${b_words:+JUSTITIA_STATS=$BLOGS/$name.%p.stats.json} timeout $STEP $tool -d $B_DEV -x $GID -p $port $* > $BLOGS/$name.server.log 2>&1 & echo \$!")
    if ! b_listen "$port"; then
      ERROR="the server on B did not listen (log: $BLOGS/$name.server.log)"
    else
      before=$(rx_tx)
      # shellcheck disable=SC2086 # NAME=value words without spaces
      env $env_words ${env_words:+JUSTITIA_STATS=$L.$name.%p.stats.json} timeout "$STEP" "$tool" -d "$A_DEV" -x "$GID" -p "$port" "$@" "$B_ADDR" > "$L.$name.client.log" 2>&1
      rc=$?
      after=$(rx_tx)
      onb 30 "for _ in \$(seq 100); do kill -0 $spid 2> /dev/null || exit 0; sleep 0.2; done; kill $spid" > /dev/null
      COUNTS=$(perftest_counts "$L.$name.client.log")
      FIGURE=$(perftest_figure "$L.$name.client.log")
      MOVED=$(awk -v b="$before" -v a="$after" 'BEGIN {split(b, x, " "); split(a, y, " "); print y[1] - x[1], y[2] - x[2]}')
      [ "$rc" = 0 ] && [ -n "$COUNTS" ] && return 0
      ERROR="client exit $rc: $(grep -h -m1 -i -E "error|fail|couldn't|unable|can't" "$L.$name.client.log") (logs: $L.$name.client.log, $BLOGS/$name.server.log)"
    fi
    PORT=$((PORT + 1))
    port=$PORT
    for f in "$L.$name.client.log" "$BLOGS/$name.server.log"; do
      [ -f "$f" ] && mv "$f" "${f%.log}.attempt$attempt.log"
    done
  done
  return 1
}
# cross_envs NAME A_ENV B_ENV TOOL ARGS...: cross with the server on B under B_ENV.
cross_envs() {
  local name=$1 a_env=$2 b_env=$3
  shift 3
  CROSS_B_ENV=$b_env cross "$name" "$a_env" "$@"
}
split_of() { # NAME: the split requests and chunks the shaper on A counted
  cat "$L.$1".*.stats.json 2>/dev/null | tr -d ' \n' \
    | grep -o '"split_requests":[0-9]*\|"chunks":[0-9]*' | paste -sd ' '
}

# TWO_HOSTS_ONLY=peer runs section 1 and the peer channel (6) alone, to repeat those;
# TWO_HOSTS_ONLY=setup section 1 alone, for wire.sh's sections (WIRE_ONLY) after it.
if [ -z "${TWO_HOSTS_ONLY:-}" ]; then
# ---------------------------------------------------------------------------------------
# 2. perftest across the cable: server on B, client on A, natively and under the shaper
# (bandwidth class, 16 KiB chunks, both sides); the same counts, and the bytes must have
# crossed eth0 in the direction the data goes (a READ's data comes to A, a WRITE's and a
# SEND's leave). READs and WRITEs of 64 KiB must be split; SENDs consume a receive at the
# peer and go whole until the two shapers agree to split them (docs/architecture.md,
# "Splitting two-sided requests"): their counts must match the native run's, and what the
# shaper counted is reported. perftest 4.5-0.17 (Debian bookworm) has no
# --write_with_imm.
SHAPED="LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=16K"
for spec in "ib_read_bw -s 65536 -n 300:rx" "ib_write_bw -s 65536 -n 300:tx" "ib_read_lat -s 64 -n 300:rx" \
  "ib_send_bw -s 65536 -n 300:tx" "ib_send_lat -s 64 -n 300:tx"; do
  cmd=${spec%:*} dir=${spec##*:}
  tool=${cmd%% *}
  base=""
  for mode in native shaped; do
    env_words=""
    [ "$mode" = shaped ] && env_words=$SHAPED
    # shellcheck disable=SC2086 # the tool's arguments
    if ! cross "$tool.$mode" "$env_words" $cmd; then
      result FAIL "$tool A -> B ($mode)" "$ERROR"
      continue
    fi
    bytes=$(echo "$COUNTS" | awk -F x '{print $1 * $2}')
    on_wire=$(echo "$MOVED" | awk -v d="$dir" '{print (d == "rx") ? $1 : $2}')
    stats=$(split_of "$tool.$mode")
    if [ "$on_wire" -lt "$bytes" ]; then
      result FAIL "$tool A -> B ($mode)" "$COUNTS moved but eth0 counted only $on_wire bytes $dir: the data did not cross the cable"
    elif [ "$mode" = shaped ] && [ -z "$stats" ]; then
      result FAIL "$tool A -> B ($mode)" "no statistics from the shaper on A: it was not in the data path"
    elif [ "$mode" = shaped ] && [[ $tool == ib_read_bw || $tool == ib_write_bw ]] && ! echo "$stats" | grep -q '"split_requests":[1-9]'; then
      result FAIL "$tool A -> B ($mode)" "64 KiB requests with 16 KiB chunks, but the shaper on A split none: $stats"
    elif [ -n "$base" ] && [ "$COUNTS" != "$base" ]; then
      result FAIL "$tool A -> B ($mode)" "counts $COUNTS differ from the native run's $base"
    else
      [ -z "$base" ] && base=$COUNTS
      result PASS "$tool A -> B ($mode)" "$COUNTS, $FIGURE; eth0 $dir $on_wire bytes${stats:+; shaper on A: $stats}"
    fi
  done
done

# 2b. Two-sided requests across the cable, byte by byte: justitia-integrity --two-sided,
# its server on B posting a receive per message with a random scatter list, its client on
# A SENDing (half of them with an immediate) or WRITing with immediate
# TWO_SIDED_MESSAGES (12, 20 to 40 MB) messages of 1 B to 16 MiB from random scatter
# lists; the server judges every completion (order, status, opcode, byte_len,
# immediate) and every byte and guard. Both ends natively, then both under the shaper
# (bandwidth class, 64 KiB chunks, the sizes drawn to hit the chunk's multiples so that
# messages fall below, at and above it): every run must pass with 0 mismatches. What the
# shapers counted is reported; with no daemon to pair them they send these requests
# whole (section 6 splits them between paired shapers, and runs a shaped end beside an
# unshaped one).
SHAPED_2S="LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=64K"
# MODE HOW: HOW is native or shaped (both ends).
for run in "send native" "send shaped" "write-imm native" "write-imm shaped"; do
  read -r mode how <<< "$run"
  a_env="" b_env=""
  [ "$how" = shaped ] && a_env=$SHAPED_2S b_env=$SHAPED_2S
  two_sided_run "$mode" "two_sided.$mode.$how" "$a_env" "$b_env"
  if [ "$TS_OK" = 1 ]; then
    result PASS "justitia-integrity --two-sided $mode A -> B ($how)" "$TS_WHAT"
  else
    result FAIL "justitia-integrity --two-sided $mode A -> B ($how)" "$TS_WHAT (logs: $TS_LOGS)"
  fi
done

# ---------------------------------------------------------------------------------------
# 3. Data across the cable, byte by byte: rping with validation. Its server (here on A)
# RDMA READs each ping out of the client's buffer on B, then RDMA WRITEs it back into
# another buffer of the client, which compares the two (-V) and fails on a mismatch. 65000
# bytes a ping: with 16 KiB chunks the shaper must split the WRITEs (four chunks, the last
# odd); it leaves the READs whole, as rping's QP allows one READ outstanding and the shaper
# never cuts a READ into more pieces than its max_rd_atomic. (justitia-integrity connects
# its two QPs within one process, so it cannot span two hosts.)
PINGS=40
for mode in native shaped; do
  port=$((PORT++))
  env_words=""
  [ "$mode" = shaped ] && env_words="$SHAPED JUSTITIA_STATS=$L.rping.$mode.%p.stats.json"
  # shellcheck disable=SC2086
  env $env_words timeout "$STEP" rping -s -a "$A_ADDR" -p "$port" -C "$PINGS" -S 65000 > "$L.rping.$mode.server.log" 2>&1 &
  spid=$!
  for _ in $(seq 200); do rdma resource show cm_id 2>/dev/null | grep -q LISTEN && break; sleep 0.1; done
  onb $((STEP + 10)) "timeout $STEP rping -c -a $A_ADDR -p $port -C $PINGS -S 65000 -V -v > $BLOGS/rping.$mode.client.log 2>&1"
  crc=$?
  wait "$spid"
  src=$?
  pings=$(grep -c 'ping data: rdma-ping-' "$BLOGS/rping.$mode.client.log")
  mism=$(grep -c -i mismatch "$BLOGS/rping.$mode.client.log")
  stats=$(split_of "rping.$mode")
  if [ "$crc" != 0 ] || [ "$src" != 0 ] || [ "$pings" != "$PINGS" ] || [ "$mism" != 0 ]; then
    result FAIL "rping -V, READ and WRITE of 65000 B by A against B ($mode)" "client exit $crc, server exit $src, $pings of $PINGS pings validated, $mism mismatches (logs: $L.rping.$mode.server.log, $BLOGS/rping.$mode.client.log)"
  elif [ "$mode" = shaped ] && ! echo "$stats" | grep -q '"split_requests":[1-9]'; then
    result FAIL "rping -V, READ and WRITE of 65000 B by A against B ($mode)" "the shaper on A split nothing: '$stats'"
  else
    result PASS "rping -V, READ and WRITE of 65000 B by A against B ($mode)" "$pings pings validated, 0 mismatches${stats:+; shaper on A (READs left whole, max_rd_atomic 1): $stats}"
  fi
done

# ---------------------------------------------------------------------------------------
# 4. A justitiad on each host, on its own device; each lists only its own flows. A WRITEs
# to B in the bandwidth class while B READs from A in the latency class, both under the
# shaper following their own host's daemon; perftest servers run unshaped, so each daemon
# must list exactly one flow, its own host's client, in its class.
dir=$(mktemp -d /tmp/two-hosts.XXXXXX)
bdir=/tmp/two-hosts.b
config_ok=1
daemon_config "$dir/justitiad.toml" "$dir/justitiad.sock" "$dir/admin.sock" 127.0.0.1:19466 "device=\"$A_DEV\"" || config_ok=0
cp "$dir/justitiad.toml" "$L.justitiad.toml" 2>/dev/null
if [ "$config_ok" = 0 ]; then
  result FAIL "a justitiad on each host" "$DAEMON_ERR"
else
  daemon_start "$dir/justitiad.toml" "$L.justitiad.log"
  a_daemon=$DAEMON_PID
  PIDS+=("$a_daemon")
  b_err=$(onb 60 "mkdir -p $bdir && BIN=$BIN && source tests/vm/guest/daemon-lib.sh \
    && daemon_config $bdir/justitiad.toml $bdir/justitiad.sock $bdir/admin.sock 127.0.0.1:19466 'device=\"$B_DEV\"' \
    && cp $bdir/justitiad.toml $BLOGS/justitiad.toml && daemon_start $bdir/justitiad.toml $BLOGS/justitiad.log \
    && echo \$DAEMON_PID > $bdir/pid && daemon_wait $BLOGS/justitiad.log $bdir/admin.sock 60 || { echo \$DAEMON_ERR; exit 1; }")
  b_rc=$?
  if ! daemon_wait "$L.justitiad.log" "$dir/admin.sock" 60; then
    result FAIL "a justitiad on each host" "A: $DAEMON_ERR"
  elif [ "$b_rc" != 0 ]; then
    result FAIL "a justitiad on each host" "B: $b_err"
  else
    # The start line (the probe's GID line before it names the device in quotes).
    a_start=$(grep -m1 'justitiad started' "$L.justitiad.log" | grep -o 'device=[^ ]* port=[^ ]*')
    b_start=$(grep -m1 'justitiad started' "$BLOGS/justitiad.log" | grep -o 'device=[^ ]* port=[^ ]*')
    if [ "$a_start" = "device=$A_DEV port=1" ] && [ "$b_start" = "device=$B_DEV port=1" ]; then
      result PASS "a justitiad on each host" "A: $a_start, B: $b_start"
    else
      result FAIL "a justitiad on each host" "A: '$a_start', B: '$b_start'"
    fi
    # The perftest processes poll without pause and, niced, leave the one emulated CPU of
    # each host to the daemon and justitia; they run until the listing is done.
    # A shaped ib_write_bw across the cable now and then fails with status 9 (see section
    # 5): when A's writer ended so before it was listed, one more attempt, said in the line.
    note=""
    for attempt in 1 2; do
      wport=$((PORT++)) rport=$((PORT++))
      onb 10 "nice -n 19 timeout $STEP ib_write_bw -d $B_DEV -x $GID -p $wport -n 1000000 > $BLOGS/flows.write.server.log 2>&1 &"
      nice -n 19 timeout "$STEP" ib_read_bw -d "$A_DEV" -x "$GID" -p "$rport" -n 1000000 > "$L.flows.read.server.log" 2>&1 &
      PIDS+=($!)
      b_listen "$wport"
      for _ in $(seq 100); do ss -Hltn "sport = :$rport" | grep -q . && break; sleep 0.1; done
      LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=16K JUSTITIA_SOCKET=$dir/justitiad.sock nice -n 19 timeout "$STEP" \
        ib_write_bw -d "$A_DEV" -x "$GID" -p "$wport" -n 1000000 "$B_ADDR" > "$L.flows.write.client.log" 2>&1 &
      PIDS+=($!)
      onb 10 "LD_PRELOAD=$LIB JUSTITIA_CLASS=latency JUSTITIA_CHUNK=16K JUSTITIA_SOCKET=$bdir/justitiad.sock nice -n 19 timeout $STEP \
        ib_read_bw -d $B_DEV -x $GID -p $rport -n 1000000 $A_ADDR > $BLOGS/flows.read.client.log 2>&1 &"
      # "pid:class" of every flow `justitia flows --json` lists (pid comes before class).
      table='/"pid":/ {gsub(/[^0-9]/, "", $2); p = $2} /"class":/ {gsub(/[",]/, "", $2); printf "%s%s:%s", s, p, $2; s = " "}'
      a_flows="" b_flows="" a_tool="" b_tool=""
      for _ in $(seq 30); do
        sleep 1
        a_tool=$(pgrep -x ib_write_bw)
        a_flows=$("$BIN/justitia" flows --socket "$dir/admin.sock" --json 2>> "$L.flows.err" | awk "$table")
        b_flows=$(onb 20 "echo \$(pgrep -x ib_read_bw) \$($BIN/justitia flows --socket $bdir/admin.sock --json | awk '$table')")
        b_tool=${b_flows%% *}
        b_flows=${b_flows#"$b_tool"}
        b_flows=${b_flows# }
        echo "$SECONDS A: tool $a_tool flows '$a_flows'; B: tool $b_tool flows '$b_flows'" >> "$L.flows.trace.log"
        [ -n "$a_flows" ] && [ -n "$b_flows" ] && break
        # A's writer gone of status 9: no use asking on.
        [ -z "$a_tool" ] && grep -q "Failed status 9" "$L.flows.write.client.log" && break
      done
      pkill -x ib_write_bw
      pkill -x ib_read_bw
      onb 20 "pkill -x ib_read_bw; pkill -x ib_write_bw" > /dev/null
      [ -n "$a_flows" ] && [ -n "$b_flows" ] && break
      grep -q "Failed status 9" "$L.flows.write.client.log" || break
      [ "$attempt" = 2 ] && break
      note=" [passed on attempt 2; on attempt 1 A's ib_write_bw ended with status 9 before it was listed]"
      for f in "$L.flows.write.client.log" "$L.flows.read.server.log" "$L.flows.trace.log"; do mv "$f" "${f%.log}.attempt1.log" 2> /dev/null; done
      onb 20 "for f in $BLOGS/flows.write.server.log $BLOGS/flows.read.client.log; do mv \$f \${f%.log}.attempt1.log; done" > /dev/null 2>&1
    done
    # Each host's only shaped process is its client (perftest's server runs unshaped).
    if [ "$a_flows" = "${a_tool:-?}:bandwidth" ] && [ "$b_flows" = "${b_tool:-?}:latency" ]; then
      result PASS "justitia flows on each host lists only its own" "A: $a_flows (its ib_write_bw to B), B: $b_flows (its ib_read_bw from A)$note"
    else
      result FAIL "justitia flows on each host lists only its own" "A lists '$a_flows' (expected ${a_tool:-?}:bandwidth), B lists '$b_flows' (expected ${b_tool:-?}:latency) (logs: $L.flows.*, $BLOGS/flows.*)"
    fi
  fi
fi

# ---------------------------------------------------------------------------------------
# 5. Incast: two senders WRITE into host B at once, INCAST_ITERS messages of 1 KiB each
# (one packet at the cable's MTU, 16 in flight), each to its own server there; the
# bandwidth each gets is printed, natively and under the shaper (bandwidth class,
# following A's daemon). Both senders are processes on A: they share A's link as well as
# B's (the incast of two sending hosts, A and C, each paced to B's share, is in section 6,
# where the daemons have [peer]). Single-packet messages: a multi-packet WRITE meets the
# rxe retransmission defect under load, natively too (status 9, remote invalid request;
# the cause is in tests/vm/guest/pair-write.sh, which checks shaped 64 KiB WRITEs across
# the cable, and crates/preload's QpState::chunk_bytes_for); with host C booted, two
# native 64 KiB writers failed with it in two runs of three.
INCAST_ITERS=3000
# incast MODE ENV: both senders at once; sets BW1, BW2, SENT (MB eth0 sent) and RCS.
incast() {
  local mode=$1 env_words=$2 p1=$((PORT++)) p2=$((PORT++)) p c before after cpids=()
  for p in $p1 $p2; do
    onb 10 "timeout $STEP ib_write_bw -d $B_DEV -x $GID -p $p -s 1024 -t 16 -n $INCAST_ITERS > $BLOGS/incast.$mode.$p.server.log 2>&1 &"
  done
  b_listen "$p1" && b_listen "$p2"
  before=$(rx_tx)
  for p in $p1 $p2; do
    # shellcheck disable=SC2086 # NAME=value words without spaces
    env $env_words timeout "$STEP" ib_write_bw -d "$A_DEV" -x "$GID" -p "$p" -s 1024 -t 16 -n "$INCAST_ITERS" "$B_ADDR" > "$L.incast.$mode.$p.log" 2>&1 &
    cpids+=($!)
  done
  RCS=""
  for c in "${cpids[@]}"; do wait "$c"; RCS="$RCS $?"; done
  after=$(rx_tx)
  BW1=$(perftest_figure "$L.incast.$mode.$p1.log")
  BW2=$(perftest_figure "$L.incast.$mode.$p2.log")
  SENT=$(awk -v b="$before" -v a="$after" 'BEGIN {split(b, x, " "); split(a, y, " "); print int((y[2] - x[2]) / 1e6)}')
  [ "$RCS" = " 0 0" ] && [ -n "$BW1" ] && [ -n "$BW2" ]
}
for mode in native shaped; do
  env_words=""
  [ "$mode" = shaped ] && env_words="LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_SOCKET=$dir/justitiad.sock"
  # perftest under emulation now and then ends a timed run without its report (exit 1, no
  # message; suite.sh retries the same way): one more attempt, said in the line.
  note=""
  if ! incast "$mode" "$env_words"; then
    note=" [passed on attempt 2; attempt 1: exit statuses$RCS, figures '$BW1' '$BW2']"
    incast "$mode" "$env_words" || note=""
  fi
  if [ "$RCS" = " 0 0" ] && [ -n "$BW1" ] && [ -n "$BW2" ]; then
    result PASS "incast, two senders WRITE $INCAST_ITERS x 1 KiB each into B at once ($mode)" "sender 1 $BW1, sender 2 $BW2; eth0 tx $SENT MB$note"
  else
    result FAIL "incast, two senders WRITE $INCAST_ITERS x 1 KiB each into B at once ($mode)" "exit statuses$RCS, figures '$BW1' '$BW2' (logs: $L.incast.$mode.*)"
  fi
done

fi # sections 2 to 5
# ---------------------------------------------------------------------------------------
# 6. The peer channel (crates/peer, crates/daemon/src/peer.rs): each daemon with a [peer]
# table (its node, its own private key made on its host by `justitiad genkey` at mode
# 0600, the members A, B and C with the public keys `justitiad pubkey` printed on each
# host, UDP port 7471 on the cable) and silence_ms
# PEER_SILENCE_MS (3000: under emulation a loop stalls for tens of milliseconds and now and
# then for over a second, which the packaged 20 ms, and 1000 now and then, take for a
# silent peer). A READs from B (ib_read_bw, bandwidth
# class, under the shaper following A's daemon) while B WRITEs to itself (ib_write_bw,
# bandwidth class, following B's daemon): B counts A's READ flow with its own WRITE flow and grants A
# half its MaxRate (one unit of two, Justitia's remote READ rule); A's flow must hold that
# guarantee, its allotment paced to it. Then kill -9 of B's daemon (A's guarantee gone
# within the silence bound), its restart (the guarantee back), and hostile datagrams to
# A's channel, each refused and counted with the guarantee unchanged: a malformed one, a
# replay of one of B's, and a member with the wrong key (a second justitiad on host C
# claiming B's node with a fresh key of its own, whose handshake A refuses). Last, the incast (§6.7): A and host C each WRITE into B in the bandwidth
# class, following their own daemon (C's with a [peer] table too); B's daemon sees
# bandwidth flows of two sending hosts and grants each its share of B's link, to which
# both senders' allotments must be paced. PEER_OFF=guarantee runs A's daemon without its
# [peer] table, so no guarantee is applied: the checks that need one must then fail.
# PEER_OFF=incast runs C's daemon without its [peer] table: B then sees one sending host
# and divides nothing, and the incast check must fail.
PEER_SILENCE_MS=${PEER_SILENCE_MS:-3000}
# A READ guarantee not renewed for 40 RefPeriods lapses in the control loop (20 ms at the
# packaged 500 us), a bound a loop stalled under emulation misses all the time: the
# guarantee came and went between B's grants. 5 ms gives 200 ms (and the probe's timeout,
# which must exceed it, 50 ms: probes take tens of milliseconds here).
PEER_REF_PERIOD_US=${PEER_REF_PERIOD_US:-5000}
PEER_PORT=7471
a_metrics=127.0.0.1:19467
metric() { # SCRAPE NAME{LABELS}: the sample's value, or empty
  awk -v k="$2" '$1 == k {print $2; exit}' "$1"
}
# flow_json PID FIELD...: "v1 v2 ..." of PID's flow in A's `justitia flows --json` (null
# where absent; "absent" when the pid has no flow).
flow_fields() {
  "$BIN/justitia" flows --socket "$pdir/admin.sock" --json 2>/dev/null | python3 -c '
import json, sys
pid = int(sys.argv[1]); fields = sys.argv[2:]
mine = [f for f in json.load(sys.stdin) if f.get("pid") == pid]
print(" ".join(str(mine[0].get(k)).replace(" ", "_") for k in fields) if mine else "absent")' "$@"
}
peer_table() { # NODE KEY_FILE [LISTEN_ADDRESS]: the members are A, B and C (A_PUB etc.)
  peer_config "$1" "$2" "${3:-$1}" "$PEER_PORT" "$PEER_SILENCE_MS" \
    "\"$A_ADDR\" = \"$A_PUB\", \"$B_ADDR\" = \"$B_PUB\", \"$C_ADDR\" = \"$C_PUB\""
}
if [ "${TWO_HOSTS_ONLY:-}" = setup ]; then
  :
elif ! grep -q '^# \[peer\]' packaging/justitiad.toml; then
  result SKIP "peer channel" "packaging/justitiad.toml has no [peer] table (the peer channel is not built)"
else
  # The daemons of section 4 make way for peered ones.
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  onb 20 "pkill -KILL -x justitiad" > /dev/null
  pdir=$(mktemp -d /tmp/two-hosts-peer.XXXXXX)
  bpdir=/tmp/two-hosts-peer.b
  cpdir=/tmp/two-hosts-peer.c
  # Each host's key pair, made on the host that keeps the private key; only the public
  # keys travel (in the members tables).
  key_lib="BIN=$BIN && $(declare -f new_key)"
  A_PUB=$(new_key "$pdir")
  B_PUB=$(onb 30 "$key_lib && new_key $bpdir")
  C_PUB=$(onc 30 "$key_lib && new_key $cpdir")
  echo "members: A $A_PUB, B $B_PUB, C $C_PUB" >> "$L.peer.trace.log"
  daemon_config "$pdir/justitiad.toml" "$pdir/justitiad.sock" "$pdir/admin.sock" "$a_metrics" "device=\"$A_DEV\"" "ref_period_us=$PEER_REF_PERIOD_US" "probe_timeout_ms=50" \
    || result FAIL "peer channel" "$DAEMON_ERR"
  [ "${PEER_OFF:-}" = guarantee ] || peer_table "$A_ADDR" "$pdir/peer.key" >> "$pdir/justitiad.toml"
  cp "$pdir/justitiad.toml" "$L.peer.justitiad.toml"
  # B's daemon, started (and restarted) by one command on B.
  start_b="cd $PWD && BIN=$BIN && source tests/vm/guest/daemon-lib.sh && daemon_start $bpdir/justitiad.toml \$1 \
    && echo \$DAEMON_PID > $bpdir/pid && daemon_wait \$1 $bpdir/admin.sock 60 || { echo \$DAEMON_ERR; exit 1; }"
  b_err=$(onb 60 "printf '%s\n' '$start_b' > $bpdir/start.sh && BIN=$BIN && source tests/vm/guest/daemon-lib.sh \
    && daemon_config $bpdir/justitiad.toml $bpdir/justitiad.sock $bpdir/admin.sock 127.0.0.1:19467 'device=\"$B_DEV\"' ref_period_us=$PEER_REF_PERIOD_US probe_timeout_ms=50 \
    && printf '%s' '$(peer_table "$B_ADDR" "$bpdir/peer.key")' >> $bpdir/justitiad.toml \
    && cp $bpdir/justitiad.toml $BLOGS/peer.justitiad.toml && bash $bpdir/start.sh $BLOGS/peer.justitiad.1.log")
  b_rc=$?
  daemon_start "$pdir/justitiad.toml" "$L.peer.justitiad.log"
  PIDS+=("$DAEMON_PID")
  if [ -z "$A_PUB" ] || [ -z "$B_PUB" ] || [ -z "$C_PUB" ]; then
    result FAIL "peer: B's guarantee reaches A" "a key pair was not made (justitiad genkey/pubkey): A '$A_PUB', B '$B_PUB', C '$C_PUB'"
  elif ! daemon_wait "$L.peer.justitiad.log" "$pdir/admin.sock" 60 || [ "$b_rc" != 0 ]; then
    result FAIL "peer: B's guarantee reaches A" "daemons with [peer] did not start: A: ${DAEMON_ERR:-ok}; B: ${b_err:-ok}"
  else
    wport=$((PORT++)) rport=$((PORT++))
    # A's READ flow against B, and B's own WRITE flow, both long; stopped at the end. B's
    # WRITEs go to B itself (rxeb's loopback): for B's daemon a local bandwidth flow like
    # any other. Across the cable a shaped ib_write_bw fails now and then with a remote
    # invalid request (status 9, after some dozens to hundreds of completions; see
    # section 5), which would end B's flow mid-check.
    onb 10 "nice -n 19 timeout $((STEP * 3)) ib_read_bw -d $B_DEV -x $GID -p $rport -s 65536 -n 1000000 > $BLOGS/peer.read.server.log 2>&1 &"
    onb 10 "nice -n 19 timeout $((STEP * 3)) ib_write_bw -d $B_DEV -x $GID -p $wport -s 65536 -n 1000000 > $BLOGS/peer.write.server.log 2>&1 &"
    b_listen "$rport"
    b_listen "$wport"
    LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=16K JUSTITIA_SOCKET=$pdir/justitiad.sock JUSTITIA_LOG=info nice -n 19 timeout "$((STEP * 3))" \
      ib_read_bw -d "$A_DEV" -x "$GID" -p "$rport" -s 65536 -n 1000000 "$B_ADDR" > "$L.peer.read.client.log" 2>&1 &
    PIDS+=($!)
    # Its exit status ends its log: it must be alive when the guarantee is checked.
    onb 10 "{ LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=16K JUSTITIA_SOCKET=$bpdir/justitiad.sock JUSTITIA_LOG=info nice -n 19 timeout $((STEP * 3)) \
      ib_write_bw -d $B_DEV -x $GID -p $wport -s 65536 -n 1000000 $B_ADDR; echo \"exit status \$?\"; } > $BLOGS/peer.write.client.log 2>&1 &"
    reader=""
    for _ in $(seq 100); do reader=$(pgrep -x ib_read_bw | head -n 1); [ -n "$reader" ] && break; sleep 0.1; done
    # wait_guarantee WANT SECONDS: until the reader's guarantee is present (WANT=set) or
    # gone (WANT=null); FLOW holds "remote guarantee allot", WAITED the milliseconds it took (at most
    # one `justitia flows` late: a few hundred milliseconds under emulation).
    wait_guarantee() {
      local want=$1 t0 deadline=$((SECONDS + $2)) g
      t0=$(date +%s%N)
      while :; do
        FLOW=$(flow_fields "$reader" remote read_guarantee_bytes_per_sec allot_bytes_per_sec active)
        g=$(echo "$FLOW" | awk '{print $2}')
        echo "$SECONDS want $want: $FLOW" >> "$L.peer.trace.log"
        WAITED=$((($(date +%s%N) - t0) / 1000000))
        if [ "$want" = set ] && [ -n "$g" ] && [ "$g" != None ]; then return 0; fi
        if [ "$want" = null ] && [ "$g" = None ]; then return 0; fi
        [ "$SECONDS" -ge "$deadline" ] && return 1
        sleep 0.2
      done
    }
    # integrity_across N: justitia-integrity READs from B byte by byte: its server on B
    # (--serve), its client on A under the shaper following A's daemon (--connect, every
    # transfer a READ, sizes steered around the 16 KiB chunk). Its flow is polled while it
    # runs; INTEG holds the client's verdict line, INTEG_RC its status, INTEG_GUAR what its
    # flow was seen as ("remote/guarantee", one entry per distinct pair).
    integrity_across() { # N TRANSFERS
      local n=$1 iport=$((PORT++)) client g
      onb 10 "nice -n 19 timeout $STEP $BIN/justitia-integrity -d $B_DEV -x $GID --serve $B_ADDR:$iport \
        > $BLOGS/peer.integrity.server.$n.log 2>&1 &" > /dev/null
      b_listen "$iport"
      LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=16K JUSTITIA_SOCKET=$pdir/justitiad.sock JUSTITIA_LOG=info \
        timeout "$STEP" "$BIN/justitia-integrity" -d "$A_DEV" -x "$GID" --connect "$B_ADDR:$iport" \
        -n "$2" --max-size 256K --boundary 16K > "$L.peer.integrity.$n.log" 2>&1 &
      client=$!
      INTEG_GUAR=""
      while kill -0 "$client" 2>/dev/null; do
        # The checker is timeout's child; its flow carries its own pid.
        g=$(flow_fields "$(pgrep -P "$client" | head -n 1)" remote read_guarantee_bytes_per_sec | tr ' ' /)
        case " $INTEG_GUAR " in *" $g "*) ;; *) INTEG_GUAR="$INTEG_GUAR $g" ;; esac
        sleep 0.5
      done
      wait "$client"
      INTEG_RC=$?
      INTEG=$(grep -m1 'justitia-integrity: \(PASS\|FAIL\)' "$L.peer.integrity.$n.log" || tail -n 1 "$L.peer.integrity.$n.log")
    }
    b_max=$(onb 20 "$BIN/justitia status --socket $bpdir/admin.sock --json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["max_rate"])' 2>/dev/null)
    if wait_guarantee set 90; then
      # B's own WRITE flow may register after A's READ flow is first granted (the whole
      # MaxRate then): until the guarantee is B's MaxRate shared by the two, at most 20 s.
      seen=""
      for _ in $(seq 40); do
        read -r remote guarantee allot _ <<< "$FLOW"
        case " $seen " in *" $guarantee "*) ;; *) seen="$seen $guarantee" ;; esac
        awk -v g="$guarantee" -v m="${b_max:-0}" 'BEGIN {exit !(g > 0.49 * m && g < 0.51 * m)}' && break
        sleep 0.5
        FLOW=$(flow_fields "$reader" remote read_guarantee_bytes_per_sec allot_bytes_per_sec active)
      done
      curl -s "http://$a_metrics/metrics" > "$L.peer.metrics.a.txt"
      onb 20 "curl -s http://127.0.0.1:19467/metrics" > "$L.peer.metrics.b.txt"
      a_recv=$(metric "$L.peer.metrics.a.txt" justitia_peer_messages_received_total)
      b_sent=$(metric "$L.peer.metrics.b.txt" justitia_peer_messages_sent_total)
      # One unit of two at B: A's READ flow beside B's own WRITE flow.
      if [ "$remote" = "reads_from_$B_ADDR" ] && awk -v g="$guarantee" -v a="$allot" -v m="${b_max:-0}" -v r="${a_recv:-0}" -v s="${b_sent:-0}" \
        'BEGIN {exit !(m > 0 && g > 0.49 * m && g < 0.51 * m && a > 0 && a <= g * 1.001 && r > 0 && s > 0)}'; then
        result PASS "peer: B's guarantee reaches A, A's READs paced to it" "A's ib_read_bw (pid $reader) $remote: guarantee $(awk -v g="$guarantee" 'BEGIN {printf "%.1f MB/s", g / 1e6}') = $(awk -v g="$guarantee" -v m="$b_max" 'BEGIN {printf "%.3f", g / m}') of B's MaxRate $(awk -v m="$b_max" 'BEGIN {printf "%.1f MB/s", m / 1e6}'), allotment $(awk -v a="$allot" 'BEGIN {printf "%.1f MB/s", a / 1e6}'); metrics: B sent $b_sent peer messages, A received $a_recv; first guarantee within ${WAITED} ms, guarantees seen:$seen"
      else
        result FAIL "peer: B's guarantee reaches A, A's READs paced to it" "A's flow: remote '$remote', guarantee $guarantee, allotment $allot (B's MaxRate '$b_max': expected half; guarantees seen:$seen); B sent '$b_sent', A received '$a_recv' (logs: $L.peer.*)"
      fi
    else
      result FAIL "peer: B's guarantee reaches A, A's READs paced to it" "no guarantee on A's READ flow (pid ${reader:-none}) in 90 s: $FLOW (logs: $L.peer.*)"
    fi

    # What runs on B now (B's writer must still run: its flow is what B divides with A's).
    onb 20 "ps -eo pid,stat,etime,args; dmesg | grep -iE 'segfault|traps|protection'" > "$BLOGS/peer.ps.log" 2>&1

    # Data across the cable while the guarantee holds: rping -V, its server on A shaped
    # and following A's daemon.
    port=$((PORT++))
    LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=16K JUSTITIA_SOCKET=$pdir/justitiad.sock \
      timeout "$STEP" rping -s -a "$A_ADDR" -p "$port" -C 20 -S 65000 > "$L.peer.rping.server.log" 2>&1 &
    spid=$!
    for _ in $(seq 200); do rdma resource show cm_id 2>/dev/null | grep -q LISTEN && break; sleep 0.1; done
    onb $((STEP + 10)) "timeout $STEP rping -c -a $A_ADDR -p $port -C 20 -S 65000 -V -v > $BLOGS/peer.rping.client.log 2>&1"
    crc=$?
    wait "$spid"
    src=$?
    pings=$(grep -c 'ping data: rdma-ping-' "$BLOGS/peer.rping.client.log")
    mism=$(grep -c -i mismatch "$BLOGS/peer.rping.client.log")
    if [ "$crc" = 0 ] && [ "$src" = 0 ] && [ "$pings" = 20 ] && [ "$mism" = 0 ]; then
      result PASS "peer: rping -V by A against B beside the guaranteed READ flow" "20 pings validated, 0 mismatches"
    else
      result FAIL "peer: rping -V by A against B beside the guaranteed READ flow" "client exit $crc, server exit $src, $pings of 20 validated, $mism mismatches"
    fi

    # justitia-integrity READing from B under the shaper while B's guarantee holds.
    # Long enough (about a minute here) for its flow to be seen with B's guarantee: the
    # grant takes some seconds to come, a poll of `justitia flows` one or more, and 400
    # transfers were over in 27 s with the flow seen twice, before its guarantee.
    integrity_across 1 1000
    if [ "$INTEG_RC" = 0 ] && echo "$INTEG" | grep -q ' 0 mismatched, 0 overruns, 0 bad completions; the server.s regions intact' \
      && echo "$INTEG_GUAR" | grep -q "reads_from_$B_ADDR/[0-9]"; then
      result PASS "peer: justitia-integrity READs from B under B's guarantee, byte by byte" "$INTEG; its flow seen as (remote/guarantee B/s):$INTEG_GUAR"
    else
      result FAIL "peer: justitia-integrity READs from B under B's guarantee, byte by byte" "exit $INTEG_RC: $INTEG; its flow seen as (remote/guarantee):$INTEG_GUAR (logs: $L.peer.integrity.1.log, $BLOGS/peer.integrity.server.1.log)"
    fi

    # Hostile datagrams to A's channel: each refused and counted. B's own grants go on
    # meanwhile (and may change with B's flows), so what is checked of A's guarantee is
    # that A still holds one; that a refused datagram changes no state is the channel's
    # own invariant, tested in crates/peer. The member with the wrong key: a second
    # justitiad on C (its own sockets, no shaper) whose [peer] table claims B's node with
    # a fresh key of its own; at start it greets every member, and A, which knows B's
    # public key, refuses its handshake ("authentication").
    before=$(flow_fields "$reader" read_guarantee_bytes_per_sec)
    curl -s "http://$a_metrics/metrics" > "$L.peer.metrics.before.txt"
    ipdir=/tmp/two-hosts-peer.impostor
    # One request each, each with its own limit: on a loaded machine the three in one
    # request of 30 s timed out before the replay was sent.
    inject="$(onb 60 "python3 tests/vm/guest/peer_inject.py malformed $A_ADDR $PEER_PORT")
$(onb 60 "python3 tests/vm/guest/peer_inject.py replayed eth0 $A_ADDR $PEER_PORT 10")
$(onc 90 "$key_lib && new_key $ipdir > /dev/null && source tests/vm/guest/daemon-lib.sh \
  && daemon_config $ipdir/justitiad.toml $ipdir/justitiad.sock $ipdir/admin.sock 127.0.0.1:19468 'device=\"$C_DEV\"' ref_period_us=$PEER_REF_PERIOD_US probe_timeout_ms=50 \
  && printf '%s' '$(peer_table "$B_ADDR" "$ipdir/peer.key" "$C_ADDR")' >> $ipdir/justitiad.toml \
  && cp $ipdir/justitiad.toml $CLOGS/peer.impostor.justitiad.toml \
  && daemon_start $ipdir/justitiad.toml $CLOGS/peer.impostor.justitiad.log \
  && daemon_wait $CLOGS/peer.impostor.justitiad.log $ipdir/admin.sock 60 \
  && sleep 2 && kill \$DAEMON_PID && echo 'impostor: a justitiad on C claiming B with a fresh key, started and stopped' \
  || echo \"impostor: not started: \$DAEMON_ERR\"")"
    echo "$inject" > "$L.peer.inject.log"
    sleep 1
    curl -s "http://$a_metrics/metrics" > "$L.peer.metrics.after.txt"
    after=$(flow_fields "$reader" read_guarantee_bytes_per_sec)
    for check in "length malformed" "replayed replayed" "authentication impostor"; do
      reason=${check% *} mode=${check#* }
      k="justitia_peer_messages_refused_total{value=\"$reason\"}"
      n0=$(metric "$L.peer.metrics.before.txt" "$k")
      n1=$(metric "$L.peer.metrics.after.txt" "$k")
      what=$(echo "$inject" | grep -m1 "^$mode")
      if [ "$mode" = impostor ]; then
        label="peer: a member with the wrong key (a second justitiad claiming B) is refused and counted by A"
      else
        label="peer: a $mode datagram to A is refused and counted"
      fi
      # The datagram must have been sent (a replay needs one of B's own to copy).
      if echo "$what" | grep -qE '^[a-z]+: ([0-9]+ bytes|a justitiad)' && [ -n "$n0" ] && [ -n "$n1" ] \
        && awk -v a="$n0" -v b="$n1" 'BEGIN {exit !(b >= a + 1)}' \
        && [ "$after" != absent ]; then
        result PASS "$label" "$what; refused{$reason} $n0 -> $n1; A's guarantee $before -> $after B/s (B's own grants go on)"
      else
        result FAIL "$label" "$what; refused{$reason} '$n0' -> '$n1'; A's guarantee $before -> $after (logs: $L.peer.*, $CLOGS/peer.impostor.*)"
      fi
    done

    # kill -9 of B's daemon: A's flow is unconstrained again within the silence bound, then
    # B's daemon restarted: believed at once. The lapse is timed by A's daemon's own log
    # line against A's clock. The kill runs on B through remote.py, which under a loaded
    # machine takes seconds to deliver it (6.3 s seen): the kill happened between the
    # command's start and its return, so the lapse is timed from its return (never more
    # than the true lapse, which is at most the lapse from its start; both are printed),
    # and the line must come after its start. A second beyond silence_ms is left for the
    # daemon's loop under emulation. Polling `justitia flows` only confirms it.
    # Under emulation a stall of either loop now and then outlasts silence_ms and the
    # guarantee lapses and returns by itself: the kill waits until it is held.
    wait_guarantee set 30
    held=$(echo "$FLOW" | awk '{print $2}')
    kill_ns=$(date +%s%N)
    onb 10 "kill -KILL \$(cat $bpdir/pid)" > /dev/null
    killed_ns=$(date +%s%N)
    echo "$SECONDS kill of B's daemon sent at $kill_ns ns (A's clock), done in $(((killed_ns - kill_ns) / 1000000)) ms" >> "$L.peer.trace.log"
    bound=$((PEER_SILENCE_MS / 1000 + 10))
    lapse_ms="" lapse_from_start_ms=""
    if [ "$held" != None ] && [ "$held" != absent ] && wait_guarantee null "$bound"; then
      # The daemon's log is written by a thread of its own, a moment later: its line,
      # stamped when the lapse happened, is awaited up to 20 s. (A here-string, not a
      # process substitution: the guest has no /dev/fd, and `< <(...)` read nothing, so
      # every earlier run said no lapse was logged.)
      for _ in $(seq 100); do
        while read -r ts _; do
          t=$(date -d "$ts" +%s%N 2>/dev/null) || continue
          if [ "$t" -ge "$kill_ns" ]; then
            lapse_ms=$(((t - killed_ns) / 1000000)) lapse_from_start_ms=$(((t - kill_ns) / 1000000))
            break
          fi
        done <<< "$(grep "peer silent" "$L.peer.justitiad.log")"
        [ -n "$lapse_ms" ] && break
        sleep 0.2
      done
    fi
    if [ "$held" = None ] || [ "$held" = absent ]; then
      result FAIL "peer: kill -9 of B's daemon, A's READs back to A's own allotment" "A's flow held no guarantee before the kill ($held)"
    elif [ -n "$lapse_ms" ] && [ "$lapse_ms" -le $((PEER_SILENCE_MS + 1000)) ]; then
      result PASS "peer: kill -9 of B's daemon, A's READs back to A's own allotment" "A's daemon let the guarantee lapse ${lapse_ms} ms after the kill was done (${lapse_from_start_ms} ms after it was sent; silence_ms $PEER_SILENCE_MS, bound $((PEER_SILENCE_MS + 1000)) ms); justitia flows showed it gone after ${WAITED} ms: $FLOW"
    elif [ -n "$lapse_ms" ]; then
      result FAIL "peer: kill -9 of B's daemon, A's READs back to A's own allotment" "the guarantee lapsed ${lapse_ms} ms after the kill was done (${lapse_from_start_ms} ms after it was sent), beyond silence_ms $PEER_SILENCE_MS + 1000 ms"
    else
      result FAIL "peer: kill -9 of B's daemon, A's READs back to A's own allotment" "no lapse logged by A's daemon; its flow: $FLOW ${WAITED} ms after the kill (silence_ms $PEER_SILENCE_MS)"
    fi
    # B's daemon is gone: A's READs go on at A's own allotment, byte-exact.
    integrity_across 2 400
    if [ "$INTEG_RC" = 0 ] && echo "$INTEG" | grep -q ' 0 mismatched, 0 overruns, 0 bad completions; the server.s regions intact'; then
      result PASS "peer: justitia-integrity READs from B after kill -9 of B's daemon, byte by byte" "$INTEG; its flow seen as (remote/guarantee):$INTEG_GUAR"
    else
      result FAIL "peer: justitia-integrity READs from B after kill -9 of B's daemon, byte by byte" "exit $INTEG_RC: $INTEG (logs: $L.peer.integrity.2.log, $BLOGS/peer.integrity.server.2.log)"
    fi
    b_err=$(onb 60 "bash $bpdir/start.sh $BLOGS/peer.justitiad.2.log")
    if [ "$?" != 0 ]; then
      result FAIL "peer: B's daemon restarted, the guarantee returns" "B's daemon did not start again: $b_err"
    elif wait_guarantee set 30; then
      result PASS "peer: B's daemon restarted, the guarantee returns" "A's flow: $FLOW, ${WAITED} ms after B's daemon listened"
    else
      result FAIL "peer: B's daemon restarted, the guarantee returns" "no guarantee on A's flow 30 s after the restart: $FLOW"
    fi
    pkill -x ib_read_bw
    pkill -x ib_write_bw
    onb 20 "pkill -x ib_read_bw; pkill -x ib_write_bw" > /dev/null

    # Splitting two-sided requests (JUSTITIA_TWO_SIDED=split): justitia-integrity's SENDs
    # with both ends shaped, each following its own host's daemon. Each shaper opens a
    # side channel (a UD queue pair of its own) and reports its RC queue pair with it; the
    # daemons send the pairings to each other over the peer channel, match them, and each
    # shaper learns the other's side channel (qps_paired 1 on both ends). Then the two
    # shapers say hello over the cable, from side channel to side channel, each hello
    # checked against the paired source (GID and queue pair), and agree (qps_agreed 1 on
    # both ends, nothing refused); B's shaper offers to own its receive queue, A's
    # accepts, and from then on A announces each message and B posts, for each, the
    # application's receive whole or one receive per 64 KiB chunk over slices of it: A's
    # messages longer than a chunk go split (split_requests >= 1), byte-exact, every
    # completion as native. Then WRITEs with immediate the same way (the data as WRITE
    # chunks, the last carrying the immediate), and a shaped sender beside an unshaped
    # receiver and the reverse: never paired, nothing split, byte-exact. Six messages a
    # run for those (each message costs time), twelve for the paired ones, of 1 B to
    # 16 MiB: the server's receive queue holds 32 receives, so B's shaper posts the
    # receives of a message over 2 MiB (more than 32 chunks of 64 KiB) in parts as they
    # land, each part credited. Those sent before the two shapers agree go whole. The
    # server sleeps until its receive CQ's events (--events: the CQ armed for the next
    # completion, its sends on another CQ): B's shaper arms it for solicited completions
    # only once it owns the receives (cq_arms_solicited >= 1), A's marks the last chunk of
    # each message and of each half of a credited part, and a completion found without
    # its event within 1 s is a mismatch.
    paired_env="LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=64K JUSTITIA_TWO_SIDED=split JUSTITIA_LOG=debug"
    agreed='"split_requests":[1-9].*"qps_paired":[1-9].*"qps_agreed":[1-9][0-9]* "side_refused":0'
    b_agreed='"qps_paired":[1-9].*"qps_agreed":[1-9][0-9]* "side_refused":0'
    for mode in send write-imm; do
      TS_CLIENT_ARGS="--events" two_sided_run "$mode" "peer.two_sided.$mode.paired" \
        "$paired_env JUSTITIA_SOCKET=$pdir/justitiad.sock" "$paired_env JUSTITIA_SOCKET=$bpdir/justitiad.sock" 12
      if [ "$TS_OK" = 1 ] && echo "$TS_A_STATS" | grep -q "$agreed" && echo "$TS_B_STATS" | grep -q "$b_agreed.*\"cq_arms_solicited\":[1-9]"; then
        result PASS "peer: two shapers agree over their side channels and split $mode requests to an event-driven receiver" "$TS_WHAT"
      else
        result FAIL "peer: two shapers agree over their side channels and split $mode requests to an event-driven receiver" "both ends must pass, count qps_paired and qps_agreed >= 1 and side_refused 0, A split_requests >= 1 and B cq_arms_solicited >= 1: $TS_WHAT (logs: $TS_LOGS)"
      fi
    done
    # A receiver that looks at its receive CQ only once the sender says its SENDs
    # completed (justitia-integrity --late-polling), as an application does that polls
    # after a later word: natively nothing waits for its poll, so nothing may between the
    # paired shapers either. Seed 9 draws SENDs of 3.2, 5.9 and 14.8 MiB after the first
    # batch, each more chunks than B's receive queue holds: B's shaper posts their
    # receives in parts, and its side thread's timer polls the receive CQ aside to free
    # the room (receiver_polls_aside >= 1).
    TS_CLIENT_ARGS="--late-polling --seed 9" two_sided_run send peer.two_sided.late-polling \
      "$paired_env JUSTITIA_SOCKET=$pdir/justitiad.sock" "$paired_env JUSTITIA_SOCKET=$bpdir/justitiad.sock" 12
    if [ "$TS_OK" = 1 ] && echo "$TS_A_STATS" | grep -q "$agreed" && echo "$TS_B_STATS" | grep -q "$b_agreed.*\"receiver_polls_aside\":[1-9]"; then
      result PASS "peer: a receiver that polls only once the sender's SENDs completed gets every split message" "$TS_WHAT"
    else
      result FAIL "peer: a receiver that polls only once the sender's SENDs completed gets every split message" "both ends must pass, A split_requests >= 1 and B receiver_polls_aside >= 1: $TS_WHAT (logs: $TS_LOGS)"
    fi
    two_sided_run send peer.two_sided.sender-only "$paired_env JUSTITIA_SOCKET=$pdir/justitiad.sock" "" 6
    if [ "$TS_OK" = 1 ] && echo "$TS_A_STATS" | grep -q '"split_requests":0 .*"pairings_reported":[1-9]' && echo "$TS_A_STATS" | grep -q '"qps_paired":0'; then
      result PASS "peer: a shaped sender beside an unshaped receiver is never paired" "$TS_WHAT"
    else
      result FAIL "peer: a shaped sender beside an unshaped receiver is never paired" "A must pass, report its pairing, count qps_paired 0 and split nothing: $TS_WHAT (logs: $TS_LOGS)"
    fi
    two_sided_run send peer.two_sided.receiver-only "" "$paired_env JUSTITIA_SOCKET=$bpdir/justitiad.sock" 6
    if [ "$TS_OK" = 1 ] && echo "$TS_B_STATS" | grep -q '"pairings_reported":[1-9].*"qps_paired":0'; then
      result PASS "peer: an unshaped sender beside a shaped receiver is never paired" "$TS_WHAT"
    else
      result FAIL "peer: an unshaped sender beside a shaped receiver is never paired" "B must pass, report its pairing and count qps_paired 0: $TS_WHAT (logs: $TS_LOGS)"
    fi
    # Unmodified perftest with both ends shaped and paired: the counts its arguments ask
    # for (section 2 ran these tools natively across the cable, with the same counts as
    # asked), and A's 256 KiB SENDs split into 64 KiB chunks. The receives the server
    # posted before the two shapers agreed are at the NIC whole, so as many messages go
    # whole first (-r 16 keeps them few: perftest posts min(-n, 512) at the start
    # otherwise). ib_send_lat's 64 B SENDs go whole (each announced, and credited before
    # it goes). perftest 4.5-0.17 (Debian bookworm) has no --write_with_imm. ib_send_bw
    # waits for its completions' events (-e): B's shaper arms its receive CQ, which carries
    # only the split messages, for solicited completions only (cq_arms_solicited), and A's
    # marks each message's last chunk so; an event missed would hang the server.
    for spec in "ib_send_bw -s 262144 -n 200 -r 16 -e:262144x200" "ib_send_lat -s 64 -n 100:64x100"; do
      asked=${spec##*:} spec=${spec%:*}
      tool=${spec%% *}
      # shellcheck disable=SC2086 # the tool's arguments
      if ! cross_envs "peer.$tool.paired" "$paired_env JUSTITIA_SOCKET=$pdir/justitiad.sock" \
        "$paired_env JUSTITIA_SOCKET=$bpdir/justitiad.sock" $spec; then
        result FAIL "peer: $tool A -> B (paired)" "$ERROR"
        continue
      fi
      stats=$(split_of "peer.$tool.paired")
      b_arms=""
      if [ "$tool" = ib_send_bw ]; then
        b_arms=$(onb 10 "cat $BLOGS/peer.$tool.paired.*.stats.json 2>/dev/null | tr -d ' \n' | grep -o '\"cq_arms_solicited\":[0-9]*'")
      fi
      if [ "$COUNTS" != "$asked" ]; then
        result FAIL "peer: $tool A -> B (paired)" "counts $COUNTS, not the $asked asked for"
      elif [ "$tool" = ib_send_bw ] && ! echo "$stats" | grep -q '"split_requests":[1-9]'; then
        result FAIL "peer: $tool A -> B (paired)" "256 KiB SENDs with 64 KiB chunks between paired shapers, but A split none: $stats (logs: $L.peer.$tool.paired.client.log, $BLOGS/peer.$tool.paired.server.log)"
      elif [ "$tool" = ib_send_bw ] && ! echo "$b_arms" | grep -q ':[1-9]'; then
        result FAIL "peer: $tool A -> B (paired)" "the server waits for events on a receive CQ of split messages only, but B's shaper never armed it for solicited completions: ${b_arms:-no statistics} (logs: $BLOGS/peer.$tool.paired.server.log)"
      else
        result PASS "peer: $tool A -> B (paired)" "$COUNTS, $FIGURE${stats:+; shaper on A: $stats}${b_arms:+; shaper on B: $b_arms}"
      fi
    done
    # Hellos the daemons never paired: while justitia-integrity's SENDs run with both ends
    # shaped and agreed, host B first sends A's side channel 80 datagrams of 1000 bytes
    # (send_datagram, with the side channels' Q_Key 0x4a555354), longer than any message
    # and more than the 64 receives it keeps posted (a receive shorter than its datagram
    # put Soft-RoCE's queue pair in the error state, which silenced the side channel); then
    # a hello naming A's queue pair from a UD queue pair of its own (B's own GID, another
    # queue pair), and host C the same from its GID (another host, another queue pair).
    # A's shaper must still receive both hellos and refuse them (side_refused 2: the
    # source is not the side channel the daemons paired; the long datagrams are dropped
    # uncounted, as a wrong Q_Key's are), and stay agreed with its true peer; the messages
    # pass byte-exact. The plan's sizes are random, so a short one can end before the
    # datagrams are sent (the hellos then reach no shaper): a run that finished first is
    # told apart (FORGE_LATE) and made again once with four times the messages.
    forge_hellos() { # sets FORGED and FORGE_LATE
      local side="" rc_qpn="" hello send
      FORGED="nothing: the client's side channel and agreement were not seen in its log"
      for _ in $(seq 300); do
        side=$(grep -o 'side channel on [a-z0-9]* port 1: UD queue pair 0x[0-9a-f]*' "$CLIENT_LOG" | grep -o '0x[0-9a-f]*$' | head -n 1)
        rc_qpn=$(grep -o 'queue pair 0x[0-9a-f]*: the shaper at its other end speaks' "$CLIENT_LOG" | grep -o '0x[0-9a-f]*' | head -n 1)
        [ -n "$side" ] && [ -n "$rc_qpn" ] && break
        kill -0 "$CLIENT_PID" 2>/dev/null || return
        sleep 0.1
      done
      [ -n "$side" ] && [ -n "$rc_qpn" ] || return
      # Version 1, kind 5 (hello), A's queue pair little-endian, not heard.
      hello=$(printf '0105%02x%02x%02x%02x00' $((rc_qpn & 255)) $(((rc_qpn >> 8) & 255)) $(((rc_qpn >> 16) & 255)) $(((rc_qpn >> 24) & 255)))
      send="$BIN/examples/send_datagram --gid-index $GID --to $A_ADDR --qpn $side --qkey 0x4a555354 --hex $hello"
      # C's at the same time as B's, so that both arrive while the client runs.
      onc 20 "$send --device $C_DEV 2>&1" > "$L.forged.c.log" 2>&1 &
      local cpid=$!
      local from_b
      from_b=$(onb 30 "$send --device $B_DEV --size 1000 --count 80 2>&1 && $send --device $B_DEV 2>&1" | tail -n 2 | paste -sd ' ')
      wait "$cpid"
      FORGED="to A's side channel $side naming queue pair $rc_qpn: B: $from_b; C: $(tail -n 1 "$L.forged.c.log")"
      if ! kill -0 "$CLIENT_PID" 2>/dev/null || grep -q 'justitia-integrity: \(PASS\|FAIL\)' "$CLIENT_LOG"; then
        FORGE_LATE=1
      fi
    }
    forge_late=""
    for forge_runs in 1 2; do
      FORGE_LATE=0
      two_sided_run send "peer.two_sided.forged.$forge_runs" "$paired_env JUSTITIA_SOCKET=$pdir/justitiad.sock" \
        "$paired_env JUSTITIA_SOCKET=$bpdir/justitiad.sock" $((forge_runs == 1 ? 24 : 96)) forge_hellos
      [ "$FORGE_LATE" = 1 ] || break
      forge_late="$forge_late; run $forge_runs ended before the datagrams were sent"
    done
    FORGED="$FORGED$forge_late"
    if [ "$TS_OK" = 1 ] && echo "$TS_A_STATS" | grep -q '"qps_agreed":1 "side_refused":2$'; then
      result PASS "peer: hellos from queue pairs the daemons never paired are refused, after a flood of datagrams longer than any message" "sent $FORGED; $TS_WHAT"
    else
      result FAIL "peer: hellos from queue pairs the daemons never paired are refused, after a flood of datagrams longer than any message" "A must pass, stay agreed and refuse both: sent $FORGED; $TS_WHAT (logs: $TS_LOGS)"
    fi

    # The receiving process killed mid-stream: ib_send_bw between paired shapers, and once
    # A announces its SENDs (B owns its receives), the server on B is killed (-9). A's
    # requests on the NIC may fail there (in one trial Soft-RoCE failed none, and natively
    # the client spun until its timeout), and A's requests waiting for B's credit never
    # get one: A's shaper, having had no word from B's for its transport timeout (at least
    # 3 s), fails the oldest with IBV_WC_RETRY_EXC_ERR, flushes the rest and moves the QP
    # to the error state. Either way the client must end with a completion error well
    # before its timeout.
    port=$((PORT++))
    crash_a="$paired_env JUSTITIA_SOCKET=$pdir/justitiad.sock"
    crash_b="$paired_env JUSTITIA_SOCKET=$bpdir/justitiad.sock"
    spid=$(onb 10 "env $crash_b timeout $STEP ib_send_bw -d $B_DEV -x $GID -p $port -s 262144 -n 5000 -r 16 > $BLOGS/peer.crash.server.log 2>&1 & echo \$!")
    if ! b_listen "$port"; then
      result FAIL "peer: the receiving process killed mid-stream, the paired sender fails instead of hanging" "the server on B did not listen (log: $BLOGS/peer.crash.server.log)"
    else
      # shellcheck disable=SC2086 # NAME=value words without spaces
      env $crash_a timeout "$STEP" ib_send_bw -d "$A_DEV" -x "$GID" -p "$port" -s 262144 -n 5000 -r 16 "$B_ADDR" > "$L.peer.crash.client.log" 2>&1 &
      cpid=$!
      PIDS+=("$cpid")
      for _ in $(seq 300); do
        grep -q 'announcing from message' "$L.peer.crash.client.log" && break
        kill -0 "$cpid" 2>/dev/null || break
        sleep 0.1
      done
      sleep 1
      # The server itself (timeout's child), then timeout.
      onb 10 "pkill -KILL -P $spid; kill -KILL $spid" > /dev/null
      killed=$(date +%s%N)
      wait "$cpid"
      rc=$?
      took=$((($(date +%s%N) - killed) / 1000000))
      err=$(grep -m1 'Completion with error\|Failed status' "$L.peer.crash.client.log")
      why=$(grep -m1 -o 'has not answered for [0-9]* ms' "$L.peer.crash.client.log")
      if grep -q 'announcing from message' "$L.peer.crash.client.log" && [ "$rc" != 0 ] && [ "$rc" != 124 ] && [ "$took" -lt 20000 ] && [ -n "$err" ]; then
        result PASS "peer: the receiving process killed mid-stream, the paired sender fails instead of hanging" "client exit $rc ${took} ms after the kill ($err; A's shaper: ${why:-its requests failed at the NIC})"
      else
        result FAIL "peer: the receiving process killed mid-stream, the paired sender fails instead of hanging" "client exit $rc ${took} ms after the kill (124: timed out), error '$err', '$why' (log: $L.peer.crash.client.log)"
      fi
    fi

    # Incast: A and C each WRITE into B at once (ib_write_bw, bandwidth class, 16 KiB
    # chunks: see section 5 for why), each following its own daemon; B's perftest servers
    # run unshaped. Each sender's daemon declares its flow to B as an incast unit (host,
    # tenant uid 0, bandwidth, weight 1, the packaged default); B, seeing units of two
    # hosts of weight 1 each, grants each host MaxRate / (1 + 1) of its link, and a
    # sender's one flow into B is paced at min(its local allotment, 1 x share / 1 flow).
    # Both senders must show an allotment of half B's MaxRate (the same 0.49..0.51 band
    # as the READ guarantee's), and C must have heard B. Under emulation the link moves
    # about 10 MB/s, far below any share: what is checked is the allotment each daemon
    # publishes to its shaper (what `justitia flows` reports), not a measured rate.
    c_peer=""
    [ "${PEER_OFF:-}" = incast ] || c_peer="&& printf '%s' '$(peer_table "$C_ADDR" "$cpdir/peer.key")' >> $cpdir/justitiad.toml"
    c_err=$(onc 90 "BIN=$BIN && source tests/vm/guest/daemon-lib.sh \
      && daemon_config $cpdir/justitiad.toml $cpdir/justitiad.sock $cpdir/admin.sock 127.0.0.1:19467 'device=\"$C_DEV\"' ref_period_us=$PEER_REF_PERIOD_US probe_timeout_ms=50 \
      $c_peer && cp $cpdir/justitiad.toml $CLOGS/peer.justitiad.toml \
      && daemon_start $cpdir/justitiad.toml $CLOGS/peer.justitiad.log && daemon_wait $CLOGS/peer.justitiad.log $cpdir/admin.sock 60 || { echo \$DAEMON_ERR; exit 1; }")
    c_rc=$?
    label="peer: incast, A and C WRITE into B at once, each paced to B's share"
    if [ "$c_rc" != 0 ]; then
      result FAIL "$label" "C's daemon did not start: $c_err"
    else
      # A shaped ib_write_bw across the cable ends now and then with status 9, a remote
      # invalid request (section 5): here, two writers into B at once ended so after 132
      # to 173 posts of 64 KiB (16 KiB chunks, perftest's 128 deep send queue), and after
      # 51 to 409 posts of 16 KiB (16 deep); one writer alone of 16 KiB ran out 35 s. The
      # cause is not known; one way rxe's responder comes to that error is a multi-packet
      # WRITE whose first packet it never saw, so the writers send 1 KiB messages, one
      # packet each at the cable's 1024 B MTU, and a sender that still ends so before both
      # are seen at the share gets another attempt (three in all), said in the line.
      note=""
      for attempt in 1 2 3; do
        p1=$((PORT++)) p2=$((PORT++))
        # What C's card has taken in so far, the cables' traffic between A and B included
        # (B's hub repeats it to C; C's card should drop what is not addressed to it).
        echo "$SECONDS before the incast: C's eth0 rx $(onc 20 "cat /sys/class/net/eth0/statistics/rx_bytes") bytes, A's eth0 tx $(cat /sys/class/net/eth0/statistics/tx_bytes) bytes" >> "$L.peer.incast.trace.log"
        onb 10 "nice -n 19 timeout $((STEP * 2)) ib_write_bw -d $B_DEV -x $GID -p $p1 -s 1024 -t 16 -n 1000000 > $BLOGS/peer.incast.a.server.log 2>&1 &"
        onb 10 "nice -n 19 timeout $((STEP * 2)) ib_write_bw -d $B_DEV -x $GID -p $p2 -s 1024 -t 16 -n 1000000 > $BLOGS/peer.incast.c.server.log 2>&1 &"
        b_listen "$p1"
        b_listen "$p2"
        b_max=$(onb 20 "$BIN/justitia status --socket $bpdir/admin.sock --json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["max_rate"])' 2>/dev/null)
        onb 20 "curl -s http://127.0.0.1:19467/metrics" > "$L.peer.incast.metrics.b.before.txt"
        LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=16K JUSTITIA_SOCKET=$pdir/justitiad.sock JUSTITIA_LOG=info nice -n 19 timeout "$((STEP * 2))" \
          ib_write_bw -d "$A_DEV" -x "$GID" -p "$p1" -s 1024 -t 16 -n 1000000 "$B_ADDR" > "$L.peer.incast.client.log" 2>&1 &
        PIDS+=($!)
        onc 10 "{ LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=16K JUSTITIA_SOCKET=$cpdir/justitiad.sock JUSTITIA_LOG=info nice -n 19 timeout $((STEP * 2)) \
          ib_write_bw -d $C_DEV -x $GID -p $p2 -s 1024 -t 16 -n 1000000 $B_ADDR; echo \"exit status \$?\"; } > $CLOGS/peer.incast.client.log 2>&1 &"
        # A's and C's flows, polled together (for 60 s at most: a poll takes seconds under
        # a loaded machine) until both are paced to half of B's MaxRate; "A: remote allot
        # active | C: pid remote allot active" each time.
        a_writer="" a_flow="" c_flow="" seen_a="" seen_c=""
        c_fields='import json, sys
mine = [f for f in json.load(sys.stdin) if f.get("class") == "bandwidth"]
print(" ".join(str(mine[0].get(k)).replace(" ", "_") for k in ("pid", "remote", "allot_bytes_per_sec", "active")) if mine else "absent")'
        half() { awk -v g="$1" -v m="${b_max:-0}" 'BEGIN {exit !(m > 0 && g > 0.49 * m && g < 0.51 * m)}'; }
        deadline=$((SECONDS + 60))
        while [ "$SECONDS" -lt "$deadline" ]; do
          [ -n "$a_writer" ] || a_writer=$(pgrep -x ib_write_bw | head -n 1)
          a_flow=$(flow_fields "${a_writer:-0}" remote allot_bytes_per_sec active)
          c_flow=$(onc 20 "$BIN/justitia flows --socket $cpdir/admin.sock --json | python3 -c '$c_fields'")
          echo "$SECONDS A: $a_flow | C: $c_flow (B's MaxRate $b_max)" >> "$L.peer.incast.trace.log"
          read -r a_remote a_allot _ <<< "$a_flow"
          read -r c_pid c_remote c_allot _ <<< "$c_flow"
          case " $seen_a " in *" $a_allot "*) ;; *) seen_a="$seen_a $a_allot" ;; esac
          case " $seen_c " in *" $c_allot "*) ;; *) seen_c="$seen_c $c_allot" ;; esac
          half "$a_allot" && half "$c_allot" && break
          # A writer gone (status 9, see above): no use asking on.
          if { [ -n "$a_writer" ] && ! kill -0 "$a_writer" 2> /dev/null; } \
            || grep -q '^exit status' "$CLOGS/peer.incast.client.log" 2> /dev/null; then
            break
          fi
          sleep 1
        done
        onb 20 "curl -s http://127.0.0.1:19467/metrics" > "$L.peer.incast.metrics.b.txt"
        onc 20 "curl -s http://127.0.0.1:19467/metrics" > "$L.peer.incast.metrics.c.txt"
        b_recv0=$(metric "$L.peer.incast.metrics.b.before.txt" justitia_peer_messages_received_total)
        b_recv=$(metric "$L.peer.incast.metrics.b.txt" justitia_peer_messages_received_total)
        b_sent=$(metric "$L.peer.incast.metrics.b.txt" justitia_peer_messages_sent_total)
        c_recv=$(metric "$L.peer.incast.metrics.c.txt" justitia_peer_messages_received_total)
        c_sent=$(metric "$L.peer.incast.metrics.c.txt" justitia_peer_messages_sent_total)
        mbs() { awk -v r="$1" 'BEGIN {if (r + 0 > 0) printf "%.1f MB/s", r / 1e6; else printf "%s", r}'; }
        figures="A's ib_write_bw (pid ${a_writer:-none}) ${a_remote:-?}: allotment $(mbs "$a_allot"); C's (pid ${c_pid:-none}) ${c_remote:-?}: allotment $(mbs "$c_allot"); expected B's MaxRate $(mbs "${b_max:-0}") / 2 = $(mbs "$(awk -v m="${b_max:-0}" 'BEGIN {print m / 2}')"); metrics: B received ${b_recv0:-?} -> ${b_recv:-?} peer messages and sent ${b_sent:-?}, C sent ${c_sent:-?} and received ${c_recv:-?}; allotments seen, A:$seen_a, C:$seen_c"
        half "$a_allot" && half "$c_allot" && break
        [ "$attempt" = 3 ] && break
        grep -q "Failed status 9" "$L.peer.incast.client.log" "$CLOGS/peer.incast.client.log" 2> /dev/null || break
        note="$note [attempt $attempt: a writer ended with status 9, allotments seen A:$seen_a, C:$seen_c]"
        pkill -x ib_write_bw
        onc 20 "pkill -x ib_write_bw; mv $CLOGS/peer.incast.client.log $CLOGS/peer.incast.client.attempt$attempt.log" > /dev/null 2>&1
        onb 20 "pkill -x ib_write_bw" > /dev/null
        mv "$L.peer.incast.client.log" "$L.peer.incast.client.attempt$attempt.log"
      done
      if [ "$a_remote" = "sends_to_$B_ADDR" ] && [ "$c_remote" = "sends_to_$B_ADDR" ] && half "$a_allot" && half "$c_allot" \
        && awk -v r0="${b_recv0:-0}" -v r="${b_recv:-0}" -v c="${c_recv:-0}" 'BEGIN {exit !(r > r0 && c > 0)}'; then
        result PASS "$label" "$figures$note"
      else
        result FAIL "$label" "$figures (logs: $L.peer.incast.*, $CLOGS/peer.*, $BLOGS/peer.incast.*)"
      fi
      pkill -x ib_write_bw
      onc 20 "pkill -x ib_write_bw; cat $CLOGS/peer.incast.client.log | tail -n 3" > "$L.peer.incast.c.tail.log"
      onb 20 "pkill -x ib_write_bw" > /dev/null
    fi
  fi
  rm -rf "$pdir"
fi

cleanup
rm -rf "${dir:-}"
