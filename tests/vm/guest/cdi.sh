#!/bin/bash
# Inside the guest (in the chroot, rxe0 up): the CDI spec `justitia cdi` writes for this
# host, used as a container runtime would use it, on images assembled here from the guest's
# packages. Run from suite.sh's daemon section, or alone:
#
#   tests/vm/guest.sh --timeout 300 -- tests/vm/guest/cdi.sh RESULTS BIN_DIR SHAPER_LIB VALIDATOR APPS
#
# BIN_DIR holds justitiad and justitia (cargo build --release), SHAPER_LIB the glibc build of
# libjustitia.so as scripts/build-shaper.sh writes it (the musl build beside it, in
# ../musl/), VALIDATOR deploy/validate's program, APPS the test applications
# (tests/vm/apps/build.sh: libopen_counter.so, libc_probe, libc_probe.musl). As the
# DaemonSet's init container does, the builds and packaging/ld.so.preload are copied to a
# host directory and the spec written from the guest's sysfs, with the registration socket
# in a scratch directory; justitiad starts from packaging/justitiad.toml with its sockets
# moved there. Containers are started by container-lib.sh's runner: the CDI library's edits
# (deploy/validate inject) applied to a container's own environment, the mounts bound as
# runc binds them into an image holding only the program and the libraries it needs, and
# the program started there with exactly the resulting environment. Then:
#
# 1. The spec passes the CDI project's validation, gives rxe0 its verbs node, and injects
#    the shaper through /etc/ld.so.preload: no LD_PRELOAD, no JUSTITIA_CLASS.
# 2. A glibc image whose own LD_PRELOAD names an interposer of ibv_open_device
#    (libopen_counter.so), with justitia.io/rdma=rxe0-bandwidth: the edits keep its
#    LD_PRELOAD; ib_write_bw (1 MiB WRITEs) runs to exit 0, its shaper splits requests (its
#    statistics) and registers a bandwidth flow under that pid with the daemon (its log),
#    and the interposer counted the device's opening: both loaded, the image's first.
# 3. The same image setting JUSTITIA_CLASS=latency itself: the pod's class wins over the
#    device's default (a latency flow registered, nothing split).
# 4. Images the shaper does not serve through the list run as without it: a musl image
#    (musl's dynamic linker reads no /etc/ld.so.preload) runs its program to exit 0 with the
#    shaper not mapped, and with the musl build added to its own LD_PRELOAD the shaper is
#    mapped and the program still exits 0; a glibc program that opens no device has the
#    shaper mapped from the list and exits 0.
# 5. justitia.io/rdma=rxe0-unshaped, the opt-out, carries the device nodes and nothing else.
#
# One line per check goes to RESULTS/results.txt as in suite.sh; logs to RESULTS/logs/cdi.*.
set -uo pipefail

RESULTS=$1
BIN=$2
LIB=$3
VALIDATOR=$4
APPS=$5
MUSL_LIB=$(dirname "$(dirname "$LIB")")/musl/libjustitia.so
# shellcheck source=tests/vm/guest/daemon-lib.sh
source "$(dirname "$0")/daemon-lib.sh"
# shellcheck source=tests/vm/guest/container-lib.sh
source "$(dirname "$0")/container-lib.sh"
LOGS=$RESULTS/logs
L=$LOGS/cdi
mkdir -p "$LOGS"
touch "$RESULTS/results.txt"
DEV=rxe0
PORT=19700

LAST_RESULT=$SECONDS
result() { # STATUS NAME DETAIL
  printf '%s %s: %s (%d s)\n' "$1" "$2" "$3" $((SECONDS - LAST_RESULT)) | tee -a "$RESULTS/results.txt"
  LAST_RESULT=$SECONDS
}
CHECKS=("cdi: justitia cdi's spec for this host passes CDI's validation and injects through /etc/ld.so.preload"
  "cdi: a glibc image's ib_write_bw is shaped and registered, and its own LD_PRELOAD interposer still interposes"
  "cdi: the container's own JUSTITIA_CLASS wins over the device's default"
  "cdi: a musl image runs unshaped, or shaped by the musl build in its own LD_PRELOAD; a glibc program gets the shaper from the list"
  "cdi: the opt-out device carries device nodes only")
