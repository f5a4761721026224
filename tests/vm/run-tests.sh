#!/usr/bin/env bash
# The real-verbs test suite: boots one QEMU guest with Soft-RoCE and runs, inside it,
# transparency runs of ibv_rc_pingpong, rping and perftest with and without the shaper,
# splitting runs with 1 MiB messages, the data-integrity checker, the test applications
# of tests/vm/apps (dlopen and ctypes, rdma_cm churn, destroy with work held, the hang
# case), and justitiad probing rxe0 (tests/vm/guest/suite.sh, tests/vm/guest/daemon.sh);
# then two guests as two RDMA hosts joined by a virtual cable (tests/vm/two-hosts.sh).
#
# Prints one line per test, then exactly "vm: N passed, M failed"; exits non-zero on any
# failure. When a prerequisite is missing it says which and skips (exit 0), except in CI
# (CI=true), where setup should have installed it, so it fails.
#
# Environment: VM_SUITE_TIMEOUT (seconds for the whole guest run, default 3000),
# VM_PAIR_TIMEOUT (seconds for the two-host pair's run, default 1800),
# INTEGRITY_TRANSFERS (per checker run, default 100), HANG_TIMEOUT, DESTROY_ITERATIONS,
# CM_CONNECTIONS, CM_FD_SLACK, CM_RSS_SLACK_KB (the application tests, see the README),
# CARGO_TARGET_DIR.
set -uo pipefail
# shellcheck source=tests/vm/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$VM_REPO" || exit 1
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"

in_ci() { [ "${CI:-}" = true ] || [ "${CI:-}" = 1 ]; }

# A prerequisite is missing: skip outside CI, fail in it.
missing() {
  if in_ci; then
    echo "FAIL vm prerequisites: $*"
    echo "vm: 0 passed, 1 failed"
    exit 1
  fi
  echo "SKIPPED vm tests: $* (run scripts/setup.sh as root to install)"
  exit 0
}

prereqs=$(vm_missing_prereqs | paste -sd ';' | sed 's/;/; /g')
[ -z "$prereqs" ] || missing "missing $prereqs"
if ! kdir=$(vm_ensure_kernel); then
  missing "no guest kernel (apt-get download linux-image-6.1.0-NN-amd64 failed and none is cached in $VM_CACHE)"
fi
vm_log "guest kernel $(cat "$kdir/version")"

target=${CARGO_TARGET_DIR:-$VM_REPO/target}
locked=()
in_ci && locked=(--locked)
fails=0
passes=0

echo "vm: building justitia-integrity (release) (at ${SECONDS} s)"
if ! cargo build --release "${locked[@]}" -q -p justitia-integrity; then
  echo "FAIL build justitia-integrity"
  echo "vm: 0 passed, 1 failed"
  exit 1
fi
lib=-
if [ -f crates/preload/Cargo.toml ]; then
  # The build that ships (glibc 2.17 baseline, zig's linker), so that every run under the
  # shaper below is a run of what operators inject.
  echo "vm: building the shaper as it ships (scripts/build-shaper.sh) (at ${SECONDS} s)"
  if scripts/build-shaper.sh > "$target/build-shaper.log" 2>&1 && [ -f "$target/shaper/glibc/libjustitia.so" ]; then
    lib=$target/shaper/glibc/libjustitia.so
  else
    echo "FAIL build the shaper: $(tail -n 3 "$target/build-shaper.log" | tr '\n' ' ')"
    fails=$((fails + 1))
  fi
else
  echo "vm: the shaper is not built (crates/preload does not exist yet): runs under the shaper are skipped"
fi

# The test applications (C programs built with the host's compiler against its
# libibverbs and librdmacm headers; the Python one needs no build).
apps=$target/vm-apps
echo "vm: building the test applications (tests/vm/apps) into $apps (at ${SECONDS} s)"
if ! tests/vm/apps/build.sh "$apps" > "$target/vm-apps.build.log" 2>&1; then
  echo "FAIL build the test applications: $(grep -m1 -E 'error|not found' "$target/vm-apps.build.log") (log: $target/vm-apps.build.log)"
  fails=$((fails + 1))
  apps=-
