#!/bin/bash
# Inside the guest (in the chroot, rxe0 up): the CDI spec `justitia cdi` writes for this
# host, used as a container runtime would use it, on images assembled here from the guest's
# packages. Run from suite.sh's daemon section, or alone:
#
#   tests/vm/guest.sh --timeout 480 -- tests/vm/guest/cdi.sh RESULTS BIN_DIR SHAPER_LIB VALIDATOR APPS PLUGIN PODRUN
#
# BIN_DIR holds justitiad and justitia (cargo build --release), SHAPER_LIB the glibc build of
# libjustitia.so as scripts/build-shaper.sh writes it (the musl build beside it, in
# ../musl/), VALIDATOR deploy/validate's program, APPS the test applications
# (tests/vm/apps/build.sh: libopen_counter.so, libc_probe, libc_probe.musl; and in
# APPS/musl-verbs, tests/vm/apps/build-musl-verbs.sh's musl_write with the musl builds of
# libibverbs and the rxe provider it links). As the
# DaemonSet's init container does, the builds and packaging/ld.so.preload are copied to a
# host directory and the spec written from the guest's sysfs into /var/run/cdi, with the
# registration socket in a scratch directory; justitiad starts from packaging/justitiad.toml
# with its sockets moved there and `tenant = "cgroup"`. Containers are started by a real
# runtime, Debian's podman 4.3.1 with runc (storage in the guest's tmpfs, the host network,
# cgroup v2), from images imported in the test from the guest's own packages
# (container-lib.sh: a program and the libraries it needs, glibc's, the rxe provider; no
# registry is reachable). podman 4.3.1 reads CDI specs up to version 0.5.0; the spec
# `justitia cdi` writes by default declares the oldest version its content needs (0.3.0),
# so the check passes no --cdi-version. Then:
#
# 1. The spec passes the CDI project's validation (deploy/validate, the newest CDI
#    library), gives rxe0 its verbs node, and injects the shaper through
#    /etc/ld.so.preload: no LD_PRELOAD, no JUSTITIA_CLASS among its edits.
# 2. A glibc image whose config sets LD_PRELOAD to an interposer of ibv_open_device
#    (libopen_counter.so), run with --device justitia.io/rdma=rxe0-bandwidth: ib_write_bw
#    (1 MiB WRITEs) exits 0, its shaper splits requests (its statistics), justitiad lists
#    its bandwidth flow under the container's cgroup as tenant (justitia flows), and the
#    interposer counted the device's opening: both loaded, the image's first.
# 3. The same image run with -e JUSTITIA_CLASS=latency: the pod's class wins over the
#    device's default (a latency flow registered, nothing split).
# 4. musl images, which the list does not reach (musl's dynamic linker reads no
#    /etc/ld.so.preload), get the musl build from the precreate hook (`justitia oci-hook`,
#    packaging/oci-hooks.d/justitia-musl.json in the hooks directory podman is given): the
#    musl image's program exits 0 with the shaper mapped, and without the hook (the
#    mechanism removed) exits 0 with it not mapped; a glibc program that opens no device has the
#    shaper mapped from the list beside the image's interposer and exits 0, where an
#    injection through LD_PRELOAD (what an env edit would do) loses the interposer; a
#    set-user-ID program run by another user reads no JUSTITIA_* variable (no statistics
#    file where it asked for one, which the same program without the bit writes).
#    A musl verbs program (musl_write: rdma-core's libibverbs and rxe provider built with
#    musl-gcc, in the musl image) writes 4 x 16 KiB over a loopback RC connection and checks
#    every byte. The musl image's config preloads its own interposer (libopen_counter.so
#    built with musl-gcc). Without the hook it exits 0 and writes no statistics (nothing
#    shaped it); with the hook (JUSTITIA_CLASS=bandwidth, JUSTITIA_CHUNK=1K) it exits 0,
#    the shaper's statistics count its WRITEs split, and the image's interposer counted
#    the device's opening: both loaded. A check of its own, which the later ones do not
#    depend on.
#    A Debian 11 image (glibc 2.31, rdma-core 33.2, perftest 4.4; APPS/old-glibc-root from
#    tests/vm/apps/build-old-glibc-root.sh) given the shaped device: its ib_write_bw is
#    shaped from the list (requests split), and dlopen_app (built for glibc 2.17), which
#    finds every verb with dlsym on libibverbs' handle as NCCL does, exits 0 with its
#    256 KiB WRITE split, the shaper having found dlsym in glibc 2.31's libdl; the build
#    linked against this machine's glibc (HOST_LIB, cargo's) preloaded into the same image
#    stops ibv_devinfo at load ("version `GLIBC_2.3x' not found"). Also a check of its own.
# 5. What escapes is seen: with every container's RC queue pair held for 30 s, justitiad
#    lists a static program (rdma-core linked in) in a shaped container and a program
#    given rxe0-unshaped as unshaped (`justitia flows --unshaped`), with their containers'
#    cgroups as tenants, and not the same program given rxe0-bandwidth.
# 6. justitia.io/rdma=rxe0-unshaped, the opt-out, carries the device nodes and nothing else.
# 7. Kubernetes' path, with containerd (Debian's 1.6.20, its CRI plugin, runc) as the
#    runtime: justitia-device-plugin (PLUGIN) registers with podrun (PODRUN), which plays
#    kubelet: it has the plugin Allocate a unit of rdma/rdma_shared_device_a and starts a
#    pod through CRI with what the plugin answered (device nodes, mounts, environment; no
#    CDI). Its ib_write_bw is shaped (the pod sets JUSTITIA_CLASS=bandwidth), and justitiad
#    (tenant = "namespace") lists its flow as its namespace's, team-a, named from the pod's
#    log directory (podrun keeps it as kubelet does), at the namespace's weight, 3.
#    Processes in no pod (the podman containers above) are their cgroups' tenants.
#    containerd runs runc through the runtime wrapper (`justitia-runc`, a link to justitia,
#    as containerd's BinaryName), which appends the musl build to a musl pod's LD_PRELOAD:
#    the musl image's musl_write in a pod exits 0 with its WRITEs split and the image's
#    own interposer counting, and the glibc pods here and in 8 run through it unchanged.
#    The same pod under a runtime handler that runs runc itself (`plain`, as a
#    RuntimeClass would name it) exits 0 and is not shaped: the wrapper is the mechanism.
# 8. A rolling update of justitiad under a running pod, as a DaemonSet's (maxUnavailable
#    1) does it, with the test in kubelet's place (no kubelet, no DaemonSet controller):
#    while a second pod's ib_write_bw runs (-D CDI_ROLL_SECONDS, 20 s by default), the
#    daemon that lists its flow gets SIGTERM (SIGKILL after the DaemonSet's 15 s grace
#    period) and must stop cleanly, and a new one starts from a copy of the binary at
#    another path (the new image's) with the same configuration and sockets. The new
#    daemon must list the same pid, still running, as a bandwidth flow of
#    namespace/team-a at weight 3; the shaper's statistics must count one loss and two
#    connections (daemon_fallbacks=1, daemon_connections=2) and requests split while no
#    daemon answered (split_while_daemon_gone > 0), its stderr say it fell back and
#    registered again, and ib_write_bw exit 0 with its report. About 40 s.
#
# One line per check goes to RESULTS/results.txt as in suite.sh; logs to RESULTS/logs/cdi.*.
set -uo pipefail

