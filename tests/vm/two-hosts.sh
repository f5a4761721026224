#!/usr/bin/env bash
# Boots the two-host pair (two guests joined by a virtual cable, see tests/vm/README.md)
# with a third guest, host C, on a second cable into B, and runs one command on host A,
# from the repository root, while hosts B and C serve A's requests
# (tests/vm/guest/remote.py) until A's command ends. Prints A's output when all have
# powered off and returns A's status (124: timed out, 125: a guest failed first).
#
#   tests/vm/two-hosts.sh [--timeout SECS] [--out DIR] [--] COMMAND [ARGS...]
#
# DIR (default: a new directory under target/vm/) is host A's output directory, shared
# writable at the same path; host B's is DIR/b and host C's DIR/c, which A sees too. In
# the command, $VM_OUT is A's output directory; B's address is 10.77.0.2, C's 10.77.0.3,
# their servers' port 7770.
set -uo pipefail
# shellcheck source=tests/vm/lib.sh
source "$(dirname "$0")/lib.sh"

limit=600
out=""
while [ $# -gt 0 ]; do
  case $1 in
    --timeout) limit=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --) shift; break ;;
    -*) echo "two-hosts.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: two-hosts.sh [--timeout SECS] [--out DIR] [--] COMMAND [ARGS...]" >&2; exit 2; }

missing=$(vm_missing_prereqs)
if [ -n "$missing" ]; then
  echo "two-hosts.sh: missing prerequisites (run scripts/setup.sh):" >&2
  echo "$missing" >&2
  exit 125
fi
if [ -z "$out" ]; then
  mkdir -p "$VM_REPO/target/vm"
  out=$(mktemp -d "$VM_REPO/target/vm/pair.XXXXXX")
fi
mkdir -p "$out/b" "$out/c"
out=$(cd "$out" && pwd)

# B and C serve until A's job tells them to stop, whatever A's command did: C first, as
# A reaches C through B's emulator.
VM_UP="tests/vm/guest/host-up.sh b" vm_write_job "$out/b" python3 tests/vm/guest/remote.py serve 10.77.0.2 7770
VM_UP="tests/vm/guest/host-up.sh c" vm_write_job "$out/c" python3 tests/vm/guest/remote.py serve 10.77.0.3 7770
VM_UP="tests/vm/guest/host-up.sh a" vm_write_job "$out" bash -c \
  '"$@"; rc=$?; for h in 10.77.0.3 10.77.0.2; do python3 tests/vm/guest/remote.py run $h 7770 10 exit > /dev/null; done; exit $rc' two-hosts "$@"
vm_boot_pair "$out" "$out/b" "$limit" "$out/c"
rc=$?
[ -f "$out/job.log" ] && cat "$out/job.log"
vm_log "exit status $rc (host B: $(cat "$out/b/job.rc" 2>/dev/null || echo none), host C: $(cat "$out/c/job.rc" 2>/dev/null || echo none)); logs in $out, $out/b and $out/c"
exit "$rc"
