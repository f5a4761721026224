#!/bin/bash
# Inside the guest (in the chroot): the reference flow's GID index on an interface whose
# IPv6 link-local address is not made from its MAC address, as NetworkManager's
# stable-privacy mode and the random mode (net.ipv6.conf.<if>.addr_gen_mode 2 and 3)
# make it. GID index 0 of a RoCE port is then still the default GID fe80::<EUI-64 of
# the MAC>, which is no address of the interface: the kernel's neighbour lookup for it
# goes unanswered and a loopback connection through it fails in ibv_modify_qp(RTR) with
# ETIMEDOUT after a second. rdma-up.sh's rxe0 is left alone: this makes rxe1 on a veth
# pair of its own (veth2, veth3) and removes it at the end.
#
#   tests/vm/guest.sh --timeout 600 -- tests/vm/guest/gid-index.sh RESULTS BIN_DIR [OLD_JUSTITIAD]
#
# Checks (one line each in RESULTS/results.txt, logs in RESULTS/logs/gid.*), with
# addr_gen_mode random on veth2:
#   - the kernel refuses GID 0: ibv_rc_pingpong -g 0 in loopback fails, and strace shows
#     the uverbs command failing with ETIMEDOUT;
#   - justitiad with gid_index = 0 stops at start naming the index, the GID and veth2;
#   - justitiad with the packaged (automatic) setting takes veth2's own link-local GID
#     and probes (a latency flow registered, 50 probes completed).
# With OLD_JUSTITIAD (a justitiad from before the automatic setting), also the failures
# it meets at gid_index = 0 under each addressing mode (random, stable-privacy, IPv6 off,
# duplicate address detection still running), printed as INFO lines, and the new
# daemon's automatic choice under the last two. About 30 s without OLD_JUSTITIAD.
set -uo pipefail

RESULTS=$1
BIN=$2
OLD=${3:-}
LOGS=$RESULTS/logs
# shellcheck source=tests/vm/guest/daemon-lib.sh
source "$(dirname "$0")/daemon-lib.sh"
mkdir -p "$LOGS"
touch "$RESULTS/results.txt"

LAST_RESULT=$SECONDS
result() { # STATUS NAME DETAIL
  printf '%s %s: %s (%d s)\n' "$1" "$2" "$3" $((SECONDS - LAST_RESULT)) | tee -a "$RESULTS/results.txt"
  LAST_RESULT=$SECONDS
}
info() { echo "INFO gid: $*" | tee -a "$LOGS/gid.info.txt"; }

run=$(mktemp -d /tmp/justitiad-gid.XXXXXX)
DAEMON_PID="" rpid=""
teardown() {
  rdma link delete rxe1 2> /dev/null
  ip link del veth2 2> /dev/null
}
cleanup() {
  [ -n "$rpid" ] && kill "$rpid" 2> /dev/null
  stop_daemon
  wait 2> /dev/null
  teardown
  rm -rf "$run"
}
trap cleanup EXIT

# rxe1 on veth2, whose link-local address MODE makes: eui64, random, stable (stable
# privacy), noipv6 (IPv6 off on veth2), or dad (EUI-64 with duplicate address detection
# on, DAD_TRANSMITS probes, default 1; returns as soon as the port is active, the address
# still tentative).
mkrxe() { # MODE
  local mode=$1 _
  teardown
  ip link add veth2 type veth peer name veth3 || return 1
  case $mode in
    random) ip link set veth2 addrgenmode random ;;
    stable)
      echo 2001:db8::4a5:1:2 > /proc/sys/net/ipv6/conf/veth2/stable_secret
      ip link set veth2 addrgenmode stable_secret
      ;;
    noipv6) echo 1 > /proc/sys/net/ipv6/conf/veth2/disable_ipv6 ;;
  esac
  for d in veth2 veth3; do
    if [ "$mode" = dad ]; then
      echo 1 > "/proc/sys/net/ipv6/conf/$d/accept_dad"
      echo "${DAD_TRANSMITS:-1}" > "/proc/sys/net/ipv6/conf/$d/dad_transmits"
    else
      echo 0 > "/proc/sys/net/ipv6/conf/$d/accept_dad"
    fi
  done
  rdma link add rxe1 type rxe netdev veth2 || return 1
  ip link set veth3 up
  ip link set veth2 up
  for _ in $(seq 100); do
    if ibv_devinfo -d rxe1 2> /dev/null | grep -q PORT_ACTIVE; then
      case $mode in
        dad | noipv6) return 0 ;;
        *) grep -q ' veth2$' /proc/net/if_inet6 && return 0 ;;
      esac
    fi
    sleep 0.1
  done
  return 1
}

