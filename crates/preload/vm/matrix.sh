#!/bin/bash
# The shaper on real verbs: runs unmodified tools (server and client in one Soft-RoCE guest)
# without the shaper, under it observing, and under it shaping, and prints one line per run
# to OUT/results.txt: verdict, tool and options, mode, exit codes, seconds, the figure the
# tool reports, and the shaper's counters (JUSTITIA_STATS) of each side.
#
# Run inside the guest, from the repository root (build on the host first):
#   cargo build --release -p justitia-preload --example rate_probe
#   cargo build --release -p justitia-integrity
#   tests/vm/guest.sh --timeout 3600 --out DIR -- crates/preload/vm/matrix.sh DIR
#
# Usage: matrix.sh OUT [SECTION...]; sections: tools split probe integrity (default: all).
# Environment: LIB, PROBE, INTEGRITY (paths, default under target/release), ITERS (-n for
# every tool, default: the tools' own), TMO (seconds per side, default 300).
#
# A perftest run that fails only because perftest could not calibrate its cycle counter
# ("Correlation coefficient ... < 0.9", common under emulation) is retried up to twice;
# the line says so.
set -u
out=$1
shift
sections=${*:-tools split probe integrity}
lib=${LIB:-$PWD/target/release/libjustitia.so}
probe=${PROBE:-$PWD/target/release/examples/rate_probe}
integrity=${INTEGRITY:-$PWD/target/release/justitia-integrity}
mkdir -p "$out/logs"
res=$out/results.txt
port=20000
addr=$(ip -6 -o addr show dev veth0 scope link | awk '{print $4}' | cut -d/ -f1)

# The shaper settings of each mode.
settings() {
  case $1 in
    none) ;;
    observe) echo "LD_PRELOAD=$lib" ;;
    bandwidth) echo "LD_PRELOAD=$lib JUSTITIA_CLASS=bandwidth" ;;
    bw64k) echo "LD_PRELOAD=$lib JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=64K" ;;
    bw5k) echo "LD_PRELOAD=$lib JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=5K" ;;
    preempt) echo "LD_PRELOAD=$lib JUSTITIA_CLASS=bandwidth JUSTITIA_POLICY=preempt" ;;
    rate5m) echo "LD_PRELOAD=$lib JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=64K JUSTITIA_RATE=5M" ;;
    rate2m) echo "LD_PRELOAD=$lib JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=64K JUSTITIA_RATE=2M" ;;
    ops1k) echo "LD_PRELOAD=$lib JUSTITIA_CLASS=throughput JUSTITIA_RATE=1G:1K" ;;
    auto) echo "LD_PRELOAD=$lib JUSTITIA_CLASS=auto JUSTITIA_CHUNK=64K" ;;
    *) echo "matrix.sh: unknown mode $1" >&2; return 1 ;;
  esac
}

wait_listen() {
  for _ in $(seq 300); do
    ss -ltnH "sport = :$1" | grep -q . && return 0
    sleep 0.1
  done
  return 1
}

# The figure a tool reports: perftest's result row, ibv_rc_pingpong's rate, the checker's
# or the probe's verdict line.
figure() {
  awk '/^[ \t]*[0-9]+[ \t]+[0-9]+[ \t]+[0-9.]+[ \t]+[0-9.]+/ {r=$0}
       /iters in/ {r=$0} /PASS:|FAIL:|rate_probe:/ {r=$0}
       END {gsub(/[ \t]+/, " ", r); print substr(r, 1, 100)}' "$1"
}

counters() {
  local f
  for f in "$out"/logs/"$1".*.json; do
    [ -f "$f" ] && printf '%s ' "$(tr -d '\n' < "$f")"
  done
}

