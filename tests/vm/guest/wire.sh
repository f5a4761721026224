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
#   tput       a throughput victim (batches of 64 16 B WRITEs) alone, the stream alone,
#              both natively and under justitiad's justitia policy, WIRE_TPUT_REPEAT (3)
#              times (tests/vm/scenarios/wire-tput-vs-bw-softroce.toml): each one's rate
#              beside the other as a ratio to its rate alone, reported;
#   read       B READs from A beside A's WRITEs to B, natively and under justitiad on both
#              hosts joined by the peer channel, WIRE_READ_REPEAT (3) times
#              (tests/vm/scenarios/wire-read-vs-write-softroce.toml): the READs' rate
#              against the guarantee A's daemon grants them, reported.
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
L=$LOGS/wire
mkdir -p "$LOGS" "$BLOGS"
touch "$RESULTS/results.txt"
# shellcheck source=tests/vm/guest/daemon-lib.sh
source "$HERE/daemon-lib.sh"

A_DEV=rxea B_DEV=rxeb
A_ADDR=10.77.0.1 B_ADDR=10.77.0.2
B_PEER_DIR=/tmp/wire-peer.b
GID=1
RATE=${WIRE_RATE:-8mbit}
REPEAT=${WIRE_REPEAT:-5}
ADAPTIVE_REPEAT=${WIRE_ADAPTIVE_REPEAT:-3}
NATIVE_REPEAT=${WIRE_NATIVE_REPEAT:-3}
TPUT_REPEAT=${WIRE_TPUT_REPEAT:-3}
READ_REPEAT=${WIRE_READ_REPEAT:-3}
DURATION_MS=${WIRE_DURATION_MS:-4000}
NATIVE_DURATION_MS=${WIRE_NATIVE_DURATION_MS:-12000}
WARMUP_MS=${WIRE_WARMUP_MS:-500}
MAX_P99=${WIRE_MAX_P99_RATIO:-5}
MIN_RATE=${WIRE_MIN_RATE_RATIO:-0.2}
ACK_TIMEOUT=18
SERVER_PORT=7771
SCENARIO=tests/vm/scenarios/wire-lat-vs-bw-softroce.toml
ADAPTIVE_SCENARIO=tests/vm/scenarios/wire-lat-vs-bw-adaptive-softroce.toml
TPUT_SCENARIO=tests/vm/scenarios/wire-tput-vs-bw-softroce.toml
READ_SCENARIO=tests/vm/scenarios/wire-read-vs-write-softroce.toml
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

PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  onb 20 "pkill -KILL -f 'justitia run-server'; pkill -KILL -x justitia-loadgen" > /dev/null 2>&1
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
    --duration-ms "$duration" --warmup-ms "$WARMUP_MS" --repeat "$repeats" --compare \
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

# --- the wire and the far end ---------------------------------------------------------
if ! tc qdisc add dev eth0 root tbf rate "$RATE" burst 16kb limit 300kb 2> "$L.tc.err"; then
  result FAIL "a token bucket of $RATE on A's eth0" "tc: $(head -c 300 "$L.tc.err")"
  exit 1
fi
# The run-server's shaped requesters follow B's justitiad when one runs (the READ section).
onb 20 "(JUSTITIA_SOCKET=$B_PEER_DIR/justitiad.sock setsid $BIN/justitia run-server --listen $B_ADDR:$SERVER_PORT -d $B_DEV -x $GID --ack-timeout $ACK_TIMEOUT \
  --shaper $LIB > $BLOGS/wire.run-server.log 2>&1 &) ; for i in \$(seq 100); do grep -q listening $BLOGS/wire.run-server.log && exit 0; sleep 0.2; done; \
  cat $BLOGS/wire.run-server.log; exit 1" > "$L.server.start" 2>&1 \
  || { result FAIL "run-server on B" "$(tail -n 3 "$L.server.start" | tr '\n' ' ')"; cleanup; exit 1; }

# --- native: the strict verdict must fail ---------------------------------------------
# WIRE_ONLY=SECTION,... runs only those of native, justitia, adaptive, tput and read (to
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
  local adir=/tmp/wire-peer.a bdir=$B_PEER_DIR metrics=127.0.0.1:19472 a_pub b_pub members rc
  local name="a remote READ beside a local WRITE, under justitiad on A and B (justitia, medians of $READ_REPEAT), reported"
  local settings=('profile="softroce-wire"' 'target="1.5x"' 'policy="justitia"' "ref_period_us=$PEER_REF_PERIOD_US" probe_timeout_ms=50)
  a_pub=$(new_key "$adir")
  b_pub=$(onb 30 "cd $PWD && BIN=$BIN && source tests/vm/guest/daemon-lib.sh && new_key $bdir")
  if [ -z "$a_pub" ] || [ -z "$b_pub" ]; then
    result FAIL "$name" "a key pair was not made: A '$a_pub', B '$b_pub'"
    return
  fi
  members="\"$A_ADDR\" = \"$a_pub\", \"$B_ADDR\" = \"$b_pub\""
  if ! daemon_config "$adir/justitiad.toml" "$adir/justitiad.sock" "$adir/admin.sock" "$metrics" \
    "device=\"$A_DEV\"" "${settings[@]}"; then
    result FAIL "$name" "$DAEMON_ERR"
    return
  fi
  peer_config "$A_ADDR" "$adir/peer.key" "$A_ADDR" "$PEER_PORT" 3000 "$members" >> "$adir/justitiad.toml"
  cp "$adir/justitiad.toml" "$L.read.justitiad.toml"
  daemon_start "$adir/justitiad.toml" "$L.read.justitiad.log"
  PIDS+=("$DAEMON_PID")
  if ! onb 90 "cd $PWD && BIN=$BIN && source tests/vm/guest/daemon-lib.sh \
    && daemon_config $bdir/justitiad.toml $bdir/justitiad.sock $bdir/admin.sock 127.0.0.1:19472 'device=\"$B_DEV\"' ${settings[*]@Q} \
    && printf '%s' '$(peer_config "$B_ADDR" "$bdir/peer.key" "$B_ADDR" "$PEER_PORT" 3000 "$members")' >> $bdir/justitiad.toml \
    && cp $bdir/justitiad.toml $BLOGS/wire.read.justitiad.toml \
    && daemon_start $bdir/justitiad.toml $BLOGS/wire.read.justitiad.log \
    && daemon_wait $BLOGS/wire.read.justitiad.log $bdir/admin.sock 60 || { echo \$DAEMON_ERR; exit 1; }" > "$L.read.b-daemon" 2>&1; then
    result FAIL "$name" "B's justitiad did not start: $(tail -n 2 "$L.read.b-daemon" | tr '\n' ' ')"
    return
  fi
  if ! daemon_wait "$L.read.justitiad.log" "$adir/admin.sock" 60; then
    result FAIL "$name" "A's justitiad: $DAEMON_ERR"
    return
  fi
  # B's flows every 0.5 s while the runs go, read on B: the READ flow's guarantee, as B's
  # daemon holds it (each non-empty list on a line of its own).
  cat > "$BLOGS/wire.read.watch.sh" << WATCH
while :; do
  $BIN/justitia flows --socket $bdir/admin.sock --json 2> /dev/null \\
    | python3 -c 'import json, sys; flows = json.load(sys.stdin); flows and print(json.dumps(flows))'
  sleep 0.5
done
WATCH
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

tc -s qdisc show dev eth0 > "$L.tc.stats" 2>&1
cleanup
exit 0