# The populated GID entries of rxe1 port 1 and veth2's IPv6 addresses (flags 40:
# tentative), one line.
gid_table() {
  local p=/sys/class/infiniband/rxe1/ports/1 i g out=""
  for i in $(seq 0 15); do
    g=$(cat "$p/gids/$i" 2> /dev/null) || continue
    [ "$g" = 0000:0000:0000:0000:0000:0000:0000:0000 ] && continue
    out="$out[$i] $g $(cat "$p/gid_attrs/types/$i" 2> /dev/null) $(cat "$p/gid_attrs/ndevs/$i" 2> /dev/null); "
  done
  echo "GIDs: ${out:-none; }veth2 if_inet6: $(awk '$6 == "veth2" {printf "%s flags %s; ", $1, $5}' /proc/net/if_inet6)"
}

# justitiad BIN with CONFIG until it has started or exited (at most SECS); says how it
# ended, with its error line, in ONCE (not printed: a command substitution would run it in
# a subshell and lose DAEMON_PID). Leaves a started daemon running (DAEMON_PID).
daemon_once() { # BIN CONFIG LOG SECS
  local bin=$1 config=$2 log=$3 deadline=$((SECONDS + $4)) t0=$SECONDS rc
  JUSTITIA_LOG=info RUST_BACKTRACE=0 "$bin" --config "$config" > "$log" 2>&1 &
  DAEMON_PID=$!
  while kill -0 "$DAEMON_PID" 2> /dev/null && [ "$SECONDS" -lt "$deadline" ]; do
    if grep -q "justitiad started" "$log"; then
      ONCE="started after $((SECONDS - t0)) s"
      return 0
    fi
    sleep 0.1
  done
  if kill -0 "$DAEMON_PID" 2> /dev/null; then
    ONCE="neither started nor stopped in $4 s"
    return 2
  fi
  wait "$DAEMON_PID"
  rc=$?
  DAEMON_PID=""
  ONCE="exited $rc after $((SECONDS - t0)) s: $(grep -m1 '^Error' "$log" | cut -c1-700)"
  return 1
}

# Every process holding rxe1 must be gone before rxe1 is deleted: the kernel waits for
# them (rdma link delete hangs).
stop_daemon() {
  local _
  [ -n "$DAEMON_PID" ] || return 0
  kill "$DAEMON_PID" 2> /dev/null
  for _ in $(seq 50); do
    kill -0 "$DAEMON_PID" 2> /dev/null || break
    sleep 0.1
  done
  kill -KILL "$DAEMON_PID" 2> /dev/null
  wait "$DAEMON_PID" 2> /dev/null
  DAEMON_PID=""
}

# A configuration on rxe1 with its sockets in $run; extra KEY=VALUE as daemon_config.
gid_config() { # FILE KEY=VALUE...
  local file=$1
  shift
  daemon_config "$file" "$run/justitiad.sock" "$run/admin.sock" 127.0.0.1:19474 'device="rxe1"' "$@"
}

for f in justitiad justitia examples/register; do
  if [ ! -x "$BIN/$f" ]; then
    result FAIL "gid: prerequisites" "$BIN/$f is not built"
    exit 1
  fi
done

