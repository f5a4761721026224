#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit/property/regression tests, and the
# real-verbs tests in a QEMU guest with Soft-RoCE.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet
echo "== cargo test"
cargo test --workspace --locked
echo "== docs/calibration.md is current"
calibration="$(mktemp)"
cargo run -q --locked -p justitia-cli -- validate --markdown "$calibration" >/dev/null 2>&1
if ! diff -u docs/calibration.md "$calibration"; then
    rm -f "$calibration"
    echo "docs/calibration.md differs from what the validation table and the model give now;" >&2
    echo "regenerate it: cargo run --release -p justitia-cli -- validate --markdown docs/calibration.md" >&2
    exit 1
fi
rm -f "$calibration"
echo "== deployment files (manifests, Dockerfile, CDI spec: deploy/validate)"
deploy/validate/check.sh
echo "== real verbs (Soft-RoCE in a QEMU guest)"
tests/vm/run-tests.sh