RESULTS=$1
BIN=$2
LIB=$3
VALIDATOR=$4
APPS=$5
PLUGIN=$6
PODRUN=$7
MUSL_LIB=$(dirname "$(dirname "$LIB")")/musl/libjustitia.so
# The build cargo links against this machine's glibc (tests/vm/run-tests.sh builds it and
# names it in HOST_LIB), which the old glibc check shows stopping a program at load.
HOST_LIB=${HOST_LIB:-$PWD/target/debug/libjustitia.so}
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

# shellcheck source=tests/vm/guest/checks-lib.sh
source "$(dirname "$0")/checks-lib.sh"
CHECKS=("cdi: justitia cdi's spec for this host passes CDI's validation and injects through /etc/ld.so.preload"
  "cdi: podman: a glibc image's ib_write_bw is shaped and registered as its container's tenant, and the image's LD_PRELOAD interposer still interposes"
  "cdi: podman: the container's own JUSTITIA_CLASS wins over the device's default"
  "cdi: podman: a musl image gets the musl build from the precreate hook (unshaped without it); a glibc program gets the shaper from the list, a set-user-ID one reads none of its variables"
  "cdi: podman: a musl verbs program's checked RDMA WRITEs are split by the musl build the hook preloads after the image's own interposer, and run unshaped without the hook"
  "cdi: podman: a Debian 11 image (glibc 2.31) runs ib_write_bw and a dlopen program shaped, where the host-linked build stops it at load"
  "cdi: podman: justitiad lists a static program and a program of the unshaped device as unshaped, not a shaped one"
  "cdi: the opt-out device carries device nodes only"
  "cdi: containerd: a pod given rdma/rdma_shared_device_a by justitia-device-plugin's Allocate runs ib_write_bw shaped, as its namespace's tenant at its weight"
  "cdi: containerd: a musl pod's verbs program is split by the musl build the runtime wrapper (justitia-runc) appends to its LD_PRELOAD, after the image's own interposer, and runs unshaped under runc alone"
  "cdi: containerd: justitiad replaced as a rolling update does under the pod's running ib_write_bw: its shaper registers again with the new daemon and kept splitting between them")

run=$(mktemp -d /tmp/justitia-cdi.XXXXXX)
dpid="" spid="" ctrd_pid="" plugin_pid=""
ctrd=/run/justitia-containerd.$$
# The spec where podman looks for specs generated at run time (the guest's /run is tmpfs).
cdi_dir=/var/run/cdi
podman=(podman --root "$run/podman/storage" --runroot "/run/justitia-podman.$$" --storage-driver vfs
  --cgroup-manager cgroupfs --events-backend file)
# The hooks directory containers are started with (container below): the packaged
# precreate hook, pointed at this build of justitia. HOOKS_DIR= before a call runs without it.
HOOKS_DIR=$run/hooks
cleanup() {
  [ -n "$plugin_pid" ] && kill -KILL "$plugin_pid" 2>/dev/null
  [ -n "$ctrd_pid" ] && kill -TERM "$ctrd_pid" 2>/dev/null
  [ -n "$spid" ] && kill -KILL "$spid" 2>/dev/null
  [ -n "$dpid" ] && kill -KILL "$dpid" 2>/dev/null
  wait 2>/dev/null
  timeout 30 "${podman[@]}" rm --all --force > /dev/null 2>&1
  rm -f "$cdi_dir/justitia-test.json"
  pkill -KILL -f "containerd-shim-runc-v2 -namespace k8s.io" 2>/dev/null
  rm -rf "$run" "/run/justitia-podman.$$" "$ctrd"
}
trap 'cleanup; exit 124' TERM

for f in "$BIN/justitiad" "$BIN/justitia" "$LIB" "$MUSL_LIB" "$VALIDATOR" "$APPS/libopen_counter.so" \
  "$APPS/libc_probe" "$APPS/libc_probe.musl" "$APPS/libopen_counter.musl.so" "$APPS/static_qp" "$APPS/qp_holder" "$PLUGIN" "$PODRUN"; do
  [ -e "$f" ] || fail_rest "$f is not built"
done
command -v podman > /dev/null && command -v runc > /dev/null && command -v containerd > /dev/null \
  && [ -x /bin/busybox ] || fail_rest "podman, runc, containerd or busybox-static is not installed (scripts/setup.sh installs them)"

# 1. What the DaemonSet's init container does, with host paths in the scratch directory.
mkdir -p "$run/lib/musl" "$run/registration" "$run/admin" "$run/cdi"
cp "$LIB" "$run/lib/libjustitia.so"
cp "$MUSL_LIB" "$run/lib/musl/libjustitia.so"
cp packaging/ld.so.preload "$run/lib/ld.so.preload"
mkdir -p "$HOOKS_DIR"
sed "s|\"/usr/bin/justitia\"|\"$BIN/justitia\"|" packaging/oci-hooks.d/justitia-musl.json \
  > "$HOOKS_DIR/justitia-musl.json" && grep -q "\"$BIN/justitia\"" "$HOOKS_DIR/justitia-musl.json" \
  || fail_rest "cannot write the hook's configuration from packaging/oci-hooks.d/justitia-musl.json"
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
mkdir -p "$run/pod-logs"
daemon_config "$config" "$run/registration/justitiad.sock" "$run/admin/admin.sock" "" 'tenant="namespace"' \
  "pod_logs_dir=\"$run/pod-logs\"" '"namespace/team-a"=3' || fail_rest "$DAEMON_ERR"
daemon_start "$config" "$L.justitiad.log"
dpid=$DAEMON_PID
daemon_wait "$L.justitiad.log" "$run/registration/justitiad.sock" 20 || fail_rest "justitiad did not start: $DAEMON_ERR"

# The images: ib_write_bw and the probe with their libraries, glibc's and the rxe provider,
# and the image's own interposer, which its config preloads; a musl image with the musl
# probe. Both are imported into podman's storage.
image=$run/image
{ image_add "$image" /usr/bin/ib_write_bw /usr/bin/ibv_devinfo "$APPS/libc_probe" && image_glibc "$image" \
  && image_verbs "$image"; } || fail_rest "cannot assemble the glibc image"
# A set-user-ID copy of a program that opens the device, beside the plain one.
cp "$image/usr/bin/ibv_devinfo" "$image/usr/bin/ibv_devinfo.setuid"
chmod 4755 "$image/usr/bin/ibv_devinfo.setuid"
mkdir -p "$image/usr/lib/interposer" "$image/results"
cp "$APPS/libopen_counter.so" "$image/usr/lib/interposer/"
cp "$APPS/libc_probe" "$image/usr/bin/libc_probe"
cp "$APPS/static_qp" "$image/usr/bin/static_qp"
image_add "$image" "$APPS/qp_holder" && cp "$APPS/qp_holder" "$image/usr/bin/qp_holder" \
  || fail_rest "cannot add qp_holder to the glibc image"
