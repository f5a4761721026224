#!/usr/bin/env python3
"""A hostile local tenant for the attack suite (crates/daemon/tests/attacks.rs).

Run by the suite under another uid. Each mode does one row of the attack table, prints
one line saying what it achieved, and keeps its connections until stdin closes.

  hold SOCK N               open N registration connections
  register SOCK N HEX       one connection, N registrations (HEX: one encoded message)
  flood SOCK CONNS HEX...   CONNS connections sending the messages without pause
  tcp-idle ADDR N           N idle TCP connections
  tcp-header ADDR MIB       one request head line of MIB MiB
  squat ADDR                bind and listen on ADDR first
  shaper SOCK HEX           register one flow (HEX), report it active
  remotes SOCK HEX GID...   one connection, one flow (HEX) per GID (32 hex digits), each
                            reported active and as READing from its GID
  handoff SOCK              connect, hand the connection to a child that keeps it, print
                            this process's pid and exit (the child stays till stdin closes)
  admin SOCK                ask the admin socket for the status
  inspect SOCK FLOW PID SPOOF OWN
                            what a tenant can see: its page, the shared block, the
                            daemon's descriptors, a registration claiming root (SPOOF)
"""
import mmap
import os
import select
import socket
import struct
import sys
import threading


def addr(text):
    host, port = text.rsplit(":", 1)
    return (host, int(port))


def seq(path):
    # A daemon that stopped accepting leaves connect waiting on a full backlog.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(0.5)
    s.connect(path)
    s.settimeout(None)
    return s


def until_stdin_closes():
    sys.stdout.flush()
    sys.stdin.read()


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    held = []
    if mode == "hold":
        for _ in range(int(args[1])):
            try:
                s = seq(args[0])
                s.setblocking(False)
                held.append(s)
            except OSError:
                break
        print(f"held {len(held)}")
    elif mode == "register":
        s = seq(args[0])
        s.settimeout(5)
        s.recv(256)
        msg = bytes.fromhex(args[2])
        registered = refused = 0
        for _ in range(int(args[1])):
            s.send(msg)
            reply = s.recv(256)
            # The kind byte: see justitia_agent::proto (Registered 0x82, Refused 0x83).
            if reply[3] == 0x82:
                registered += 1
            else:
                refused += 1
        held.append(s)
        print(f"registered {registered} refused {refused}")
    elif mode == "flood":
        msgs = [bytes.fromhex(h) for h in args[2:]]
        for _ in range(int(args[1])):
            try:
                s = seq(args[0])
                s.setblocking(False)
                held.append(s)
            except OSError:
                break
        print(f"flooding on {len(held)}")
        sys.stdout.flush()
        stop = threading.Event()

        def pump():
            while not stop.is_set():
                _, w, _ = select.select([], held, [], 0.1)
                for s in w:
                    for m in msgs:
                        try:
                            s.send(m)
                        except OSError:
                            break
                    try:
                        while s.recv(256):
                            pass
                    except OSError:
                        pass

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        sys.stdin.read()
        stop.set()
        return
    elif mode == "tcp-idle":
        for _ in range(int(args[1])):
            try:
                held.append(socket.create_connection(addr(args[0]), timeout=0.5))
            except OSError:
                break
        print(f"held {len(held)}")
    elif mode == "tcp-header":
        s = socket.create_connection(addr(args[0]))
        s.settimeout(5)
        sent = 0
        chunk = b"a" * (1 << 20)
        try:
            s.sendall(b"GET /metrics HTTP/1.1\r\nX-Long: ")
            for _ in range(int(args[1])):
                s.sendall(chunk)
                sent += 1
        except OSError:
            pass
        held.append(s)
        print(f"sent {sent} MiB")
    elif mode == "shaper":
        s = seq(args[0])
        s.settimeout(5)
        hello = s.recv(256)
        s.send(bytes.fromhex(args[1]))
        reply = s.recv(256)
        assert reply[3] == 0x82, f"not registered: {reply.hex()}"
        flow = reply[12:20]
        usage = b"JA" + bytes([hello[2], 2]) + flow + b"\x01" + struct.pack("<QQ", 1, 1)
        s.send(usage)
        held.append(s)
        print("registered")
    elif mode == "remotes":
        s = seq(args[0])
        s.settimeout(5)
        hello = s.recv(256)
        registered = refused = 0
        for gid in args[2:]:
            s.send(bytes.fromhex(args[1]))
            reply = s.recv(256)
            if reply[3] != 0x82:
                refused += 1
                continue
            registered += 1
            flow = reply[12:20]
            head = b"JA" + bytes([hello[2]])
            s.send(head + b"\x02" + flow + b"\x01" + struct.pack("<QQ", 1, 1))
            # Remote end: flow, GID, LID 0, remote QP number 1, READs.
            s.send(head + b"\x04" + flow + bytes.fromhex(gid) + struct.pack("<HI", 0, 1) + b"\x01")
        held.append(s)
        print(f"registered {registered} refused {refused}")
    elif mode == "handoff":
        s = seq(args[0])
        if os.fork() == 0:
            held.append(s)
            until_stdin_closes()
            os._exit(0)
        print(f"pid {os.getpid()}")
        sys.stdout.flush()
        os._exit(0)
    elif mode == "admin":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(args[0])
        try:
            s.sendall(b'{"cmd":"status"}\n')
        except OSError:
            pass  # a refusal is written at once and the connection closed
        print(s.makefile().readline().strip())
    elif mode == "inspect":
        path, other, daemon, spoof, own = args
        other = int(other)
        s = seq(path)
        s.settimeout(5)
        _, fds, _, _ = socket.recv_fds(s, 256, 2)
        block, page = fds
        s.send(bytes.fromhex(spoof))
        reply = s.recv(256)
        spoofed = "refused" if reply[3] == 0x83 and reply[12] == 0 else "accepted"
        s.send(bytes.fromhex(own))
        reply = s.recv(256)
        assert reply[3] == 0x82, f"not registered: {reply.hex()}"
        flow = struct.unpack("<Q", reply[12:20])[0]

        def flows(fd):
            size = os.fstat(fd).st_size
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            slots = struct.unpack_from("<Q", m, 16)[0]
            return {struct.unpack_from("<Q", m, 128 + i * 128 + 8)[0] for i in range(slots)}

        import time
        mine = set()
        for _ in range(200):
            mine = flows(page)
            if flow in mine:
                break
            time.sleep(0.01)
        opened = 0
        try:
            for name in os.listdir(f"/proc/{daemon}/fd"):
                try:
                    os.close(os.open(f"/proc/{daemon}/fd/{name}", os.O_RDONLY))
                    opened += 1
                except OSError:
                    pass
        except OSError:
            pass
        print(
            f"inode={os.fstat(page).st_ino} own={str(flow in mine).lower()} "
            f"other_in_page={str(other in mine).lower()} "
            f"other_in_block={str(other in flows(block)).lower()} "
            f"opened={opened} spoof={spoofed}"
        )
        held.append(s)
    elif mode == "squat":
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(addr(args[0]))
        s.listen(8)
        held.append(s)
        print("bound")
    else:
        sys.exit(f"unknown mode {mode}")
    until_stdin_closes()


main()
