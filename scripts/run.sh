#!/usr/bin/env bash
# The main job: builds the project and runs the demo on the built-in simulated RNIC.
set -euo pipefail
cd "$(dirname "$0")/.."
JUSTITIA_SKIP_APT=${JUSTITIA_SKIP_APT:-1} scripts/setup.sh
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --locked -p justitia-cli
exec target/release/justitia demo "$@"
