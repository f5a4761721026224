# shellcheck shell=bash
# Inside the guest: starting a scratch justitiad, with its peer-channel key and table,
# shared by the daemon checks (daemon.sh, daemon-apps.sh, daemon-adaptive.sh, cdi.sh,
# escapees.sh, two-hosts.sh, wire.sh), and waiting for the programs they start
# (real-apps.sh too). Sourced; BIN must name the directory holding justitiad.

# daemon_config CONFIG SOCKET ADMIN_SOCKET METRICS [KEY=VALUE...]: packaging/justitiad.toml
# with its registration socket, admin socket and metrics address moved (to a scratch
# directory, so a test never meets an installed daemon), stale_after_ms raised to 1000 and
# each KEY (a top-level key, commented out or not in the packaged file) set to VALUE
# (TOML, quoted where a string); every other key as shipped. Under emulation the daemon's
# loop can stall for tens of milliseconds (probes of 40 ms have been seen), which the
# packaged 5 ms heartbeat limit rightly takes for a dead daemon: the registered shapers
# would fail open and register again over and over. Returns 1, saying why in DAEMON_ERR,
# when the packaged file no longer has a key it sets.
daemon_config() {
  local config=$1 socket=$2 admin=$3 metrics=$4 kv key
  shift 4
  local edits=(-e "s|^socket = .*|socket = \"$socket\"|"
    -e "s|^admin_socket = .*|admin_socket = \"$admin\"|"
    -e "s|^metrics = .*|metrics = \"$metrics\"|"
    -e "s|^stale_after_ms = .*|stale_after_ms = 1000|")
  for kv in "$@"; do
    key=${kv%%=*}
    edits+=(-e "s|^#* *$key = .*|$key = ${kv#*=}|")
  done
  sed "${edits[@]}" packaging/justitiad.toml > "$config"
  DAEMON_ERR=""
  grep -q "^socket = \"$socket\"" "$config" || DAEMON_ERR="socket"
  grep -q "^admin_socket = \"$admin\"" "$config" || DAEMON_ERR="$DAEMON_ERR admin_socket"
  grep -q "^metrics = \"$metrics\"" "$config" || DAEMON_ERR="$DAEMON_ERR metrics"
  grep -q "^stale_after_ms = 1000" "$config" || DAEMON_ERR="$DAEMON_ERR stale_after_ms"
  for kv in "$@"; do
    grep -qF "${kv%%=*} = ${kv#*=}" "$config" || DAEMON_ERR="$DAEMON_ERR ${kv%%=*}"
  done
  if [ -n "$DAEMON_ERR" ]; then
    DAEMON_ERR="packaging/justitiad.toml no longer has the keys this test sets:$DAEMON_ERR"
    return 1
  fi
}

# daemon_start CONFIG LOG: justitiad in the background at log level info; sets DAEMON_PID.
daemon_start() {
  JUSTITIA_LOG=info "$BIN/justitiad" --config "$1" > "$2" 2>&1 &
  DAEMON_PID=$!
}

# daemon_wait LOG SOCKET SECONDS [probing]: until SOCKET exists and the daemon has logged
# its start (its log is written by a thread of its own, a moment later), and, with
# "probing", its first probe; returns 1, saying why in DAEMON_ERR, when the daemon
# exits or the time is up.
daemon_wait() {
  local log=$1 socket=$2 deadline=$((SECONDS + $3)) probing=${4:-}
  while :; do
    # Alive as well: a daemon that binds its sockets and then stops on a bad setting (a
    # short key file) leaves them behind.
    if [ -S "$socket" ] && kill -0 "$DAEMON_PID" 2>/dev/null \
      && grep -q "justitiad started" "$log" \
      && { [ -z "$probing" ] || grep -q "reference flow running" "$log"; }; then
      return 0
    fi
    if ! kill -0 "$DAEMON_PID" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
      DAEMON_ERR="not ${probing:-listening} $3 s after start: $(tail -n 3 "$log" | tr '\n' ' ')"
      return 1
    fi
    sleep 0.1
  done
}

# wait_tcp_listen PORT: until something listens on TCP PORT (a perftest or qperf server),
# 30 s at most; returns 1 when nothing did.
wait_tcp_listen() { # PORT
  local _
  for _ in $(seq 300); do
    ss -Hltn "sport = :$1" 2>/dev/null | grep -q . && return 0
    sleep 0.1
  done
  return 1
}

# child_of PID: the pid of the program a `timeout` (PID) runs, the one that holds the queue
# pairs and registers with the daemon (PID itself when it has no child within 5 s).
child_of() { # PID
  local _ c
  for _ in $(seq 100); do
    c=$(pgrep -P "$1" | head -n 1)
    [ -n "$c" ] && { echo "$c"; return; }
    sleep 0.05
  done
  echo "$1"
}

# new_key DIR: a new private key in DIR/peer.key (mode 0600, as `justitiad genkey` under
# umask 077 writes it) on this host; prints its public key.
new_key() {
  mkdir -p "$1" && (umask 077 && "$BIN/justitiad" genkey > "$1/peer.key") && "$BIN/justitiad" pubkey < "$1/peer.key"
}

# peer_config NODE KEY_FILE LISTEN_ADDRESS PORT SILENCE_MS MEMBERS: a [peer] table for a
# daemon's configuration; MEMBERS is the inline table's content ("ADDR" = "PUBLIC_KEY", ...).
peer_config() {
  printf '\n[peer]\nnode = "%s"\nkey_file = "%s"\nlisten = "%s:%s"\nport = %s\nsilence_ms = %s\nmembers = { %s }\n' \
    "$1" "$2" "$3" "$4" "$4" "$5" "$6"
}
