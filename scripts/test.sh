#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit/property/regression tests, and the
# real-verbs tests in a QEMU guest with Soft-RoCE.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# stage NAME: a stage's heading, with the seconds the test command has run so far, so that
# a slow run shows where its time went.
stage() { echo "== $1 (at ${SECONDS} s)"; }
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"

stage "cargo fmt --check"
cargo fmt --all --check
stage "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
stage "cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet
stage "cargo test"
cargo test --workspace --locked
stage "the shaper as it ships: glibc 2.17 and musl builds, audited and loaded into a musl program"
scripts/build-shaper.sh
cargo test -p justitia-preload --locked --test portable -- --include-ignored
stage "peer channel: 30 s of structure-aware fuzzing of the message parser and channel"
# Mutated, partly re-signed messages (the HMAC tag would stop blind inputs); see the test.
JUSTITIA_FUZZ_SECS=30 cargo test -p justitia-peer --locked --test fuzz -- --ignored --nocapture
stage "the shaper's stress test under valgrind memcheck (use after free, invalid reads)"
# Memcheck on the test binary cargo test built (no second build); helgrind and TSan would
# flag parking_lot's futex locks, which they cannot see. About 10 s.
shaper_tests=$(cargo test --locked -q -p justitia-preload --lib --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "justitia":
        print(m["executable"])')
valgrind --tool=memcheck --error-exitcode=99 --leak-check=no -q "$shaper_tests" --test-threads=1 \
    tests::stress
stage "loom: the shaper's quick ring, every interleaving of post, poll, close, reopen and destroy"
# The ring module alone, built against loom's atomics in a target directory of its own (the
# cfg changes every crate's build). About 10 s of checking after the first build.
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/loom" \
    cargo test --locked -q -p justitia-preload --lib ring
stage "justitiad under hostile tenants, and its tests as other uids (root: uids 65534, 2001-2004)"
if [ "$(id -u)" = 0 ]; then
    cargo test -p justitia-daemon --locked --test attacks -- --ignored --test-threads=1
    cargo test -p justitia-daemon --locked --test daemon -- --ignored
else
    echo "not root: these tests act as other uids and need root; not run" >&2
fi
stage "systemd unit hardening (systemd-analyze security; fails above 2.0)"
systemd-analyze security --offline=yes --threshold=20 packaging/justitiad.service | tail -n 1
stage "docs/calibration.md is current"
# The release binaries the guest suite runs, built here (the suite's same build then has
# nothing to do), so that the validation runs at release speed: 7 s, not a minute.
cargo build --release --locked -q -p justitia-daemon --bin justitiad -p justitia-cli --bin justitia \
    -p justitia-loadgen --bin justitia-loadgen
calibration="$(mktemp)"
"${CARGO_TARGET_DIR:-target}/release/justitia" validate --markdown "$calibration" >/dev/null 2>&1
if ! diff -u docs/calibration.md "$calibration"; then
    rm -f "$calibration"
    echo "docs/calibration.md differs from what the validation table and the model give now;" >&2
    echo "regenerate it: cargo run --release -p justitia-cli -- validate --markdown docs/calibration.md" >&2
    exit 1
fi
rm -f "$calibration"
stage "deployment files (manifests, Dockerfile, CDI spec: deploy/validate)"
deploy/validate/check.sh
stage "real verbs (Soft-RoCE in a QEMU guest)"
tests/vm/run-tests.sh