musl_image=$run/musl-image
mkdir -p "$musl_image/usr/bin" "$musl_image/lib" "$musl_image/results"
cp /lib/ld-musl-x86_64.so.1 "$musl_image/lib/"
cp "$APPS/libc_probe.musl" "$musl_image/usr/bin/libc_probe"
mkdir -p "$musl_image/usr/lib/interposer"
cp "$APPS/libopen_counter.musl.so" "$musl_image/usr/lib/interposer/libopen_counter.so"
# The musl verbs program with its libibverbs, rxe provider and driver file, where an Alpine
# image has them; when it was not built, its own check fails below.
musl_verbs=$APPS/musl-verbs
if [ -x "$musl_verbs/usr/bin/musl_write" ]; then
  cp -a "$musl_verbs/." "$musl_image/" || fail_rest "cannot add musl_write to the musl image"
fi
mountpoint -q /sys/fs/cgroup || mount -t cgroup2 none /sys/fs/cgroup \
  || fail_rest "cannot mount cgroup v2 for the runtime"
tar -C "$image" -cf "$run/glibc.tar" . && tar -C "$musl_image" -cf "$run/musl.tar" . \
  || fail_rest "cannot pack the images"
timeout 120 "${podman[@]}" import --change "ENV LD_PRELOAD=/usr/lib/interposer/libopen_counter.so" \
  --change "ENV OPEN_COUNTER_FILE=/results/open_counter.txt" "$run/glibc.tar" localhost/justitia-test-glibc \
  > "$L.import.log" 2>&1 \
  && timeout 120 "${podman[@]}" import --change "ENV LD_PRELOAD=/usr/lib/interposer/libopen_counter.so" \
    --change "ENV OPEN_COUNTER_FILE=/results/open_counter.txt" "$run/musl.tar" localhost/justitia-test-musl \
    >> "$L.import.log" 2>&1 \
  || fail_rest "podman import failed: $(tail -n 3 "$L.import.log" | tr '\n' ' ')"
mkdir -p "$cdi_dir"
cp "$spec" "$cdi_dir/justitia-test.json" || fail_rest "cannot write $cdi_dir/justitia-test.json"

out=$run/out
mkdir -p "$out"
# container NAME SECONDS IMAGE DEVICE [podman run options...] -- COMMAND...: podman run with the
# device and the results directory as a volume; output in $L.NAME.log, exit status returned.
container() {
  local name=$1 secs=$2 image=$3 device=$4 opts=() hooks=()
  shift 4
  while [ "$1" != -- ]; do opts+=("$1"); shift; done
  shift
  [ -z "$HOOKS_DIR" ] || hooks=(--hooks-dir "$HOOKS_DIR")
  timeout "$secs" "${podman[@]}" "${hooks[@]}" run --rm --network host --device "justitia.io/rdma=$device" \
    -v "$out:/results" "${opts[@]}" "$image" "$@" > "$L.$name.log" 2>&1
}

# pair NAME CLIENT...: ib_write_bw's server on the guest and CLIENT, a command that runs
# its client (100 WRITEs of 1 MiB) and writes its output to $L.NAME.log; while it runs,
# the daemon's flows are sampled into $L.NAME.flows. Sets PAIR_ERR (empty when both exit
# 0). perftest calibrates its cycle counter for its report, which under emulation on a
# loaded host fails now and then without the shaper too ("Correlation coefficient r^2 <
# 0.9", then "Can't produce a report"): such a run is tried again, up to three times in all.
pair() {
  local name=$1 attempt
  shift
  for attempt in 1 2 3; do
    pair_once "$name" "$@"
    [ -n "$PAIR_ERR" ] || return 0
    grep -q "Can't produce a report" "$L.$name.log" "$L.$name.server.log" \
      && grep -q "Correlation coefficient" "$L.$name.log" "$L.$name.server.log" || return 0
    PAIR_ERR="$PAIR_ERR (perftest's calibration failed $attempt times)"
    rm -f "$out"/stats.*.json "$out/open_counter.txt"
  done
}

pair_once() {
  local name=$1 crc src cpid
  shift
  timeout 160 ib_write_bw -d "$DEV" -x 0 -s 1048576 -n 100 -p "$PORT" > "$L.$name.server.log" 2>&1 &
  spid=$!
  # A server that never listens shows in the client's error below.
  wait_tcp_listen "$PORT" || true
  "$@" &
  cpid=$!
  : > "$L.$name.flows"
  while kill -0 "$cpid" 2> /dev/null; do
    "$BIN/justitia" flows --socket "$run/admin/admin.sock" >> "$L.$name.flows" 2>&1
    sleep 0.5
  done
  wait "$cpid"
  crc=$?
  # A client that failed leaves the server waiting for it.
  [ "$crc" = 0 ] || kill "$spid" 2>/dev/null
  wait "$spid"
  src=$?
  spid=""
  PAIR_ERR=""
  if [ "$crc" != 0 ] || [ "$src" != 0 ]; then
    PAIR_ERR="client exit $crc, server exit $src: $(grep -h -m2 -i -E 'podrun|error|fail|cannot|ld.so|not found' "$L.$name.log" "$L.$name.server.log" | tr '\n' ' ')"
  fi
}
WRITE_CLIENT=(ib_write_bw -d "$DEV" -x 0 -s 1048576 -n 100 -p "$PORT" 127.0.0.1)

# write_pair NAME [podman run options...]: pair, the client in the glibc image with the
# bandwidth device.
write_pair() {
  local name=$1
  shift
  pair "$name" container "$name" 150 localhost/justitia-test-glibc rxe0-bandwidth "$@" \
    -e "JUSTITIA_STATS=/results/stats.%p.json" -- "${WRITE_CLIENT[@]}"
}

# stats_of NAME: the one statistics file the run NAME left in the results directory, moved
# to the logs; sets STATS (its path).
stats_of() {
  local f
  f=$(ls "$out"/stats.*.json 2>/dev/null | head -n 1)
  STATS=""
  [ -n "$f" ] || return 1
  STATS=$L.$1.stats.json
  mv "$f" "$STATS"
}
stat_field() { grep -o "\"$2\": *[0-9]*" "$1" | grep -o '[0-9]*$'; }

# 2. The image's own interposer and the injected shaper, together.
write_pair interposed
[ -z "$PAIR_ERR" ] || fail_rest "$PAIR_ERR"
stats_of interposed || fail_rest "the shaper wrote no statistics: it was not in the client's data path ($(head -n 3 "$L.interposed.log" | tr '\n' ' '))"
split=$(stat_field "$STATS" split_requests)
flow=$(grep -m1 -E ' bandwidth .*libpod' "$L.interposed.flows")
counted=$(cat "$out/open_counter.txt" 2>/dev/null)
[ "${split:-0}" -gt 0 ] || fail_rest "no request was split: $(tr -d '\n ' < "$STATS")"
[ -n "$flow" ] || fail_rest "justitiad listed no bandwidth flow of a podman container's cgroup: $(grep -v '^ *flow' "$L.interposed.flows" | sort -u | head -n 3 | tr '\n' ' ')"
case $counted in
  "ibv_open_device calls: "[1-9]*) ;;
  *) fail_rest "the image's interposer did not see ibv_open_device (its count: '${counted:-none}')" ;;