done_checks=0
pass() { result PASS "${CHECKS[$done_checks]}" "$1"; done_checks=$((done_checks + 1)); }
fail_rest() { # WHY: this check fails, the later ones are reported as not run
  result FAIL "${CHECKS[$done_checks]}" "$1"
  local i
  for ((i = done_checks + 1; i < ${#CHECKS[@]}; i++)); do
    result FAIL "${CHECKS[$i]}" "not run: ${CHECKS[$done_checks]} failed"
  done
  cleanup
  exit 1
}

run=$(mktemp -d /tmp/justitia-cdi.XXXXXX)
dpid="" spid=""
cleanup() {
  [ -n "$spid" ] && kill -KILL "$spid" 2>/dev/null
  [ -n "$dpid" ] && kill -KILL "$dpid" 2>/dev/null
  wait 2>/dev/null
  rm -rf "$run"
}
trap 'cleanup; exit 124' TERM

for f in "$BIN/justitiad" "$BIN/justitia" "$LIB" "$MUSL_LIB" "$VALIDATOR" "$APPS/libopen_counter.so" \
  "$APPS/libc_probe" "$APPS/libc_probe.musl"; do
  [ -e "$f" ] || fail_rest "$f is not built"
done

# 1. What the DaemonSet's init container does, with host paths in the scratch directory.
mkdir -p "$run/lib/musl" "$run/registration" "$run/admin" "$run/cdi"
cp "$LIB" "$run/lib/libjustitia.so"
cp "$MUSL_LIB" "$run/lib/musl/libjustitia.so"
cp packaging/ld.so.preload "$run/lib/ld.so.preload"
spec=$run/cdi/justitia.json
if ! "$BIN/justitia" cdi --library "$run/lib/libjustitia.so" --socket "$run/registration/justitiad.sock" \
  --output "$spec" > "$L.generate.log" 2>&1; then
  fail_rest "justitia cdi failed: $(tr '\n' ' ' < "$L.generate.log")"
fi
cp "$spec" "$L.justitia.json"
if ! "$VALIDATOR" cdi "$spec" > "$L.validate.log" 2>&1; then
  fail_rest "refused: $(tr '\n' ' ' < "$L.validate.log" | head -c 400)"
fi
uverbs=$(basename "$(grep -l "^$DEV\$" /sys/class/infiniband_verbs/uverbs*/ibdev | head -n 1 | xargs dirname)")
if ! grep -q "\"/dev/infiniband/$uverbs\"" "$spec" || ! grep -q '"name": "rxe0-unshaped"' "$spec"; then
  fail_rest "the spec does not give $DEV its node /dev/infiniband/$uverbs (spec: $L.justitia.json)"
fi
if ! "$VALIDATOR" inject "$spec" justitia.io/rdma=rxe0 "PATH=/usr/bin" > "$L.default.txt" 2>&1; then
  fail_rest "the CDI library did not apply justitia.io/rdma=rxe0: $(tr '\n' ' ' < "$L.default.txt")"
fi
if grep -q -E '^env (LD_PRELOAD|JUSTITIA_CLASS)=' "$L.default.txt" \
  || ! grep -qx "mount $run/lib/ld.so.preload /etc/ld.so.preload .*" "$L.default.txt"; then
  fail_rest "expected /etc/ld.so.preload bound and no LD_PRELOAD or JUSTITIA_CLASS: $(tr '\n' ' ' < "$L.default.txt")"
fi
pass "$(cat "$L.validate.log" | sed 's|^[^ ]*: ||'); $DEV is /dev/infiniband/$uverbs; $(grep -c '^mount ' "$L.default.txt") mounts, $(grep '^env ' "$L.default.txt" | cut -d' ' -f2 | paste -sd ' ')"

# 2. The daemon, with its registration socket where the spec binds it.
config=$run/justitiad.toml
daemon_config "$config" "$run/registration/justitiad.sock" "$run/admin/admin.sock" "" || fail_rest "$DAEMON_ERR"
daemon_start "$config" "$L.justitiad.log"
dpid=$DAEMON_PID
daemon_wait "$L.justitiad.log" "$run/registration/justitiad.sock" 20 || fail_rest "justitiad did not start: $DAEMON_ERR"

# The images: ib_write_bw and the probe with their libraries and the rxe provider, the
# image's own interposer at a path of its own; and a musl image with the musl probe.
image=$run/image
image_add "$image" /usr/bin/ib_write_bw "$APPS/libc_probe" && image_glibc "$image" \
  || fail_rest "cannot assemble the glibc image"
image_env "$image"
image_verbs "$image" || fail_rest "cannot add the rxe provider to the glibc image"
mkdir -p "$image/usr/lib/interposer" "$image/results"
cp "$APPS/libopen_counter.so" "$image/usr/lib/interposer/"
cp "$APPS/libc_probe" "$image/usr/bin/libc_probe"
musl_image=$run/musl-image
mkdir -p "$musl_image/usr/bin" "$musl_image/lib" "$musl_image/etc" "$musl_image/results"
cp /lib/ld-musl-x86_64.so.1 "$musl_image/lib/"
cp "$APPS/libc_probe.musl" "$musl_image/usr/bin/libc_probe"
image_env "$musl_image"

# inject DEVICE ENV...: the CDI library's edits of DEVICE to a container whose own
# environment is ENV; sets EDIT_ENV, EDIT_MOUNTS (with the test's results directory bound
# at /results, as a volume would be) and EDIT_DEVICES.
out=$run/out
mkdir -p "$out"
inject() {
  local device=$1 kind a b c
  shift
  "$VALIDATOR" inject "$spec" "justitia.io/rdma=$device" "$@" > "$L.edits.$device.txt" 2> "$L.inject.err" \
    || fail_rest "the CDI library did not apply $device: $(tr '\n' ' ' < "$L.inject.err")"
  EDIT_ENV=() EDIT_MOUNTS=("$out /results rw,bind") EDIT_DEVICES=()
  while read -r kind a b c; do
    case $kind in
      env) EDIT_ENV+=("$a") ;;
      mount) EDIT_MOUNTS+=("$a $b $c") ;;
      device)
        [ -e "$a" ] || fail_rest "the spec names device node $a, which this host lacks"
        EDIT_DEVICES+=("$a")
        ;;
    esac
  done < "$L.edits.$device.txt"
}

