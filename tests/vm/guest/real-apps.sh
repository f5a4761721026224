#!/bin/bash
# Inside the guest (in the chroot, rxe0 up): field applications from Debian, each run plain
# and under the shaper, client and server both in the guest on rxe0. Run by suite.sh, or
# alone:
#
#   tests/vm/guest.sh --timeout 400 -- tests/vm/guest/real-apps.sh RESULTS SHAPER_LIB [APPS_DIR]
#
# SHAPER_LIB is libjustitia.so ("-" when it is not built: the shaped runs are skipped);
# APPS_DIR holds tests/vm/apps built by apps/build.sh (mpi_check; "-" or absent: the MPI
# check is skipped). One line per check goes to RESULTS/results.txt as in suite.sh ("PASS
# name: detail", "FAIL name: why", "SKIP name: why"; the exit status is 1 after any FAIL,
# 124 when stopped by SIGTERM); every program's output goes to
# RESULTS/logs/real-apps.*, and each shaped run's statistics to
# RESULTS/logs/real-apps.NAME.shaped.stats/stats-PID.json.
#
# Each application runs plain, then shaped: LD_PRELOAD=SHAPER_LIB, JUSTITIA_CLASS=bandwidth,
# JUSTITIA_CHUNK=16K and JUSTITIA_STATS, on both sides. The shaped run must exit as the plain
# one did (status 0 on both sides) with the application's own success output (the same
# counts where it prints counts), and the shaper must have been in its data path: its
# statistics count requests, and for the applications that move bulk data with RDMA WRITE
# or READ, split requests (split_requests > 0 summed over the run's processes).
#
# - qperf 0.4.11: rc_bw and rc_lat in event mode (its default: it arms the CQ and sleeps in
#   ibv_get_cq_event) and in poll mode (-cp1), and rc_rdma_write_bw, each for -t 2 s. qperf
#   ends a test with SIGALRM, whose handler only sets a flag: in event mode the wait must
#   return EINTR for qperf to see it. qperf needs the connection manager on RoCE (-cm1; its
#   own exchange sets no GRH, and rxe refuses the QP "to RTR"), and the CM's IPv4 address:
#   the script puts REAL_APPS_ADDR on veth0 and takes it off at the end. Each test has a
#   server of its own, ended by "qperf ADDR quit". No qperf test splits: rc_bw and rc_lat
#   SEND, and rc_rdma_write_bw posts RDMA WRITE with immediate, which the shaper never
#   splits (its receive completion reports the length); the check there is that the shaper
#   counted the requests. Only the client's statistics are written: qperf's server runs
#   each test in a forked child, which dies of SIGSEGV in its final rdma_destroy_qp (NULL,
#   in libibverbs' ibv_destroy_qp) after every -cm1 test, without the shaper as with it
#   (seen with strace and gdb); its parent ignores the child's status.
# - ucx_perftest (UCX 1.13): UCT put_bw and get over rc_verbs with zero copy (one 1 MiB
#   RDMA WRITE or READ each), UCP tag_bw (rendezvous: RDMA READ of 1 MiB) and ucp_put_bw,
#   20 iterations each after 2 of warm-up. UCX_TLS=rc_verbs,ud_verbs,self (UCP connects
#   rc_verbs through ud_verbs; without it "no auxiliary transport"), UCX_NET_DEVICES=rxe0:1,
#   and UCX_IB_GID_INDEX=0: over the IPv4 address's GID, ud_verbs' first exchange never
#   completes on rxe ("UD endpoint ... unhandled timeout error") without the shaper too.
#   The "Final:" line's iteration count must be the plain run's.
# - fi_pingpong (libfabric 1.17) over "verbs;ofi_rxm", RDM endpoints, 1 MiB messages (rxm
#   moves them by rendezvous, an RDMA READ by the receiver) with its data checks (-c; its
#   -v is debugging output), 10 iterations. FI_UNIVERSE_SIZE=4: rxm sizes its CQ by the
#   universe size (256 peers by default), past what rxe allows ("Unable to create verbs
#   CQ", fi_enable -22).
# - Open MPI 4.1 over UCX (pml ucx, osc ucx): tests/vm/apps/mpi_check, 2 ranks in the guest,
#   MPI_Send/MPI_Recv both ways and MPI_Put and MPI_Get in a window, 1 B to 4 MiB, every
#   byte checked. mpirun refuses the guest's host name "(none)", so it runs in a UTS
#   namespace of its own (unshare) with a name of its own. UCX as above.
#
# Under the shaper every UCX and libfabric process says once on stderr "a CQ of 1 entries is
# too small for the send queues of its shaped QPs (2)": their capability probes (libfabric's
# verbs provider creates an RC QP on a CQ of 1 entry) are observed, not shaped. The result
# line quotes the first such line.
#
# How the checks were seen to fail (in the guest, each on its own run):
# - with the shaper built from the commit before the EINTR fix ("ibv_get_cq_event returns
#   EINTR after a handler without SA_RESTART"): "qperf rc_lat, event mode" shaped failed,
#   "client exit 1, server exit 143: failed to receive results: timed out" (the server's
#   test process never sent its results; plain passed). rc_bw in event mode passed with it
#   in that run.
# - with REAL_APPS_SHAPER_ENV="" (the shaper only observing: it counts, splits nothing):
#   every ucx_perftest, fi_pingpong and MPI shaped check failed, "no request was split",
#   with the statistics quoted (the qperf checks need only counted requests).
# - with a preloaded library that posts every RDMA WRITE and READ of 64 KiB or more 4 KiB
#   short and lets it complete as a success (so that data goes missing): fi_pingpong's
#   shaped run failed on its data check, "Error at iteration=1 size=1048576 byte=1044480";
#   the UCX runs crashed with it (exit 139). mpi_check's byte check was seen to fail
#   (exit 1, the mismatch's offset printed) on the host, over Open MPI's shared memory, in a
#   copy of it that flips one byte of each put of more than 100 KB.
#
# Environment: REAL_APPS_STEP_TIMEOUT (seconds for each program, default 60),
# REAL_APPS_SHAPER_ENV (the JUSTITIA_* settings of the shaped runs, NAME=value words;
# default "JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=16K"), REAL_APPS_ADDR (the IPv4 address
# put on veth0, default 10.77.8.1/24), REAL_APPS_ONLY (the sections to run, of
# "qperf ucx fabric mpi"; default all), REAL_APPS_QPERF_TIME (2 s), REAL_APPS_UCX_ITERS (20),
# REAL_APPS_FI_ITERS (10), REAL_APPS_MPI_MAX (4194304 B). RESULTS/logs/real-apps.trace.log
# has each run's phases, timed. About 2.5 to 3 minutes under emulation.
# shellcheck disable=SC2317 # the run and output functions are called through check_app
set -uo pipefail
# shellcheck source=tests/vm/guest/daemon-lib.sh
source "$(dirname "$0")/daemon-lib.sh"