esac
rm -f "$out/open_counter.txt"
pass "split_requests=$split; justitia flows: $(echo "$flow" | awk '{print "pid", $3, "class", $4, "tenant", $NF}'); interposer: $counted"

# 3. The pod's own class against the device's default.
write_pair own-class -e JUSTITIA_CLASS=latency
[ -z "$PAIR_ERR" ] || fail_rest "$PAIR_ERR"
stats_of own-class || fail_rest "the shaper wrote no statistics ($(head -n 3 "$L.own-class.log" | tr '\n' ' '))"
split=$(stat_field "$STATS" split_requests)
grep -q -E ' latency .*libpod' "$L.own-class.flows" \
  || fail_rest "no latency flow listed: $(grep -v '^ *flow' "$L.own-class.flows" | sort -u | head -n 3 | tr '\n' ' ')"
! grep -q -E ' bandwidth .*libpod' "$L.own-class.flows" \
  || fail_rest "a bandwidth flow was listed: $(grep -E ' bandwidth ' "$L.own-class.flows" | head -n 1)"
[ "${split:-1}" = 0 ] || fail_rest "a latency flow's requests were split: $(tr -d '\n ' < "$STATS")"
pass "JUSTITIA_CLASS=latency beside JUSTITIA_DEFAULT_CLASS=bandwidth: a latency flow, split_requests=0"

# 4. What the list does not reach, and what it does.
probe() { # NAME IMAGE [podman run options...]: the probe; sets PROBE_OUT, PROBE_RC
  local name=$1 image=$2
  shift 2
  container "$name" 60 "$image" rxe0 "$@" -- /usr/bin/libc_probe
  PROBE_RC=$?
  PROBE_OUT=$(grep -m1 '^libc_probe:' "$L.$name.log")
}
HOOKS_DIR= probe musl-unhooked localhost/justitia-test-musl
[ "$PROBE_RC" = 0 ] && [[ $PROBE_OUT == *"shaper not mapped" ]] \
  || fail_rest "musl image without the hook: exit $PROBE_RC: $(head -c 300 "$L.musl-unhooked.log")"
probe musl localhost/justitia-test-musl
[ "$PROBE_RC" = 0 ] && [[ $PROBE_OUT == *"shaper mapped" ]] \
  || fail_rest "musl image with the hook: exit $PROBE_RC: $(head -c 300 "$L.musl.log")"
rm -f "$out/open_counter.txt"
probe glibc localhost/justitia-test-glibc
[ "$PROBE_RC" = 0 ] && [[ $PROBE_OUT == *"shaper mapped" ]] && [ -f "$out/open_counter.txt" ] \
  || fail_rest "glibc image: exit $PROBE_RC, interposer's file $(ls "$out/open_counter.txt" 2>&1): $(head -c 300 "$L.glibc.log")"
# What an injection through LD_PRELOAD (an env edit, as runtimes apply CDI's) would do: the
# image's interposer is gone, and this check sees it.
rm -f "$out/open_counter.txt"
probe glibc-env-injection localhost/justitia-test-glibc -e LD_PRELOAD=/opt/justitia/libjustitia.so
[ "$PROBE_RC" = 0 ] && [ ! -f "$out/open_counter.txt" ] \
  || fail_rest "an LD_PRELOAD injection should have dropped the image's interposer: exit $PROBE_RC, $(cat "$out/open_counter.txt" 2>&1)"
# A set-user-ID program run by another user (AT_SECURE) reads none of the shaper's
# variables: no statistics file where the user asked for one; the same program without the
# bit writes it.
chmod 0777 "$out"
for variant in ibv_devinfo ibv_devinfo.setuid; do
  container "$variant" 60 localhost/justitia-test-glibc rxe0 --user 65534 \
    -e "JUSTITIA_STATS=/results/$variant.%p.json" -- "/usr/bin/$variant" -d "$DEV" \
    || fail_rest "$variant as uid 65534: exit $?: $(head -c 300 "$L.$variant.log")"
done
ls "$out"/ibv_devinfo.[0-9]*.json > /dev/null 2>&1 \
  || fail_rest "the plain ibv_devinfo wrote no statistics: the set-user-ID check would prove nothing"
! ls "$out"/ibv_devinfo.setuid.*.json > /dev/null 2>&1 \
  || fail_rest "the set-user-ID ibv_devinfo wrote statistics where its user's environment asked"
pass "musl without the hook: exit 0, not mapped; musl with the hook: exit 0, mapped; glibc: exit 0, mapped from the list beside the image's interposer, which an LD_PRELOAD injection would have dropped; set-user-ID: exit 0, no variable read"

# 4b. A musl verbs program, without the hook and with it. Its failure is its own: the later
# checks do not depend on it.
musl_write_check() {
  local rc wrote split chunks counted
  if [ ! -x "$musl_verbs/usr/bin/musl_write" ]; then
    fail_one "$musl_verbs/usr/bin/musl_write is not built (tests/vm/apps/build-musl-verbs.sh failed or was not run)"
    return
  fi
  rm -f "$out"/stats.*.json "$out/open_counter.txt"
  # Without the hook: the statistics file asked for stays unwritten, as nothing loads the
  # shaper.
  HOOKS_DIR= container musl-write 90 localhost/justitia-test-musl rxe0 -e "JUSTITIA_STATS=/results/stats.%p.json" \
    -- /usr/bin/musl_write "$DEV" 16384 4
  rc=$?
  if [ "$rc" != 0 ] || ! grep -q "every byte checked" "$L.musl-write.log"; then
    fail_one "without the hook: exit $rc: $(head -c 300 "$L.musl-write.log" | tr '\n' ' ')"
    return
  fi
  if stats_of musl-write; then
    fail_one "without the hook: statistics were written ($STATS), so something loaded the shaper"
    return
  fi
  rm -f "$out/open_counter.txt"
  container musl-write-shaped 90 localhost/justitia-test-musl rxe0 \
    -e JUSTITIA_CLASS=bandwidth -e JUSTITIA_CHUNK=1K -e "JUSTITIA_STATS=/results/stats.%p.json" \
    -- /usr/bin/musl_write "$DEV" 16384 4
  rc=$?
  if [ "$rc" != 0 ] || ! grep -q "every byte checked" "$L.musl-write-shaped.log"; then
    fail_one "with the hook: exit $rc: $(head -c 300 "$L.musl-write-shaped.log" | tr '\n' ' ')"
    return
  fi
  if ! stats_of musl-write-shaped; then
    fail_one "with the hook: no statistics written ($(head -c 300 "$L.musl-write-shaped.log" | tr '\n' ' '))"
    return
  fi
  split=$(stat_field "$STATS" split_requests)
  chunks=$(stat_field "$STATS" chunks)
  if [ "${split:-0}" -lt 4 ]; then
    fail_one "with the hook: expected its 4 WRITEs split: $(tr -d '\n ' < "$STATS")"
    return
  fi
  counted=$(cat "$out/open_counter.txt" 2>/dev/null)
  case $counted in
    "ibv_open_device calls: "[1-9]*) ;;
    *) fail_one "with the hook: the image's own interposer did not see ibv_open_device (its count: '${counted:-none}'): the hook dropped the image's LD_PRELOAD"
       return ;;
  esac
  rm -f "$out/open_counter.txt"
  wrote=$(grep -m1 -o 'wrote .* checked' "$L.musl-write-shaped.log")
  pass "musl_write (libibverbs and rxe built with musl-gcc): without the hook: exit 0, no statistics; with it: exit 0, $wrote, split_requests=$split, chunks=$chunks, daemon_connections=$(stat_field "$STATS" daemon_connections); the image's interposer: $counted"
}
musl_write_check

