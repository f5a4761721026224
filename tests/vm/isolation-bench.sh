#!/usr/bin/env bash
# The isolation benchmark on Soft-RoCE (a benchmark, not a test): in one guest boot, a
# 16 B ib_write_lat latency flow alone, beside a 1 MiB ib_write_bw bandwidth flow, and
# beside that flow under the shaper (bandwidth class paced at 75/50/25% of its alone
# bandwidth, split but unpaced, and preempt). Prints latency p50 (perftest's "typical"),
# p99 and p99.9 and the bandwidth flow's MB/s, each as the median and range of the repeats.
# Then the same experiment as a scenario file, `justitia run lat-vs-1mb-bw-ib56` (each flow
# its own process, the shaped run following justitiad's allotment as any application
# would), with the model beside it (--compare) and the isolation verdict; perftest stays
# the unmodified application of the first part.
#
#   tests/vm/isolation-bench.sh        # REPEATS=3 LAT_ITERS=5000 BW_SECONDS=10 by default
#
# Timings are those of a software RNIC under full-system emulation, not of hardware.
set -uo pipefail
# shellcheck source=tests/vm/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$VM_REPO" || exit 1
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"

missing=$(vm_missing_prereqs)
if [ -n "$missing" ]; then
  echo "isolation-bench: missing prerequisites (run scripts/setup.sh):" >&2
  echo "$missing" >&2
  exit 1
fi
target=${CARGO_TARGET_DIR:-$VM_REPO/target}
lib=-
if [ -f crates/preload/Cargo.toml ]; then
  cargo build --release -q -p justitia-preload || exit 1
  lib=$target/release/libjustitia.so
  cargo build --release -q -p justitia-cli --bin justitia || exit 1
  cargo build --release -q -p justitia-loadgen --bin justitia-loadgen || exit 1
  cargo build --release -q -p justitia-daemon --bin justitiad || exit 1
else
  echo "isolation-bench: the shaper is not built (crates/preload does not exist); only unshaped cases run"
fi
mkdir -p "$target/vm"
out=$(mktemp -d "$target/vm/isolation.XXXXXX")
echo "isolation-bench: running in the guest (logs in $out)"
vm_write_job "$out" env REPEATS="${REPEATS:-3}" LAT_ITERS="${LAT_ITERS:-5000}" BW_SECONDS="${BW_SECONDS:-10}" \
  RUN_BIN="$target/release" tests/vm/guest/isolation.sh "$out" "$lib"
vm_boot "$out" "${VM_BENCH_TIMEOUT:-1800}"
rc=$?
if [ ! -s "$out/isolation.txt" ]; then
  echo "isolation-bench: no results (status $rc; see $out/job.log, $out/console.log)" >&2
  exit 1
fi

echo
echo "Soft-RoCE under QEMU TCG emulation: 16 B ib_write_lat vs 1 MiB ib_write_bw"
echo "(median [min-max] of the repeats)"
awk -F'|' '
  # "median [min-max]" of the numeric values in a space-separated list, with "(k of n)"
  # when some repeats could not be measured; "-" when none could.
  function stat(list,   n, k, v, w, i, j, t) {
    n = split(list, w, " ")
    k = 0
    for (i = 1; i <= n; i++) if (w[i] ~ /^[0-9.]+$/) v[++k] = w[i] + 0
    if (k == 0) return "-"
    for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
    return sprintf("%.1f [%.1f-%.1f]%s", v[int((k + 1) / 2)], v[1], v[k], k < n ? sprintf(" (%d of %d)", k, n) : "")
  }
  !($1 in seen) { seen[$1] = 1; order[++cases] = $1 }
  { p50[$1] = p50[$1] " " $3; p99[$1] = p99[$1] " " $4; p999[$1] = p999[$1] " " $5; bw[$1] = bw[$1] " " $6 }
  END {
    printf "%-42s | %-22s | %-26s | %-26s | %s\n", "case", "latency p50 (us)", "latency p99 (us)", "latency p99.9 (us)", "bandwidth (MB/s)"
    for (k = 1; k <= cases; k++) {
      c = order[k]
      printf "%-42s | %-22s | %-26s | %-26s | %s\n", c, stat(p50[c]), stat(p99[c]), stat(p999[c]), stat(bw[c])
    }
  }' "$out/isolation.txt"
if [ -s "$out/justitia-run.txt" ]; then
  echo
  echo "The same experiment as a scenario file: justitia run lat-vs-1mb-bw-ib56 -d rxe0 --compare"
  cat "$out/justitia-run.txt"
fi
exit "$rc"
