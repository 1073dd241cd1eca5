"""Decode speed with and without an output constraint, side by side against one running
`strata serve` (argv[1]: base URL, default http://127.0.0.1:8000): the same prompt, greedy, the
same number of tokens, alternated `--reps` times. The constraints never complete within the
tokens asked for (the grammar is live at every step): a JSON schema (llguidance's Earley parser
and lexer) and a regex (lexer only). Prints tokens per second from the first streamed token
to the last, and the ratios.

python3 scripts/bench_structured.py http://127.0.0.1:8000 --tokens 64 --reps 5
"""

import argparse
import statistics
import time

import openai

p = argparse.ArgumentParser()
p.add_argument("base", nargs="?", default="http://127.0.0.1:8000")
p.add_argument("--tokens", type=int, default=64)
p.add_argument("--reps", type=int, default=5)
a = p.parse_args()
client = openai.OpenAI(base_url=f"{a.base}/v1", api_key="unused", max_retries=0)
model = client.models.list().data[0].id
msgs = [{"role": "user", "content": "List many fruits and vegetables as JSON strings."}]
schema = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1000}
cases = {
    "unconstrained": {"ignore_eos": True},
    "json_schema": {"guided_json": schema},
    "regex": {"guided_regex": "[a-z, ]{5000,}"},
}


def run(extra):
    t = []
    n = 0
    for c in client.chat.completions.create(model=model, messages=msgs, max_tokens=a.tokens,
                                            temperature=0, stream=True, extra_body=extra,
                                            stream_options={"include_usage": True}):
        if c.choices and c.choices[0].delta.content:
            t.append(time.perf_counter())
        if c.choices and c.choices[0].finish_reason:
            assert c.choices[0].finish_reason == "length", c
        if c.usage:
            n = c.usage.completion_tokens
    assert n == a.tokens, n
    # From the first token's text to the last: n - 1 decode steps.
    return (n - 1) / (t[-1] - t[0])


speeds = {k: [] for k in cases}
run({})  # warm-up (and the grammar engine's first build)
run(cases["json_schema"])
for _ in range(a.reps):
    for k, extra in cases.items():
        speeds[k].append(run(extra))
base = statistics.median(speeds["unconstrained"])
for k, v in speeds.items():
    m = statistics.median(v)
    print(f"{k:>14}: {m:7.1f} tok/s (median of {a.reps}; {min(v):.1f}..{max(v):.1f})  "
          f"ratio {m / base:.2f}")
