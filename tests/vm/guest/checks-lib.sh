# shellcheck shell=bash
# Inside the guest: how a check script reports, shared by the daemon's checks. One line per
# check goes to RESULTS/results.txt (STATUS NAME: DETAIL (seconds since the last line)),
# as suite.sh writes its own. Sourced once RESULTS is set; the script defines CHECKS (the
# names of its checks, in order, so that a failure early reports every later one as not
# run) and a function `cleanup` (what fail_rest takes down before it exits); it may define
# `on_result STATUS NAME`, called after each line (a timeline of its own, for one).

LAST_RESULT=$SECONDS
result() { # STATUS NAME DETAIL
  printf '%s %s: %s (%d s)\n' "$1" "$2" "$3" $((SECONDS - LAST_RESULT)) | tee -a "$RESULTS/results.txt"
  if declare -F on_result > /dev/null; then on_result "$1" "$2"; fi
  LAST_RESULT=$SECONDS
}

done_checks=0
failed=0
# pass DETAIL: the next check passes.
pass() { result PASS "${CHECKS[$done_checks]}" "$1"; done_checks=$((done_checks + 1)); }
# fail_one WHY: the next check fails; the later ones, which do not depend on it, still run.
fail_one() { result FAIL "${CHECKS[$done_checks]}" "$1"; done_checks=$((done_checks + 1)); failed=1; }
# fail_rest WHY: the next check fails, the later ones are reported as not run; then
# cleanup and exit 1.
fail_rest() {
  result FAIL "${CHECKS[$done_checks]}" "$1"
  local i
  for ((i = done_checks + 1; i < ${#CHECKS[@]}; i++)); do
    result FAIL "${CHECKS[$i]}" "not run: ${CHECKS[$done_checks]} failed"
  done
  cleanup
  exit 1
}