RESULTS=$1
LIB=${2:--}
APPS=${3:--}
LOGS=$RESULTS/logs
mkdir -p "$LOGS"
touch "$RESULTS/results.txt"
L=$LOGS/real-apps
STEP=${REAL_APPS_STEP_TIMEOUT:-60}
ADDR_CIDR=${REAL_APPS_ADDR:-10.77.8.1/24}
ADDR=${ADDR_CIDR%/*}
NETDEV=veth0
PORT=20100
# The shaper's settings in the shaped runs (REAL_APPS_SHAPER_ENV replaces them, e.g. to see
# the split checks fail with the shaper observing only).
SHAPER_ENV=${REAL_APPS_SHAPER_ENV-JUSTITIA_CLASS=bandwidth JUSTITIA_CHUNK=16K}
if [ -n "${REAL_APPS_SHAPER_ENV+set}" ]; then
  SHAPED_LABEL="shaped, ${SHAPER_ENV:-no JUSTITIA_* setting}"
else
  SHAPED_LABEL="shaped, bandwidth class, 16K chunks"
fi

ONLY=" ${REAL_APPS_ONLY:-qperf ucx fabric mpi} "
want() { [ "${ONLY#* "$1" }" != "$ONLY" ]; }

# A timeline of the run (the guest's clock), for reading a slow or failed run.
T0=${EPOCHREALTIME/./}
: > "$L.trace.log"
note() {
  local us=$((${EPOCHREALTIME/./} - T0))
  printf '%4d.%03d s: %s\n' $((us / 1000000)) $((us / 1000 % 1000)) "$*" >> "$L.trace.log"
}

LAST_RESULT=$SECONDS
FAILED=0
result() { # STATUS NAME DETAIL
  printf '%s %s: %s (%d s)\n' "$1" "real apps: $2" "$3" $((SECONDS - LAST_RESULT)) | tee -a "$RESULTS/results.txt"
  LAST_RESULT=$SECONDS
  [ "$1" = FAIL ] && FAILED=1
  note "$1 $2"
}

have_shaper() { [ "$LIB" != - ] && [ -e "$LIB" ]; }

# The one program in the background at a time (a timeout wrapping a server) is SERVER_PID;
# cleanup stops it (timeout passes the signal on to its program's process group, so a
# server's forked children go too) and takes the address off.
SERVER_PID=""
added_addr=0
cleanup() {
  if [ -n "$SERVER_PID" ]; then
    kill -TERM "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
    SERVER_PID=""
  fi
  [ "$added_addr" = 1 ] && ip addr del "$ADDR_CIDR" dev "$NETDEV" 2>/dev/null
  added_addr=0
}
# Stopped by the suite's timeout: take every program down too.
trap 'cleanup; exit 124' TERM INT

# The environment of a mode, as NAME=value words: nothing plain; shaped, the shaper with its
# statistics in DIR.
mode_env() { # MODE STATS_DIR
  [ "$1" = shaped ] && echo "LD_PRELOAD=$LIB $SHAPER_ENV JUSTITIA_STATS=$2/stats-%p.json"
}

# The statistics files in DIR, and the sums of their requests, split_requests and chunks:
# "FILES REQUESTS SPLIT_REQUESTS CHUNKS" (one awk: under emulation every process counts).
stats_sums() { # DIR
  local files=("$1"/stats-*.json)
  [ -f "${files[0]}" ] || { echo "0 0 0 0"; return; }
  awk 'BEGIN { split("requests split_requests chunks", k, " ") }
    FNR == 1 { n++ }
    { for (i = 1; i <= 3; i++) if (match($0, "\"" k[i] "\": *[0-9]+")) {
        v = substr($0, RSTART, RLENGTH); sub(/.*: */, "", v); s[i] += v } }
    END { print n + 0, s[1] + 0, s[2] + 0, s[3] + 0 }' "${files[@]}"
}
stats_summary() { # DIR
  local f out=""
  for f in "$1"/stats-*.json; do
    [ -f "$f" ] || continue
    out="$out${out:+; }$(basename "$f" .json | sed 's/^stats-/pid /'): $(tr -d '\n ' < "$f")"
  done
  echo "${out:-no statistics}"
}

