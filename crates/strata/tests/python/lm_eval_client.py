"""lm-evaluation-harness (lm_eval, pinned in scripts/requirements-test.txt) against a Strata
worker or router, with the harness's defaults: `local-completions` sends tokenized requests
(`"prompt": [[ids]]`), its tokenizer taken from the server (`/tokenizer_info`, `/tokenize`,
`/detokenize`: the remote backend it detects), for a log-likelihood task (multiple choice,
`echo` + `logprobs`) and a generate-until task; `local-chat-completions` with the chat
template for the generate-until task. Every task runs twice (cold, then warm from the prefix
cache) and must score the same; the harness's per-choice log-likelihoods must equal sums of the
server's own prompt log probabilities.

python3 lm_eval_client.py BASE_URL MODEL MODE
"""

import json
import math
import os
import sys
import tempfile
import urllib.request

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

BASE, MODEL, MODE = sys.argv[1], sys.argv[2], sys.argv[3]

MC = [
    {"question": "The sky is", "choices": [" blue", " green", " made of cheese"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Paris is in", "choices": [" France", " Spain", " Peru", " Mars"], "answer": 0},
    {"question": "Water is", "choices": [" wet", " dry"], "answer": 0},
    {"question": "A cat says", "choices": [" meow", " moo", " quack"], "answer": 0},
]
GEN = [
    {"question": "Q: say hi\nA:", "answer": "hi"},
    {"question": "Q: count to three\nA:", "answer": "1 2 3"},
    {"question": "Q: name a colour\nA:", "answer": "red"},
]


def write_tasks(d):
    for name, rows in (("mc", MC), ("gen", GEN)):
        with open(os.path.join(d, f"{name}.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    with open(os.path.join(d, "strata_mc.yaml"), "w") as f:
        f.write(
            "task: strata_mc\n"
            "dataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {d}/mc.jsonl\n"
            "test_split: test\n"
            "output_type: multiple_choice\n"
            'doc_to_text: "{{question}}"\n'
            'doc_to_choice: "{{choices}}"\n'
            'doc_to_target: "{{answer}}"\n'
            "metric_list:\n  - metric: acc\n"
        )
    with open(os.path.join(d, "strata_gen.yaml"), "w") as f:
        f.write(
            "task: strata_gen\n"
            "dataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {d}/gen.jsonl\n"
            "test_split: test\n"
            "output_type: generate_until\n"
            'doc_to_text: "{{question}}"\n'
            'doc_to_target: "{{answer}}"\n'
            "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  temperature: 0\n"
            "metric_list:\n  - metric: exact_match\n"
        )


def post(path, body):
    req = urllib.request.Request(
        BASE + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def run(model, tasks, tm, **extra):
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=f"model={MODEL},base_url={BASE}/v1/{'chat/completions' if 'chat' in model else 'completions'},max_length=512",
        tasks=tasks,
        task_manager=tm,
        log_samples=True,
        **extra,
    )
    return out


def scores(out):
    return {t: {k: v for k, v in r.items() if k != "alias"} for t, r in out["results"].items()}


def own_loglikelihood(context, continuation):
    """The continuation's log-likelihood from the server's own prompt log probabilities."""
    tok = lambda s: post("/tokenize", {"prompt": s, "add_special_tokens": False})["tokens"]
    ctx, whole = tok(context), tok(context + continuation)
    # lm-eval splits at the context's tokens when the context ends where the whole's do.
    n = len(ctx)
    a = post(
        "/v1/completions",
        {"model": MODEL, "prompt": [whole], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True},
    )
    lps = a["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps) == len(whole) + 1, ("the generated token has its entry", len(lps), len(whole))
    return sum(lps[n : len(whole)])


def main():
    info = json.loads(urllib.request.urlopen(BASE + "/tokenizer_info", timeout=30).read())
    assert "eos_token" in info and info["model_max_length"] > 0, info
    d = tempfile.mkdtemp()
    write_tasks(d)
    tm = TaskManager(include_path=d)
    cold = run("local-completions", ["strata_mc", "strata_gen"], tm)
    warm = run("local-completions", ["strata_mc", "strata_gen"], tm)
    assert scores(cold) == scores(warm), (scores(cold), scores(warm))
    acc = cold["results"]["strata_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0, acc
    # The harness's log-likelihoods are the server's.
    checked = 0
    for s in cold["samples"]["strata_mc"]:
        for (ctx, cont), resp in zip(s["arguments"], s["resps"]):
            ll = resp[0][0]
            own = own_loglikelihood(ctx, cont)
            assert math.isclose(ll, own, rel_tol=1e-5, abs_tol=1e-4), (ctx, cont, ll, own)
            checked += 1
    assert checked == sum(len(r["choices"]) for r in MC), checked
    # Chat completions: the generate-until task through the chat template, cold and warm.
    c1 = run("local-chat-completions", ["strata_gen"], tm, apply_chat_template=True)
    c2 = run("local-chat-completions", ["strata_gen"], tm, apply_chat_template=True)
    assert scores(c1) == scores(c2), (scores(c1), scores(c2))
    print(f"lm-eval ({MODE}): mc acc {acc}, gen {cold['results']['strata_gen']}, {checked} log-likelihoods checked")
    print("all checks passed")


main()
