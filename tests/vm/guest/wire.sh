#!/bin/bash
# On host A of the two-host pair (tests/vm/two-hosts.sh): isolation measured across a wire
# that is the bottleneck. A's side of the cable (eth0) goes through a token bucket of
# WIRE_RATE (8 Mbit/s), far below the 7 to 10 MB/s rxe pushes across the cable under
# emulation, so a WRITE stream queues at A's interface, not in the emulated CPUs. On it,
# `justitia run` places each flow's requester on A and its responder on B (a
# `justitia run-server` there), with a 16 B ping-pong latency flow beside a stream of
# 64 KiB WRITEs (tests/vm/scenarios/wire-lat-vs-bw*-softroce.toml), each run WIRE_REPEAT
# (5) times under the daemon:
#
#   native     the latency flow alone, then beside the stream, no shaper, WIRE_NATIVE_REPEAT
#              (3) times: the strict verdict must FAIL, the p99 judged (the latency flow
#              waits behind the stream's packets at the bucket);
#   justitia   alone, the stream alone, both together under A's justitiad (policy
#              justitia, profile SoftRoCE-wire, whose MaxRate is the wire's payload rate,
#              Target99 1.5 x the probe's idle p99): the strict verdict must PASS;
#   adaptive   the same under A's justitiad with policy adaptive, WIRE_ADAPTIVE_REPEAT (3)
#              times: reported, not judged;
#   probe      the justitia section's runs under justitiad on A with its reference flow
#              across the wire to a queue pair B's justitiad makes for it (peer.probe_to),
#              WIRE_PROBE_REPEAT (3) times: reported; then under the same daemons the
#              latency flow beside the stream as 64 KiB SENDs, split between the two paired
#              shapers, the section's runs warmed up past the SENDs that go whole before
#              the shapers agree (tests/vm/scenarios/wire-lat-vs-write-and-send-softroce.toml):
#              its p99 beside the SENDs within WIRE_SEND_VS_WRITE (2) times its p99
#              beside the WRITEs;
#   tput       a throughput victim (batches of 64 16 B WRITEs) alone, the stream alone,
#              both natively and under justitiad's justitia policy, WIRE_TPUT_REPEAT (3)
#              times (tests/vm/scenarios/wire-tput-vs-bw-softroce.toml): each one's rate
#              beside the other as a ratio to its rate alone, reported;
#   read       B READs from A beside A's WRITEs to B, natively and under justitiad on both
#              hosts joined by the peer channel, WIRE_READ_REPEAT (3) times
#              (tests/vm/scenarios/wire-read-vs-write-softroce.toml): the READs' rate
#              against the guarantee A's daemon grants them, reported.
#   incast     the bucket moves to B's side (B's eth0 ingress redirected to an IFB device
#              that queues through it): A and host C each stream 64 KiB WRITEs into B
#              while A pings B, natively and under justitiad on A, B and C joined by the
#              peer channel, WIRE_INCAST_REPEAT (3) times
#              (tests/vm/scenarios/wire-incast-softroce.toml): each sender's measured
#              rate against the share B's daemon grants it (a third of B's MaxRate: A's
#              pings are an incast unit too), and the pings' p99 beside the incast as a
#              ratio to their p99 alone, reported.
#
# The strict verdict, on the medians of the repeats: the latency flow's p99 beside the
# stream at most WIRE_MAX_P99_RATIO (5) times its p99 alone, and every flow's rate at
# least WIRE_MIN_RATE_RATIO (0.2) of its rate alone; tests/vm/README.md derives the band
# from the repeats' spread. The native runs last WIRE_NATIVE_DURATION_MS (12 s): beside
# the stream the latency flow makes 13 to 14 round trips a second, and its p99 needs 100
# samples to be judged (8 s runs gave a median of 99 on a landing host, and the p99 went
# unjudged). The ACK timeout is 18 (1.07 s): the bucket's backlog of 64
# packets holds a request 73 ms, past the usual 67 ms, and rxe then resent what was never
# lost.
#
# Under the daemon, `justitia run --daemon-metrics` reads SafeUtil, Current99 and
# Target99 from its metrics every 100 ms while each run goes: the decreases per second
# are in the result line, the series in RESULTS/logs/wire.<policy>.log.out/ and the figure
# in RESULTS/logs/wire.<policy>.plot/*-control.svg.
#
#   wire.sh RESULTS SHAPER_LIB BIN_DIR
set -uo pipefail

RESULTS=$1
LIB=$2
BIN=$3
HERE=$(cd "$(dirname "$0")" && pwd)
LOGS=$RESULTS/logs
BLOGS=$RESULTS/b/logs
CLOGS=$RESULTS/c/logs
L=$LOGS/wire
mkdir -p "$LOGS" "$BLOGS" "$CLOGS"
touch "$RESULTS/results.txt"
# shellcheck source=tests/vm/guest/daemon-lib.sh
source "$HERE/daemon-lib.sh"

A_DEV=rxea B_DEV=rxeb C_DEV=rxec
A_ADDR=10.77.0.1 B_ADDR=10.77.0.2 C_ADDR=10.77.0.3
B_PEER_DIR=/tmp/wire-peer.b C_PEER_DIR=/tmp/wire-peer.c
GID=1
RATE=${WIRE_RATE:-8mbit}
REPEAT=${WIRE_REPEAT:-5}
ADAPTIVE_REPEAT=${WIRE_ADAPTIVE_REPEAT:-3}
NATIVE_REPEAT=${WIRE_NATIVE_REPEAT:-3}
TPUT_REPEAT=${WIRE_TPUT_REPEAT:-3}
READ_REPEAT=${WIRE_READ_REPEAT:-3}
PROBE_REPEAT=${WIRE_PROBE_REPEAT:-3}
INCAST_REPEAT=${WIRE_INCAST_REPEAT:-3}
DURATION_MS=${WIRE_DURATION_MS:-3000}
NATIVE_DURATION_MS=${WIRE_NATIVE_DURATION_MS:-12000}
WARMUP_MS=${WIRE_WARMUP_MS:-500}
MAX_P99=${WIRE_MAX_P99_RATIO:-5}
MIN_RATE=${WIRE_MIN_RATE_RATIO:-0.2}
SEND_VS_WRITE=${WIRE_SEND_VS_WRITE:-2}
SEND_WARMUP_MS=${WIRE_SEND_WARMUP_MS:-3500}
SEND_DURATION_MS=${WIRE_SEND_DURATION_MS:-6500}
ACK_TIMEOUT=18
SERVER_PORT=7771
SCENARIO=tests/vm/scenarios/wire-lat-vs-bw-softroce.toml
ADAPTIVE_SCENARIO=tests/vm/scenarios/wire-lat-vs-bw-adaptive-softroce.toml
TPUT_SCENARIO=tests/vm/scenarios/wire-tput-vs-bw-softroce.toml
READ_SCENARIO=tests/vm/scenarios/wire-read-vs-write-softroce.toml
INCAST_SCENARIO=tests/vm/scenarios/wire-incast-softroce.toml
PROBE_SCENARIO=tests/vm/scenarios/wire-lat-vs-write-and-send-softroce.toml
# The peer channel's port, and the daemons' loop under emulation as two-hosts.sh sets it:
# a READ guarantee not renewed for 40 RefPeriods lapses, which 5 ms RefPeriods (200 ms)
# survive on the emulated hosts and the packaged 500 us do not.
PEER_PORT=7472
PEER_REF_PERIOD_US=5000