# --- The investigation (with a justitiad from before the fix): each addressing mode.
if [ -n "$OLD" ]; then
  gid_config "$run/old.toml" gid_index=0 || info "config: $DAEMON_ERR"
  # dad: five probes (five to six seconds tentative), the daemon started at once, the
  # address's flags read just before.
  for mode in eui64 random stable noipv6 dad; do
    if ! DAD_TRANSMITS=5 mkrxe "$mode"; then
      info "$mode: rxe1 did not come up: $(ip addr show veth2 | tr '\n' ' ')"
      continue
    fi
    if [ "$mode" = dad ]; then
      info "$mode: at start, veth2 if_inet6: $(awk '$6 == "veth2" {printf "%s flags %s", $1, $5}' /proc/net/if_inet6)"
    else
      info "$mode: $(gid_table)"
    fi
    daemon_once "$OLD" "$run/old.toml" "$LOGS/gid.old-$mode.log" 20
    info "$mode: old justitiad, gid_index = 0: $ONCE"
    info "$mode: afterwards: $(gid_table)"
    stop_daemon
  done
  # IPv6 off with an IPv4 address, and detection in progress, under the new default.
  gid_config "$run/auto.toml" || info "config: $DAEMON_ERR"
  if mkrxe noipv6; then
    daemon_once "$BIN/justitiad" "$run/auto.toml" "$LOGS/gid.new-noipv6.log" 20
    info "noipv6: new justitiad, automatic, no IPv4 address: $ONCE"
    stop_daemon
    ip addr add 10.77.0.1/24 dev veth2
    sleep 0.5
    info "noipv6+ipv4: $(gid_table)"
    daemon_once "$BIN/justitiad" "$run/auto.toml" "$LOGS/gid.new-noipv6-ipv4.log" 20
    info "noipv6+ipv4: new justitiad, automatic: $ONCE $(grep -m1 'reference flow GID' "$LOGS/gid.new-noipv6-ipv4.log" | grep -o 'gid_index=.*')"
    stop_daemon
  fi
  if DAD_TRANSMITS=5 mkrxe dad; then
    info "dad: at start, veth2 if_inet6: $(awk '$6 == "veth2" {printf "%s flags %s", $1, $5}' /proc/net/if_inet6)"
    daemon_once "$BIN/justitiad" "$run/auto.toml" "$LOGS/gid.new-dad.log" 30
    info "dad: new justitiad, automatic: $ONCE $(grep -m1 'waiting for duplicate' "$LOGS/gid.new-dad.log" | cut -c1-27) $(grep -m1 'reference flow GID' "$LOGS/gid.new-dad.log" | grep -o 'gid_index=.*')"
    stop_daemon
  fi
fi

# --- The checks, with addr_gen_mode random on veth2.
if ! mkrxe random; then
  result FAIL "gid: rxe1 on veth2 (addrgenmode random)" "did not come up: $(ip addr show veth2 | tr '\n' ' ')"
  exit 1
fi
table=$(gid_table)
echo "$table" > "$LOGS/gid.table.txt"
default_gid=$(cat /sys/class/infiniband/rxe1/ports/1/gids/0)

# 1. The kernel's answer, without the daemon: ibv_rc_pingpong through GID 0, in loopback.
# The server moves its QP to RTR first (on the client's address, before answering), so
# it is the one that fails; strace shows the errno of its uverbs command.
trace=()
command -v strace > /dev/null && trace=(strace -f --seccomp-bpf -e trace=ioctl,write -o "$LOGS/gid.pingpong-server.strace")
"${trace[@]}" ibv_rc_pingpong -d rxe1 -g 0 -p 18600 -n 5 > "$LOGS/gid.pingpong-server.log" 2>&1 &
spid=$!
wait_tcp_listen 18600
timeout 30 ibv_rc_pingpong -d rxe1 -g 0 -p 18600 -n 5 localhost > "$LOGS/gid.pingpong-client.log" 2>&1
crc=$?
for _ in $(seq 50); do
  kill -0 "$spid" 2> /dev/null || break
  sleep 0.1
