#!/usr/bin/env bash
# Boots a QEMU guest with Debian's kernel and Soft-RoCE (rxe0 on a veth pair) and runs one
# command in it, inside a chroot into this machine's own root file system (shared
# read-only), from the repository root. The command's output is printed when the guest has
# powered off; its exit status is returned (124: timed out, 125: the guest failed first).
#
#   tests/vm/guest.sh [--timeout SECS] [--out DIR] [--] COMMAND [ARGS...]
#   tests/vm/guest.sh --check      # list missing prerequisites and exit
#
# --out DIR (default: a new directory under target/vm/) is shared writable with the guest
# at the same path, so the command can leave results there; the guest's console is kept
# there as console.log and the command's output as job.log. The kernel and the initramfs
# are cached under ${XDG_CACHE_HOME:-$HOME/.cache}/justitia/vm.
set -uo pipefail
# shellcheck source=tests/vm/lib.sh
source "$(dirname "$0")/lib.sh"

limit=600
out=""
while [ $# -gt 0 ]; do
  case $1 in
    --timeout) limit=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --check)
      missing=$(vm_missing_prereqs)
      if [ -n "$missing" ]; then
        echo "missing prerequisites:"
        echo "$missing"
        exit 1
      fi
      echo "all prerequisites present"
      exit 0
      ;;
    --) shift; break ;;
    -*) echo "guest.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: guest.sh [--timeout SECS] [--out DIR] [--] COMMAND [ARGS...]" >&2; exit 2; }

missing=$(vm_missing_prereqs)
if [ -n "$missing" ]; then
  echo "guest.sh: missing prerequisites (run scripts/setup.sh):" >&2
  echo "$missing" >&2
  exit 125
fi
if [ -z "$out" ]; then
  mkdir -p "$VM_REPO/target/vm"
  out=$(mktemp -d "$VM_REPO/target/vm/run.XXXXXX")
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)

vm_write_job "$out" "$@"
vm_boot "$out" "$limit"
rc=$?
[ -f "$out/job.log" ] && cat "$out/job.log"
vm_log "exit status $rc; logs in $out"
exit "$rc"