LAST_RESULT=$SECONDS
result() { # STATUS NAME DETAIL
  printf '%s %s: %s (%d s)\n' "$1" "wire: $2" "$3" $((SECONDS - LAST_RESULT)) | tee -a "$RESULTS/results.txt"
  LAST_RESULT=$SECONDS
}
onb() { # SECONDS COMMAND
  python3 "$HERE/remote.py" run "$B_ADDR" 7770 "$1" "$2"
}
onc() { # SECONDS COMMAND
  python3 "$HERE/remote.py" run "$C_ADDR" 7770 "$1" "$2"
}

PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  onb 20 "pkill -KILL -f 'justitia run-server'; pkill -KILL -x justitia-loadgen; tc qdisc del dev eth0 ingress" > /dev/null 2>&1
  onc 20 "pkill -KILL -f 'justitia run-server'; pkill -KILL -x justitia-loadgen" > /dev/null 2>&1
  tc qdisc del dev eth0 root 2> /dev/null
  wait 2>/dev/null
}
trap 'cleanup; exit 124' TERM

# The verdict's lines of a run's output, on one line.
verdict_of() { # LOG
  sed -n '/^isolation verdict/,$p' "$1" | head -n 12 | tr -s ' ' | paste -sd ';' | cut -c1-900
}

# justitia run with the wire's settings and the strict verdict; its output in LOG, its
# status returned.
wire_run() { # LOG SCENARIO ONLY DURATION_MS REPEATS [OPTION...]
  local log=$1 scenario=$2 only=$3 duration=$4 repeats=$5 verdict
  shift 5
  # NO_P99 set: a scenario without latency flows, judged on rates only.
  verdict=(--min-rate-ratio "$MIN_RATE")
  [ -n "${NO_P99:-}" ] || verdict+=(--max-p99-ratio "$MAX_P99")
  timeout 1500 "$BIN/justitia" run "$scenario" -d "$A_DEV" -x "$GID" --ack-timeout "$ACK_TIMEOUT" \
    --host "b=$B_ADDR:$SERVER_PORT" --shaper "$LIB" --only "$only" \
    --duration-ms "$duration" --warmup-ms "${RUN_WARMUP_MS:-$WARMUP_MS}" --repeat "$repeats" --compare \
    "${verdict[@]}" --out "$log.out" "$@" > "$log" 2>&1
}

# The medians of the throughput victim's runs, from the spread table: its rate and the
# stream's beside it natively and under the daemon, each as a ratio to its rate alone.
tput_summary() { # LOG
  awk '$NF ~ /^[0-9.]+$/ && /rate \(msgs\/s\)/ {
      key = $0; sub(/ +(tput|bw) +rate.*/, "", key); gsub(/^ +/, "", key)
      flow = ($0 ~ / tput +rate/) ? "tput" : "bw"
      for (i = 1; i <= NF; i++) if ($i == "(msgs/s)") { m[key "/" flow] = $(i + 1); break }
    }
    END {
      a = m["alone/tput"]; b = m["bw alone/bw"]
      if (a > 0 && b > 0)
        printf "throughput flow %.0f msgs/s alone, %.0f beside the stream natively (x%.2f), %.0f under justitiad (x%.2f); the stream x%.2f natively, x%.2f under justitiad", a, m["with bw/tput"], m["with bw/tput"] / a, m["with bw + justitia/tput"], m["with bw + justitia/tput"] / a, m["with bw/bw"] / b, m["with bw + justitia/bw"] / b
      else printf "no spread table"
    }' "$1"
}

# The loop over a policy run's repeats, from justitia run's "justitiad's loop in" lines:
# "... N decreases in S s (R/s), SafeUtil LOW..HIGH Gb/s, Current99 up to C us, Target99 T us".
loop_of() { # LOG
  awk '/^justitiad.s loop in/ {
      for (i = 1; i < NF; i++) {
        if ($(i + 1) == "decreases" && $(i + 2) == "in") { cuts += $i; secs += $(i + 3) }
        if ($i == "SafeUtil") { split($(i + 1), r, "[.][.]"); if (low == "" || r[1] + 0 < low) low = r[1] + 0 }
        if ($i == "Target99") target = $(i + 1)
      }
    }
    END {
      if (secs > 0) printf "loop: %d decreases in %.1f s of runs (%.1f/s), SafeUtil down to %.5f Gb/s, Target99 %s us", cuts, secs, cuts / secs, low, target
      else printf "loop: no reading of the daemon"
    }' "$1"
}

# far_run_server RUN ADDR DEV DAEMON_DIR LOG_DIR: a `justitia run-server` on the host RUN
# (onb or onc) reaches, listening on ADDR, its shaped requesters following the justitiad
# of DAEMON_DIR when one runs there, its shaped processes' statistics in
# LOG_DIR/wire.stats; waits until it listens, or prints its log and fails.
far_run_server() {
  "$1" 30 "mkdir -p $5/wire.stats; (JUSTITIA_SOCKET=$4/justitiad.sock JUSTITIA_STATS=$5/wire.stats/%p.json \
      setsid $BIN/justitia run-server --listen $2:$SERVER_PORT -d $3 -x $GID \
      --ack-timeout $ACK_TIMEOUT --shaper $LIB > $5/wire.run-server.log 2>&1 &) ; \
      for i in \$(seq 100); do grep -q listening $5/wire.run-server.log && exit 0; sleep 0.2; done; \
      cat $5/wire.run-server.log; exit 1"
}

