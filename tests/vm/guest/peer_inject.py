#!/usr/bin/env python3
"""Hostile datagrams for a justitiad peer channel (crates/peer/src/wire.rs, version 3).

    peer_inject.py malformed DEST_IP PORT
    peer_inject.py replayed IFACE DEST_IP PORT SECONDS

malformed: the preamble of a transport message (magic, version 3, type 3) and a header,
then fewer bytes than the smallest ciphertext (a kind byte and a 16-byte tag): the daemon
must refuse it as "length". replayed: waits up to SECONDS for a datagram this host sends
to DEST_IP:PORT on IFACE (an authentic one, from this host's justitiad), then sends the
same bytes again ("replayed": its session has taken that counter already). Prints what it
sent; exits 1 when it had nothing to send.

Datagrams of another key cannot be made here (that needs the Noise handshake):
tests/vm/guest/two-hosts.sh runs a second justitiad claiming another host's node with a
key of its own for that check.
"""

import os
import socket
import struct
import sys
import time

MAGIC = b"JSPC"
VERSION = 3
TYPE_TRANSPORT = 3


def send(dest, port, data):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(data, (dest, port))


def malformed(dest, port):
    # Preamble, a receiver index and a counter, then 5 bytes where at least 17 must follow.
    data = MAGIC + bytes([VERSION, TYPE_TRANSPORT, 0, 0]) + os.urandom(4) + struct.pack(">Q", 1)
    data += os.urandom(5)
    send(dest, port, data)
    print("malformed: %d bytes, a transport message too short for its tag" % len(data))


def replayed(iface, dest, port, seconds):
    # Outgoing frames reach only the taps of every protocol (ETH_P_ALL), not a socket
    # bound to IPv4 alone.
    ETH_P_ALL, ETH_P_IP = 0x0003, 0x0800
    s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_ALL))
    s.bind((iface, ETH_P_ALL))
    s.settimeout(0.5)
    want = socket.inet_aton(dest)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            packet, addr = s.recvfrom(65535)
        except socket.timeout:
            continue
        if addr[1] != ETH_P_IP or len(packet) < 28:
            continue
        ihl = (packet[0] & 0x0F) * 4
        if packet[9] != socket.IPPROTO_UDP or packet[16:20] != want:
            continue
        (dport,) = struct.unpack(">H", packet[ihl + 2 : ihl + 4])
        payload = packet[ihl + 8 :]
        # A transport message: a replayed handshake message would be refused under
        # another reason.
        if dport != port or not payload.startswith(MAGIC) or len(payload) < 6 or payload[5] != TYPE_TRANSPORT:
            continue
        # Let a newer datagram of the same sender be accepted first.
        time.sleep(0.2)
        send(dest, port, payload)
        print("replayed: %d bytes, a transport message, counter %d" % (len(payload), struct.unpack(">Q", payload[12:20])[0]))
        return 0
    print("replayed: no datagram to %s:%d seen on %s in %d s" % (dest, port, iface, seconds))
    return 1


def main(argv):
    if len(argv) == 4 and argv[1] == "malformed":
        malformed(argv[2], int(argv[3]))
        return 0
    if len(argv) == 6 and argv[1] == "replayed":
        return replayed(argv[2], argv[3], int(argv[4]), int(argv[5]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