# write_pair NAME: ib_write_bw's server on the guest, its client in the glibc image with the
# edits last made by inject; sets PAIR_ERR (empty when both exit 0).
write_pair() {
  local name=$1 crc src
  timeout 160 ib_write_bw -d "$DEV" -x 0 -s 1048576 -n 100 -p "$PORT" > "$L.$name.server.log" 2>&1 &
  spid=$!
  for _ in $(seq 100); do
    ss -Hltn "sport = :$PORT" 2>/dev/null | grep -q . && break
    sleep 0.1
  done
  run_container 60 "$image" ib_write_bw -d "$DEV" -x 0 -s 1048576 -n 100 -p "$PORT" 127.0.0.1 \
    > "$L.$name.client.log" 2>&1
  crc=$?
  # A client that failed leaves the server waiting for it.
  [ "$crc" = 0 ] || kill "$spid" 2>/dev/null
  wait "$spid"
  src=$?
  spid=""
  PAIR_ERR=""
  if [ "$crc" != 0 ] || [ "$src" != 0 ]; then
    PAIR_ERR="client exit $crc, server exit $src: $(grep -h -m1 -i -E 'error|fail|cannot|ld.so|not found' "$L.$name.client.log" "$L.$name.server.log")"
  fi
}

# stats_of NAME: the one statistics file the run NAME left in the results directory, moved
# to the logs; sets STATS (its path) and STATS_PID.
stats_of() {
  local f
  f=$(ls "$out"/stats.*.json 2>/dev/null | head -n 1)
  STATS="" STATS_PID=""
  [ -n "$f" ] || return 1
  STATS_PID=${f##*/stats.}
  STATS_PID=${STATS_PID%.json}
  STATS=$L.$1.stats.json
  mv "$f" "$STATS"
}
stat_field() { grep -o "\"$2\": *[0-9]*" "$1" | grep -o '[0-9]*$'; }

# 2. The image's own interposer and the injected shaper, together.
inject rxe0-bandwidth "PATH=/usr/bin" "LD_PRELOAD=/usr/lib/interposer/libopen_counter.so" \
  "OPEN_COUNTER_FILE=/results/open_counter.txt" "JUSTITIA_STATS=/results/stats.%p.json"
printf '%s\n' "${EDIT_ENV[@]}" | grep -qx "LD_PRELOAD=/usr/lib/interposer/libopen_counter.so" \
  || fail_rest "the image's LD_PRELOAD was not kept: $(tr '\n' ' ' < "$L.edits.rxe0-bandwidth.txt")"
write_pair interposed
[ -z "$PAIR_ERR" ] || fail_rest "$PAIR_ERR"
stats_of interposed || fail_rest "the shaper wrote no statistics: it was not in the client's data path ($(head -n 3 "$L.interposed.client.log" | tr '\n' ' '))"
split=$(stat_field "$STATS" split_requests)
registered=$(grep "flow registered" "$L.justitiad.log" | grep "pid=$STATS_PID " | head -n 1)
counted=$(cat "$out/open_counter.txt" 2>/dev/null)
[ "${split:-0}" -gt 0 ] || fail_rest "no request was split: $(tr -d '\n ' < "$STATS")"
echo "$registered" | grep -q "class=bandwidth" \
  || fail_rest "no bandwidth flow registered for pid $STATS_PID: $(grep "flow registered" "$L.justitiad.log" | tail -n 2 | tr '\n' ' ')"
case $counted in
  "ibv_open_device calls: "[1-9]*) ;;
  *) fail_rest "the image's interposer did not see ibv_open_device (its count: '${counted:-none}')" ;;