# --- the wire and the far end ---------------------------------------------------------
if ! tc qdisc add dev eth0 root tbf rate "$RATE" burst 16kb limit 300kb 2> "$L.tc.err"; then
  result FAIL "a token bucket of $RATE on A's eth0" "tc: $(head -c 300 "$L.tc.err")"
  exit 1
fi
# The run-server's shaped requesters follow B's justitiad when one runs (the READ section).
far_run_server onb "$B_ADDR" "$B_DEV" "$B_PEER_DIR" "$BLOGS" > "$L.server.start" 2>&1 \
  || { result FAIL "run-server on B" "$(tail -n 3 "$L.server.start" | tr '\n' ' ')"; cleanup; exit 1; }

# --- native: the strict verdict must fail ---------------------------------------------
# WIRE_ONLY=SECTION,... runs only those of native, justitia, adaptive, probe, tput, read and incast (to
# repeat them); the test command runs all.
wanted() { [ -z "${WIRE_ONLY:-}" ] || [[ ",$WIRE_ONLY," == *",$1,"* ]]; }

if wanted native; then
  NAME="the strict verdict fails natively (16 B ping-pong beside 64 KiB WRITEs on the $RATE wire, medians of $NATIVE_REPEAT)"
  wire_run "$L.native.log" "$SCENARIO" "alone,with bw" "$NATIVE_DURATION_MS" "$NATIVE_REPEAT"
  rc=$?
  # The verdict must fail, with the latency flow's p99 judged (100 samples or more): the
  # p99 ratio was x10.2 to x12 on quiet hosts and x5.6 on one loaded by other builds, whose
  # CPU load lifted the p99 alone; the rate fails by a factor of ten either way.
  if [ "$rc" != 0 ] && grep -q "^isolation verdict" "$L.native.log" && grep -qE "^ *FAIL " "$L.native.log" \
    && grep -qE "^ *(PASS|FAIL) lat .*p99" "$L.native.log"; then
    result PASS "$NAME" "$(verdict_of "$L.native.log")"
  else
    result FAIL "$NAME" "exit $rc (the p99 must be judged and the verdict fail): $(verdict_of "$L.native.log") $(tail -n 3 "$L.native.log" | tr '\n' ' ')"
  fi
fi

# --- under justitiad: justitia must pass, adaptive is reported ------------------------
# TAG names the logs (RESULTS/logs/wire.TAG.*); WHAT, when given, starts the result's name.
under_daemon() { # TAG POLICY SCENARIO ONLY STRICT(yes|no) REPEATS [WHAT]
  local tag=$1 policy=$2 scenario=$3 only=$4 strict=$5 repeats=$6 what=${7:-}
  local dir=/tmp/wire-daemon.$1 metrics=127.0.0.1:19470 rc loop name
  if [ "$strict" = yes ]; then
    name="the strict verdict passes under justitiad ($policy, medians of $repeats)"
  else
    name="under justitiad ($policy, medians of $repeats), reported"
  fi
  [ -n "$what" ] && name="$what, $name"
  mkdir -p "$dir"
  if ! daemon_config "$dir/justitiad.toml" "$dir/justitiad.sock" "$dir/admin.sock" "$metrics" \
    "device=\"$A_DEV\"" 'profile="softroce-wire"' 'target="1.5x"' "policy=\"$policy\""; then
    result FAIL "$name" "$DAEMON_ERR"
    return
  fi
  cp "$dir/justitiad.toml" "$L.$tag.justitiad.toml"
  daemon_start "$dir/justitiad.toml" "$L.$tag.justitiad.log"
  PIDS+=("$DAEMON_PID")
  if ! daemon_wait "$L.$tag.justitiad.log" "$dir/admin.sock" 60; then
    result FAIL "$name" "$DAEMON_ERR"
    return
  fi
  JUSTITIA_SOCKET=$dir/justitiad.sock wire_run "$L.$tag.log" "$scenario" "$only" "$DURATION_MS" "$repeats" \
    --daemon-metrics "$metrics" --plot "$L.$tag.plot"
  rc=$?
  "$BIN/justitia" status --socket "$dir/admin.sock" > "$L.$tag.status" 2>&1
  kill -TERM "$DAEMON_PID" 2> /dev/null
  wait "$DAEMON_PID" 2> /dev/null
  loop=$(loop_of "$L.$tag.log")
  if [ "$strict" = no ]; then
    if grep -q "^isolation verdict" "$L.$tag.log"; then
      result PASS "$name" "exit $rc: ${NO_P99:+$(tput_summary "$L.$tag.log"); }$(verdict_of "$L.$tag.log"); $loop"
    else
      result FAIL "$name" "exit $rc, no verdict: $(tail -n 3 "$L.$tag.log" | tr '\n' ' ')"
    fi
  elif [ "$rc" = 0 ] && grep -q "^isolation verdict" "$L.$tag.log" && grep -q "PASS lat .*p99" "$L.$tag.log"; then
    result PASS "$name" "$(verdict_of "$L.$tag.log"); $loop"
  else
    result FAIL "$name" "exit $rc: $(verdict_of "$L.$tag.log") $(tail -n 3 "$L.$tag.log" | tr '\n' ' '); $loop"
  fi
}
wanted justitia && under_daemon justitia justitia "$SCENARIO" "alone,bw alone,with bw + justitia" yes "$REPEAT"
wanted adaptive && under_daemon adaptive adaptive "$ADAPTIVE_SCENARIO" "alone,bw alone,with bw + adaptive" no "$ADAPTIVE_REPEAT"

# --- a throughput victim: reported -----------------------------------------------------
# Batches of 64 16 B WRITEs beside the same stream, every run of the scenario (native ones
# too: they do not follow the daemon) in one invocation under justitiad's justitia policy.
wanted tput && NO_P99=1 under_daemon tput justitia "$TPUT_SCENARIO" "alone,bw alone,with bw,with bw + justitia" no "$TPUT_REPEAT" \
  "a throughput victim (16 B WRITEs in batches of 64)"
