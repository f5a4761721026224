#!/bin/bash
# Inside the guest (in the chroot, rxe0 up): the CDI spec `justitia cdi` writes for this
# host, used as a container runtime would use it. Run from suite.sh's daemon section, or
# alone:
#
#   tests/vm/guest.sh --timeout 300 -- tests/vm/guest/cdi.sh RESULTS BIN_DIR SHAPER_LIB VALIDATOR
#
# BIN_DIR holds justitiad and justitia (cargo build --release), SHAPER_LIB libjustitia.so,
# VALIDATOR deploy/validate's program. As the DaemonSet's init container does, the library
# is copied to a host directory and the spec written from the guest's sysfs, with the
# registration socket in a scratch directory; justitiad starts from packaging/justitiad.toml
# with its sockets moved there. Then:
#
# 1. The spec passes the CDI project's validation and lists rxe0 with its verbs node.
# 2. The CDI library applies justitia.io/rdma=rxe0-bandwidth to a container whose own
#    environment sets JUSTITIA_CLASS=latency (the spec's value must win: CDI edits replace
#    a variable of the same name), and ib_write_bw (1 MiB WRITEs) runs with exactly the
#    resulting environment and mounts: a private mount namespace (unshare -m) with each
#    mount bound read-only at its container path, a tmpfs on /opt standing for the
#    container's writable layer, and `env -i`. Its shaper must split requests (its
#    statistics) and register a bandwidth flow under that pid with the daemon (its log).
# 3. justitia.io/rdma=rxe0-unshaped, the opt-out, carries the device nodes and nothing else.
#
# One line per check goes to RESULTS/results.txt as in suite.sh; logs to RESULTS/logs/cdi.*.
set -uo pipefail

RESULTS=$1
BIN=$2
LIB=$3
VALIDATOR=$4
# shellcheck source=tests/vm/guest/daemon-lib.sh
source "$(dirname "$0")/daemon-lib.sh"
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
CHECKS=("cdi: justitia cdi's spec for this host passes CDI's validation"
  "cdi: ib_write_bw with the spec's env and mounts applied is shaped and registers with justitiad"
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

for f in "$BIN/justitiad" "$BIN/justitia" "$LIB" "$VALIDATOR"; do
  [ -e "$f" ] || fail_rest "$f is not built"
done

# 1. What the DaemonSet's init container does, with host paths in the scratch directory.
mkdir -p "$run/lib" "$run/registration" "$run/admin" "$run/cdi"
cp "$LIB" "$run/lib/libjustitia.so"
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
pass "$(cat "$L.validate.log" | sed 's|^[^ ]*: ||'); $DEV is /dev/infiniband/$uverbs"

# 2. The daemon, with its registration socket where the spec binds it.
config=$run/justitiad.toml
daemon_config "$config" "$run/registration/justitiad.sock" "$run/admin/admin.sock" "" || fail_rest "$DAEMON_ERR"
daemon_start "$config" "$L.justitiad.log"
dpid=$DAEMON_PID
daemon_wait "$L.justitiad.log" "$run/registration/justitiad.sock" 20 || fail_rest "justitiad did not start: $DAEMON_ERR"

# The container's own environment, then what the CDI library makes of it with the device.
stats=$run/stats.%p.json
if ! "$VALIDATOR" inject "$spec" justitia.io/rdma=rxe0-bandwidth "PATH=/usr/sbin:/usr/bin:/sbin:/bin" \
  "JUSTITIA_CLASS=latency" "JUSTITIA_STATS=$stats" > "$L.edits.txt" 2> "$L.inject.err"; then
  fail_rest "the CDI library did not apply the device: $(tr '\n' ' ' < "$L.inject.err")"
fi
env_words=()
mounts=()
while read -r kind a b c; do
  case $kind in
    env) env_words+=("$a") ;;
    mount) mounts+=("$a $b $c") ;;
    device) [ -e "$a" ] || fail_rest "the spec names device node $a, which this host lacks" ;;
  esac
