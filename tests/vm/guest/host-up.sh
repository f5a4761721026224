#!/bin/bash
# Inside one guest of the two-host pair (in the chroot): brings up this host's end of the
# virtual cable (eth0, QEMU's virtio-net card) with its IPv4 address and binds Soft-RoCE to
# it as this host's only RDMA device, then waits until its port is active and GID index 1
# (the IPv4-mapped address, RoCE v2) is usable.
#
#   host-up.sh a|b|c      # host A: rxea on 10.77.0.1; B: rxeb on 10.77.0.2; C: rxec on 10.77.0.3
set -euo pipefail

case ${1:-} in
  a) dev=rxea addr=10.77.0.1 ;;
  b) dev=rxeb addr=10.77.0.2 ;;
  c) dev=rxec addr=10.77.0.3 ;;
  *) echo "usage: host-up.sh a|b|c" >&2; exit 2 ;;
esac

# perftest's and rping's connection data go over TCP on the cable; the daemon's metrics
# and its loopback probe stay local.
ip link set lo up
echo 0 > /proc/sys/net/ipv6/conf/eth0/accept_dad
ip addr add "$addr/24" dev eth0
ip link set eth0 up
rdma link add "$dev" type rxe netdev eth0

for _ in $(seq 150); do
  if ibv_devinfo -d "$dev" 2>/dev/null | grep -q PORT_ACTIVE \
    && grep -q "ffff:$(printf '%02x%02x:%02x%02x' ${addr//./ })" "/sys/class/infiniband/$dev/ports/1/gids/1" 2>/dev/null \
    && ip -6 addr show dev eth0 scope link | grep -q 'inet6 fe80'; then
    echo "host-up: $dev active on eth0 ($addr, GID 1 $(cat "/sys/class/infiniband/$dev/ports/1/gids/1"))"
    exit 0
  fi
  sleep 0.2
done
echo "host-up: $dev did not become active" >&2
ibv_devinfo -v -d "$dev" >&2 || true
ip addr show >&2 || true
exit 1
