#!/usr/bin/env python3
"""A multi-turn trace in Mooncake's format with a `session_id` per conversation.

Conversations under a few shared system prompts, interleaved (Poisson arrivals, each
conversation's turns a think time apart). Every prompt is whole 512-token blocks, and a turn's
prompt is the previous turn's prompt, the answer as the next turn renders it, and a new user
message: exactly what a chat client sends, with the rendered answer *not* the tokens the engine
generated (a template that strips a reasoning model's thinking, or re-renders the answer). The
engine (and `strata sim`, which caches each request's output as stand-in tokens) caches the
generated answer after each prompt; the next turn leaves it. That is what sessions detect
(`prompt_cache_key`, crates/strata-kv/src/cache/session.rs).

Usage: scripts/session_trace.py OUT.jsonl [--conversations 400] [--turns 6] [--seed 1]
(docs/BENCHMARKS.md, "Sessions", runs it and quotes `strata sim` on its output.)
"""
import argparse
import json
import random

BLOCK = 512


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--systems", type=int, default=4, help="shared system prompts")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    next_id = [0]

    def blocks(n):
        ids = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return ids

    systems = [blocks(rng.randint(2, 8)) for _ in range(a.systems)]
    events = []
    t = 0.0
    for c in range(a.conversations):
        t += rng.expovariate(1 / 2000.0)  # a new conversation every 2 s on average
        ids = list(rng.choice(systems)) + blocks(rng.randint(1, 4))
        at = t
        for turn in range(rng.randint(1, a.turns)):
            out = rng.randint(100, 1500)  # generated tokens (thinking and answer)
            events.append((at, c, list(ids), out))
            # The next turn: the rendered answer (shorter than what was generated) and a message.
            ids = ids + blocks(max(1, out // 2 // BLOCK)) + blocks(rng.randint(1, 3))
            at += rng.expovariate(1 / 30000.0)  # think time, 30 s on average
    events.sort(key=lambda e: e[0])
    with open(a.out, "w") as f:
        for at, c, ids, out in events:
            f.write(json.dumps({
                "timestamp": int(at),
                "input_length": len(ids) * BLOCK,
                "output_length": out,
                "hash_ids": ids,
                "session_id": f"conv-{c}",
            }) + "\n")


if __name__ == "__main__":
    main()
