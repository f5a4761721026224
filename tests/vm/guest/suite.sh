#!/bin/bash
# Inside the guest (in the chroot, rxe0 up): the real-verbs test suite. Run by
# tests/vm/run-tests.sh through guest.sh; one line per test goes to RESULTS/results.txt
# ("PASS name: detail", "FAIL name: why", "SKIP name: why") and every tool's output to
# RESULTS/logs/.
#
#   suite.sh RESULTS SHAPER_LIB INTEGRITY_BIN [APPS_DIR [DAEMON_BIN_DIR]]
#
# SHAPER_LIB may be "-" when the shaper is not built: the runs that need it are then
# reported as skipped, with the reason. APPS_DIR holds the test applications built from
# tests/vm/apps (tests/vm/apps/build.sh); DAEMON_BIN_DIR holds justitiad and its test tools
# (see the daemon section at the end). Either may be "-" or absent: their tests are then
# skipped, saying so.
set -uo pipefail

RESULTS=$1
LIB=$2
INTEGRITY=$3
APPS=${4:--}
LOGS=$RESULTS/logs
mkdir -p "$LOGS"
: > "$RESULTS/results.txt"

DEV=rxe0
GID=0
STEP_TIMEOUT=${STEP_TIMEOUT:-150}
PORT=19000
NO_SHAPER="shaper not built (no libjustitia.so)"

# One result line, with the seconds spent since the previous one (the test's own time).
LAST_RESULT=$SECONDS
result() { # STATUS NAME DETAIL
  printf '%s %s: %s (%d s)\n' "$1" "$2" "$3" $((SECONDS - LAST_RESULT)) | tee -a "$RESULTS/results.txt"
  LAST_RESULT=$SECONDS
}

have_shaper() { [ "$LIB" != "-" ] && [ -e "$LIB" ]; }

# The environment of each mode of a transparency test: "plain" is the baseline; "preload"
# loads the shaper with no JUSTITIA_* variable at all (it must only observe); "shaped"
# makes every QP a bandwidth QP with 16 KiB chunks, so perftest's 64 KiB messages split.
mode_env() { # MODE STATS_PREFIX
  case $1 in
    plain) ;;
    preload) echo "LD_PRELOAD=$LIB" ;;
    shaped) echo "LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=16K JUSTITIA_STATS=$2.%p.stats.json" ;;
  esac
}

mode_label() { # MODE
  case $1 in
    preload) echo "preload, no JUSTITIA_* set" ;;
    shaped) echo "shaped, bandwidth class, 16K chunks" ;;
    *) echo "$1" ;;
  esac
}

wait_tcp_listen() { # PORT
  local _
  for _ in $(seq 200); do
    ss -Hltn "sport = :$1" 2>/dev/null | grep -q . && return 0
    sleep 0.1
  done
  return 1
}

wait_cm_listen() {
  local _
  for _ in $(seq 200); do
    rdma resource show cm_id 2>/dev/null | grep -q LISTEN && return 0
    sleep 0.1
  done
  return 1
}

# The counts a tool reports, one "side=..." word per side, from its log.
perftest_counts() { # LOG: "#bytes x #iterations" of the result row
  awk '/#bytes/ && /#iterations/ {h = 1; next} h && $1 ~ /^[0-9]+$/ {print $1 "x" $2; exit}' "$1"
}
pingpong_counts() { # LOG: "bytes x iterations"
  awk '/ bytes in / {b = $1} / iters in / {i = $1} END {if (b != "") print b "x" i}' "$1"
}
rping_counts() { # LOG: number of verified pings
  local n
  n=$(grep -c 'ping data: rdma-ping-' "$1")
  [ "$n" -gt 0 ] && echo "${n}pings"
}

# Problems a preloaded run must not show: the loader refusing the library, or the shaper
# saying anything at its default log level when it has nothing to shape.
preload_problems() { # LOG...
  grep -h -m1 -E "cannot be preloaded|justitia" "$@" 2>/dev/null | head -n 1
}

