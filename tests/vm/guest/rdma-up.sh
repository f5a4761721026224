#!/bin/bash
# Inside the guest (in the chroot): creates the veth pair and binds Soft-RoCE to veth0 as
# rxe0, then waits until its port is active and GID index 0 (the IPv6 link-local address)
# is usable. Soft-RoCE will not bind to lo, and busybox's ip cannot create veth pairs,
# which is why this runs with the host's iproute2.
set -euo pipefail

# The out-of-band exchanges of perftest and ibv_rc_pingpong go over TCP to localhost.
ip link set lo up
ip link add veth0 type veth peer name veth1
# Without duplicate address detection the link-local address (GID 0) is usable at once.
for dev in veth0 veth1; do
  echo 0 > "/proc/sys/net/ipv6/conf/$dev/accept_dad"
done
ip link set veth0 up
ip link set veth1 up
rdma link add rxe0 type rxe netdev veth0

for _ in $(seq 100); do
  if ibv_devinfo -d rxe0 2>/dev/null | grep -q PORT_ACTIVE \
    && ip -6 addr show dev veth0 scope link | grep -q 'inet6 fe80'; then
    echo "rdma-up: rxe0 active on veth0 ($(ip -6 -o addr show dev veth0 scope link | awk '{print $4}'))"
    exit 0
  fi
  sleep 0.2
done
echo "rdma-up: rxe0 did not become active" >&2
ibv_devinfo -d rxe0 >&2 || true
ip addr show >&2 || true
exit 1