# 4c. An image with a glibc older than 2.34 (Debian 11's packages), where the host-linked
# build stops every program at load. Its failure is its own.
old_glibc_check() {
  local root=$APPS/old-glibc-root rc split dl_split result
  if [ ! -x "$root/usr/bin/ib_write_bw" ] || [ ! -x "$root/usr/bin/dlopen_app" ]; then
    fail_one "$root is not assembled (tests/vm/apps/build-old-glibc-root.sh failed or was not run)"
    return
  fi
  if [ ! -f "$HOST_LIB" ]; then
    fail_one "$HOST_LIB (the build linked against this machine's glibc) is not built"
    return
  fi
  mkdir -p "$root/results"
  if ! tar -C "$root" -cf "$run/old-glibc.tar" . \
    || ! timeout 120 "${podman[@]}" import "$run/old-glibc.tar" localhost/justitia-test-glibc231 >> "$L.import.log" 2>&1; then
    fail_one "cannot import the Debian 11 image: $(tail -n 2 "$L.import.log" | tr '\n' ' ')"
    return
  fi
  rm -f "$out"/stats.*.json
  # Debian 11's ib_write_bw (perftest 4.4+0.37, rdma-core 33.2) given the shaped device:
  # the shaper from the list, its WRITEs split.
  pair old-glibc container old-glibc 150 localhost/justitia-test-glibc231 rxe0-bandwidth \
    -e "JUSTITIA_STATS=/results/stats.%p.json" -- "${WRITE_CLIENT[@]}"
  if [ -n "$PAIR_ERR" ]; then
    fail_one "Debian 11's ib_write_bw: $PAIR_ERR"
    return
  fi
  if ! stats_of old-glibc; then
    fail_one "Debian 11's ib_write_bw: no statistics, the shaper was not loaded ($(head -c 300 "$L.old-glibc.log" | tr '\n' ' '))"
    return
  fi
  split=$(stat_field "$STATS" split_requests)
  if [ "${split:-0}" -lt 1 ]; then
    fail_one "Debian 11's ib_write_bw: no request split: $(tr -d '\n ' < "$STATS")"
    return
  fi
  # A program that finds the verbs with dlsym on libibverbs' handle, as NCCL does: glibc
  # 2.31 keeps dlsym in libdl, where the shaper must find it to answer with its entries.
  container old-glibc-dlopen 90 localhost/justitia-test-glibc231 rxe0-bandwidth -e JUSTITIA_CLASS=bandwidth \
    -e JUSTITIA_CHUNK=16K -e "JUSTITIA_STATS=/results/stats.%p.json" -- /usr/bin/dlopen_app "$DEV"
  rc=$?
  result=$(grep -m1 -o 'dlopen_app: result .*' "$L.old-glibc-dlopen.log")
  if [ "$rc" != 0 ] || [ -z "$result" ]; then
    fail_one "dlopen_app in Debian 11: exit $rc: $(head -c 300 "$L.old-glibc-dlopen.log" | tr '\n' ' ')"
    return
  fi
  if ! stats_of old-glibc-dlopen; then
    fail_one "dlopen_app in Debian 11: no statistics ($(head -c 300 "$L.old-glibc-dlopen.log" | tr '\n' ' '))"
    return
  fi
  dl_split=$(stat_field "$STATS" split_requests)
  if [ "${dl_split:-0}" -lt 1 ]; then
    fail_one "dlopen_app in Debian 11: its 256 KiB WRITE was not split, so its verbs found through dlsym bypassed the shaper: $(tr -d '\n ' < "$STATS"); it said: $(grep -m1 justitia "$L.old-glibc-dlopen.log")"
    return
  fi
  # The mechanism removed: the build linked against this machine's glibc, preloaded the
  # same way, stops the program at load.
  container old-glibc-host-build 60 localhost/justitia-test-glibc231 rxe0-unshaped \
    -v "$HOST_LIB:/opt/host/libjustitia.so:ro" -e LD_PRELOAD=/opt/host/libjustitia.so -- /usr/bin/ibv_devinfo -d "$DEV"
  rc=$?
  if [ "$rc" = 0 ] || ! grep -q "version .GLIBC_2\.3[0-9]*. not found" "$L.old-glibc-host-build.log"; then
    fail_one "the host-linked build should have stopped ibv_devinfo at load: exit $rc: $(head -c 300 "$L.old-glibc-host-build.log" | tr '\n' ' ')"
    return
  fi
  pass "Debian 11 (glibc 2.31): ib_write_bw shaped from the list, split_requests=$split; dlopen_app (verbs through dlsym on the handle) exit 0, split_requests=$dl_split; the host-linked build: exit $rc, $(grep -m1 -o "version .GLIBC_2\.3[0-9]*. not found" "$L.old-glibc-host-build.log")"
}
old_glibc_check

# 5. What escapes, seen by the daemon: a static program in a shaped container, and a
# program given the unshaped device, each holding an RC queue pair, are listed unshaped
# (justitia flows --unshaped) under their containers' cgroups; the same program given a
# shaped device is not. The host's pid namespace, so that each says the pid the daemon
# lists.
holders=()
for run_as in "static rxe0-bandwidth static_qp" "unshaped-device rxe0-unshaped qp_holder" \
  "shaped-device rxe0-bandwidth qp_holder"; do
  read -r name device program <<< "$run_as"
  container "$name" 90 localhost/justitia-test-glibc "$device" --pid host -- "/usr/bin/$program" "$DEV" 30 &
  holders+=($!)
done
pid_of() { grep -m1 -o 'pid [0-9]*' "$L.$1.log" 2> /dev/null | grep -o '[0-9]*'; }
listed() { grep -q "\"pid\": *$1," "$L.unshaped.json"; }
deadline=$((SECONDS + 60))
while :; do
  "$BIN/justitia" flows --unshaped --json --socket "$run/admin/admin.sock" > "$L.unshaped.json" 2>&1
  static_pid=$(pid_of static) unshaped_pid=$(pid_of unshaped-device) shaped_pid=$(pid_of shaped-device)
  if [ -n "$static_pid" ] && [ -n "$unshaped_pid" ] && [ -n "$shaped_pid" ] \
    && listed "$static_pid" && listed "$unshaped_pid"; then
    break
  fi
  [ "$SECONDS" -lt "$deadline" ] || break
  sleep 1
