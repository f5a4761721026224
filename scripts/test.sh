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
echo "== cargo test"
cargo test --workspace --locked
echo "== real verbs (Soft-RoCE in a QEMU guest)"
tests/vm/run-tests.sh