done < "$L.edits.txt"
if ! printf '%s\n' "${env_words[@]}" | grep -qx "JUSTITIA_CLASS=bandwidth" \
  || printf '%s\n' "${env_words[@]}" | grep -q "JUSTITIA_CLASS=latency"; then
  fail_rest "the container's JUSTITIA_CLASS=latency was not replaced by the device's bandwidth: $(tr '\n' ' ' < "$L.edits.txt")"
fi
if [ "${#mounts[@]}" != 2 ] || ! grep -qx "device /dev/infiniband/$uverbs" "$L.edits.txt"; then
  fail_rest "expected two mounts and /dev/infiniband/$uverbs: $(tr '\n' ' ' < "$L.edits.txt")"
fi

# The runner: what runc does with these mounts, in a private mount namespace. Arguments:
# the mounts ("SRC DST OPTIONS" words), "--", then the command.
runner=$run/runner.sh
cat > "$runner" << 'RUNNER'
#!/bin/bash
set -e
# The container's writable layer, where the runtime creates mount points.
mount -t tmpfs -o mode=0755 tmpfs /opt
while [ "$1" != -- ]; do
  read -r src dst opts <<< "$1"
  shift
  if [ -d "$src" ]; then mkdir -p "$dst"; else mkdir -p "$(dirname "$dst")"; [ -e "$dst" ] || touch "$dst"; fi
  mount --bind "$src" "$dst"
  # The options other than bind, applied as runc applies them: a read-only remount.
  mount -o "remount,bind,$(echo "$opts" | tr ',' '\n' | grep -vx bind | paste -sd ,)" "$dst"
done
shift
exec "$@"
RUNNER
chmod +x "$runner"
ib_write_bw -d "$DEV" -x 0 -s 1048576 -n 100 -p "$PORT" > "$L.server.log" 2>&1 &
spid=$!
for _ in $(seq 100); do
  ss -Hltn "sport = :$PORT" 2>/dev/null | grep -q . && break
  sleep 0.1
done
timeout 150 unshare -m --propagation private "$runner" "${mounts[@]}" -- \
  env -i "${env_words[@]}" ib_write_bw -d "$DEV" -x 0 -s 1048576 -n 100 -p "$PORT" localhost > "$L.client.log" 2>&1 &
cpid=$!
wait "$cpid"
crc=$?
wait "$spid"
src=$?
spid=""
if [ "$crc" != 0 ] || [ "$src" != 0 ]; then
  fail_rest "client exit $crc, server exit $src: $(grep -h -m1 -i -E 'error|fail|cannot|ld.so' "$L.client.log" "$L.server.log")"
fi
f=$(ls "$run"/stats.*.json 2>/dev/null | head -n 1)
if [ -z "$f" ]; then
  fail_rest "the shaper wrote no statistics: it was not in the client's data path ($(head -n 3 "$L.client.log" | tr '\n' ' '))"
fi
cp "$f" "$L.stats.json"
split=$(grep -o '"split_requests": *[0-9]*' "$f" | grep -o '[0-9]*$')
chunks=$(grep -o '"chunks": *[0-9]*' "$f" | grep -o '[0-9]*$')
pid=${f##*/stats.}
pid=${pid%.json}
registered=$(grep "flow registered" "$L.justitiad.log" | grep "pid=$pid " | head -n 1)
if ! [ "${split:-0}" -gt 0 ]; then
  fail_rest "no request was split: $(tr -d '\n ' < "$f")"
fi
if ! echo "$registered" | grep -q "class=bandwidth"; then
  fail_rest "no bandwidth flow registered for pid $pid: $(grep "flow registered" "$L.justitiad.log" | tail -n 2 | tr '\n' ' ')"
fi
pass "split_requests=$split chunks=$chunks; justitiad: $(echo "$registered" | grep -o 'pid=[0-9]* flow=[0-9]* class=[a-z]*')"

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