done
# strace's child first: strace killed alone would leave the server running, holding rxe1.
pkill -KILL -P "$spid" 2> /dev/null
kill -KILL "$spid" 2> /dev/null
wait "$spid" 2> /dev/null
errno=$(grep -s -m1 -E '= -1 ETIMEDOUT' "$LOGS/gid.pingpong-server.strace" | grep -oE '^[0-9]+ +[a-z0-9]+\(|= -1 E[A-Z]+ \([^)]*\)' | tr '\n' ' ')
[ ${#trace[@]} = 0 ] && errno="not seen (no strace)"
if [ "$crc" -ne 0 ] && grep -q "Failed to modify QP to RTR" "$LOGS/gid.pingpong-server.log" && [ -n "$errno" ]; then
  result PASS "gid: GID 0 unusable when the link-local address is not the MAC's" \
    "ibv_rc_pingpong -g 0 server: '$(grep -m1 'Failed to modify' "$LOGS/gid.pingpong-server.log")', its uverbs command: $errno; $table"
else
  result FAIL "gid: GID 0 unusable when the link-local address is not the MAC's" \
    "expected the server's RTR to fail with ETIMEDOUT: client exit $crc, errno '${errno:-none}', server: $(tail -n 2 "$LOGS/gid.pingpong-server.log" | tr '\n' ' '); $table"
fi

# 2. An explicit gid_index = 0: refused at start, with the index, the GID and the device.
if gid_config "$run/zero.toml" gid_index=0; then
  daemon_once "$BIN/justitiad" "$run/zero.toml" "$LOGS/gid.zero.log" 30
  ended=$ONCE
  stop_daemon
  short=$(echo "$default_gid" | sed 's/:0\{1,3\}/:/g; s/^fe80:0:0:0:/fe80::/')
  if echo "$ended" | grep -q "^exited" && grep -q "gid_index 0" "$LOGS/gid.zero.log" \
    && grep -q "not an address of veth2" "$LOGS/gid.zero.log" && grep -qi "$short" "$LOGS/gid.zero.log"; then
    result PASS "gid: gid_index = 0 refused at start" "$ended"
  else
    result FAIL "gid: gid_index = 0 refused at start" "$ended (wanted the index, $short and veth2 named)"
  fi
else
  result FAIL "gid: gid_index = 0 refused at start" "$DAEMON_ERR"
fi

# 3. The packaged setting: veth2's own link-local GID, and probes.
if ! gid_config "$run/auto.toml"; then
  result FAIL "gid: the packaged gid_index probes" "$DAEMON_ERR"
  exit 1
fi
daemon_once "$BIN/justitiad" "$run/auto.toml" "$LOGS/gid.auto.log" 30
ended=$ONCE
chosen=$(grep -m1 'reference flow GID' "$LOGS/gid.auto.log" | grep -o 'gid_index=.*')
if ! echo "$ended" | grep -q "^started"; then
  result FAIL "gid: the packaged gid_index probes" "$ended"
  exit 1
fi
"$BIN/examples/register" "$run/justitiad.sock" latency 60 > "$LOGS/gid.register.log" 2>&1 &
rpid=$!
probes=0
for _ in $(seq 60); do
  probes=$("$BIN/justitia" status --socket "$run/admin.sock" --json 2>&1 | grep -o '"probes": *[0-9]*' | grep -o '[0-9]*$')
  [ "${probes:-0}" -ge 50 ] && break
  sleep 0.5
done
if [ "${probes:-0}" -ge 50 ] && ! echo "$chosen" | grep -q 'gid_index=0 '; then
  result PASS "gid: the packaged gid_index probes" "$ended; $chosen; $probes probes"
else
  result FAIL "gid: the packaged gid_index probes" "$ended; ${chosen:-no GID logged}; ${probes:-no} probes; $(tail -n 2 "$LOGS/gid.auto.log" | tr '\n' ' ')"
fi