# far_daemon RUN DIR DEV LOG_DIR TAG PEER_TABLE SETTING...: a justitiad on the host RUN (onb
# or onc) reaches, configured in DIR from the packaged file with SETTINGs and PEER_TABLE
# (its configuration copied to LOG_DIR/wire.TAG.justitiad.toml, its log beside it); prints
# why and fails when it did not start.
far_daemon() {
  local run=$1 dir=$2 dev=$3 logs=$4 tag=$5 table=$6
  shift 6
  "$run" 90 "cd $PWD && BIN=$BIN && source tests/vm/guest/daemon-lib.sh \
    && daemon_config $dir/justitiad.toml $dir/justitiad.sock $dir/admin.sock 127.0.0.1:19472 'device=\"$dev\"' ${*@Q} \
    && printf '%s' '$table' >> $dir/justitiad.toml \
    && cp $dir/justitiad.toml $logs/wire.$tag.justitiad.toml \
    && daemon_start $dir/justitiad.toml $logs/wire.$tag.justitiad.log \
    && daemon_wait $logs/wire.$tag.justitiad.log $dir/admin.sock 60 || { echo \$DAEMON_ERR; exit 1; }"
}

# flows_watch ADMIN_SOCKET: a script that prints that daemon's flows every 0.5 s, each
# non-empty list on a line of its own.
flows_watch() {
  cat << WATCH
while :; do
  $BIN/justitia flows --socket $1 --json 2> /dev/null \\
    | python3 -c 'import json, sys; flows = json.load(sys.stdin); flows and print(json.dumps(flows))'
  sleep 0.5
done
WATCH
}

# The peered daemons' settings: the testbed's profile and target, and the RefPeriod and
# probe timeout the pair's peer checks use under emulation.
PEER_SETTINGS=('profile="softroce-wire"' 'target="1.5x"' 'policy="justitia"' "ref_period_us=$PEER_REF_PERIOD_US" probe_timeout_ms=50)

# near_daemon DIR TAG METRICS MEMBERS: A's justitiad with PEER_SETTINGS and a [peer] table
# of MEMBERS, configured in DIR (copied to $L.TAG.justitiad.toml, its log beside it) and
# started (its pid in PIDS); fails with DAEMON_ERR set when it cannot be configured.
near_daemon() {
  daemon_config "$1/justitiad.toml" "$1/justitiad.sock" "$1/admin.sock" "$3" \
    "device=\"$A_DEV\"" "${PEER_SETTINGS[@]}" || return 1
  peer_config "$A_ADDR" "$1/peer.key" "$A_ADDR" "$PEER_PORT" 3000 "$4" >> "$1/justitiad.toml"
  cp "$1/justitiad.toml" "$L.$2.justitiad.toml"
  daemon_start "$1/justitiad.toml" "$L.$2.justitiad.log"
  PIDS+=("$DAEMON_PID")
}

# far_key RUN DIR: a key pair made on the host RUN reaches, kept in DIR; prints the public key.
far_key() {
  "$1" 30 "cd $PWD && BIN=$BIN && source tests/vm/guest/daemon-lib.sh && new_key $2"
}

# far_stop_daemon: B's justitiad stopped, and gone (its peer port free) when it returns.
far_stop_daemon() {
  onb 30 "pkill -TERM -x justitiad; for i in \$(seq 100); do pgrep -x justitiad > /dev/null || exit 0; sleep 0.1; done; \
    pkill -KILL -x justitiad" > /dev/null 2>&1
}

# probes_completed ADMIN_SOCKET: the probes that daemon has seen complete.
probes_completed() {
  "$BIN/justitia" status --socket "$1" 2> /dev/null | awk '/^probes/ {print $2; found = 1} END {if (!found) print 0}'
}

# pair_members A_DIR B_DIR: a key pair made on A (kept in A_DIR) and one made on B (in
# B_DIR); prints the [peer] table's members for both, or why not and fails.
pair_members() {
  local a_pub b_pub
  a_pub=$(new_key "$1")
  b_pub=$(far_key onb "$2")
  if [ -z "$a_pub" ] || [ -z "$b_pub" ]; then
    echo "a key pair was not made: A '$a_pub', B '$b_pub'"
    return 1
  fi
  echo "\"$A_ADDR\" = \"$a_pub\", \"$B_ADDR\" = \"$b_pub\""
}