# run_pair NAME ENV KIND WAIT TOOL ARGS...: server then client of one tool, both with the
# NAME=value words of ENV in their environment; sets COUNTS ("client=... server=...") and
# ERROR; returns 0 on success.
run_pair() {
  local name=$1 env_words=$2 kind=$3 wait=$4 tool=$5
  shift 5
  local port=$((PORT++)) srv cli spid crc src
  srv=$LOGS/$name.server.log
  cli=$LOGS/$name.client.log
  COUNTS="" ERROR=""
  local server_args=("$@") client_args=("$@")
  case $kind in
    perftest) server_args+=(-p "$port"); client_args+=(-p "$port" localhost) ;;
    pingpong) server_args+=(-p "$port"); client_args+=(-p "$port" localhost) ;;
    rping)
      local addr
      addr=$(ip -6 -o addr show dev veth0 scope link | awk '{print $4}' | cut -d/ -f1)
      server_args+=(-s -a "$addr%veth0" -p "$port")
      client_args+=(-c -a "$addr%veth0" -p "$port")
      ;;
  esac
  # shellcheck disable=SC2086 # env_words is a list of NAME=value words without spaces
  env $env_words timeout "$STEP_TIMEOUT" "$tool" "${server_args[@]}" > "$srv" 2>&1 &
  spid=$!
  if ! "$wait" "$port"; then
    kill "$spid" 2>/dev/null
    wait "$spid" 2>/dev/null
    ERROR="server did not start listening (log: $srv)"
    return 1
  fi
  # shellcheck disable=SC2086
  env $env_words timeout "$STEP_TIMEOUT" "$tool" "${client_args[@]}" > "$cli" 2>&1
  crc=$?
  [ "$crc" = 0 ] || kill "$spid" 2>/dev/null
  wait "$spid"
  src=$?
  if [ "$crc" != 0 ] || [ "$src" != 0 ]; then
    local why
    why=$(grep -h -i -m1 -E "error|fail|couldn't|unable|cannot|can't" "$cli" "$srv" | head -n 1)
    ERROR="client exit $crc, server exit $src (logs: $cli, $srv)${why:+: $why}"
    return 1
  fi
  local c s
  c=$("${kind}_counts" "$cli")
  s=$("${kind}_counts" "$srv")
  if [ -z "$c" ]; then
    ERROR="no counts in the client's output ($cli)"
    return 1
  fi
  COUNTS="client=$c server=${s:-none}"
  return 0
}

# run_pair_retried: run_pair, again on failure. Under emulation perftest now and then
# fails without the shaper too: it cannot calibrate its cycle counter ("Correlation
# coefficient r^2 < 0.9", then "Can't produce a report"), or its bandwidth tests lose the
# closing out-of-band handshake. A failure gets one more attempt, a calibration failure up
# to two; NOTE then says so, and each failed attempt's logs are kept as *.attemptN.log.
run_pair_retried() { # NAME ENV KIND WAIT TOOL ARGS...
  local name=$1 attempt=1 history="" f
  NOTE=""
  while ! run_pair "$@"; do
    history="$history${history:+; }attempt $attempt: $ERROR"
    for f in "$LOGS/$name".*.log; do
      case $f in *.attempt*.log) ;; *) mv "$f" "${f%.log}.attempt$attempt.log" ;; esac
    done
    rm -f "$LOGS/$name".*.stats.json
    if [ "$attempt" -ge 3 ] || { [ "$attempt" -ge 2 ] \
      && ! grep -q "Correlation coefficient" "$LOGS/$name".*.attempt"$attempt".log; }; then
      ERROR=$history
      return 1
    fi
    attempt=$((attempt + 1))
  done
  [ -z "$history" ] || NOTE=" [passed on attempt $attempt; $history]"
  return 0
}

# transparency TEST KIND WAIT TOOL ARGS...: the same run plain, under the unconfigured
# shaper and shaped; the counts must be identical.
transparency() {
  local test=$1 kind=$2 wait=$3 tool=$4
  shift 4
  local base slug
  slug=$(echo "$test" | tr ' /' '__' | tr -cd 'A-Za-z0-9_.=-')
  if ! run_pair_retried "$slug.plain" "" "$kind" "$wait" "$tool" "$@"; then
    result FAIL "$test (plain)" "$ERROR"
    for mode in preload shaped; do
      result FAIL "$test ($(mode_label "$mode"))" "no baseline to compare with"
    done
    return
  fi
  base=$COUNTS
  result PASS "$test (plain)" "$base$NOTE"
  for mode in preload shaped; do
    local label
    label=$(mode_label "$mode")
    if ! have_shaper; then
      result SKIP "$test ($label)" "$NO_SHAPER"
    elif ! run_pair_retried "$slug.$mode" "$(mode_env "$mode" "$LOGS/$slug.$mode")" "$kind" "$wait" "$tool" "$@"; then
      result FAIL "$test ($label)" "$ERROR"
    elif [ "$mode" = preload ] && [ -n "$(preload_problems "$LOGS/$slug.$mode".*.log)" ]; then
      result FAIL "$test ($label)" "the unconfigured shaper changed the output: $(preload_problems "$LOGS/$slug.$mode".*.log)"
    elif [ "$mode" = shaped ] && ! ls "$LOGS/$slug.$mode".*.stats.json >/dev/null 2>&1; then
      result FAIL "$test ($label)" "the shaper wrote no statistics, so it was not in the data path"
    elif [ "$COUNTS" != "$base" ]; then
      result FAIL "$test ($label)" "counts $COUNTS differ from the plain run's $base"
    else
      result PASS "$test ($label)" "same counts as plain: $COUNTS$NOTE"
    fi
  done
}

json_field() { # FILE KEY
  grep -o "\"$2\": *[0-9]*" "$1" 2>/dev/null | head -n 1 | grep -o '[0-9]*$'
}

# ---------------------------------------------------------------------------------------
echo "== shaper"
if have_shaper; then
  if LD_PRELOAD=$LIB grep -q libjustitia /proc/self/maps; then
    result PASS "shaper loads" "$LIB is mapped into a process started with LD_PRELOAD"
  else
    result FAIL "shaper loads" "$LIB is not mapped under LD_PRELOAD: $(LD_PRELOAD=$LIB true 2>&1 | head -n 1)"
  fi
else
  result SKIP "shaper loads" "$NO_SHAPER"
