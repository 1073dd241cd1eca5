#!/usr/bin/env python3
"""Writes a Mooncake-format trace with its requests in a random order (the timestamps stay in
place): every block keeps its accesses, but when it is used no longer says anything. Replaying
both shows what the order of a trace is worth to each policy and to Belady.

Usage: scripts/shuffle_trace.py TRACE OUT [--seed N]
(docs/BENCHMARKS.md, "Eviction that learns the workload", quotes the replays.)
"""
import argparse
import json
import random


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    with open(a.trace) as f:
        reqs = [json.loads(line) for line in f if line.strip()]
    stamps = [r["timestamp"] for r in reqs]
    random.Random(a.seed).shuffle(reqs)
    with open(a.out, "w") as f:
        for t, r in zip(stamps, reqs):
            f.write(json.dumps(dict(r, timestamp=t)) + "\n")
    print(f"{a.out}: {len(reqs)} requests in a random order (seed {a.seed})")


if __name__ == "__main__":
    main()