# run NAME KIND SERVER CLIENT MODE...: KIND is tcp (wait for the server's port), cm (rdma_cm,
# give the server a moment) or solo (CLIENT only). PORT in a command becomes a fresh port.
run() {
  local name=$1 kind=$2 server=$3 client=$4 mode
  shift 4
  for mode in "$@"; do
    local tag=$name.$mode note="" attempt verdict src crc t0 t1 env
    env=$(settings "$mode") || continue
    for attempt in 1 2 3; do
      port=$((port + 1))
      rm -f "$out"/logs/"$tag".*
      local s=${server//PORT/$port} c=${client//PORT/$port}
      local e="$env"
      [ -n "$e" ] && e="$e JUSTITIA_STATS=$out/logs/$tag.%p.json"
      t0=$(date +%s.%N)
      src=0
      if [ "$kind" != solo ]; then
        env $e timeout -k 5 "${TMO:-300}" $s > "$out/logs/$tag.server.log" 2>&1 &
        local spid=$!
        if [ "$kind" = tcp ]; then
          wait_listen "$port" || echo "matrix.sh: server not listening" >> "$out/logs/$tag.server.log"
        else
          sleep 2
        fi
      fi
      env $e timeout -k 5 "${TMO:-300}" $c > "$out/logs/$tag.client.log" 2>&1
      crc=$?
      [ "$kind" != solo ] && { wait "$spid"; src=$?; }
      t1=$(date +%s.%N)
      verdict=PASS
      { [ "$crc" = 0 ] && [ "$src" = 0 ]; } || verdict=FAIL
      if [ $verdict = FAIL ] && [ $attempt -lt 3 ] \
        && grep -q "Correlation coefficient" "$out"/logs/"$tag".*.log; then
        note="(perftest clock calibration failed, retry $attempt) "
        continue
      fi
      break
    done
    printf '%-4s %-34s %-9s s=%-3s c=%-3s %6.1fs %s| %s | %s\n' "$verdict" "$name" "$mode" \
      "$src" "$crc" "$(echo "$t1 - $t0" | bc)" "$note" "$(figure "$out/logs/$tag.client.log")" \
      "$(counters "$tag")" | tee -a "$res"
  done
}

n=${ITERS:+-n $ITERS}
base="none observe bandwidth"

if [[ " $sections " == *" tools "* ]]; then
  pp="ibv_rc_pingpong -d rxe0 -g 0 $n"
  run rc_pingpong tcp "$pp -p PORT" "$pp -p PORT localhost" $base
  run rc_pingpong-e tcp "$pp -e -p PORT" "$pp -e -p PORT localhost" $base
  run rc_pingpong-N tcp "$pp -N -p PORT" "$pp -N -p PORT localhost" $base
  rp="rping -C ${RPING_COUNT:-10} -v"
  run rping cm "$rp -s -a $addr%veth0 -p PORT" "$rp -c -a $addr%veth0 -p PORT" $base
  for t in ib_write_bw ib_write_lat ib_read_bw ib_read_lat ib_send_bw ib_send_lat; do
    p="$t -d rxe0 -x 0 $n"
    run "$t" tcp "$p -p PORT" "$p -p PORT localhost" $base
    run "$t--use_old_post_send" tcp "$p --use_old_post_send -p PORT" \
      "$p --use_old_post_send -p PORT localhost" $base
    case $t in
      ib_write_*) ;; # perftest has no -e for WRITE tests
      *) run "$t-e" tcp "$p -e -p PORT" "$p -e -p PORT localhost" $base ;;
    esac
  done
fi

if [[ " $sections " == *" split "* ]]; then
  modes="none bw64k preempt rate5m rate2m"
  for t in ib_write_bw ib_read_bw; do
    p="$t -d rxe0 -x 0 -s 1048576 ${SPLIT_ITERS:--n 100}"
    run "$t-1M" tcp "$p -p PORT" "$p -p PORT localhost" $modes
    run "$t-1M--use_old_post_send" tcp "$p --use_old_post_send -p PORT" \
      "$p --use_old_post_send -p PORT localhost" $modes
  done
  p="ib_read_bw -d rxe0 -x 0 -s 1048576 ${SPLIT_ITERS:--n 100} -e"
  run ib_read_bw-1M-e tcp "$p -p PORT" "$p -p PORT localhost" $modes
  p="ib_write_bw -d rxe0 -x 0 -s 64 -n 5000"
  run ib_write_bw-64B tcp "$p -p PORT" "$p -p PORT localhost" none ops1k
fi

if [[ " $sections " == *" probe "* ]]; then
  run rate_probe-1M solo "" "$probe rxe0 1048576 64 16" none bw64k rate5m rate2m
fi

if [[ " $sections " == *" integrity "* ]]; then
  ig="$integrity -d rxe0 -x 0 -n ${INTEGRITY_TRANSFERS:-200} --seed ${SEED:-7} --max-size 4M --boundary 64K"
  run integrity solo "" "$ig" none observe bw64k bw5k preempt rate5m auto
fi
echo "matrix.sh: done"
