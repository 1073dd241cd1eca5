"""The cost of the prompt's log probabilities (completions' `echo` with `logprobs`), side by
side against one running `strata serve --disable-prefix-cache` (argv[1]: base URL, default
http://127.0.0.1:8000): the same 1,024-token prompt, one generated token, plain and with
`echo` + `logprobs` 1 and 5, alternated `--reps` times. Without the prefix cache every request
computes the whole prompt, so the difference is the logits of every prompt row (the output
projection over the vocabulary for each) and their log-softmax. Prints median latencies and
the ratios to plain.

python3 scripts/bench_prompt_logprobs.py http://127.0.0.1:8000 --reps 5
"""

import argparse
import json
import statistics
import time
import urllib.request

p = argparse.ArgumentParser()
p.add_argument("base", nargs="?", default="http://127.0.0.1:8000")
p.add_argument("--reps", type=int, default=5)
p.add_argument("--prompt-tokens", type=int, default=1024)
a = p.parse_args()

prompt = list(range(1000, 1000 + a.prompt_tokens))


def post(body):
    r = urllib.request.Request(a.base.rstrip("/") + "/v1/completions",
                               data=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
    return json.load(urllib.request.urlopen(r))


base = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
post(base)  # warm-up
kinds = [("plain", {}), ("echo + logprobs 1", {"echo": True, "logprobs": 1}),
         ("echo + logprobs 5", {"echo": True, "logprobs": 5})]
times = {k: [] for k, _ in kinds}
for _ in range(a.reps):
    for name, extra in kinds:
        t0 = time.perf_counter()
        r = post({**base, **extra})
        times[name].append(time.perf_counter() - t0)
        if extra:
            n = len(r["choices"][0]["logprobs"]["token_logprobs"])
            assert n == a.prompt_tokens + 1, n
plain = statistics.median(times["plain"])
for name, v in times.items():
    m = statistics.median(v)
    print(f"{name}: median {m * 1000:.0f} ms ({m / plain:.2f}x plain)")