done
# Each holder would hold its queue pair for 30 s; once seen (or not), they end now.
for p in "$static_pid" "$unshaped_pid" "$shaped_pid"; do [ -n "$p" ] && kill -TERM "$p" 2> /dev/null; done
for p in "${holders[@]}"; do wait "$p"; done
[ -n "$static_pid" ] && [ -n "$unshaped_pid" ] && [ -n "$shaped_pid" ] \
  || fail_rest "the queue pair holders did not all start: $(cat "$L.static.log" "$L.unshaped-device.log" "$L.shaped-device.log" | head -c 400)"
listed "$static_pid" && listed "$unshaped_pid" \
  || fail_rest "not listed within 60 s (static pid $static_pid, unshaped-device pid $unshaped_pid): $(head -c 600 "$L.unshaped.json")"
! listed "$shaped_pid" || fail_rest "the shaped qp_holder (pid $shaped_pid) was listed as unshaped: $(head -c 600 "$L.unshaped.json")"
grep -q libpod "$L.unshaped.json" || fail_rest "no container cgroup as tenant: $(head -c 600 "$L.unshaped.json")"
pass "static_qp (pid $static_pid, shaped device) and qp_holder (pid $unshaped_pid, unshaped device) listed unshaped; qp_holder on a shaped device (pid $shaped_pid) not"

# 6. The opt-out.
if ! "$VALIDATOR" inject "$spec" justitia.io/rdma=rxe0-unshaped "PATH=/usr/bin" > "$L.unshaped.txt" 2>&1; then
  fail_rest "$(tr '\n' ' ' < "$L.unshaped.txt")"
fi
if grep -q -E '^mount |LD_PRELOAD|JUSTITIA_' "$L.unshaped.txt" || ! grep -qx "device /dev/infiniband/$uverbs" "$L.unshaped.txt"; then
  fail_rest "$(tr '\n' ' ' < "$L.unshaped.txt")"
fi
pass "$(grep -c '^device ' "$L.unshaped.txt") device nodes ($(grep '^device ' "$L.unshaped.txt" | cut -d' ' -f2 | paste -sd ' ')), no mounts, environment as the container set it"

# 7. containerd, driven by the device plugin's Allocate through podrun (kubelet's part).
kdir=$run/device-plugins
# runc through the runtime wrapper, as README's containerd snippet configures a node: the
# justitia binary under the name justitia-runc.
mkdir -p "$run/bin" && ln -sf "$BIN/justitia" "$run/bin/justitia-runc" \
  || fail_rest "cannot link $run/bin/justitia-runc"
mkdir -p "$ctrd" "$kdir" "$run/containerd/root" "$run/containerd/opt" "$run/cni/bin" "$run/cni/conf" "$run/pause/bin"
cat > "$run/containerd.toml" << EOF
version = 2
root = "$run/containerd/root"
state = "$ctrd/state"
[grpc]
  address = "$ctrd/containerd.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$run/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/justitia-test-pause:latest"
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$run/bin/justitia-runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.plain]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$run/cni/bin"
    conf_dir = "$run/cni/conf"
EOF
# ib_write_bw registers its buffers: the pod inherits containerd's memlock limit.
(ulimit -l unlimited && exec containerd --config "$run/containerd.toml") > "$L.containerd.log" 2>&1 &
ctrd_pid=$!
for _ in $(seq 1 100); do [ -S "$ctrd/containerd.sock" ] && break; sleep 0.2; done
[ -S "$ctrd/containerd.sock" ] || fail_rest "containerd did not start: $(grep -m2 -E 'level=(error|fatal)|ulimit' "$L.containerd.log" | tr '\n' ' ')"
# The pod's sandbox image (a static busybox that sleeps) and the glibc image, from podman's
# storage as OCI archives into containerd's k8s.io namespace, which its CRI plugin uses.
cp /bin/busybox "$run/pause/bin/busybox"
tar -C "$run/pause" -cf "$run/pause.tar" . \
  && timeout 120 "${podman[@]}" import --change 'CMD ["/bin/busybox", "sleep", "2147483647"]' "$run/pause.tar" \
    localhost/justitia-test-pause:latest >> "$L.import.log" 2>&1 \
  && timeout 120 "${podman[@]}" save --format oci-archive -o "$run/pause-oci.tar" localhost/justitia-test-pause:latest >> "$L.import.log" 2>&1 \
  && timeout 120 "${podman[@]}" save --format oci-archive -o "$run/glibc-oci.tar" localhost/justitia-test-glibc:latest >> "$L.import.log" 2>&1 \
  && timeout 120 ctr -a "$ctrd/containerd.sock" -n k8s.io images import "$run/pause-oci.tar" >> "$L.import.log" 2>&1 \
  && timeout 120 ctr -a "$ctrd/containerd.sock" -n k8s.io images import "$run/glibc-oci.tar" >> "$L.import.log" 2>&1 \
  && timeout 120 "${podman[@]}" save --format oci-archive -o "$run/musl-oci.tar" localhost/justitia-test-musl:latest >> "$L.import.log" 2>&1 \
  && timeout 120 ctr -a "$ctrd/containerd.sock" -n k8s.io images import "$run/musl-oci.tar" >> "$L.import.log" 2>&1 \
  || fail_rest "images into containerd: $(tail -n 3 "$L.import.log" | tr '\n' ' ')"
"$PLUGIN" --kubelet-dir "$kdir" --library "$run/lib/libjustitia.so" --socket "$run/registration/justitiad.sock" \
  --rescan 1s > "$L.plugin.log" 2>&1 &
plugin_pid=$!
uid=5f0c6a2e-7d1b-4c39-9e0a-3b2d1c4e5f60
# pod_client: the client in the pod, podrun in kubelet's place.
pod_client() {
  "$PODRUN" --kubelet-dir "$kdir" --runtime "$ctrd/containerd.sock" --image localhost/justitia-test-glibc:latest \
    --namespace team-a --pod writer --uid "$uid" --env JUSTITIA_CLASS=bandwidth \
    --env "JUSTITIA_STATS=/results/stats.%p.json" --mount "$out:/results" --pod-logs-dir "$run/pod-logs" \
    --timeout 150s -- "${WRITE_CLIENT[@]}" > "$L.pod.log" 2>&1
}
pair pod pod_client
[ -z "$PAIR_ERR" ] || fail_rest "$PAIR_ERR"
stats_of pod || fail_rest "the shaper wrote no statistics in the pod ($(head -n 3 "$L.pod.log" | tr '\n' ' '))"
split=$(stat_field "$STATS" split_requests)
[ "${split:-0}" -gt 0 ] || fail_rest "no request was split in the pod: $(tr -d '\n ' < "$STATS")"
flow=$(grep -m1 -E " bandwidth .* 3  namespace/team-a$" "$L.pod.flows")
[ -n "$flow" ] || fail_rest "justitiad listed no bandwidth flow of tenant namespace/team-a at weight 3: $(grep -v '^ *flow' "$L.pod.flows" | sort -u | head -n 3 | tr '\n' ' ')"
pass "$(grep -m1 'allocated' "$L.pod.log" | sed 's/^podrun: //'); split_requests=$split; justitia flows: $(echo "$flow" | awk '{print "pid", $3, "class", $4, "weight", $(NF-1), "tenant", $NF}')"

