#!/usr/bin/env bash
# Builds a musl verbs program for the guest's musl image (tests/vm/guest/cdi.sh):
#
#   tests/vm/apps/build-musl-verbs.sh OUTDIR
#
# rdma-core is not part of this repository and no musl build of it is packaged on the
# machines: its source comes from crates.io, where the ibverbs-sys crate (0.3.2+55.0)
# vendors rdma-core v55.0, fetched by cargo through a scratch manifest. libibverbs and the
# rxe provider are built from it with musl-gcc as shared libraries (cmake and ninja, one
# job), without libnl (no neighbour resolution: Soft-RoCE's loopback needs none), udev,
# systemd or valgrind, and against the build machine's kernel UAPI headers (linux/, asm/,
# asm-generic/ from Debian's linux-libc-dev, which musl-gcc's include path leaves out).
# The program, musl_write.c, is linked against that libibverbs.so as applications link it,
# dynamically against musl's C library: the shaper's musl build interposes the exported
# verbs (LD_PRELOAD) and takes over the context's operations at ibv_open_device, which a
# program with libibverbs linked in statically would never let it see.
#
# OUTDIR gets the image's part, laid out as an Alpine system has it:
#   OUTDIR/usr/bin/musl_write
#   OUTDIR/usr/lib/libibverbs.so.1 (and its versioned file)
#   OUTDIR/usr/lib/libibverbs/librxe-rdmav34.so    (the build's provider directory)
#   OUTDIR/etc/libibverbs.d/rxe.driver
# The work (the scratch manifest, the cmake build) goes to $MUSL_VERBS_WORK, by default
# $CARGO_TARGET_DIR/musl-verbs or target/musl-verbs. Every step's failure stops the script
# with a message and a non-zero status.
set -euo pipefail
src=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$src/../../.." && pwd)
out=${1:?usage: build-musl-verbs.sh OUTDIR}
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
work=${MUSL_VERBS_WORK:-${CARGO_TARGET_DIR:-$repo/target}/musl-verbs}
for tool in cargo musl-gcc cmake ninja python3; do
  command -v "$tool" > /dev/null || { echo "build-musl-verbs.sh: $tool is not installed (scripts/setup.sh)" >&2; exit 1; }
done
mkdir -p "$work/fetch/src" "$out"
work=$(cd "$work" && pwd)
out=$(cd "$out" && pwd)

# 1. rdma-core's source, as the ibverbs-sys crate ships it.
cat > "$work/fetch/Cargo.toml" << 'EOF'
# Written by tests/vm/apps/build-musl-verbs.sh: only to have cargo fetch rdma-core's
# source (vendored by ibverbs-sys); nothing here is built.
[package]
name = "musl-verbs-fetch"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
ibverbs-sys = "=0.3.2"

[workspace]
EOF
: > "$work/fetch/src/lib.rs"
cargo fetch --quiet --manifest-path "$work/fetch/Cargo.toml"
crate=$(cargo metadata --quiet --format-version 1 --manifest-path "$work/fetch/Cargo.toml" \
  | python3 -c 'import json, sys, os
m = json.load(sys.stdin)
print(next(os.path.dirname(p["manifest_path"]) for p in m["packages"] if p["name"] == "ibverbs-sys"))')
rdma=$crate/vendor/rdma-core
[ -f "$rdma/CMakeLists.txt" ] || { echo "build-musl-verbs.sh: no rdma-core in $crate" >&2; exit 1; }

# 2. The kernel's UAPI headers where musl-gcc finds them, and nothing else of glibc's.
kinc=$work/kernel-include
mkdir -p "$kinc"
for d in /usr/include/linux /usr/include/asm-generic /usr/include/x86_64-linux-gnu/asm; do
  [ -d "$d" ] || { echo "build-musl-verbs.sh: $d is missing (Debian's linux-libc-dev)" >&2; exit 1; }
  ln -sfn "$d" "$kinc/$(basename "$d")"
done
nopc=$work/no-pkg-config
mkdir -p "$nopc"

# 3. libibverbs and the rxe provider, shared, with musl-gcc.
build=$work/build
if [ ! -f "$build/build.ninja" ]; then
  PKG_CONFIG_LIBDIR=$nopc PKG_CONFIG_PATH= CC=musl-gcc CFLAGS="-isystem $kinc" \
    cmake -S "$rdma" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX=/usr -DCMAKE_INSTALL_LIBDIR=lib -DCMAKE_INSTALL_SYSCONFDIR=/etc \
    -DENABLE_RESOLVE_NEIGH=0 -DENABLE_VALGRIND=0 -DENABLE_STATIC=0 -DNO_PYVERBS=1 -DNO_MAN_PAGES=1 \
    -DIOCTL_MODE=both
fi
ninja -C "$build" -j 1 ibverbs rxe-rdmav34

# 4. The program, against the headers and library just built, and the image's part.
mkdir -p "$out/usr/bin" "$out/usr/lib/libibverbs" "$out/etc/libibverbs.d"
musl-gcc -O2 -g -Wall -Wextra -Werror -std=gnu11 -isystem "$kinc" -I "$build/include" \
  -o "$out/usr/bin/musl_write" "$src/musl_write.c" -L "$build/lib" -libverbs
lib=$(readlink -f "$build/lib/libibverbs.so.1")
install -m 0755 "$lib" "$out/usr/lib/$(basename "$lib")"
ln -sfn "$(basename "$lib")" "$out/usr/lib/libibverbs.so.1"
install -m 0755 "$build/lib/librxe-rdmav34.so" "$out/usr/lib/libibverbs/librxe-rdmav34.so"
echo "driver rxe" > "$out/etc/libibverbs.d/rxe.driver"
# A dynamically linked musl program: musl's dynamic linker, and libibverbs by its soname.
interp=$(readelf -l "$out/usr/bin/musl_write" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')
needed=$(readelf -d "$out/usr/bin/musl_write" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | paste -sd ' ')
if [ "$interp" != /lib/ld-musl-x86_64.so.1 ] || [ "$needed" != "libibverbs.so.1 libc.so" ]; then
  echo "build-musl-verbs.sh: musl_write has interpreter '$interp' and needs '$needed'" >&2
  exit 1
fi
echo "build-musl-verbs.sh: $out/usr/bin/musl_write, with libibverbs and the rxe provider built with musl-gcc from $(basename "$crate")'s rdma-core"