fi

echo "== transparency (test 2; the 'preload' runs are test 5: no configuration)"
transparency "ibv_rc_pingpong" pingpong wait_tcp_listen ibv_rc_pingpong -d "$DEV" -g "$GID"
transparency "ibv_rc_pingpong -N" pingpong wait_tcp_listen ibv_rc_pingpong -d "$DEV" -g "$GID" -N
transparency "rping" rping wait_cm_listen rping -C 10 -v
for tool in ib_write_bw ib_write_lat ib_read_bw ib_read_lat ib_send_bw ib_send_lat; do
  help=$("$tool" --help 2>&1)
  for variant in "" --use_old_post_send -e; do
    if [ -n "$variant" ] && ! grep -qE -- "(^|[ ,])$variant([ ,=]|$)" <<< "$help"; then
      result SKIP "$tool $variant" "$tool does not accept $variant"
      continue
    fi
    # shellcheck disable=SC2086 # an empty variant adds no argument
    transparency "$tool ${variant:-(defaults)}" perftest wait_tcp_listen "$tool" -d "$DEV" -x "$GID" $variant
  done
done

# stats_where_positive SLUG KEY: the statistics file of the run SLUG (one per process) in
# which KEY is positive (the last such), or nothing.
stats_where_positive() {
  local f v best=""
  for f in "$LOGS/$1".*.stats.json; do
    v=$(json_field "$f" "$2")
    [ -n "$v" ] && [ "$v" -gt 0 ] && best=$f
  done
  echo "$best"
}

