#!/usr/bin/env bash
# Installs what the build and the tests need on a fresh Debian machine of this project's kind.
# Safe to run again: it installs only what is missing. Set JUSTITIA_SKIP_APT=1 to skip apt.
set -euo pipefail

log() { printf 'setup: %s\n' "$*" >&2; }

# Debian packages: the verbs stack and perftest (used inside the QEMU guest through a
# read-only share of this file system), QEMU itself, valgrind for instruction counts,
# python3-prometheus-client, the parser the guest's daemon tests read the metrics with,
# musl-tools (a musl program for the musl build's checks), podman with runc (the container
# runtime of the guest's CDI checks; runc named, as podman would otherwise take crun),
# containerd (Debian's 1.6, the CRI runtime the device plugin's check drives), cmake and
# ninja (rdma-core built with musl-gcc for the musl image's verbs program).
APT_PACKAGES=(
  qemu-system-x86 busybox-static cpio kmod
  rdma-core ibverbs-utils ibverbs-providers libibverbs-dev librdmacm-dev rdmacm-utils perftest
  iproute2 valgrind python3-prometheus-client musl-tools python3-venv
  podman runc containerd
  systemd util-linux python3
  qperf ucx-utils libfabric-bin openmpi-bin libopenmpi-dev
  cmake ninja-build
)

if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    log "cargo not found; install Rust with rustup (https://rustup.rs) and run again"
    exit 1
  fi
fi
# rust-toolchain.toml asks for rustfmt and clippy; rustup installs them on first use.
rustup show active-toolchain >/dev/null 2>&1 || true

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "${JUSTITIA_SKIP_APT:-0}" = 1 ]; then
    log "JUSTITIA_SKIP_APT=1: not installing ${missing[*]}"
  elif [ "$(id -u)" != 0 ] && ! command -v sudo >/dev/null 2>&1; then
    log "not root and no sudo: cannot install ${missing[*]}; tests that need them will say so"
  else
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO=sudo
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

# The portable builds of the shaper (scripts/build-shaper.sh): cargo-zigbuild and zig from
# PyPI in a virtual environment of their own, and Rust's musl target. Pinned: a newer zig
# can change the glibc stubs the builds link against.
tools=${JUSTITIA_TOOLS:-$HOME/.cache/justitia/tools}
if [ ! -x "$tools/bin/cargo-zigbuild" ] || ! "$tools/bin/python" -m ziglang version >/dev/null 2>&1; then
  log "installing cargo-zigbuild and zig into $tools"
  python3 -m venv "$tools"
  "$tools/bin/pip" install --quiet --disable-pip-version-check cargo-zigbuild==0.24.1 ziglang==0.15.2
fi
if ! rustup target list --installed 2>/dev/null | grep -qx x86_64-unknown-linux-musl; then
  log "adding Rust's x86_64-unknown-linux-musl target"
  rustup target add x86_64-unknown-linux-musl
fi

# Go, for deploy/validate (its go.mod's version: Debian's golang-go is too old for the
# Kubernetes and CDI modules); the machine image has it in /usr/local/go/bin.
if ! command -v go >/dev/null 2>&1 && [ ! -x /usr/local/go/bin/go ]; then
  log "no Go toolchain: deploy/validate/check.sh will fail; install Go $(awk '/^go / {print $2}' "$(dirname "$0")/../deploy/validate/go.mod") or newer from https://go.dev/dl"
fi