esac
rm -f "$out/open_counter.txt"
pass "split_requests=$split; justitiad: $(echo "$registered" | grep -o 'pid=[0-9]* flow=[0-9]* class=[a-z]*'); interposer: $counted"

# 3. The pod's own class against the device's default.
inject rxe0-bandwidth "PATH=/usr/bin" "JUSTITIA_CLASS=latency" "JUSTITIA_STATS=/results/stats.%p.json"
write_pair own-class
[ -z "$PAIR_ERR" ] || fail_rest "$PAIR_ERR"
stats_of own-class || fail_rest "the shaper wrote no statistics ($(head -n 3 "$L.own-class.client.log" | tr '\n' ' '))"
split=$(stat_field "$STATS" split_requests)
registered=$(grep "flow registered" "$L.justitiad.log" | grep "pid=$STATS_PID " | head -n 1)
echo "$registered" | grep -q "class=latency" \
  || fail_rest "pid $STATS_PID did not register as latency: $(grep "flow registered" "$L.justitiad.log" | tail -n 2 | tr '\n' ' ')"
[ "${split:-1}" = 0 ] || fail_rest "a latency flow's requests were split: $(tr -d '\n ' < "$STATS")"
pass "JUSTITIA_CLASS=latency with JUSTITIA_DEFAULT_CLASS=bandwidth: $(echo "$registered" | grep -o 'class=[a-z]*'), split_requests=0"

# 4. What the list does not reach, and what it does.
probe() { # NAME ROOT ENV...: the probe in ROOT with the rxe0 edits and ENV; sets PROBE_OUT, PROBE_RC
  local name=$1 root=$2
  shift 2
  inject rxe0 "PATH=/usr/bin" "$@"
  run_container 60 "$root" /usr/bin/libc_probe > "$L.$name.log" 2>&1
  PROBE_RC=$?
  PROBE_OUT=$(grep -m1 '^libc_probe:' "$L.$name.log")
}
probe musl "$musl_image"
[ "$PROBE_RC" = 0 ] && [[ $PROBE_OUT == *"shaper not mapped" ]] \
  || fail_rest "musl image: exit $PROBE_RC: $(head -c 300 "$L.musl.log")"
probe musl-preload "$musl_image" "LD_PRELOAD=/opt/justitia/musl/libjustitia.so"
[ "$PROBE_RC" = 0 ] && [[ $PROBE_OUT == *"shaper mapped" ]] \
  || fail_rest "musl image with the musl build in LD_PRELOAD: exit $PROBE_RC: $(head -c 300 "$L.musl-preload.log")"
probe glibc "$image"
[ "$PROBE_RC" = 0 ] && [[ $PROBE_OUT == *"shaper mapped" ]] \
  || fail_rest "glibc image: exit $PROBE_RC: $(head -c 300 "$L.glibc.log")"
pass "musl: exit 0, not mapped; musl with LD_PRELOAD: exit 0, mapped; glibc: exit 0, mapped from the list"

# 3. The opt-out.
if ! "$VALIDATOR" inject "$spec" justitia.io/rdma=rxe0-unshaped "PATH=/usr/bin" > "$L.unshaped.txt" 2>&1; then
  fail_rest "$(tr '\n' ' ' < "$L.unshaped.txt")"
fi
if grep -q -E '^mount |LD_PRELOAD|JUSTITIA_' "$L.unshaped.txt" || ! grep -qx "device /dev/infiniband/$uverbs" "$L.unshaped.txt"; then
  fail_rest "$(tr '\n' ' ' < "$L.unshaped.txt")"
fi
pass "$(grep -c '^device ' "$L.unshaped.txt") device nodes ($(grep '^device ' "$L.unshaped.txt" | cut -d' ' -f2 | paste -sd ' ')), no mounts, environment as the container set it"

kill -TERM "$dpid" 2>/dev/null
wait "$dpid" 2>/dev/null
dpid=""
cleanup