# The same latency flow beside the same stream as SENDs, in the probe section's runs (its
# daemons peered): under the justitia policy `justitia run` starts both ends of the SEND
# stream under the shaper with JUSTITIA_TWO_SIDED=split, the daemons pair their queue
# pairs over the peer channel, and A's shaper splits each 64 KiB SEND into the policy's
# chunks against the credits of B's, which posts the responder's receives (20, fewer than
# a message's chunks) in parts. The responder posts its 20 receives before the two shapers
# agree, so the first 20 messages go whole (docs/architecture.md, "Entering the protocol
# mid-stream"): the section's runs last SEND_DURATION_MS (6.5 s), their first
# SEND_WARMUP_MS (3.5 s) not measured, which those take
# (tests/vm/scenarios/wire-lat-vs-write-and-send-softroce.toml). Checked, on the medians:
# the latency flow's p99 beside the SENDs is at most WIRE_SEND_VS_WRITE (2) times its p99
# beside the same stream as WRITEs (1.09 to 1.32 in seven sections: x2.78 to x3.36 of
# alone beside the SENDs, x2.35 to x2.75 beside the WRITEs; without the warm-up, 2.7:
# x11.1 against x4.05, a whole 64 KiB SEND holding the wire 65 ms), A's daemon found side
# channels for its queue pairs (justitia_pairings_found_total), and B's shapers armed the
# event-driven responders' receive CQs for solicited completions only (cq_arms_solicited
# in the run-server's statistics, $BLOGS/wire.stats/ on B), so that a responder wakes
# once per message and per half of a credited part rather than once per chunk. Both
# ratios to alone are reported (the probe section's verdict, itself reported, judges
# them against WIRE_MAX_P99_RATIO), and so are the SENDs A's shapers split against those
# that went whole before the two shapers agreed (their statistics in $L.probe.stats/): 22
# to 25 of 70 to 88 a run went whole, in about its first 3 s, and a 7 s warm-up left the
# ratio where it was (1.30), so those do not make it; and the waits for B's credit
# (credit_holds: 17 to 111 in three runs).
send_beside_write() {
  local name="the latency flow beside 64 KiB SENDs split between the paired shapers stays as near its p99 alone as beside the same WRITEs, under justitiad on A and B (justitia, medians of $PROBE_REPEAT)"
  local found alone send write detail sends
  found=$(awk '/^justitia_pairings_found_total/ {print $2}' "$L.probe.metrics")
  # The medians of the spread table: "   RUN  lat  p99 (us)  MEDIAN  MIN  MAX  SAMPLES".
  median_p99() { # RUN
    awk -v run="$1" 'index($0, "   " run " ") == 1 && / lat +p99 \(us\)/ {
      sub(/.*p99 \(us\) +/, ""); print $1; exit }' "$L.probe.log"
  }
  alone=$(median_p99 alone)
  send=$(median_p99 "with send + justitia")
  write=$(median_p99 "with bw + justitia")
  # The SEND streams' shapers: the agreed ones (a latency flow's or a WRITE stream's never
  # pairs).
  sends=$(python3 - "$L.probe.stats" <<'EOF' 2>&1
import glob, json, sys
requests = split = holds = runs = 0
for path in glob.glob(f"{sys.argv[1]}/*.json"):
    try:
        s = json.load(open(path))
    except (OSError, ValueError):
        continue
    if s.get("qps_agreed", 0) > 0:
        runs += 1
        requests += s.get("requests", 0)
        split += s.get("split_requests", 0)
        holds += s.get("credit_holds", 0)
print(f"{split} of {requests} SENDs split in {runs} runs' shapers, the rest whole before agreement; {holds} waits for B's credit")
EOF
  )
  # B's SEND responders wait for their receive CQ's events: their shapers arm it for
  # solicited completions only, so that they wake per message and credited part rather
  # than per 1 KiB chunk (docs/architecture.md, "Events").
  arms=$(onb 10 "cat $BLOGS/wire.stats/*.json 2>/dev/null" | grep -o '"cq_arms_solicited":[0-9]*' \
    | awk -F: '{n += $2} END {print n + 0}')
  detail="p99 ${send:-?} us beside the SENDs, ${write:-?} us beside the WRITEs, ${alone:-?} us alone; A's daemon found ${found:-no} side channels; $sends; B's shapers armed the responders' receive CQs for solicited completions $arms times"
  if [ -z "$alone" ] || [ -z "$send" ] || [ -z "$write" ]; then
    result FAIL "$name" "$detail ($(tail -n 2 "$L.probe.log" | tr '\n' ' '))"
  elif ! awk -v s="$send" -v w="$write" -v k="$SEND_VS_WRITE" 'BEGIN {exit !(s <= k * w)}'; then
    result FAIL "$name" "more than $SEND_VS_WRITE times its p99 beside the WRITEs: $detail"
  elif ! awk -v f="${found:-0}" 'BEGIN {exit !(f >= 1)}'; then
    result FAIL "$name" "the SEND stream's queue pairs were never paired: $detail"
  elif [ "$arms" -lt 1 ]; then
    result FAIL "$name" "B's shapers never armed the SEND responders' receive CQs for solicited completions: $detail"
  else
    result PASS "$name" "$(awk -v s="$send" -v w="$write" -v a="$alone" 'BEGIN {printf "x%.2f of alone beside the SENDs, x%.2f beside the WRITEs", s / a, w / a}'); $detail"
  fi
}