# run_app NAME MODE SERVER_ENV CLIENT_ENV PORT SERVER_CMD... -- CLIENT_CMD...: the server in
# the background (under timeout), once its TCP PORT listens the client, then the server's
# end: FINISH (a command run after the client, e.g. qperf's "quit") or its own. Sets SRC and
# CRC (exit statuses, 124 for a timeout), SLOG and CLOG, and ERR when the server never
# listened. FINISH is a global (an array), empty for none.
FINISH=()
run_app() {
  local name=$1 mode=$2 senv=$3 cenv=$4 port=$5
  shift 5
  local server=() spid
  while [ $# -gt 0 ] && [ "$1" != -- ]; do server+=("$1"); shift; done
  shift
  SLOG=$L.$name.$mode.server.log CLOG=$L.$name.$mode.client.log ERR="" STATUS=""
  note "$name.$mode: server ${server[*]}"
  # shellcheck disable=SC2086 # the ENV strings are NAME=value words without spaces
  env $senv timeout -k 5 "$STEP" "${server[@]}" > "$SLOG" 2>&1 &
  spid=$!
  SERVER_PID=$spid
  if ! wait_tcp_listen "$port"; then
    kill -TERM "$spid" 2>/dev/null
    wait "$spid" 2>/dev/null
    SERVER_PID=""
    SRC=- CRC=-
    ERR="the server did not listen on port $port within 30 s ($SLOG: $(tail -n 2 "$SLOG" | tr '\n' ' '))"
    return
  fi
  note "$name.$mode: server listening; client $*"
  # shellcheck disable=SC2086
  env $cenv timeout -k 5 "$STEP" "$@" > "$CLOG" 2>&1
  CRC=$?
  note "$name.$mode: client exit $CRC"
  if [ ${#FINISH[@]} -gt 0 ] && [ "$CRC" = 0 ]; then
    timeout -k 5 20 "${FINISH[@]}" >> "$CLOG" 2>&1
    note "$name.$mode: ${FINISH[*]}: exit $?"
  fi
  # A server whose client failed may wait for it for ever: it is given a few seconds.
  if [ "$CRC" != 0 ]; then
    local _
    for _ in $(seq 50); do kill -0 "$spid" 2>/dev/null || break; sleep 0.1; done
    kill -TERM "$spid" 2>/dev/null
  fi
  wait "$spid"
  SRC=$?
  SERVER_PID=""
  note "$name.$mode: server exit $SRC"
}

logs_of() { if [ "$CLOG" = "$SLOG" ]; then echo "$CLOG"; else echo "$CLOG, $SLOG"; fi; }

# The first line of the logs that says what went wrong (not a frame of a backtrace).
why() { # LOG...
  grep -h -v -E '^ *[0-9]+ +/' "$@" 2>/dev/null \
    | grep -m1 -i -E "error|fail|abort|unable|cannot|couldn't|mismatch|invalid|timed out" | cut -c1-300
}

# check_app TEST SPLIT OUTPUT_FN RUN_FN: RUN_FN SLUG MODE STATS_DIR runs the application in
# MODE (run_app or its own way; sets SRC, CRC, SLOG, CLOG, ERR, and STATUS to say them
# otherwise than "client exit CRC, server exit SRC"); OUTPUT_FN CLIENT_LOG
# SERVER_LOG prints the part of its success output that must be there and be the same plain
# and shaped (nothing: the output is not there), then, after " [", figures that may differ
# (a bandwidth) for the result line.
# SPLIT: "split" when the shaped run's statistics must count split requests, "requests"
# when they must count requests only (the application's requests are not ones the shaper
# splits).
check_app() {
  local test=$1 split=$2 outfn=$3 runfn=$4 slug base="" mode label dir out t0 plain_time=""
  slug=$(echo "$test" | tr ' /' '__' | tr -cd 'A-Za-z0-9_.=-')
  for mode in plain shaped; do
    label=$mode
    [ "$mode" = shaped ] && label=$SHAPED_LABEL
    if [ "$mode" = shaped ] && ! have_shaper; then
      result SKIP "$test ($label)" "the shaper is not built (no libjustitia.so)"
      continue
    fi
    if [ "$mode" = shaped ] && [ -z "$base" ]; then
      result FAIL "$test ($label)" "no plain run to compare with"
      continue
    fi
    dir=$L.$slug.$mode.stats
    rm -rf "$dir"
    mkdir -p "$dir"
    t0=$SECONDS
    "$runfn" "$slug" "$mode" "$dir"
    local took=$((SECONDS - t0))
    [ "$mode" = plain ] && plain_time=$took
    if [ -n "$ERR" ]; then
      result FAIL "$test ($label)" "$ERR"
      continue
    fi
    local status=${STATUS:-"client exit $CRC, server exit $SRC"}
    if [ "$CRC" != 0 ] || [ "$SRC" != 0 ]; then
      local w
      w=$(why "$CLOG" "$SLOG")
      [ "$CRC" = 124 ] || [ "$SRC" = 124 ] && w="still running after $STEP s (plain: ${plain_time:-?} s)${w:+; $w}"
      result FAIL "$test ($label)" "$status${w:+: $w} (logs: $(logs_of))"
      continue
    fi
    out=$("$outfn" "$CLOG" "$SLOG")
    local figures=""
    case $out in *" ["*) figures=" [${out#* [}"; out=${out%% \[*} ;; esac
    if [ -z "$out" ]; then
      result FAIL "$test ($label)" "$status but no success output (logs: $(logs_of))"
      continue
    fi
    if [ "$mode" = plain ]; then
      base=$out
      result PASS "$test (plain)" "$status; $out$figures"
      continue
    fi
    if [ "$out" != "$base" ]; then
      result FAIL "$test ($label)" "$status, but its output differs from plain: '$out', plain '$base' (logs: $(logs_of))"
      continue
    fi
    local files requests splits chunks
    read -r files requests splits chunks <<< "$(stats_sums "$dir")"
    if [ "$files" = 0 ]; then
      result FAIL "$test ($label)" "$status, $out; but the shaper wrote no statistics in $dir: it was not in the data path"
    elif [ "$requests" = 0 ]; then
      result FAIL "$test ($label)" "$status, $out; but the shaper counted no request ($(stats_summary "$dir"))"
    elif [ "$split" = split ] && [ "$splits" = 0 ]; then
      result FAIL "$test ($label)" "$status, $out; but no request was split ($(stats_summary "$dir"))"
    else
      # What the shaper said on stderr (at its default level, warnings only), if anything.
      local said
      said=$(grep -h -m1 '^justitia' "$CLOG" "$SLOG" 2>/dev/null | head -n 1 | cut -c1-200)
      result PASS "$test ($label)" "$status, same as plain: $out$figures; shaper ($files processes): requests=$requests split_requests=$splits chunks=$chunks${said:+; it said: $said}"
    fi
  done
}

# ---------------------------------------------------------------------------------------
# The address the connection manager and the applications' out-of-band exchanges use.
if ! ip addr replace "$ADDR_CIDR" dev "$NETDEV" 2>"$L.addr.log"; then
  result FAIL "IPv4 address on $NETDEV" "ip addr replace $ADDR_CIDR dev $NETDEV: $(cat "$L.addr.log")"
  exit 1
fi
added_addr=1
# The address's GID appears once the kernel has the address; rdma_cm needs it to resolve.
for _ in $(seq 50); do
  ibv_devinfo -v -d rxe0 2>/dev/null | grep -q "::ffff:$ADDR" && break
  sleep 0.1
done
ibv_devinfo -v -d rxe0 > "$L.devinfo.log" 2>&1

# --- qperf -------------------------------------------------------------------------------
QPERF_TIME=${REAL_APPS_QPERF_TIME:-2}
# qperf prints "    bw  =  44.8 MB/sec" or "    latency  =  4.66 ms": the figure must be
# there and not zero (its value and unit vary from run to run).
qperf_output() { # CLIENT_LOG SERVER_LOG
  awk '$2 == "=" && $3 + 0 > 0 { print $1 " reported [" $3 " " $4 "]"; exit }' "$1"
}
# qperf_run: a server of its own for each test (its forked child runs the test), ended
# by the client's "quit".
qperf_run() { # SLUG MODE DIR TEST ARGS...
  local slug=$1 mode=$2 dir=$3 port=$((PORT++)) envw
  shift 3
  envw=$(mode_env "$mode" "$dir")
  FINISH=(qperf "$ADDR" -lp "$port" quit)
  run_app "$slug" "$mode" "$envw" "$envw" "$port" qperf -lp "$port" -- \
    qperf "$ADDR" -lp "$port" -cm1 -t "$QPERF_TIME" "$@"
  FINISH=()
}
qperf_rc_bw_event() { qperf_run "$@" rc_bw; }
qperf_rc_lat_event() { qperf_run "$@" rc_lat; }
qperf_rc_bw_poll() { qperf_run "$@" -cp1 rc_bw; }
qperf_rc_lat_poll() { qperf_run "$@" -cp1 rc_lat; }
qperf_rc_rdma_write_bw() { qperf_run "$@" -m 1M rc_rdma_write_bw; }
if ! want qperf; then
  :
elif ! command -v qperf > /dev/null; then
  result FAIL "qperf" "qperf is not installed (scripts/setup.sh installs it)"
else
  check_app "qperf rc_bw, event mode (ibv_get_cq_event, ended by SIGALRM)" requests qperf_output qperf_rc_bw_event
  check_app "qperf rc_lat, event mode (ibv_get_cq_event, ended by SIGALRM)" requests qperf_output qperf_rc_lat_event
  check_app "qperf rc_bw, poll mode" requests qperf_output qperf_rc_bw_poll
  check_app "qperf rc_lat, poll mode" requests qperf_output qperf_rc_lat_poll
  check_app "qperf rc_rdma_write_bw 1M (WRITE with immediate: not split)" requests qperf_output qperf_rc_rdma_write_bw
fi

# --- ucx_perftest ------------------------------------------------------------------------
UCX_ITERS=${REAL_APPS_UCX_ITERS:-20}
UCX_ENV="UCX_NET_DEVICES=rxe0:1 UCX_TLS=rc_verbs,ud_verbs,self UCX_IB_GID_INDEX=0"
# The client's "Final:" line: its iteration count (and the overall bandwidth, MB/s).
ucx_output() { # CLIENT_LOG SERVER_LOG
  awk '$1 == "Final:" { print "Final: " $2 " iterations [" $7 " MB/s]"; exit }' "$1"
}
ucx_run() { # SLUG MODE DIR ARGS...
  local slug=$1 mode=$2 dir=$3 port=$((PORT++)) envw
  shift 3
  envw="$UCX_ENV $(mode_env "$mode" "$dir")"
  run_app "$slug" "$mode" "$envw" "$envw" "$port" ucx_perftest -p "$port" -- \
    ucx_perftest "$ADDR" -p "$port" -s 1048576 -n "$UCX_ITERS" -w 2 "$@"
}
ucx_uct_put() { ucx_run "$@" -t put_bw -x rc_verbs -d rxe0:1 -D zcopy; }
ucx_uct_get() { ucx_run "$@" -t get -x rc_verbs -d rxe0:1 -D zcopy; }
ucx_ucp_tag() { ucx_run "$@" -t tag_bw; }
ucx_ucp_put() { ucx_run "$@" -t ucp_put_bw; }
if ! want ucx; then
  :
elif ! command -v ucx_perftest > /dev/null; then
  result FAIL "ucx_perftest" "ucx_perftest is not installed (ucx-utils; scripts/setup.sh installs it)"
else
  check_app "ucx_perftest UCT put_bw rc_verbs zcopy 1M (RDMA WRITE)" split ucx_output ucx_uct_put
  check_app "ucx_perftest UCT get rc_verbs zcopy 1M (RDMA READ)" split ucx_output ucx_uct_get
  check_app "ucx_perftest UCP tag_bw 1M (rendezvous)" split ucx_output ucx_ucp_tag
  check_app "ucx_perftest UCP ucp_put_bw 1M" split ucx_output ucx_ucp_put
fi

# --- fi_pingpong -------------------------------------------------------------------------
FI_ITERS=${REAL_APPS_FI_ITERS:-10}
FI_ENV="FI_UNIVERSE_SIZE=4"
# The client's result row: "bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec", its
# size and counts.
fi_output() { # CLIENT_LOG SERVER_LOG
  awk '$1 == "bytes" && $2 == "#sent" { h = 1; next } h && NF >= 6 { print $1 " x " $2 " sent, " $3 " acked, " $4 " in all [" $6 " MB/s]"; exit }' "$1"
}
fi_run() { # SLUG MODE DIR
  local slug=$1 mode=$2 dir=$3 port=$((PORT++)) envw
  envw="$FI_ENV $(mode_env "$mode" "$dir")"
  local args=(-p "verbs;ofi_rxm" -e rdm -S 1048576 -I "$FI_ITERS" -c)
  run_app "$slug" "$mode" "$envw" "$envw" "$port" fi_pingpong "${args[@]}" -B "$port" -- \
    fi_pingpong "${args[@]}" -P "$port" "$ADDR"
}
if ! want fabric; then
  :
elif ! command -v fi_pingpong > /dev/null; then
  result FAIL "fi_pingpong" "fi_pingpong is not installed (libfabric-bin; scripts/setup.sh installs it)"
else
  check_app "fi_pingpong verbs;ofi_rxm RDM 1M, data checked (-c)" split fi_output fi_run
fi

# --- Open MPI over UCX -------------------------------------------------------------------
MPI_MAX=${REAL_APPS_MPI_MAX:-4194304}
mpi_output() { # CLIENT_LOG SERVER_LOG
  grep -o 'result PASS: [0-9]* bytes checked on 2 ranks, 0 mismatched' "$1" | head -n 1
}
mpi_run() { # SLUG MODE DIR: mpirun is both sides; its status is the client's
  local slug=$1 mode=$2 dir=$3 envw xs=() w
  envw="$(mode_env "$mode" "$dir")"
  for w in $envw; do xs+=(-x "${w%%=*}"); done
  CLOG=$L.$slug.$mode.log SLOG=$CLOG ERR="" SRC=0
  note "$slug.$mode: mpirun"
  # shellcheck disable=SC2086
  env $envw unshare --uts /bin/sh -c 'hostname real-apps-guest && exec "$@"' sh \
    timeout -k 5 "$STEP" mpirun --allow-run-as-root --oversubscribe -np 2 \
    --mca pml ucx --mca osc ucx --mca btl self \
    -x UCX_NET_DEVICES=rxe0:1 -x UCX_TLS=rc_verbs,ud_verbs,self -x UCX_IB_GID_INDEX=0 "${xs[@]}" \
    "$APPS/mpi_check" "$MPI_MAX" > "$CLOG" 2>&1
  CRC=$?
  STATUS="mpirun exit $CRC"
  note "$slug.$mode: mpirun exit $CRC"
}
if ! want mpi; then
  :
elif ! command -v mpirun > /dev/null; then
  result FAIL "MPI" "mpirun is not installed (openmpi-bin; scripts/setup.sh installs it)"
elif [ "$APPS" = - ] || [ ! -x "$APPS/mpi_check" ]; then
  result SKIP "Open MPI over UCX, mpi_check" "tests/vm/apps/mpi_check was not built (mpicc missing, or apps/build.sh failed)"
else
  check_app "Open MPI over UCX, 2 ranks, mpi_check send/recv, put, get up to $MPI_MAX B" split mpi_output mpi_run
fi

cleanup
exit "$FAILED"