fi
# The musl image's verbs program (tests/vm/guest/cdi.sh): libibverbs and the rxe provider
# built with musl-gcc from rdma-core's source, which cargo fetches from crates.io (the
# ibverbs-sys crate vendors it); beside the applications, in $apps/musl-verbs.
if [ "$apps" != - ]; then
  echo "vm: building the musl verbs program (tests/vm/apps/build-musl-verbs.sh) into $apps/musl-verbs (at ${SECONDS} s)"
  if ! tests/vm/apps/build-musl-verbs.sh "$apps/musl-verbs" > "$target/vm-musl-verbs.build.log" 2>&1; then
    echo "FAIL build the musl verbs program: $(grep -m1 -E 'error|not found|build-musl-verbs.sh:' "$target/vm-musl-verbs.build.log") (log: $target/vm-musl-verbs.build.log)"
    fails=$((fails + 1))
  fi
fi

# The Debian 11 image's root (tests/vm/guest/cdi.sh): bullseye's packages from
# deb.debian.org unpacked, and dlopen_app built for glibc 2.17; in $apps/old-glibc-root.
if [ "$apps" != - ]; then
  echo "vm: assembling the glibc 2.31 image's root (tests/vm/apps/build-old-glibc-root.sh) into $apps/old-glibc-root (at ${SECONDS} s)"
  if ! tests/vm/apps/build-old-glibc-root.sh "$apps/old-glibc-root" > "$target/vm-old-glibc.build.log" 2>&1; then
    echo "FAIL assemble the glibc 2.31 image's root: $(grep -m1 'build-old-glibc-root.sh:' "$target/vm-old-glibc.build.log") (log: $target/vm-old-glibc.build.log)"
    fails=$((fails + 1))
  fi
fi

# The shaper linked against this machine's glibc, as cargo builds it: the old glibc check
# in tests/vm/guest/cdi.sh shows it stopping a Debian 11 program at load.
host_lib=-
if cargo build "${locked[@]}" -q -p justitia-preload --lib; then
  host_lib=$target/debug/libjustitia.so
else
  echo "FAIL build the shaper linked against this machine's glibc"
  fails=$((fails + 1))
fi

# The guest's binaries, in one directory: release builds of what ships (one cargo
# invocation, so that both cores stay busy), and the test tools (justitia-daemon's example
# scrape, justitia-agent's register, justitia-verbs' completion_stamps, ud_datagrams and
# send_datagram) as the workspace's tests built them: a release build
# of an example compiles its package's dev-dependencies (criterion, proptest, a regex
# engine) for nothing.
daemon_bins=-
echo "vm: building justitiad, justitia and the load generator (release) (at ${SECONDS} s)"
if cargo build --release "${locked[@]}" -q -p justitia-daemon --bin justitiad -p justitia-cli --bin justitia \
    -p justitia-loadgen --bin justitia-loadgen \
  && cargo build "${locked[@]}" -q --workspace --examples; then
  daemon_bins=$target/vm-bin
  mkdir -p "$daemon_bins/examples"
  cp -f "$target/release/justitiad" "$target/release/justitia" "$target/release/justitia-loadgen" \
    "$target/release/justitia-integrity" "$daemon_bins/"
  cp -f "$target/debug/examples/scrape" "$target/debug/examples/register" \
    "$target/debug/examples/completion_stamps" "$target/debug/examples/ud_datagrams" \
    "$target/debug/examples/send_datagram" "$daemon_bins/examples/"
else
  echo "FAIL build justitiad and its test tools"
  fails=$((fails + 1))
fi

# The Go programs of tests/vm/guest/cdi.sh: deploy/validate applies the CDI spec's edits,
# justitia-device-plugin answers Allocate, and podrun plays kubelet in front of containerd.
cdi_validator=- device_plugin=- podrun=-
echo "vm: building deploy/validate, deploy/device-plugin and tests/vm/podrun (Go) (at ${SECONDS} s)"
if (command -v go > /dev/null || export PATH="$PATH:/usr/local/go/bin"
  export GOFLAGS=-mod=readonly
  (cd deploy/validate && go build -o "$target/deploy-validate" .) \
    && (cd deploy/device-plugin && go build -o "$target/justitia-device-plugin" .) \
    && (cd tests/vm/podrun && go build -o "$target/podrun" .)); then
  cdi_validator=$target/deploy-validate device_plugin=$target/justitia-device-plugin podrun=$target/podrun
else
  echo "FAIL build the Go programs of the CDI and containerd checks"
  fails=$((fails + 1))