echo "== splitting (test 3)"
# split NAME POLICY_ENV EXPECT TOOL: 1 MiB messages under the bandwidth class with 64 KiB
# chunks; the requester's statistics must show the chunks (and, for preempt, the yields).
split_test() {
  local test=$1 env_extra=$2 expect=$3 tool=$4
  local slug=${test// /_} stats n=100
  if ! have_shaper; then
    result SKIP "$test" "$NO_SHAPER"
    return
  fi
  slug=$(echo "$slug" | tr -cd 'A-Za-z0-9_.=-')
  local env_words="LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=64K $env_extra JUSTITIA_STATS=$LOGS/$slug.%p.stats.json"
  if ! run_pair_retried "$slug" "$env_words" perftest wait_tcp_listen "$tool" -d "$DEV" -x "$GID" -s 1048576 -n "$n"; then
    result FAIL "$test" "$ERROR"
    return
  fi
  # The requester is the process that split: the one whose statistics count requests.
  local best r s c y
  best=$(stats_where_positive "$slug" split_requests)
  if [ -z "$best" ]; then
    result FAIL "$test" "no process split a request ($(cat "$LOGS/$slug".*.stats.json 2>/dev/null | tr '\n' ' '))"
    return
  fi
  r=$(json_field "$best" requests)
  s=$(json_field "$best" split_requests)
  c=$(json_field "$best" chunks)
  y=$(json_field "$best" yields)
  local detail="$COUNTS; requests=$r split_requests=$s chunks=$c yields=$y$NOTE"
  if [ "${COUNTS#"client=1048576x$n "}" = "$COUNTS" ]; then
    result FAIL "$test" "unexpected counts: $detail"
  elif [ "$c" -lt $((16 * s)) ]; then
    result FAIL "$test" "fewer than 16 chunks per split request: $detail"
  elif [ "$expect" = yields ] && [ "${y:-0}" -le 0 ]; then
    result FAIL "$test" "no yields: $detail"
  else
    result PASS "$test" "$detail"
  fi
}
for tool in ib_write_bw ib_read_bw; do
  split_test "$tool 1M split into 64K chunks" "" chunks "$tool"
  split_test "$tool 1M preempt" "JUSTITIA_POLICY=preempt" yields "$tool"
done

# QP turns: ib_write_bw on 8 QPs with JUSTITIA_QP_TURNS=2:256K (two of its QPs post at a
# time, 256 KiB a turn while another waits). The run completes with the counts it has
# without the shaper, and the requester's statistics show QPs waiting in line and spent
# turns handed on.
turns_test() {
  local test="ib_write_bw -q 8, two QPs post at a time" slug=qp_turns n=25
  if ! have_shaper; then
    result SKIP "$test" "$NO_SHAPER"
    return
  fi
  local env_words="LD_PRELOAD=$LIB JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=64K JUSTITIA_QP_TURNS=2:256K JUSTITIA_STATS=$LOGS/$slug.%p.stats.json"
  if ! run_pair_retried "$slug" "$env_words" perftest wait_tcp_listen ib_write_bw -d "$DEV" -x "$GID" -q 8 -s 1048576 -n "$n"; then
    result FAIL "$test" "$ERROR"
    return
  fi
  local best w y
  best=$(stats_where_positive "$slug" turn_waits)
  if [ -z "$best" ]; then
    result FAIL "$test" "no QP waited for a turn ($(cat "$LOGS/$slug".*.stats.json 2>/dev/null | tr '\n' ' '))"
    return
  fi
  w=$(json_field "$best" turn_waits)
  y=$(json_field "$best" turn_yields)
  local detail="$COUNTS; turn_waits=$w turn_yields=$y split_requests=$(json_field "$best" split_requests)$NOTE"
  # perftest counts the iterations of all its QPs: 8 x n.
  if [ "${COUNTS#"client=1048576x$((8 * n)) "}" = "$COUNTS" ]; then
    result FAIL "$test" "unexpected counts: $detail"
  elif [ "${y:-0}" -le 0 ]; then
    result FAIL "$test" "no spent turn was handed on: $detail"
  else
    result PASS "$test" "$detail"
  fi
}
turns_test

echo "== data integrity (test 4)"
INTEGRITY_TRANSFERS=${INTEGRITY_TRANSFERS:-100}
shaped_transfers=0
integrity_ok=1
# integrity NAME CHECK [--OPTION=VALUE...] ENV...: one run of the checker; CHECK names the
# statistic that must be positive (split_requests, yields, pacing_delay_ns), or is "-"
# (none), or "unconfigured" (the shaper is preloaded with no JUSTITIA_* variable at all, ENV
# is empty). Words starting with "-" are passed to the checker (e.g. --post-api=wr); the
# other words are the shaper's environment, and without any the shaper is not loaded.
integrity() {
  local test=$1 check=$2
  shift 2
  local slug log stats v
  local checker_args=() shaper_env=()
  for v in "$@"; do
    case $v in
      -*) checker_args+=("$v") ;;
      *) shaper_env+=("$v") ;;
    esac
  done
  slug=$(echo "integrity_$test" | tr ' /' '__' | tr -cd 'A-Za-z0-9_.=-')
  log=$LOGS/$slug.log
  stats=$LOGS/$slug.stats.json
  if { [ ${#shaper_env[@]} -gt 0 ] || [ "$check" = unconfigured ]; } && ! have_shaper; then
    result SKIP "integrity $test" "$NO_SHAPER"
    return
  fi
  for v in "${shaper_env[@]}"; do
    case $v in JUSTITIA_CHUNK=*) checker_args+=(--boundary "${v#JUSTITIA_CHUNK=}") ;; esac
  done
  local env_words=()
  [ ${#shaper_env[@]} -gt 0 ] && env_words=("LD_PRELOAD=$LIB" "${shaper_env[@]}" "JUSTITIA_STATS=$stats")
  [ "$check" = unconfigured ] && env_words=("LD_PRELOAD=$LIB")
  env "${env_words[@]}" timeout $((STEP_TIMEOUT * 3)) "$INTEGRITY" -d "$DEV" -x "$GID" \
    -n "$INTEGRITY_TRANSFERS" "${checker_args[@]}" > "$log" 2>&1
  local rc=$? summary
  summary=$(grep -E 'PASS:|FAIL:|error:' "$log" | tail -n 1 | sed 's/^justitia-integrity: //')
  if [ "$rc" != 0 ]; then
    integrity_ok=0
    result FAIL "integrity $test" "exit $rc: ${summary:-no summary} (log: $log)"
    return
  fi
  local n
  n=$(echo "$summary" | grep -o 'PASS: [0-9]*' | grep -o '[0-9]*$')
  if [ "$check" = unconfigured ] && grep -qv '^justitia-integrity: ' "$log"; then
    integrity_ok=0
    result FAIL "integrity $test" "the unconfigured shaper printed: $(grep -v '^justitia-integrity: ' "$log" | head -n 1)"
    return
  fi
  if [ ${#shaper_env[@]} -gt 0 ]; then
    if [ ! -s "$stats" ]; then
      integrity_ok=0
      result FAIL "integrity $test" "the shaper wrote no statistics to $stats"
      return
    fi
    v=$(json_field "$stats" "$check")
    if [ "$check" != - ] && ! [ "${v:-0}" -gt 0 ]; then
      integrity_ok=0
      result FAIL "integrity $test" "$check is 0 in $(tr -d '\n' < "$stats"): the shaper did not act"
      return
    fi
    shaped_transfers=$((shaped_transfers + n))
    summary="$summary; shaper: $(tr -d '\n ' < "$stats")"
  fi
  result PASS "integrity $test" "$summary"
}
integrity "without the shaper" -
integrity "preload, no JUSTITIA_* set" unconfigured
integrity "bandwidth, default chunk" split_requests JUSTITIA_CLASS=bandwidth
integrity "bandwidth, chunk 4K" split_requests JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=4K
integrity "bandwidth, chunk 64K" split_requests JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=64K
integrity "bandwidth, chunk 1M" split_requests JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=1M
integrity "bandwidth, chunk 12345" split_requests JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=12345
integrity "bandwidth, chunk 64K, paced 40M:20K" pacing_delay_ns JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=64K JUSTITIA_RATE=40M:20K
# Chunk sizes drawn at random on every run (the line names them, so a failure can be
# replayed with the same JUSTITIA_CHUNK and the seed the checker prints).
small_chunk=$((2048 + (RANDOM * 32768 + RANDOM) % (64 * 1024 - 2048)))
large_chunk=$((64 * 1024 + (RANDOM * 32768 + RANDOM) % (4 * 1024 * 1024 - 64 * 1024)))
integrity "bandwidth, random chunk $small_chunk" split_requests JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=$small_chunk
integrity "bandwidth, random chunk $large_chunk" split_requests JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=$large_chunk
integrity "auto class" split_requests JUSTITIA_CLASS=auto
integrity "preempt" yields JUSTITIA_CLASS=bandwidth JUSTITIA_POLICY=preempt
integrity "preempt, sub-message 48K, yield unit 3K" yields JUSTITIA_CLASS=bandwidth JUSTITIA_POLICY=preempt JUSTITIA_SUBMSG=48K JUSTITIA_YIELD_UNIT=3K
# The same checks posted through the extended send interface (ibv_create_qp_ex with
# send-ops flags, ibv_wr_start ... ibv_wr_complete: perftest's default on rxe), which the
# shaper intercepts apart from ibv_post_send. The runs without the shaper and under the
# unconfigured one (which forwards to rxe's own ibv_wr_* verbs) tell a failure of the shaper
# from one of rxe or of the checker. They post one SGE per request: rxe's
# ibv_wr_set_sge_list in rdma-core 44 (Debian bookworm) takes num_sge times the first SGE's
# length as the request's length, so multi-SGE requests fail there with local protection
# errors (fixed upstream by rdma-core PR #1744). A shaped QP is unaffected: the shaper
# reposts what it collects through ibv_post_send. The same seed without --post-api replays a
# failing run's exact transfers through ibv_post_send.
integrity "wr API, single SGE, without the shaper" - --post-api=wr --max-sges=1
integrity "wr API, single SGE, preload, no JUSTITIA_* set" unconfigured --post-api=wr --max-sges=1
integrity "wr API, bandwidth, chunk 64K" split_requests --post-api=wr JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=64K
integrity "wr API, bandwidth, random chunk $small_chunk" split_requests --post-api=wr JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=$small_chunk
integrity "wr API, preempt" yields --post-api=wr JUSTITIA_CLASS=bandwidth JUSTITIA_POLICY=preempt
# Four threads posting on four QPs that share one send CQ, polled by a fifth, split and
# paced: the checker's byte checks, and every signaled request completed exactly once.
integrity "4 threads, one shared send CQ, chunk 64K, paced 40M:20K" pacing_delay_ns --threads=4 --max-size=1M \
  JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=64K JUSTITIA_RATE=40M:20K
if have_shaper; then
  if [ "$integrity_ok" = 1 ] && [ "$shaped_transfers" -ge 1000 ]; then
    result PASS "integrity total" "$shaped_transfers transfers through the shaper, zero mismatches"
  else
    result FAIL "integrity total" "$shaped_transfers transfers through the shaper (at least 1000 needed), all clean: $([ "$integrity_ok" = 1 ] && echo yes || echo no)"
  fi
fi

echo "== real applications (dlopen, ctypes, rdma_cm churn, destroy with work held, the hang case, threads)"
# The test applications of tests/vm/apps, built on the host by run-tests.sh into APPS.
have_apps() { [ "$APPS" != - ] && [ -x "$APPS/dlopen_app" ]; }
NO_APPS="the test applications were not built (tests/vm/apps/build.sh failed or was not run)"

# app_modes TEST CMD...: the application plain, under the unconfigured shaper and shaped
# (bandwidth, 16K chunks); each must exit 0 and print the same "result" line.
app_modes() {
  local test=$1
  shift
  local slug base="" mode label log rc res why
  slug=$(echo "app_$test" | tr ' /' '__' | tr -cd 'A-Za-z0-9_.=-')
  for mode in plain preload shaped; do
    label=$(mode_label "$mode")
    if ! have_apps; then
      result SKIP "$test ($label)" "$NO_APPS"
      continue
    fi
    if [ "$mode" != plain ] && ! have_shaper; then
      result SKIP "$test ($label)" "$NO_SHAPER"
      continue
    fi
    log=$LOGS/$slug.$mode.log
    # shellcheck disable=SC2046 # mode_env prints NAME=value words without spaces
    env $(mode_env "$mode" "$LOGS/$slug.$mode") timeout "$STEP_TIMEOUT" "$@" > "$log" 2>&1
    rc=$?
    res=$(grep -o 'result .*' "$log" | head -n 1)
    why=$(grep -h -m1 -E 'error|rror:' "$log" | head -n 1)
    if [ "$rc" != 0 ]; then
      result FAIL "$test ($label)" "exit $rc${why:+: $why} (log: $log)"
    elif [ -z "$res" ]; then
      result FAIL "$test ($label)" "no result line (log: $log)"
    elif [ "$mode" = plain ]; then
      base=$res
      result PASS "$test ($label)" "$res"
    elif [ -z "$base" ]; then
      result FAIL "$test ($label)" "no plain result to compare with; got: $res"
    elif [ "$res" != "$base" ]; then
      result FAIL "$test ($label)" "result differs from plain: $res"
    elif [ "$mode" = preload ] && [ -n "$(preload_problems "$log")" ]; then
      result FAIL "$test ($label)" "the unconfigured shaper printed: $(preload_problems "$log")"
    else
      result PASS "$test ($label)" "same result as plain: $res"
    fi
  done
}
app_modes "dlopen libibverbs RTLD_LOCAL (C)" "$APPS/dlopen_app" "$DEV" "$GID"
app_modes "dlopen plugin linked to libibverbs RTLD_LOCAL (C)" "$APPS/dlopen_app" --plugin "$APPS/libping_plugin.so" "$DEV"
app_modes "ctypes libibverbs (Python)" /usr/bin/python3 tests/vm/apps/ctypes_app.py "$DEV"
app_modes "ctypes plugin linked to libibverbs (Python)" /usr/bin/python3 tests/vm/apps/ctypes_app.py --plugin "$APPS/libping_plugin.so" "$DEV"
app_modes "NCCL-style dlopen and dlvsym table (C)" "$APPS/nccl_style_app" "$DEV" "$GID"

# app_reached TEST FIELD: the shaped run of app_modes TEST counted FIELD > 0 in its
# JUSTITIA_STATS: split_requests (its 256 KiB WRITE went in 16K chunks) or qps (the QP it
# created was registered). Either means the verbs it looked up through its own libibverbs
# handle (dlsym, dlvsym, ctypes) reached the shaper; without a stats file, its
# ibv_open_device never did.
app_reached() {
  local test=$1 field=$2 slug f v
  slug=$(echo "app_$test" | tr ' /' '__' | tr -cd 'A-Za-z0-9_.=-')
  if ! have_apps || ! have_shaper; then
    result SKIP "$test reaches the shaper" "$NO_APPS"
    return
  fi
  for f in "$LOGS/$slug".shaped.*.stats.json; do
    [ -f "$f" ] || continue
    v=$(json_field "$f" "$field")
    if [ -n "$v" ] && [ "$v" -gt 0 ]; then
      result PASS "$test reaches the shaper" "$field=$v ($(tr -d '\n' < "$f"))"
      return
    fi
  done
  result FAIL "$test reaches the shaper" "no $field in its stats: $(cat "$LOGS/$slug".shaped.*.stats.json 2>/dev/null | tr '\n' ' ')"
}
app_reached "dlopen libibverbs RTLD_LOCAL (C)" split_requests
app_reached "NCCL-style dlopen and dlvsym table (C)" split_requests
app_reached "ctypes libibverbs (Python)" qps

# The hang case: an unsignaled 1 MiB WRITE and a signaled SEND on a 16-deep send queue,
# then the reply awaited on the receive CQ only. Plain (the baseline), then shaped with
# 16K chunks (64 chunks per WRITE: the queue fills); each bounded by HANG_TIMEOUT.
HANG_TIMEOUT=${HANG_TIMEOUT:-60}
hang_case() { # LABEL ENV...
  local label=$1 log rc
  shift
  log=$LOGS/app_hang.$(echo "$label" | tr -cd 'a-z').log
  env "$@" timeout "$HANG_TIMEOUT" "$APPS/hang_app" "$DEV" 5 20 > "$log" 2>&1
  rc=$?
  if [ "$rc" = 0 ]; then
    result PASS "hang case, reply polled on the receive CQ only ($label)" "$(grep -o 'PASS: .*' "$log")"
  elif [ "$rc" = 124 ]; then
    result FAIL "hang case, reply polled on the receive CQ only ($label)" "still running after $HANG_TIMEOUT s (log: $log)"
  else
    result FAIL "hang case, reply polled on the receive CQ only ($label)" "exit $rc: $(grep -h -m1 -E 'FAIL|error' "$log") (log: $log)"
  fi
}
if ! have_apps; then
  result SKIP "hang case" "$NO_APPS"
else
  hang_case plain
  if have_shaper; then
    hang_case "shaped, bandwidth class, 16K chunks, send queue 16" LD_PRELOAD="$LIB" JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=16K
  else
    result SKIP "hang case (shaped)" "$NO_SHAPER"
  fi
fi

# Destroying QPs with paced requests held, under valgrind's memcheck: the shaper's Rust
# code, libibverbs and the provider are all checked (ASan would see only the C program's
# own code). Zero errors and a clean exit are required; the plain run is the baseline that
# shows the program and rdma-core are clean alone.
DESTROY_ITERATIONS=${DESTROY_ITERATIONS:-100}
destroy_case() { # LABEL ITERATIONS ENV...
  local label=$1 iterations=$2 log vlog rc errors
  shift 2
  log=$LOGS/app_destroy.$(echo "$label" | tr -cd 'a-z').log
  vlog=${log%.log}.valgrind.log
  env "$@" timeout $((STEP_TIMEOUT * 2)) valgrind --tool=memcheck --error-exitcode=99 \
    --log-file="$vlog" "$APPS/destroy_held" "$DEV" "$iterations" 4 > "$log" 2>&1
  rc=$?
  errors=$(grep -o 'ERROR SUMMARY: [0-9]* errors' "$vlog" | tail -n 1 | grep -o '[0-9]*')
  local test="destroy QPs with requests held, under valgrind ($label)"
  if [ "$rc" = 0 ] && [ "${errors:-x}" = 0 ]; then
    result PASS "$test" "$(grep -o 'PASS: .*' "$log"); valgrind: 0 errors"
  elif [ "$rc" = 124 ]; then
    result FAIL "$test" "still running after $((STEP_TIMEOUT * 2)) s (logs: $log, $vlog)"
  else
    local first
    first=$(grep -m1 -E '^==[0-9]+== (Invalid|Conditional|Use of|Syscall|Mismatched|Source and)' "$vlog" | sed 's/^==[0-9]*== //')
    result FAIL "$test" "exit $rc, valgrind errors: ${errors:-none reported}${first:+, first: $first}; $(grep -h -m1 error "$log") (logs: $log, $vlog)"
  fi
}
if ! have_apps; then
  result SKIP "destroy QPs with requests held" "$NO_APPS"
elif ! command -v valgrind > /dev/null; then
  result FAIL "destroy QPs with requests held" "valgrind is not installed (scripts/setup.sh installs it)"
else
  destroy_case plain 20
  if have_shaper; then
    destroy_case "bandwidth, 64K chunks, paced 10M" "$DESTROY_ITERATIONS" LD_PRELOAD="$LIB" JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=64K JUSTITIA_RATE=10M
  else
    result SKIP "destroy QPs with requests held (shaped)" "$NO_SHAPER"
  fi
fi

# rdma_cm churn: a server accepts, serves and drops CM_CONNECTIONS connections, one at a
# time, under the shaper (shaped class, so it keeps per-QP state); the server's descriptor
# count and RSS after all of them may exceed those after the first 5% by at most
# CM_FD_SLACK descriptors and CM_RSS_SLACK_KB KiB. The figures go into the result line.
CM_CONNECTIONS=${CM_CONNECTIONS:-2000}
# The plain run is the baseline that shows the program and rdma-core alone hold steady;
# fewer connections keep its time down.
CM_PLAIN_CONNECTIONS=${CM_PLAIN_CONNECTIONS:-400}
CM_FD_SLACK=${CM_FD_SLACK:-16}
CM_RSS_SLACK_KB=${CM_RSS_SLACK_KB:-4096}
cm_case() { # LABEL CONNECTIONS ENV...
  local label=$1 conns=$2 port=$((PORT++)) addr srv cli spid crc src figures
  shift 2
  local test="rdma_cm churn, $conns connections ($label)"
  srv=$LOGS/app_cm.$(echo "$label" | tr -cd 'a-z').server.log
  cli=${srv%.server.log}.client.log
  addr=$(ip -6 -o addr show dev veth0 scope link | awk '{print $4}' | cut -d/ -f1)
  env "$@" timeout $((STEP_TIMEOUT * 3)) "$APPS/cm_churn" server "$addr%veth0" "$port" "$conns" \
    "$CM_FD_SLACK" "$CM_RSS_SLACK_KB" > "$srv" 2>&1 &
  spid=$!
  if ! wait_cm_listen; then
    kill "$spid" 2> /dev/null
    wait "$spid" 2> /dev/null
    result FAIL "$test" "the server did not start listening (log: $srv)"
    return
  fi
  env "$@" timeout $((STEP_TIMEOUT * 3)) "$APPS/cm_churn" client "$addr%veth0" "$port" "$conns" > "$cli" 2>&1
  crc=$?
  [ "$crc" = 0 ] || kill "$spid" 2> /dev/null
  wait "$spid"
  src=$?
  figures=$(grep -E '^cm_churn server: (at exit: )?conns=' "$srv" \
    | sed -E 's/^cm_churn server: //; s/conns=([0-9]+) fds=(-?[0-9]+) rss_kb=(-?[0-9]+).*/\1 conns: \2 fds, \3 kB/' \
    | paste -sd ';' | sed 's/;/; /g')
  if [ "$crc" = 0 ] && [ "$src" = 0 ]; then
    result PASS "$test" "$(grep -o 'PASS: .*' "$srv"); server at $figures; client at $(grep '^cm_churn client: conns=' "$cli" | tail -n 1 | sed 's/^cm_churn client: //')"
  else
    # The programs' own verdict first; lines the shaper printed come after.
    local why
    why=$( (grep -h -E '^cm_churn.*(FAIL|error)' "$srv" "$cli"; grep -h -E 'FAIL|error' "$srv" "$cli") | head -n 1)
    result FAIL "$test" "client exit $crc, server exit $src: $why; server at $figures (logs: $srv, $cli)"
  fi
}
if ! have_apps; then
  result SKIP "rdma_cm churn" "$NO_APPS"
else
  cm_case plain "$CM_PLAIN_CONNECTIONS"
  if have_shaper; then
    cm_case "shaped, bandwidth class, 16K chunks" "$CM_CONNECTIONS" LD_PRELOAD="$LIB" JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=16K
  else
    result SKIP "rdma_cm churn (shaped)" "$NO_SHAPER"
  fi
fi

# ---------------------------------------------------------------------------------------
# justitiad on rxe0 (crates/daemon, crates/agent): its own script, which writes its own
# result lines. DAEMON_BIN_DIR holds justitiad, justitia and the register and scrape
# examples, as run-tests.sh builds them.
# Field applications (qperf, ucx_perftest, fi_pingpong, Open MPI over UCX), plain and under
# the shaper (tests/vm/guest/real-apps.sh; 2.5 to 3.5 minutes).
echo "== field applications"
if ! have_shaper; then
  result SKIP "real apps" "$NO_SHAPER"
else
  timeout 360 tests/vm/guest/real-apps.sh "$RESULTS" "$LIB" "$APPS"
  if [ "$?" = 124 ]; then
    result FAIL "real apps" "tests/vm/guest/real-apps.sh did not finish within 360 s"
  fi
fi

echo "== daemon"
DAEMON_BIN_DIR=${5:--}
if [ "$DAEMON_BIN_DIR" = - ]; then
  result SKIP "daemon" "justitiad and its test tools not built"
else
  timeout 120 tests/vm/guest/daemon.sh "$RESULTS" "$DAEMON_BIN_DIR"
  rc=$?
  if [ "$rc" = 124 ]; then
    result FAIL "daemon" "tests/vm/guest/daemon.sh did not finish within 120 s"
  fi
  # The reference flow's GID on rxe1, whose interface's link-local address is not made
  # from its MAC (tests/vm/guest/gid-index.sh; about 30 s).
  timeout 120 tests/vm/guest/gid-index.sh "$RESULTS" "$DAEMON_BIN_DIR"
  if [ "$?" = 124 ]; then
    result FAIL "gid" "tests/vm/guest/gid-index.sh did not finish within 120 s"
  fi
  # The daemon steering applications under the shaper, and its faults (2 to 5 minutes; the
  # limit leaves room for a loaded host).
  if ! have_shaper; then
    result SKIP "daemon apps" "$NO_SHAPER"
  else
    timeout 420 tests/vm/guest/daemon-apps.sh "$RESULTS" "$DAEMON_BIN_DIR" "$LIB" "$INTEGRITY"
    rc=$?
    if [ "$rc" = 124 ]; then
      result FAIL "daemon apps" "tests/vm/guest/daemon-apps.sh did not finish within 420 s"
    fi
  fi
  # The daemon under `policy = "adaptive"`: its allotments follow the law, and the integrity
  # checker under them finds no mismatch (two to four minutes).
  if ! have_shaper; then
    result SKIP "daemon adaptive" "$NO_SHAPER"
  else
    timeout 300 tests/vm/guest/daemon-adaptive.sh "$RESULTS" "$DAEMON_BIN_DIR" "$LIB" "$INTEGRITY"
    if [ "$?" = 124 ]; then
      result FAIL "daemon adaptive" "tests/vm/guest/daemon-adaptive.sh did not finish within 300 s"
    fi
  fi
  # The CDI spec of `justitia cdi` applied as a container runtime would, and the device
  # plugin's Allocate in front of containerd (CDI_VALIDATOR, DEVICE_PLUGIN, PODRUN: the Go
  # programs run-tests.sh builds).
  if ! have_shaper || [ "${CDI_VALIDATOR:--}" = - ] || [ "${DEVICE_PLUGIN:--}" = - ] || [ "$APPS" = - ]; then
    result SKIP "cdi" "needs the shaper, the Go programs and the test applications"
  else
    timeout 720 tests/vm/guest/cdi.sh "$RESULTS" "$DAEMON_BIN_DIR" "$LIB" "$CDI_VALIDATOR" "$APPS" \
      "$DEVICE_PLUGIN" "$PODRUN"
    if [ "$?" = 124 ]; then
      result FAIL "cdi" "tests/vm/guest/cdi.sh did not finish within 720 s"
    fi
  fi
  # Applications that escape the shaper: a plain ib_write_bw is listed unshaped by the
  # daemon's scan, a shaped one is not (about a minute under emulation).
  if ! have_shaper; then
    result SKIP "escapees" "$NO_SHAPER"
  else
    timeout 180 tests/vm/guest/escapees.sh "$RESULTS" "$DAEMON_BIN_DIR" "$LIB"
    if [ "$?" = 124 ]; then
      result FAIL "escapees" "tests/vm/guest/escapees.sh did not finish within 180 s"
    fi
  fi
  # A control-verb storm from one tenant paced by its shaper while another tenant's
  # registrations and latency flow proceed (about 40 s under emulation).
  if ! have_shaper || [ "$APPS" = - ]; then
    result SKIP "control verbs" "needs the shaper and the test applications"
  else
    timeout 180 tests/vm/guest/control-verbs.sh "$RESULTS" "$DAEMON_BIN_DIR" "$LIB" "$APPS"
    if [ "$?" = 124 ]; then
      result FAIL "control verbs" "tests/vm/guest/control-verbs.sh did not finish within 180 s"
    fi
  fi
fi

# `justitia run`: scenario files on rxe0, natively and under the shaper with justitiad
# (tests/vm/guest/run-backend.sh; about two minutes).
echo "== run backend"
if [ "$DAEMON_BIN_DIR" = - ] || ! have_shaper; then
  result SKIP "run backend" "justitia, justitia-loadgen, justitiad or the shaper not built"
elif ! timeout 420 tests/vm/guest/run-backend.sh "$RESULTS" "$DAEMON_BIN_DIR" "$LIB"; then
  result FAIL "run backend" "tests/vm/guest/run-backend.sh did not finish within 420 s"
fi

echo "== suite done"
