#!/usr/bin/env bash
# Builds the guest's test applications with the host's C compiler against the installed
# libibverbs and librdmacm headers: tests/vm/apps/build.sh OUTDIR. dlopen_app and
# nccl_style_app are not linked with libibverbs (they load it with dlopen); the others
# link it as applications do; mpi_check is built with mpicc when it is installed.
# Warnings are errors: these programs are small and must stay clean.
set -euo pipefail
src=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh OUTDIR}
mkdir -p "$out"
cc=${CC:-cc}
flags=(-O2 -g -Wall -Wextra -Werror -std=gnu11)
"$cc" "${flags[@]}" -o "$out/dlopen_app" "$src/dlopen_app.c" -ldl
"$cc" "${flags[@]}" -o "$out/nccl_style_app" "$src/nccl_style_app.c" -ldl
"$cc" "${flags[@]}" -pthread -o "$out/hang_app" "$src/hang_app.c" -libverbs
"$cc" "${flags[@]}" -pthread -o "$out/destroy_held" "$src/destroy_held.c" -libverbs
"$cc" "${flags[@]}" -o "$out/cm_churn" "$src/cm_churn.c" -lrdmacm -libverbs
"$cc" "${flags[@]}" -o "$out/ctl_storm" "$src/ctl_storm.c" -libverbs -ldl
"$cc" "${flags[@]}" -shared -fPIC -fvisibility=hidden -o "$out/libping_plugin.so" "$src/ping_plugin.c" -libverbs
"$cc" "${flags[@]}" -shared -fPIC -fvisibility=hidden -o "$out/libopen_counter.so" "$src/open_counter.c" -ldl
musl-gcc "${flags[@]}" -shared -fPIC -fvisibility=hidden -o "$out/libopen_counter.musl.so" "$src/open_counter.c"
# The container checks' probe (tests/vm/guest/cdi.sh), for a glibc image and a musl one.
"$cc" "${flags[@]}" -pthread -o "$out/libc_probe" "$src/../../../crates/preload/tests/apps/libc_probe.c" -ldl
musl-gcc "${flags[@]}" -pthread -o "$out/libc_probe.musl" "$src/../../../crates/preload/tests/apps/libc_probe.c"
# Statically linked with rdma-core and the rxe provider (libibverbs-dev's static archives):
# the escapee no preload reaches. The linker's warnings about getaddrinfo in static programs
# (from libnl) are about name lookups the program never makes.
"$cc" "${flags[@]}" -static -o "$out/static_qp" "$src/static_qp.c" \
  -Wl,--whole-archive -lrxe-rdmav34 -Wl,--no-whole-archive -libverbs -lnl-route-3 -lnl-3 -lpthread
# The same program linked as usual, which the shaper does reach.
"$cc" "${flags[@]}" -o "$out/qp_holder" "$src/static_qp.c" -libverbs
# The MPI check (tests/vm/guest/real-apps.sh runs it under Open MPI over UCX), when an MPI
# compiler wrapper is installed (Debian's libopenmpi-dev).
if command -v mpicc > /dev/null; then
  mpicc "${flags[@]}" -o "$out/mpi_check" "$src/mpi_check.c"
fi
