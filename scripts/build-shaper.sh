#!/usr/bin/env bash
# Builds the shaper as it ships: libjustitia.so for every glibc from 2.17 on, and for musl.
#
#   scripts/build-shaper.sh [OUTDIR]     (default: $CARGO_TARGET_DIR/shaper, or target/shaper)
#
# writes OUTDIR/glibc/libjustitia.so and OUTDIR/musl/libjustitia.so. A library built the
# ordinary way links against the build machine's glibc and asks for its newest symbol
# versions (GLIBC_2.34 on Debian 12), which an image with an older glibc refuses before
# `main`; and Rust's unwinder comes from libgcc_s, which slim images lack. cargo-zigbuild
# links against zig's glibc 2.17 stubs and zig's own static unwinder instead, and builds the
# musl variant the same way. `crates/preload/tests/portable.rs` audits what this writes.
#
# The tools (cargo-zigbuild and zig, both from PyPI) are installed by scripts/setup.sh into
# $JUSTITIA_TOOLS (default ~/.cache/justitia/tools); the musl target by rustup.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
tools=${JUSTITIA_TOOLS:-$HOME/.cache/justitia/tools}
if [ ! -x "$tools/bin/cargo-zigbuild" ]; then
  echo "build-shaper.sh: cargo-zigbuild is not in $tools; run scripts/setup.sh" >&2
  exit 1
fi
export PATH="$tools/bin:$PATH"
target=${CARGO_TARGET_DIR:-target}
out=${1:-$target/shaper}
# A target directory of its own: zig as the linker changes every crate's build.
portable=$target/portable

# glibc: the oldest baseline still in the field (CentOS 7, RHEL 7), as manylinux2014.
cargo zigbuild --quiet --release --locked -p justitia-preload --lib \
  --target x86_64-unknown-linux-gnu.2.17 --target-dir "$portable"
# musl: a shared library needs the dynamic C library (musl links statically by default).
CARGO_TARGET_X86_64_UNKNOWN_LINUX_MUSL_RUSTFLAGS="-C target-feature=-crt-static" \
  cargo zigbuild --quiet --release --locked -p justitia-preload --lib \
  --target x86_64-unknown-linux-musl --target-dir "$portable"

install -D -m 0755 "$portable/x86_64-unknown-linux-gnu/release/libjustitia.so" "$out/glibc/libjustitia.so"
install -D -m 0755 "$portable/x86_64-unknown-linux-musl/release/libjustitia.so" "$out/musl/libjustitia.so"
echo "build-shaper.sh: $out/glibc/libjustitia.so (glibc 2.17 and later), $out/musl/libjustitia.so (musl)"
