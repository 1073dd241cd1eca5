#!/usr/bin/env python3
"""Running streams while the remote L3 stalls (docs/BENCHMARKS.md, "A stalled Redis and the
running streams").

Starts a redis-server and `strata serve --l3 redis://...` (defaults otherwise: a 500 ms bound
per Redis operation), runs one long greedy stream and, once it is under way, stops Redis with
SIGSTOP (a hang: connections stay open, nothing answers) and sends new prompts one after
another, each admitted while the stream runs. Prints the stream's gaps between tokens before
the stall and during it, and each new prompt's time to answer. Redis is resumed (SIGCONT) at
the end. Run it with two binaries in one sitting to compare them.

usage: scripts/l3_stall.py STRATA MODEL [--port 18710] [--redis-port 18711] [--prompts 6]
                          [--no-stall]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def post(url, body, stream=False):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=120)


def wait_healthy(url, proc, limit=120):
    t = time.time()
    while time.time() - t < limit:
        if proc.poll() is not None:
            sys.exit(f"server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit("server not healthy")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("strata")
    ap.add_argument("model")
    ap.add_argument("--port", type=int, default=18710)
    ap.add_argument("--redis-port", type=int, default=18711)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--no-stall", action="store_true", help="the same without stopping Redis")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp()
    redis = subprocess.Popen(["redis-server", "--port", str(a.redis_port), "--save", "",
                              "--appendonly", "no", "--dir", tmp],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = open(os.path.join(tmp, "serve.log"), "w")
    serve = subprocess.Popen([a.strata, "serve", "--model", a.model, "--port", str(a.port),
                              "--l3", f"redis://127.0.0.1:{a.redis_port}"],
                             stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{a.port}"
    try:
        wait_healthy(url, serve)
        post(url + "/v1/completions", {"prompt": "Warm up " * 40, "max_tokens": 2}).read()
        stamps, started = [], threading.Event()

        def stream():
            body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with post(url + "/v1/completions", body) as r:
                for line in r:
                    if line.startswith(b"data: {"):
                        stamps.append(time.perf_counter())
                        if len(stamps) == 40:
                            started.set()

        th = threading.Thread(target=stream)
        th.start()
        started.wait(60)
        stall_at = time.perf_counter()
        if not a.no_stall:
            os.kill(redis.pid, signal.SIGSTOP)
        answers = []
        for i in range(a.prompts):
            words = " ".join(f"story{i}-{k}" for k in range(12))
            t = time.perf_counter()
            post(url + "/v1/completions", {"prompt": words, "max_tokens": 1}).read()
            answers.append(time.perf_counter() - t)
        stall_end = time.perf_counter()
        os.kill(redis.pid, signal.SIGCONT)
        th.join()
        gaps = [(b - a_, b) for a_, b in zip(stamps, stamps[1:])]
        before = sorted(g for g, t in gaps if t < stall_at)
        during = [g for g, t in gaps if stall_at <= t <= stall_end]
        med = before[len(before) // 2]
        print(f"{a.strata}: {len(stamps)} tokens streamed; before the stall median gap "
              f"{med * 1e3:.1f} ms; during it ({stall_end - stall_at:.2f} s, {len(during)} "
              f"tokens) max gap {max(during, default=0) * 1e3:.1f} ms, gaps over 100 ms: "
              f"{sum(g > 0.1 for g in during)}; new prompts answered in "
              + ", ".join(f"{x * 1e3:.0f}" for x in answers) + " ms")
    finally:
        os.kill(redis.pid, signal.SIGCONT)
        serve.terminate()
        serve.wait(30)
        redis.terminate()
        redis.wait(10)


if __name__ == "__main__":
    main()
