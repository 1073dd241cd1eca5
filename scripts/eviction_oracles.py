#!/usr/bin/env python3
"""What a policy could reach on a Mooncake-format trace if it knew more than the past.

A small mirror of `strata sim --page-size 1 --ids-as-tokens` (each hash id one token of a prefix
tree; a request hits its longest cached prefix, then inserts every id; leaves are evicted to the
capacity, the request's own ids last), with static priorities:

  lru            last access (checks the mirror against `strata sim`'s LRU)
  rate           the block's true long-run rate over its whole life (accesses / lifespan): an
                 oracle of *how often* a block is used, not of when it stops
  rate+death     the same, and 0 once the block has seen its last access: also knows *when*
  next           the next access (Belady's order without bypass)

With --by-gap, also where each policy's hits come from: by how many times the block was used
before and how many requests ago it was last used.

Usage: scripts/eviction_oracles.py TRACE [--capacity 5] [--by-gap]
(docs/BENCHMARKS.md, "Eviction that learns the workload", quotes its output.)
"""
import argparse
import bisect
import collections
import heapq
import json


GAPS = (10, 100, 1000)


def replay(reqs, cap, prio, by_gap=None):
    """Hit rate (of ids) with priority `prio(id, t)` (lowest evicted first); `by_gap`, a
    Counter, gets each hit under (earlier uses (4 = 4 or more), gap bucket)."""
    parent, cached, kids = {}, set(), collections.Counter()
    heap, ver = [], {}
    seen, last_t = collections.Counter(), {}
    hits = total = 0
    for t, r in enumerate(reqs):
        ids = r["hash_ids"]
        total += len(ids)
        k = 0
        while k < len(ids) and ids[k] in cached:
            k += 1
        hits += k
        if by_gap is not None:
            for n in ids[:k]:
                gap = t - last_t[n]
                by_gap[(min(seen[n], 4), sum(gap > g for g in GAPS))] += 1
        for i, n in enumerate(ids):
            seen[n] += 1
            last_t[n] = t
            if i > 0:
                parent[n] = ids[i - 1]
            if n not in cached:
                cached.add(n)
                if i > 0:
                    kids[ids[i - 1]] += 1
        for i, n in enumerate(ids):
            ver[n] = ver.get(n, 0) + 1
            heapq.heappush(heap, (prio(n, t, i), ver[n], n))
        mine, held = set(ids), []
        while len(cached) > cap and heap:
            item = heapq.heappop(heap)
            _, v, n = item
            if v != ver[n] or n not in cached or kids[n] > 0:
                continue  # stale, gone, or not a leaf (pushed again when it becomes one)
            if n in mine:
                held.append(item)
                continue
            cached.discard(n)
            p = parent.get(n)
            if p is not None and p in cached:
                kids[p] -= 1
                if kids[p] == 0:
                    ver[p] += 1
                    heapq.heappush(heap, (prio(p, t, -1), ver[p], p))
        for item in held:
            heapq.heappush(heap, item)
    return hits / total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--capacity", type=float, default=5.0, help="%% of distinct ids")
    ap.add_argument("--by-gap", action="store_true", help="hits by earlier uses and gap")
    a = ap.parse_args()
    reqs = [json.loads(line) for line in open(a.trace) if line.strip()]
    uses = collections.defaultdict(list)
    for t, r in enumerate(reqs):
        for n in r["hash_ids"]:
            uses[n].append(t)
    cap = int(len(uses) * a.capacity / 100)
    last = {}

    def lru(n, t, i):
        if i >= 0:
            last[n] = (t, -i)  # a request's deeper ids go first
        return last[n]

    def rate(n, t, i):
        u = uses[n]
        return (len(u) - 1) / (u[-1] - u[0] + 1)

    def rate_death(n, t, i):
        return -1.0 if t >= uses[n][-1] else rate(n, t, i)

    def nxt(n, t, i):
        u = uses[n]
        j = bisect.bisect_right(u, t)
        return -(u[j] if j < len(u) else float("inf"))

    print(f"{a.trace}: {len(reqs)} requests, {len(uses)} distinct ids, capacity {cap} ids")
    total = sum(len(r["hash_ids"]) for r in reqs)
    for name, p in [("lru", lru), ("rate", rate), ("rate+death", rate_death), ("next", nxt)]:
        by_gap = collections.Counter() if a.by_gap else None
        print(f"{name:12} {100 * replay(reqs, cap, p, by_gap):6.2f} % of prompt ids hit")
        if by_gap is None:
            continue
        heads = ["<= 10", "11-100", "101-1000", "> 1000"]
        print(f"  {'used before':12}" + "".join(f"{h + ' ago':>14}" for h in heads))
        for before in range(1, 5):
            cells = "".join(f"{100 * by_gap[(before, g)] / total:14.2f}" for g in range(4))
            print(f"  {str(before) + ('+' if before == 4 else ''):12}{cells}")


if __name__ == "__main__":
    main()
