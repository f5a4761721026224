#!/usr/bin/env python3
"""Runs shell commands on host B (or C) of the two-host pair for the checks that run on A.

    remote.py serve ADDR PORT          # on B or C: serve until told to stop
    remote.py run ADDR PORT SECS CMD   # on A: run CMD (a bash command line) there

The guests share nothing but their virtual cables, so host A's checks start B's and C's
servers, daemons and tools through this. Each request is one TCP connection: the command
(a 4-byte big-endian length, then UTF-8), answered with the command's exit status (4
bytes, signed) and its combined output. B runs it with bash from the repository root,
stdin closed, at most SECS seconds (status 124 when it takes longer); a command that
must outlive its request puts itself in the background with its output in a file. The
command "exit" stops the server. It listens on the cable's private address only: the
pair is a test rig, its guests its only members.
"""

import socket
import socketserver
import struct
import subprocess
import sys
import time


def read_exact(conn, n):
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError("connection closed after %d of %d bytes" % (len(data), n))
        data += part
    return data


class Handler(socketserver.StreamRequestHandler):
    def handle(self):
        (length,) = struct.unpack(">I", read_exact(self.request, 4))
        (limit,) = struct.unpack(">I", read_exact(self.request, 4))
        command = read_exact(self.request, length).decode()
        if command == "exit":
            self.request.sendall(struct.pack(">i", 0))
            self.server.stopping = True
            return
        try:
            done = subprocess.run(
                ["bash", "-c", command],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=limit,
            )
            status, output = done.returncode, done.stdout
        except subprocess.TimeoutExpired as expired:
            status, output = 124, (expired.stdout or b"") + b"\nremote: timed out\n"
        self.request.sendall(struct.pack(">i", status) + output)


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    stopping = False


def serve(addr, port):
    with Server((addr, port), Handler) as server:
        server.timeout = 0.5
        print("remote: serving on %s:%d" % (addr, port), flush=True)
        while not server.stopping:
            server.handle_request()
    print("remote: stopped", flush=True)


def run(addr, port, limit, command):
    # B boots beside A: until its server listens, connecting is retried (up to SECS).
    deadline = time.monotonic() + limit
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                print("remote: no server at %s:%d" % (addr, port), file=sys.stderr)
                return 125
            time.sleep(0.5)
    with conn:
        conn.settimeout(limit + 30)
        data = command.encode()
        conn.sendall(struct.pack(">II", len(data), limit) + data)
        (status,) = struct.unpack(">i", read_exact(conn, 4))
        while True:
            part = conn.recv(65536)
            if not part:
                break
            sys.stdout.buffer.write(part)
    sys.stdout.flush()
    return status


def main(argv):
    if len(argv) == 4 and argv[1] == "serve":
        serve(argv[2], int(argv[3]))
        return 0
    if len(argv) == 6 and argv[1] == "run":
        return run(argv[2], int(argv[3]), int(argv[4]), argv[5])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
