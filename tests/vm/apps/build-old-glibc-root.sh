#!/usr/bin/env bash
# Assembles the root file system of an image with a C library older than glibc 2.34, for the
# guest's old-glibc check (tests/vm/guest/cdi.sh):
#
#   tests/vm/apps/build-old-glibc-root.sh OUTDIR
#
# Debian 11 (bullseye, glibc 2.31, rdma-core 33.2, perftest 4.4+0.37) is what many CUDA and
# MPI base images of the field are built on, and the shaper built against the build
# machine's glibc stops every one of its programs at load ("version `GLIBC_2.34' not
# found"). Its packages are on deb.debian.org beside the current releases: apt, with a
# scratch state directory and the machine's Debian archive keyring (which holds bullseye's
# keys), resolves perftest's and the verbs utilities' dependencies from bullseye alone and
# downloads them, and each package is unpacked into OUTDIR (no maintainer scripts run, as
# an image built from a root file system has it). Nothing is installed on the machine.
# Beside bullseye's programs goes dlopen_app.c (OUTDIR/usr/bin/dlopen_app), which loads
# libibverbs with dlopen and finds each verb with dlsym on its handle, as NCCL does: built
# with zig's C compiler against glibc 2.17's symbol versions (scripts/setup.sh installs zig
# in $JUSTITIA_TOOLS), so that it runs on glibc 2.31 (only rdma-core's verbs.h is taken from
# the machine's headers).
# The download is kept in $BULLSEYE_WORK (by default $CARGO_TARGET_DIR/bullseye or
# target/bullseye) and used again while bullseye's package list is unchanged.
set -euo pipefail
out=${1:?usage: fetch-bullseye-root.sh OUTDIR}
work=${BULLSEYE_WORK:-${CARGO_TARGET_DIR:-target}/bullseye}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
[ -r "$keyring" ] || { echo "build-old-glibc-root.sh: $keyring is missing (Debian's debian-archive-keyring)" >&2; exit 1; }
mkdir -p "$work/lists/partial" "$work/archives/partial"
# apt reads relative Dir:: paths from its root directory, not from here.
work=$(cd "$work" && pwd)
: > "$work/status"
echo "deb [signed-by=$keyring] http://deb.debian.org/debian bullseye main" > "$work/sources.list"
apt=(apt-get -q -o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/nonexistent
  -o "Dir::State::Lists=$work/lists" -o "Dir::State::status=$work/status" -o "Dir::Cache=$work"
  -o "Dir::Cache::Archives=$work/archives" -o APT::Architecture=amd64 -o APT::Architectures::=amd64
  -o Debug::NoLocking=1)
"${apt[@]}" update > "$work/update.log" 2>&1 \
  || { echo "build-old-glibc-root.sh: apt-get update from bullseye failed: $(tail -n 3 "$work/update.log")" >&2; exit 1; }
"${apt[@]}" -y install --download-only --no-install-recommends perftest ibverbs-utils ibverbs-providers \
  > "$work/download.log" 2>&1 \
  || { echo "build-old-glibc-root.sh: downloading bullseye's packages failed: $(tail -n 3 "$work/download.log")" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out"
for deb in "$work"/archives/*.deb; do
  dpkg-deb -x "$deb" "$out"
done
tools=${JUSTITIA_TOOLS:-$HOME/.cache/justitia/tools}
headers="$work/include"
mkdir -p "$headers"
ln -sfn /usr/include/infiniband "$headers/infiniband"
"$tools/bin/python3" -m ziglang cc -target x86_64-linux-gnu.2.17 -O2 -g -Wall -Wextra -Werror -std=gnu11 \
  -I"$headers" -o "$out/usr/bin/dlopen_app" "$(dirname "$0")/dlopen_app.c" -ldl \
  || { echo "build-old-glibc-root.sh: zig cc could not build dlopen_app.c for glibc 2.17" >&2; exit 1; }
glibc=$(find "$out" -name 'libc.so.6' | head -n 1)
[ -x "$out/usr/bin/ib_write_bw" ] && [ -n "$glibc" ] \
  || { echo "build-old-glibc-root.sh: ib_write_bw or libc.so.6 missing from $out" >&2; exit 1; }
echo "build-old-glibc-root.sh: $out: $(ls "$work"/archives/*.deb | wc -l) packages of bullseye, $(basename "$(ls "$work"/archives/libc6_*.deb)"); dlopen_app for glibc 2.17"
