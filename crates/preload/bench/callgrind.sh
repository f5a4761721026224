#!/usr/bin/env bash
# Instructions the shaper adds to one post and one poll.
#
# Runs examples/post_poll_loop under callgrind straight to the mock provider, through the
# shaper with no class set (pass-through), through the shaper's shaped path (bandwidth
# class, a request too small to split) and through the shaped path of a throughput flow
# paced by operations (16 B requests, the pacer asked about each) and through the shaped
# path of a bandwidth flow following the allotment a stand-in daemon publishes in a control
# block (the pacer asked about each request at the allotted rate), and the same under
# JUSTITIA_POLICY=adaptive with the allotment an adaptive daemon publishes (bytes only, no
# release phase, each request priced at RoCE-100's price for its chunk), and in a
# bandwidth-class process on a CQ too small to shape its QP (the QP observed, its CQ's
# polls passed through), and in a latency-class process without a daemon (its QP observed,
# its polls the provider's) and following one (one request in four timed from its post to
# the poll that returns its completion, for the adaptive law's tail), and a 16 B SEND on the
# shaped path beside one straight to the provider (sent whole), counts the instructions
# executed inside the post and poll calls only, and prints them per request and what the
# shaper adds, each beside its target.
# Needs valgrind (apt-get install valgrind). N sets the iteration count (default 100000).
set -euo pipefail
cd "$(dirname "$0")/../../.."
command -v valgrind >/dev/null || { echo "callgrind.sh: valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
target=${CARGO_TARGET_DIR:-target}
cargo build --quiet --release -p justitia-preload --example post_poll_loop
bin="$target/release/examples/post_poll_loop"
n=${N:-100000}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

count() {
  valgrind --tool=callgrind --callgrind-out-file="$tmp/$1.out" \
    --toggle-collect=justitia_bench_post --toggle-collect=justitia_bench_poll \
    "$bin" "$1" "$n" >"$tmp/$1.log" 2>&1 || { cat "$tmp/$1.log" >&2; exit 1; }
  awk '/^(summary|totals):/ {print $2; exit}' "$tmp/$1.out"
}

direct=$(count direct)
shaper=$(count shaper)
shaped=$(count shaped)
paced=$(count paced)
follow=$(count follow)
adaptive=$(count follow-adaptive)
unshaped=$(count unshaped-cq)
latency=$(count latency)
timed=$(count latency-timed)
direct_send=$(count direct-send)
shaped_send=$(count shaped-send)
awk -v ds="$direct_send" -v xs="$shaped_send" -v d="$direct" -v s="$shaper" -v x="$shaped" -v p="$paced" -v f="$follow" -v a="$adaptive" -v u="$unshaped" -v l="$latency" -v t="$timed" -v n="$n" 'BEGIN {
  printf "instructions per post+poll, %d iterations (callgrind, mock provider)\n", n
  printf "  direct to provider : %8.1f\n", d / n
  printf "  through the shaper : %8.1f\n", s / n
  printf "  added by the shaper: %8.1f (class unset, pass-through; target: at most 51)\n", (s - d) / n
  printf "  shaped path adds   : %8.1f (bandwidth class, request not split; target: under 300)\n", (x - d) / n
  printf "  paced path adds    : %8.1f (throughput class, 16 B paced by ops; target: under 300)\n", (p - d) / n
  printf "  following adds     : %8.1f (bandwidth class at the daemon'"'"'s allotment; target: under 300)\n", (f - d) / n
  printf "  adaptive adds      : %8.1f (the same under JUSTITIA_POLICY=adaptive, an adaptive daemon'"'"'s allotment, each request priced; target: under 330)\n", (a - d) / n
  printf "  unshaped CQ adds   : %8.1f (bandwidth class, a CQ too small to shape its QP: observed, polled through; target: under 65)\n", (u - d) / n
  printf "  latency adds       : %8.1f (latency class, no daemon: observed, the provider'"'"'s poll; target: at most 51)\n", (l - d) / n
  printf "  timed latency adds : %8.1f (latency class following a daemon, one request in four timed; target: under 200)\n", (t - d) / n
  printf "  shaped SEND adds   : %8.1f (bandwidth class, a 16 B SEND, sent whole; target: under 300)\n", (xs - ds) / n
}'
