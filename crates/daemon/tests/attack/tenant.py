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
"""
import select
import socket
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