# 7b. A musl pod: the device plugin mounts the musl build, the runtime wrapper appends it to
# the pod's LD_PRELOAD after the image's own interposer. A check of its own.
musl_pod_check() {
  local rc split counted
  if [ ! -x "$musl_verbs/usr/bin/musl_write" ]; then
    fail_one "$musl_verbs/usr/bin/musl_write is not built"
    return
  fi
  # Without the wrapper first: runc itself, through the handler `plain`.
  rm -f "$out"/stats.*.json "$out/open_counter.txt"
  "$PODRUN" --kubelet-dir "$kdir" --runtime "$ctrd/containerd.sock" --runtime-handler plain \
    --image localhost/justitia-test-musl:latest --namespace team-a --pod musl-plain \
    --uid 3e9a7c15-6d2b-4f80-9c1e-5b4a3d2c1f08 --env JUSTITIA_CLASS=bandwidth \
    --env JUSTITIA_CHUNK=1K --env "JUSTITIA_STATS=/results/stats.%p.json" --mount "$out:/results" \
    --pod-logs-dir "$run/pod-logs" --timeout 90s -- /usr/bin/musl_write "$DEV" 16384 4 > "$L.musl-pod-plain.log" 2>&1
  rc=$?
  if [ "$rc" != 0 ] || ! grep -q "every byte checked" "$L.musl-pod-plain.log"; then
    fail_one "without the wrapper: exit $rc: $(grep -v '^podrun: ' "$L.musl-pod-plain.log" | head -c 300 | tr '\n' ' ')"
    return
  fi
  if stats_of musl-pod-plain; then
    fail_one "without the wrapper: statistics were written ($STATS), so something loaded the shaper"
    return
  fi
  rm -f "$out"/stats.*.json "$out/open_counter.txt"
  "$PODRUN" --kubelet-dir "$kdir" --runtime "$ctrd/containerd.sock" --image localhost/justitia-test-musl:latest \
    --namespace team-a --pod musl --uid 7c2d9e41-0b3a-4f58-8d6e-1a2b3c4d5e6f --env JUSTITIA_CLASS=bandwidth \
    --env JUSTITIA_CHUNK=1K --env "JUSTITIA_STATS=/results/stats.%p.json" --mount "$out:/results" \
    --pod-logs-dir "$run/pod-logs" --timeout 90s -- /usr/bin/musl_write "$DEV" 16384 4 > "$L.musl-pod.log" 2>&1
  rc=$?
  if [ "$rc" != 0 ] || ! grep -q "every byte checked" "$L.musl-pod.log"; then
    fail_one "exit $rc: $(grep -v '^podrun: ' "$L.musl-pod.log" | head -c 300 | tr '\n' ' ')"
    return
  fi
  if ! stats_of musl-pod; then
    fail_one "no statistics: the musl build was not loaded ($(grep -m1 justitia-runc "$L.containerd.log"))"
    return
  fi
  split=$(stat_field "$STATS" split_requests)
  counted=$(cat "$out/open_counter.txt" 2>/dev/null)
  rm -f "$out/open_counter.txt"
  if [ "${split:-0}" -lt 4 ]; then
    fail_one "expected its 4 WRITEs split: $(tr -d '\n ' < "$STATS")"
    return
  fi
  case $counted in
    "ibv_open_device calls: "[1-9]*) ;;
    *) fail_one "the image's own interposer did not see ibv_open_device (its count: '${counted:-none}')"
       return ;;
  esac
  pass "musl_write in a pod of containerd: through runc alone exit 0, no statistics; through justitia-runc exit 0, split_requests=$split, chunks=$(stat_field "$STATS" chunks); the image's interposer: $counted"
}
musl_pod_check