# --- the reference flow across the wire: reported ---------------------------------------
# As the justitia section, with A's justitiad peered with B's and its reference flow
# crossing the wire to a queue pair B's daemon makes for it (peer.probe_to; Justitia
# §4.2.1 sends it to another host): the probes queue at A's bucket as the latency flow's
# requests do, and Target99 is 1.5 x their idle p99 across the wire, measured again when
# the probe moved there. The probe timeout is 100 ms, past the bucket's backlog (73 ms).
# RefPeriod is 5 ms: at the paper's 500 us the probe's 2 000 WRITEs a second took about
# 1.1 Mbit/s of the 8 with their headers and doubled the latency flow's p99 alone (6.98
# against 3.4 ms); at 5 ms they take 1.4 % of the wire (the paper's 500 us on 100 Gb/s
# take a millionth).
# Checked: A's daemon says its probes cross the wire (its status and its
# justitia_probe_across_wire metric) and measured its target there. Reported: the verdict
# and the loop.
wire_probe() {
  local adir=/tmp/wire-probe.a bdir=$B_PEER_DIR metrics=127.0.0.1:19474 members rc loop
  local name="the reference flow crosses the wire to B's justitiad, under justitiad on A and B (justitia, medians of $PROBE_REPEAT), reported"
  if ! members=$(pair_members "$adir" "$bdir"); then
    result FAIL "$name" "$members"
    return
  fi
  if ! far_daemon onb "$bdir" "$B_DEV" "$BLOGS" probe \
    "$(peer_config "$B_ADDR" "$bdir/peer.key" "$B_ADDR" "$PEER_PORT" 3000 "$members")" 'profile="softroce-wire"' \
    > "$L.probe.b-daemon" 2>&1; then
    result FAIL "$name" "B's justitiad did not start: $(tail -n 2 "$L.probe.b-daemon" | tr '\n' ' ')"
    return
  fi
  if ! daemon_config "$adir/justitiad.toml" "$adir/justitiad.sock" "$adir/admin.sock" "$metrics" \
    "device=\"$A_DEV\"" 'profile="softroce-wire"' 'target="1.5x"' 'policy="justitia"' probe_timeout_ms=100 ref_period_us=5000; then
    result FAIL "$name" "$DAEMON_ERR"
    return
  fi
  { peer_config "$A_ADDR" "$adir/peer.key" "$A_ADDR" "$PEER_PORT" 3000 "$members"
    printf 'probe_to = "%s"\n' "$B_ADDR"; } >> "$adir/justitiad.toml"
  cp "$adir/justitiad.toml" "$L.probe.justitiad.toml"
  daemon_start "$adir/justitiad.toml" "$L.probe.justitiad.log"
  PIDS+=("$DAEMON_PID")
  if ! daemon_wait "$L.probe.justitiad.log" "$adir/admin.sock" 60; then
    result FAIL "$name" "A's justitiad: $DAEMON_ERR"
    return
  fi
  # The probe moves to the wire once B's daemon answers A's offer: a handshake and a
  # datagram each way, then the idle p99 is measured there (100 probes).
  local i
  for i in $(seq 100); do
    grep -q "Target99 measured" <(sed -n '/reference flow crosses the wire/,$p' "$L.probe.justitiad.log") && break
    sleep 0.1
  done
  "$BIN/justitia" status --socket "$adir/admin.sock" > "$L.probe.status.before" 2>&1
  # With the SEND stream's run (see send_beside_write), each run warmed up long enough for
  # the SENDs that go whole before the two shapers agree.
  mkdir -p "$L.probe.stats"
  JUSTITIA_STATS="$L.probe.stats/%p.json" JUSTITIA_SOCKET=$adir/justitiad.sock RUN_WARMUP_MS=$SEND_WARMUP_MS \
    wire_run "$L.probe.log" "$PROBE_SCENARIO" \
    "alone,bw alone,with bw + justitia,with send + justitia" \
    "$SEND_DURATION_MS" "$PROBE_REPEAT" --daemon-metrics "$metrics" --plot "$L.probe.plot"
  rc=$?
  "$BIN/justitia" status --socket "$adir/admin.sock" > "$L.probe.status" 2>&1
  curl -s "http://$metrics/metrics" > "$L.probe.metrics" 2>&1
  send_beside_write
  # B's justitiad restarts (a new process: no session, a new responder): A's channel
  # handshakes again, B answers A's refreshed offer, A makes its requester again for the
  # new answer and connects it, and the probes of a short run cross the wire again.
  local again=FAIL detail before after
  far_stop_daemon
  if far_daemon onb "$bdir" "$B_DEV" "$BLOGS" probe-again \
    "$(peer_config "$B_ADDR" "$bdir/peer.key" "$B_ADDR" "$PEER_PORT" 3000 "$members")" 'profile="softroce-wire"' \
    > "$L.probe.b-again" 2>&1; then
    for i in $(seq 200); do
      grep -q "connected across the wire again" "$L.probe.justitiad.log" && break
      sleep 0.1
    done
    # The probes run while a latency flow is registered: the shaped run's.
    before=$(probes_completed "$adir/admin.sock")
    JUSTITIA_SOCKET=$adir/justitiad.sock wire_run "$L.probe.again.log" "$SCENARIO" "with bw + justitia" 2000 1
    after=$(probes_completed "$adir/admin.sock")
    detail="connected again after $((i / 10)).$((i % 10)) s ($(grep -c "connected across the wire again" "$L.probe.justitiad.log") time); $((after - before)) probes completed in a 2 s run after it ($before before, $after after)"
    # Probes complete again at all (none would through a requester left connected to the
    # old responder); how many depends on the emulated hosts' load: 156 to 331 so far.
    grep -q "connected across the wire again" "$L.probe.justitiad.log" && [ $((after - before)) -ge 20 ] && again=PASS
  else
    detail="B's justitiad did not start again: $(tail -n 2 "$L.probe.b-again" | tr '\n' ' ')"
  fi
  result "$again" "A's reference flow crosses the wire again after B's justitiad restarts" "$detail"
  # B's daemon is gone before the next section starts one with the same peer port.
  far_stop_daemon
  kill -TERM "$DAEMON_PID" 2> /dev/null
  wait "$DAEMON_PID" 2> /dev/null
  loop=$(loop_of "$L.probe.log")
  local idle
  idle=$(sed -n '/reference flow crosses the wire/,$p' "$L.probe.justitiad.log" | grep -m1 "Target99 measured" \
    | grep -oE "idle_p99_us=[0-9.]+" | cut -d= -f2)
  if ! grep -q "wire to $B_ADDR" "$L.probe.status"; then
    result FAIL "$name" "A's status does not say its probes cross the wire: $(grep probes "$L.probe.status")"
  elif ! grep -q "^justitia_probe_across_wire 1" "$L.probe.metrics"; then
    result FAIL "$name" "A's metrics do not say its probes cross the wire: $(grep probe_across "$L.probe.metrics")"
  elif [ -z "$idle" ]; then
    result FAIL "$name" "A's daemon measured no Target99 across the wire: $(grep -E "wire|Target99" "$L.probe.justitiad.log" | tail -n 3 | tr '\n' ' ')"
  elif grep -q "^isolation verdict" "$L.probe.log"; then
    result PASS "$name" "exit $rc: idle p99 across the wire ${idle} us ($(grep -m1 "^Target99" "$L.probe.status.before" | tr -s ' ')); $(verdict_of "$L.probe.log"); $loop"
  else
    result FAIL "$name" "exit $rc, no verdict: $(tail -n 3 "$L.probe.log" | tr '\n' ' ')"
  fi
}
wanted probe && wire_probe

# --- a remote READ beside a local WRITE: reported ----------------------------------------
# B READs 64 KiB from A while A WRITEs 64 KiB to B, four times as many outstanding: the
# READ responses and the WRITEs both leave A through its bucket. Natively the READ
# responses took most of it in every run so far, the WRITEs' four times as many requests
# outstanding notwithstanding (the WRITEs kept x0.26 of their rate alone, the READs x0.74;
# the model shares it evenly); under justitiad on both hosts, peered (each host's key
# made there, members A and B), A's daemon counts B's READs among the flows of its own
# wire and grants them their share over the peer channel, and B's shaper paces them to
# it (Justitia §6.6).
# Reported: the READs' rate alone, beside the WRITEs natively and under the daemons, as a
# share of the guarantee (half of A's MaxRate, the SoftRoCE-wire profile's 0.00757 Gb/s),
# and the largest guarantee B's daemon showed for them.
read_beside_write() {
  local adir=/tmp/wire-peer.a bdir=$B_PEER_DIR metrics=127.0.0.1:19472 members rc
  local name="a remote READ beside a local WRITE, under justitiad on A and B (justitia, medians of $READ_REPEAT), reported"
  if ! members=$(pair_members "$adir" "$bdir"); then
    result FAIL "$name" "$members"
    return
  fi
  if ! near_daemon "$adir" read "$metrics" "$members"; then
    result FAIL "$name" "$DAEMON_ERR"
    return
  fi
  if ! far_daemon onb "$bdir" "$B_DEV" "$BLOGS" read \
    "$(peer_config "$B_ADDR" "$bdir/peer.key" "$B_ADDR" "$PEER_PORT" 3000 "$members")" "${PEER_SETTINGS[@]}" \
    > "$L.read.b-daemon" 2>&1; then
    result FAIL "$name" "B's justitiad did not start: $(tail -n 2 "$L.read.b-daemon" | tr '\n' ' ')"
    return
  fi
  if ! daemon_wait "$L.read.justitiad.log" "$adir/admin.sock" 60; then
    result FAIL "$name" "A's justitiad: $DAEMON_ERR"
    return
  fi
  # B's flows every 0.5 s while the runs go, read on B: the READ flow's guarantee, as B's
  # daemon holds it.
  flows_watch "$bdir/admin.sock" > "$BLOGS/wire.read.watch.sh"
  onb 10 "(setsid bash $BLOGS/wire.read.watch.sh > $BLOGS/wire.read.b-flows 2>&1 &)" > /dev/null 2>&1
  NO_P99=1 JUSTITIA_SOCKET=$adir/justitiad.sock wire_run "$L.read.log" "$READ_SCENARIO" \
    "read alone,write alone,together,together + justitia" "$DURATION_MS" "$READ_REPEAT" \
    --daemon-metrics "$metrics"
  rc=$?
  onb 20 "pkill -f $BLOGS/wire.read.watch.sh; pkill -TERM -x justitiad" > /dev/null 2>&1
  kill -TERM "$DAEMON_PID" 2> /dev/null
  wait "$DAEMON_PID" 2> /dev/null
  if grep -q "^isolation verdict" "$L.read.log"; then
    result PASS "$name" "exit $rc: $(read_summary "$L.read.log" "$BLOGS/wire.read.b-flows"); $(verdict_of "$L.read.log")"
  else
    result FAIL "$name" "exit $rc, no verdict: $(tail -n 3 "$L.read.log" | tr '\n' ' ')"
  fi
}