fi

mkdir -p "$target/vm"
out=$(mktemp -d "$target/vm/suite.XXXXXX")
echo "vm: booting the guest (logs in $out) (at ${SECONDS} s)"
start=$(date +%s)
vm_write_job "$out" env STEP_TIMEOUT="${STEP_TIMEOUT:-150}" INTEGRITY_TRANSFERS="${INTEGRITY_TRANSFERS:-100}" \
  CDI_VALIDATOR="$cdi_validator" DEVICE_PLUGIN="$device_plugin" PODRUN="$podrun" HOST_LIB="$host_lib" HANG_TIMEOUT="${HANG_TIMEOUT:-60}" DESTROY_ITERATIONS="${DESTROY_ITERATIONS:-100}" \
  CM_CONNECTIONS="${CM_CONNECTIONS:-2000}" CM_PLAIN_CONNECTIONS="${CM_PLAIN_CONNECTIONS:-400}" CM_FD_SLACK="${CM_FD_SLACK:-16}" CM_RSS_SLACK_KB="${CM_RSS_SLACK_KB:-4096}" \
  tests/vm/guest/suite.sh "$out" "$lib" "$target/release/justitia-integrity" "$apps" "$daemon_bins"
vm_boot "$out" "${VM_SUITE_TIMEOUT:-3000}"
rc=$?
echo "vm: guest ran for $(($(date +%s) - start)) s"

skips=0
count_results() { # RESULTS_FILE
  [ -f "$1" ] || return 0
  while IFS= read -r line; do
    echo "$line"
    case $line in
      PASS\ *) passes=$((passes + 1)) ;;
      FAIL\ *) fails=$((fails + 1)) ;;
      SKIP\ *) skips=$((skips + 1)) ;;
    esac
  done < "$1"
}
count_results "$out/results.txt"
if [ "$rc" != 0 ]; then
  echo "FAIL vm suite: the guest run ended with status $rc (see $out/job.log and $out/console.log)"
  fails=$((fails + 1))
  tail -n 20 "$out/job.log" 2>/dev/null | sed 's/^/  job: /'
  tail -n 20 "$out/console.log" 2>/dev/null | sed 's/^/  console: /'
fi

# Two RDMA hosts: a second boot, of two guests joined by a virtual cable, each with its own
# Soft-RoCE device and justitiad, and a third on a second cable into B for the incast
# (tests/vm/two-hosts.sh, tests/vm/guest/two-hosts.sh).
if [ "$lib" = - ] || [ "$daemon_bins" = - ]; then
  echo "SKIP two hosts: the shaper or justitiad is not built"
  skips=$((skips + 1))
else
  pair=$out/two-hosts
  echo "vm: booting the two-host pair (logs in $pair) (at ${SECONDS} s)"
  start=$(date +%s)
  # In the same boot, after the pair's checks: shaped WRITE streams across the cable
  # (tests/vm/guest/pair-write.sh), two rounds a mode; then isolation measured across
  # the cable made a wire of 8 Mbit/s (tests/vm/guest/wire.sh).
  tests/vm/two-hosts.sh --timeout "${VM_PAIR_TIMEOUT:-1800}" --out "$pair" -- \
    bash -c 'env STEP_TIMEOUT="$0" tests/vm/guest/two-hosts.sh "$@"; rc=$?
      PAIR_WRITE_ROUNDS=2 tests/vm/guest/pair-write.sh "$@" || rc=1
      tests/vm/guest/wire.sh "$@" || rc=1
      exit $rc' "${STEP_TIMEOUT:-150}" "$pair" "$lib" "$daemon_bins" > "$out/two-hosts.log" 2>&1
  rc=$?
  echo "vm: the two-host pair ran for $(($(date +%s) - start)) s"
  count_results "$pair/results.txt"
  if [ "$rc" != 0 ]; then
    echo "FAIL vm two hosts: the pair's run ended with status $rc (see $out/two-hosts.log, $pair/console.log, $pair/b/console.log and $pair/c/console.log)"
    fails=$((fails + 1))
    tail -n 20 "$out/two-hosts.log" | sed 's/^/  job: /'
  fi
fi
[ "$skips" = 0 ] || echo "vm: $skips skipped"
echo "vm: $passes passed, $fails failed"
[ "$fails" = 0 ]