# 8. A rolling update of justitiad under a running pod. A DaemonSet's rolling update
# (maxUnavailable 1, as deploy/kubernetes/daemonset.yaml has it) stops the old pod (SIGTERM,
# SIGKILL after its grace period) before the new one starts from the new image, on the same
# host paths: here the running daemon gets SIGTERM, and a new one starts from a copy of the
# binary at another path (standing for the new image's) with the same configuration and
# sockets. The pod's ib_write_bw runs for ROLL_SECONDS (-D), from before the replacement to
# after it. No kubelet or DaemonSet controller runs: the test does their part.
ROLL_SECONDS=${CDI_ROLL_SECONDS:-20}
ROLL_PORT=$((PORT + 1))
# The DaemonSet's terminationGracePeriodSeconds.
GRACE=15
next_bin=$run/justitiad-next
mkdir -p "$next_bin"
cp "$BIN/justitiad" "$next_bin/justitiad" || fail_rest "cannot copy justitiad to $next_bin"
roll_uid=0b7e3f1a-52c4-4d8e-a6f9-7c1d2e3b4a50
# team_a_flow OUT: justitia flows into OUT; prints the first bandwidth flow of tenant
# namespace/team-a at weight 3 as "PID CLASS WEIGHT TENANT".
team_a_flow() {
  "$BIN/justitia" flows --socket "$run/admin/admin.sock" > "$1" 2>&1
  grep -m1 -E " bandwidth .* 3  namespace/team-a$" "$1" | awk '{print $3, $4, $(NF-1), $NF}'
}
# roll_once: a server on the guest and the pod's client; once the old daemon lists the
# client's flow, the daemon is replaced and the new one must list the same process while
# it still runs. Sets ROLL_ERR (empty when every step held), ROLL_CALIBRATION (perftest's
# calibration failed: the attempt proves nothing), BEFORE and AFTER (the flow as each
# daemon listed it), APP_PID, GAP (seconds from the old daemon's exit to the new one
# listing the flow), KILLED_OLD, and STATS (the shaper's statistics, moved to
# R.stats.json; empty when it wrote none).
roll_err() { ROLL_ERR="${ROLL_ERR:+$ROLL_ERR; }$1"; }
roll_once() { # ATTEMPT: logs in $L.roll.ATTEMPT.* (R), the old daemon's in R.justitiad-old.log
  local crc src deadline stopped_at term_rc
  R=$L.roll.$1
  ROLL_ERR="" ROLL_CALIBRATION="" BEFORE="" AFTER="" APP_PID="" GAP="" KILLED_OLD=""
  rm -f "$out"/stats.*.json
  timeout $((ROLL_SECONDS + 100)) ib_write_bw -d "$DEV" -x 0 -s 1048576 -D "$ROLL_SECONDS" -p "$ROLL_PORT" \
    > "$R.server.log" 2>&1 &
  spid=$!
  # A server that never listens shows in the client's error below.
  wait_tcp_listen "$ROLL_PORT" || true
  "$PODRUN" --kubelet-dir "$kdir" --runtime "$ctrd/containerd.sock" --image localhost/justitia-test-glibc:latest \
    --namespace team-a --pod roller --uid "$roll_uid" --env JUSTITIA_CLASS=bandwidth \
    --env "JUSTITIA_STATS=/results/stats.%p.json" --mount "$out:/results" --pod-logs-dir "$run/pod-logs" \
    --timeout $((ROLL_SECONDS + 90))s -- ib_write_bw -d "$DEV" -x 0 -s 1048576 -D "$ROLL_SECONDS" -p "$ROLL_PORT" \
    127.0.0.1 > "$R.log" 2>&1 &
  cpid=$!
  # The old daemon lists the pod's flow (the pod takes seconds to start under emulation).
  deadline=$((SECONDS + 60))
  while kill -0 "$cpid" 2> /dev/null && [ "$SECONDS" -lt "$deadline" ]; do
    BEFORE=$(team_a_flow "$R.before.flows")
    [ -n "$BEFORE" ] && break
    sleep 0.5
  done
  if [ -z "$BEFORE" ]; then
    roll_err "the old justitiad listed no bandwidth flow of namespace/team-a at weight 3: $(grep -v '^ *flow' "$R.before.flows" | head -n 3 | tr '\n' ' ')"
  else
    APP_PID=${BEFORE%% *}
    # SIGTERM; SIGKILL if the grace period passes, as kubelet does.
    kill -TERM "$dpid"
    deadline=$((SECONDS + GRACE))
    while kill -0 "$dpid" 2> /dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
    if kill -0 "$dpid" 2> /dev/null; then
      kill -KILL "$dpid"
      KILLED_OLD=" (SIGKILL after the $GRACE s grace period)"
    fi
    wait "$dpid"
    term_rc=$?
    stopped_at=$SECONDS
    dpid=""
    mv "$L.justitiad.log" "$R.justitiad-old.log"
    if [ "$term_rc" != 0 ] || ! grep -q "justitiad stopped" "$R.justitiad-old.log"; then
      roll_err "the old justitiad did not stop cleanly on SIGTERM$KILLED_OLD: exit $term_rc ($R.justitiad-old.log)"
    fi
    BIN=$next_bin daemon_start "$config" "$L.justitiad.log"
    dpid=$DAEMON_PID
    if ! daemon_wait "$L.justitiad.log" "$run/registration/justitiad.sock" 20; then
      roll_err "the new justitiad did not start: $DAEMON_ERR"
    else
      # The new daemon lists the same process, as the same tenant at the same weight.
      deadline=$((SECONDS + 30))
      while [ "$SECONDS" -lt "$deadline" ] && kill -0 "$APP_PID" 2> /dev/null; do
        AFTER=$(team_a_flow "$R.after.flows")
        [ "${AFTER%% *}" = "$APP_PID" ] && break
        AFTER=""
        sleep 0.5
      done
      GAP=$((SECONDS - stopped_at))
      if [ -z "$AFTER" ]; then
        roll_err "the new justitiad did not list pid $APP_PID (bandwidth, weight 3, namespace/team-a) in $GAP s: $(grep -v '^ *flow' "$R.after.flows" | head -n 3 | tr '\n' ' ')"
      elif ! kill -0 "$APP_PID" 2> /dev/null; then
        roll_err "pid $APP_PID had ended when the new justitiad listed it: not shown for a running application (raise CDI_ROLL_SECONDS)"
      fi
    fi
  fi
  wait "$cpid"
  crc=$?
  # A client that failed leaves the server waiting for it.
  [ "$crc" = 0 ] || kill "$spid" 2>/dev/null
  wait "$spid"
  src=$?
  spid=""
  if [ "$crc" != 0 ] || [ "$src" != 0 ]; then
    roll_err "client exit $crc, server exit $src: $(grep -h -m2 -i -E 'podrun|error|fail|cannot|ld.so|not found' "$R.log" "$R.server.log" | tr '\n' ' ')"
    grep -q "Can't produce a report" "$R.log" "$R.server.log" \
      && grep -q "Correlation coefficient" "$R.log" "$R.server.log" && ROLL_CALIBRATION=yes
  fi
  stats_of "roll.$1"
}
roll_started=$SECONDS
for attempt in 1 2; do
  roll_once "$attempt"
  [ -n "$ROLL_CALIBRATION" ] || break
  ROLL_ERR="$ROLL_ERR (perftest's calibration failed $attempt times)"
done
[ -z "$ROLL_ERR" ] || fail_rest "$ROLL_ERR"
# The application's own report: 1 MiB messages, and the iterations of its -D run.
counts=$(awk '/#bytes/ && /#iterations/ {h = 1; next} h && $1 ~ /^[0-9]+$/ {print $1 "x" $2; exit}' "$R.log")
case $counts in
  1048576x[1-9]*) ;;
  *) fail_rest "ib_write_bw in the pod exited 0 without its report (counts '${counts:-none}', $R.log)" ;;
esac
[ -n "$STATS" ] || fail_rest "the shaper wrote no statistics in the pod ($(head -n 3 "$R.log" | tr '\n' ' '))"
split=$(stat_field "$STATS" split_requests)
gone_split=$(stat_field "$STATS" split_while_daemon_gone)
fallbacks=$(stat_field "$STATS" daemon_fallbacks)
connections=$(stat_field "$STATS" daemon_connections)
# One loss and one reconnection, the replacement's: no other break in between.
[ "${fallbacks:-x}" = 1 ] && [ "${connections:-x}" = 2 ] \
  || fail_rest "expected daemon_fallbacks=1 and daemon_connections=2 ($STATS): $(tr -d '\n ' < "$STATS")"
[ "${gone_split:-0}" -gt 0 ] && [ "${split:-0}" -ge "$gone_split" ] \
  || fail_rest "no request split while no daemon answered ($STATS): $(tr -d '\n ' < "$STATS")"
grep -q "is gone; static settings" "$R.log" && grep -q "is back; the flow registers again" "$R.log" \
  || fail_rest "the shaper did not say that it fell back and registered again ($R.log)"
read -r _ class weight tenant <<< "$AFTER"
retried=""
[ "$attempt" = 1 ] || retried=" (a second attempt: perftest's calibration failed in the first, $L.roll.1.log)"
pass "pid $APP_PID listed by the old justitiad, and by the new one (a copy at $next_bin) $GAP s after the old one stopped on SIGTERM$KILLED_OLD, still running: class $class, weight $weight, tenant $tenant; stats: split_requests=$split, split_while_daemon_gone=$gone_split, daemon_fallbacks=$fallbacks, daemon_connections=$connections; ib_write_bw -D $ROLL_SECONDS: exit 0, $counts; $((SECONDS - roll_started)) s for the check$retried"

kill -TERM "$dpid" 2>/dev/null
wait "$dpid" 2>/dev/null
dpid=""
cleanup
