#!/usr/bin/env bash
# The main job: builds the project and runs the headline experiment in the simulator, a 16 B
# latency flow against a 1 MB bandwidth flow on IB-56, alone, natively and under Justitia.
# Prints the table and writes figures (SVG) and data (JSON, CSV) to out/.
# Other scenarios can be named instead: scripts/run.sh scenarios/tput-vs-1mb-bw-ib56.toml
set -euo pipefail
cd "$(dirname "$0")/.."
JUSTITIA_SKIP_APT=${JUSTITIA_SKIP_APT:-1} scripts/setup.sh
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --locked -p justitia-cli
if [ "$#" -eq 0 ]; then
  set -- scenarios/lat-vs-1mb-bw-ib56.toml
fi
exec "${CARGO_TARGET_DIR:-target}/release/justitia" sim --out out --plot out "$@"