# The READs' medians from the spread table, 64 KiB each, against their guarantee (half of
# the SoftRoCE-wire profile's MaxRate, 0.00757 Gb/s), and the largest guarantee B's daemon
# showed for a flow reading from A.
read_summary() { # LOG B_FLOWS
  local seen
  seen=$(python3 -c '
import json, sys
best = None
for line in open(sys.argv[1]):
    try:
        flows = json.loads(line)
    except ValueError:
        continue
    for f in flows if isinstance(flows, list) else []:
        g = f.get("read_guarantee_bytes_per_sec")
        if isinstance(g, (int, float)) and "reads from" in str(f.get("remote")):
            best = g if best is None else max(best, g)
print("none seen" if best is None else "%.0f B/s" % best)' "$2" 2> /dev/null)
  awk -v seen="${seen:-none seen}" '$NF ~ /^[0-9.]+$/ && /rate \(msgs\/s\)/ {
      key = $0; sub(/ +(read|write) +rate.*/, "", key); gsub(/^ +/, "", key)
      flow = ($0 ~ / read +rate/) ? "read" : "write"
      for (i = 1; i <= NF; i++) if ($i == "(msgs/s)") { m[key "/" flow] = $(i + 1); break }
    }
    END {
      g = 0.00757e9 / 8 / 2 / 65536
      r = m["read alone/read"]; w = m["write alone/write"]
      if (r > 0 && w > 0)
        printf "READs %.2f msgs/s alone, %.2f beside the WRITEs natively, %.2f under the daemons (x%.2f of the guarantee, %.2f msgs/s); the WRITEs x%.2f natively, x%.2f under the daemons; guarantee on B: %s", r, m["together/read"], m["together + justitia/read"], m["together + justitia/read"] / g, g, m["together/write"] / w, m["together + justitia/write"] / w, seen
      else printf "no spread table; guarantee on B: %s", seen
    }' "$1"
}
wanted read && read_beside_write

