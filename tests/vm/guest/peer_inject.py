#!/usr/bin/env python3
"""Hostile datagrams for a justitiad peer channel (crates/peer/src/wire.rs, version 1).

    peer_inject.py malformed DEST_IP PORT
    peer_inject.py forged DEST_IP PORT SENDER_IPV4 RECEIVER_IPV4
    peer_inject.py replayed IFACE DEST_IP PORT SECONDS

malformed: the magic and version of a peer message, then a body length that does not
match the datagram (the daemon must refuse it as "length"). forged: a well-formed grant
from SENDER to RECEIVER (nodes as IPv4-mapped GIDs), epoch and sequence far ahead, tagged
with a key that is not the cluster's ("authentication"). replayed: waits up to SECONDS for
a datagram this host sends to DEST_IP:PORT on IFACE (an authentic one, from this host's
justitiad), then sends the same bytes again ("replayed": its sequence is not newer than
the one already accepted). Prints what it sent; exits 1 when it had nothing to send.
"""

import hashlib
import hmac
import os
import socket
import struct
import sys
import time

MAGIC = b"JSPC"
VERSION = 1
KIND_GRANT = 2


def node(ipv4):
    return b"\0" * 10 + b"\xff\xff" + socket.inet_aton(ipv4)


def send(dest, port, data):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(data, (dest, port))


def malformed(dest, port):
    # Header says a 40-byte body; the datagram carries 8 bytes after the header and no tag.
    data = MAGIC + bytes([VERSION, KIND_GRANT]) + struct.pack(">H", 40) + b"\0" * 48 + b"\x01" * 40
    data = data[: 56 + 8] + os.urandom(32)
    send(dest, port, data)
    print("malformed: %d bytes, body length 40 declared" % len(data))


def forged(dest, port, sender, receiver):
    # A plausible grant: half of a 10 Gb/s port, 64 KiB chunks.
    body = struct.pack(">dddII d", 0.5, 625e6, 1e6, 65536, 0, 0.0)
    header = MAGIC + bytes([VERSION, KIND_GRANT]) + struct.pack(">H", len(body))
    header += node(sender) + node(receiver) + struct.pack(">QQ", 1 << 40, 1)
    tag = hmac.new(os.urandom(32), header + body, hashlib.sha256).digest()
    send(dest, port, header + body + tag)
    print("forged: %d bytes, a grant %s -> %s tagged with another key" % (len(header + body + tag), sender, receiver))


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
        if dport != port or not payload.startswith(MAGIC):
            continue
        # Let a newer datagram of the same sender be accepted first.
        time.sleep(0.2)
        send(dest, port, payload)
        print("replayed: %d bytes, kind %d, sequence %d" % (len(payload), payload[5], struct.unpack(">Q", payload[48:56])[0]))
        return 0
    print("replayed: no datagram to %s:%d seen on %s in %d s" % (dest, port, iface, seconds))
    return 1


def main(argv):
    if len(argv) == 4 and argv[1] == "malformed":
        malformed(argv[2], int(argv[3]))
        return 0
    if len(argv) == 6 and argv[1] == "forged":
        forged(argv[2], int(argv[3]), argv[4], argv[5])
        return 0
    if len(argv) == 6 and argv[1] == "replayed":
        return replayed(argv[2], argv[3], int(argv[4]), int(argv[5]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
