"""What a K/V dtype costs in quality, measured against running `strata serve` workers (one per
dtype, same model): perplexity of a fixed public-domain text (the opening of Dickens' "A Tale of
Two Cities", scored with `echo` + `logprobs`), how often each position's likeliest token equals
the first worker's (the f16 reference), and the multiple-choice task of the client tests
(crates/strata/tests/python/lm_eval_client.py: each choice's log-likelihood after its
question, the likeliest choice answers), with the mean log-likelihood of the right answers.

python3 scripts/kv_quality.py f16=http://127.0.0.1:8301 q8_0=http://127.0.0.1:8302 ...

Standard library only. Prints one Markdown table row per worker.
"""

import json
import math
import sys
import urllib.request

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the "
    "winter of despair, we had everything before us, we had nothing before us, we were all "
    "going direct to Heaven, we were all going direct the other way--in short, the period was "
    "so far like the present period, that some of its noisiest authorities insisted on its "
    "being received, for good or for evil, in the superlative degree of comparison only. There "
    "were a king with a large jaw and a queen with a plain face, on the throne of England; "
    "there were a king with a large jaw and a queen with a fair face, on the throne of France. "
    "In both countries it was clearer than crystal to the lords of the State preserves of "
    "loaves and fishes, that things in general were settled for ever. It was the year of Our "
    "Lord one thousand seven hundred and seventy-five. Spiritual revelations were conceded to "
    "England at that favoured period, as at this."
)

MC = [
    ("The sky is", [" blue", " green", " made of cheese"], 0),
    ("Two plus two is", [" four", " five"], 0),
    ("Paris is in", [" France", " Spain", " Peru", " Mars"], 0),
    ("Water is", [" wet", " dry"], 0),
    ("A cat says", [" meow", " moo", " quack"], 0),
    ("The capital of Italy is", [" Rome", " Madrid", " Berlin"], 0),
    ("Ice is made of frozen", [" water", " sand", " air"], 0),
    ("The sun rises in the", [" east", " west", " north"], 0),
    ("A week has seven", [" days", " hours", " years"], 0),
    ("Bees make", [" honey", " milk", " bread"], 0),
    ("The opposite of hot is", [" cold", " loud", " tall"], 0),
    ("Fish live in", [" water", " trees", " deserts"], 0),
]


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def tokens(base, s):
    return post(base, "/tokenize", {"prompt": s, "add_special_tokens": False})["tokens"]


def echo(base, ids):
    """Each prompt token's log probability and the likeliest token at each position."""
    a = post(base, "/v1/completions", {"prompt": [ids], "max_tokens": 1, "temperature": 0,
                                       "logprobs": 1, "echo": True})
    lp = a["choices"][0]["logprobs"]
    top = [max(t, key=t.get) if t else None for t in lp["top_logprobs"]]
    return lp["token_logprobs"][:len(ids)], top[:len(ids)]


def measure(base):
    ids = tokens(base, TEXT)
    lps, top = echo(base, ids)
    scored = [x for x in lps[1:] if x is not None]
    ppl = math.exp(-sum(scored) / len(scored))
    right, ll_right = 0, 0.0
    for q, choices, answer in MC:
        n = len(tokens(base, q))
        lls = []
        for c in choices:
            whole = tokens(base, q + c)
            l, _ = echo(base, whole)
            lls.append(sum(l[n:]))
        right += max(range(len(lls)), key=lls.__getitem__) == answer
        ll_right += lls[answer]
    return {"ppl": ppl, "tokens": len(scored), "top": top, "acc": right / len(MC),
            "ll": ll_right / len(MC)}


def main():
    workers = [a.split("=", 1) for a in sys.argv[1:]]
    if not workers or any(len(w) != 2 for w in workers):
        sys.exit("usage: kv_quality.py NAME=URL [NAME=URL ...] (the first is the reference)")
    results = [(name, measure(url)) for name, url in workers]
    ref = results[0][1]["top"]
    print("| K/V dtype | perplexity (tokens) | top-1 = " + results[0][0] +
          " | multiple choice | mean log-likelihood of the right answer |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results:
        same = sum(a == b for a, b in zip(r["top"][1:], ref[1:])) / max(1, len(ref) - 1)
        print(f"| {name} | {r['ppl']:.4f} ({r['tokens']}) | {100 * same:.1f} % | "
              f"{round(r['acc'] * len(MC))}/{len(MC)} | {r['ll']:.4f} |")


main()