# --- incast: two senders into B, each at its share: reported ----------------------------
# The bucket moves from A's side to B's: B's eth0 ingress is redirected to ifb0, whose
# root qdisc is the same token bucket, so A's and C's traffic into B (they meet in B's
# emulator) queues there together, and A's pings to B wait behind both streams. Natively
# the streams share the bucket as its queue serves them; under justitiad on the three
# hosts, peered (each host's key made there), A's and C's daemons declare their flows
# into B, B's daemon counts one incast unit per sending host, tenant and class (A's
# pings, A's stream, C's stream: three of weight 1) and grants each a third of its
# MaxRate (Justitia §6.7: the pings' unit keeps its part of the link free of streams),
# and each sender's shaper paces its stream to at most that. Reported: each sender's
# measured rate natively and under the daemons, against the grant; the pings' p99 beside
# the incast as a ratio to their p99 alone; the allotments A's and C's daemons gave the
# streams into B.
incast() {
  local adir=/tmp/wire-incast.a bdir=/tmp/wire-incast.b cdir=$C_PEER_DIR metrics=127.0.0.1:19473
  local a_pub b_pub c_pub members rc far
  local name="incast, A and C WRITE into B through B's $RATE bucket beside A's pings, under justitiad on A, B and C (justitia, medians of $INCAST_REPEAT), reported"
  tc qdisc del dev eth0 root 2> /dev/null
  # An earlier section's daemon on B has its peer port until it is gone.
  far_stop_daemon
  if ! onb 20 "ip link set ifb0 up && tc qdisc add dev eth0 handle ffff: ingress \
      && tc filter add dev eth0 parent ffff: matchall action mirred egress redirect dev ifb0 \
      && tc qdisc add dev ifb0 root tbf rate $RATE burst 16kb limit 300kb" > "$L.incast.tc" 2>&1; then
    result FAIL "$name" "B's ingress bucket: $(head -c 300 "$L.incast.tc" | tr '\n' ' ')"
    return
  fi
  # C's run-server: the requester of C's stream; its shaped requesters follow C's daemon.
  if ! far_run_server onc "$C_ADDR" "$C_DEV" "$cdir" "$CLOGS" > "$L.incast.c-server" 2>&1; then
    result FAIL "$name" "run-server on C: $(tail -n 3 "$L.incast.c-server" | tr '\n' ' ')"
    return
  fi
  a_pub=$(new_key "$adir")
  b_pub=$(far_key onb "$bdir")
  c_pub=$(far_key onc "$cdir")
  if [ -z "$a_pub" ] || [ -z "$b_pub" ] || [ -z "$c_pub" ]; then
    result FAIL "$name" "a key pair was not made: A '$a_pub', B '$b_pub', C '$c_pub'"
    return
  fi
  members="\"$A_ADDR\" = \"$a_pub\", \"$B_ADDR\" = \"$b_pub\", \"$C_ADDR\" = \"$c_pub\""
  if ! near_daemon "$adir" incast "$metrics" "$members"; then
    result FAIL "$name" "$DAEMON_ERR"
    return
  fi
  for far in "onb $bdir $B_DEV $BLOGS $B_ADDR" "onc $cdir $C_DEV $CLOGS $C_ADDR"; do
    set -- $far
    if ! far_daemon "$1" "$2" "$3" "$4" incast \
      "$(peer_config "$5" "$2/peer.key" "$5" "$PEER_PORT" 3000 "$members")" "${PEER_SETTINGS[@]}" \
      > "$L.incast.$1-daemon" 2>&1; then
      result FAIL "$name" "the daemon by $1 did not start: $(tail -n 2 "$L.incast.$1-daemon" | tr '\n' ' ')"
      return
    fi
  done
  if ! daemon_wait "$L.incast.justitiad.log" "$adir/admin.sock" 60; then
    result FAIL "$name" "A's justitiad: $DAEMON_ERR"
    return
  fi
  # A's and C's flows every 0.5 s while the runs go, each read on its host: the streams'
  # allotments into B.
  flows_watch "$adir/admin.sock" > "$L.incast.watch.sh"
  (setsid bash "$L.incast.watch.sh" > "$L.incast.a-flows" 2>&1 &)
  flows_watch "$cdir/admin.sock" > "$CLOGS/wire.incast.watch.sh"
  onc 10 "(setsid bash $CLOGS/wire.incast.watch.sh > $CLOGS/wire.incast.c-flows 2>&1 &)" > /dev/null 2>&1
  JUSTITIA_SOCKET=$adir/justitiad.sock wire_run "$L.incast.log" "$INCAST_SCENARIO" \
    "alone,with incast,with incast + justitia" "$DURATION_MS" "$INCAST_REPEAT" \
    --host "c=$C_ADDR:$SERVER_PORT" --daemon-metrics "$metrics"
  rc=$?
  pkill -f "$L.incast.watch.sh"
  onc 20 "pkill -f $CLOGS/wire.incast.watch.sh; pkill -TERM -x justitiad" > /dev/null 2>&1
  onb 20 "pkill -TERM -x justitiad; tc -s qdisc show dev ifb0 > $BLOGS/wire.incast.tc.stats 2>&1; tc qdisc del dev eth0 ingress" > /dev/null 2>&1
  kill -TERM "$DAEMON_PID" 2> /dev/null
  wait "$DAEMON_PID" 2> /dev/null
  if grep -q "^isolation verdict" "$L.incast.log"; then
    result PASS "$name" "exit $rc: $(incast_summary "$L.incast.log" "$L.incast.a-flows" "$CLOGS/wire.incast.c-flows")"
  else
    result FAIL "$name" "exit $rc, no verdict: $(tail -n 3 "$L.incast.log" | tr '\n' ' ')"
  fi
}

# The incast's medians from the spread table: the pings' p99 and each stream's rate (64 KiB
# messages) natively and under the daemons, against the grant (a third of B's MaxRate, the
# SoftRoCE-wire profile's 0.00757 Gb/s), with the pings' sample counts; and the allotments
# each sender's daemon showed for its flow sending to B.
incast_summary() { # LOG A_FLOWS C_FLOWS
  python3 - "$@" <<'EOF'
import json, re, statistics, sys
log, a_flows, c_flows = sys.argv[1:]
grant = 0.00757e9 / 8 / 3 / 65536
row = re.compile(r"^\s+(?P<run>\S.*?)\s{2,}(?P<flow>lat|wa|wc)\s+(?P<fig>rate \(msgs/s\)|p99 \(us\))"
                 r"\s+(?P<median>[0-9.]+)\s+[0-9.]+\s+[0-9.]+(?:\s+(?P<n>[0-9]+))?")
m, n = {}, {}
try:
    text = open(log).read()
except OSError as e:
    print(f"unreadable: {e}")
    sys.exit()
# The spread table only: it ends at its first blank line (the comparison with the model,
# further on, has rows of the same shape).
spread = text.split("each figure is the median of", 1)
for line in (spread[1] if len(spread) > 1 else "").splitlines()[1:]:
    if not line.strip():
        break
    r = row.match(line)
    if r:
        key = (r["run"].strip(), r["flow"], r["fig"][:3])
        m[key] = float(r["median"])
        n[key] = r["n"]
def allotments(path):
    seen = []
    try:
        lines = open(path).read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            flows = json.loads(line)
        except ValueError:
            continue
        for f in flows if isinstance(flows, list) else []:
            a = f.get("allot_bytes_per_sec")
            if isinstance(a, (int, float)) and "sends to 10.77.0.2" in str(f.get("remote")):
                seen.append(a)
    if not seen:
        return "none seen"
    return "%.0f B/s (%.0f..%.0f, %d reads)" % (statistics.median(seen), min(seen), max(seen), len(seen))
p = lambda run: m.get((run, "lat", "p99"))
r = lambda run, flow: m.get((run, flow, "rat"))
s = lambda run: n.get((run, "lat", "p99")) or "?"
alone, native, daemons = p("alone"), p("with incast"), p("with incast + justitia")
rates = [r(v, f) for v in ("with incast", "with incast + justitia") for f in ("wa", "wc")]
if None in (alone, native, daemons) or None in rates:
    print(f"no spread table (seen {sorted(m)})")
    sys.exit()
print(f"pings' p99 {alone:.0f} us alone [n={s('alone')}], {native:.0f} us beside the incast natively "
      f"(x{native / alone:.2f}) [n={s('with incast')}], {daemons:.0f} us under the daemons "
      f"(x{daemons / alone:.2f}) [n={s('with incast + justitia')}]; "
      f"A's stream {rates[0]:.2f} msgs/s natively, {rates[2]:.2f} under the daemons "
      f"(x{rates[2] / grant:.2f} of the grant, {grant:.2f} msgs/s); "
      f"C's {rates[1]:.2f} and {rates[3]:.2f} (x{rates[3] / grant:.2f}); "
      f"allotments into B, median of the reads: on A {allotments(a_flows)}, on C {allotments(c_flows)}")
EOF
}
wanted incast && incast

tc -s qdisc show dev eth0 > "$L.tc.stats" 2>&1
cleanup
exit 0
