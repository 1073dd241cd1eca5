"""Reference logits from llama.cpp for Strata's tiny test models: the fixtures
crates/strata-model/tests/fixtures/tiny_{llama,llama3,qwen2,qwen3,mistral,dsv4}_logits.json.

1. Writes the model with Strata's own generator (`cargo run -p strata-model --example
   write_tiny -- ARCH FILE`, seeded: the same bytes every time; its SHA-256 goes in the
   fixture, and a test checks the generator still writes exactly that file).
2. Builds scripts/llamacpp/logits.c against llama.cpp's libllama: llama.cpp as vendored by the
   PyPI sdist of llama-cpp-python (pass its `vendor/llama.cpp`, already built with
   `cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON
   -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
   -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama`).
   Nothing of llama.cpp is committed.
3. Runs it on prompts whose lengths cross the pages (16 tokens), DeepSeek-V4's 32-token window
   and its 4- and 128-token compression blocks, with greedy decode steps after each, F32 K/V
   caches, no flash attention.
   (`--kv q8_0`: q8_0 K/V caches with flash attention, as `-ctk q8_0 -ctv q8_0 -fa on`).
4. Runs it again with 1 thread and checks the output is the same (the values do not depend on
   threads).

python3 scripts/llamacpp/reference.py --arch deepseek4 --llama-cpp /path/to/llama-cpp-python-0.3.36/vendor/llama.cpp
python3 scripts/llamacpp/reference.py --arch llama --llama-cpp (the same)   # also llama3, qwen2, qwen3, mistral

With `--kv q8_0` the K and V caches are q8_0 (llama.cpp's `-ctk q8_0 -ctv q8_0`, which needs
flash attention: on) and the fixture is tiny_{arch}_q8kv_logits.json; for the families whose KV
heads hold whole 32-value blocks (qwen3, llama-h32):

python3 scripts/llamacpp/reference.py --arch qwen3 --kv q8_0 --llama-cpp (the same)
"""

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = {"llama": "tiny_llama_logits.json", "llama3": "tiny_llama3_logits.json",
            "qwen2": "tiny_qwen2_logits.json", "qwen3": "tiny_qwen3_logits.json",
            "mistral": "tiny_mistral_logits.json",
            "deepseek4": "tiny_dsv4_logits.json", "llama-h32": "tiny_llama-h32_logits.json"}

# (name, length, decode steps): lengths before, on and after the window (32) and the 4- and
# 128-token block boundaries, and past two 128-blocks with more than top-k (8) 4-blocks.
PROMPTS = [("len1", 1, 2), ("len5", 5, 2), ("len33", 33, 3), ("len129", 129, 3),
           ("len333", 333, 4)]
# Positions whose whole logits are kept (the others: argmax only).
POSITIONS = [0, 3, 4, 31, 32, 33, 127, 128, 129, 255, 256, 332]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--llama-cpp", required=True, help="llama.cpp source tree with build/bin")
    p.add_argument("--sdist", default="llama-cpp-python 0.3.36")
    p.add_argument("--arch", choices=sorted(FIXTURES), required=True)
    p.add_argument("--kv", choices=["f32", "q8_0"], default="f32")
    p.add_argument("--out")
    a = p.parse_args()
    name = FIXTURES[a.arch]
    if a.kv == "q8_0":
        name = name.replace("_logits.json", "_q8kv_logits.json")
    out_path = a.out or os.path.join(ROOT, "crates/strata-model/tests/fixtures", name)
    lib = os.path.join(a.llama_cpp, "build", "bin")
    commit = subprocess.run(["git", "-C", a.llama_cpp, "rev-parse", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    with tempfile.TemporaryDirectory() as d:
        model = os.path.join(d, "tiny.gguf")
        subprocess.run(["cargo", "run", "-q", "-p", "strata-model", "--example",
                        "write_tiny", "--", a.arch, model], check=True, cwd=ROOT)
        sha = hashlib.sha256(open(model, "rb").read()).hexdigest()
        exe = os.path.join(d, "reference")
        subprocess.run(["gcc", "-O2", "-o", exe, os.path.join(ROOT, "scripts/llamacpp/logits.c"),
                        "-I" + os.path.join(a.llama_cpp, "include"),
                        "-I" + os.path.join(a.llama_cpp, "ggml/include"), "-L" + lib,
                        "-lllama", "-lggml", "-lggml-base", "-Wl,-rpath," + lib], check=True)
        rng = random.Random(20261201)
        prompts = []
        tsv = os.path.join(d, "prompts.tsv")
        with open(tsv, "w") as f:
            for name, n, steps in PROMPTS:
                toks = [rng.randrange(0, 256) for _ in range(n)]
                prompts.append((name, toks))
                keep = ",".join(str(x) for x in POSITIONS + [n - 1] if x < n)
                f.write(f"{name}\t{keep}\t{steps}\t{' '.join(map(str, toks))}\n")
        out = subprocess.run([exe, model, tsv, "2", a.kv], capture_output=True, text=True,
                             check=True).stdout
        again = subprocess.run([exe, model, tsv, "1", a.kv], capture_output=True, text=True,
                               check=True).stdout
        if again != out:
            sys.exit("llama.cpp's logits differ between 2 threads and 1")
    rows = [json.loads(l) for l in out.splitlines()]
    for (name, toks), r in zip(prompts, rows):
        assert r["name"] == name and r["tokens"] == len(toks)
        r["tokens"] = toks
    fixture = {
        "about": f"llama.cpp's logits for the tiny {a.arch} model (scripts/llamacpp/reference.py)",
        "llama_cpp": {"source": a.sdist + " sdist, vendor/llama.cpp", "commit": commit,
                      "settings": ("F32 K/V cache, flash attention off" if a.kv == "f32" else
                                   "Q8_0 K and V caches (-ctk q8_0 -ctv q8_0), flash attention on")
                                  + ", one batch per prompt, then one token per decode step"},
        "model_sha256": sha,
        "prompts": rows,
    }
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {out_path} ({os.path.getsize(out_path)} bytes; llama.cpp {commit[:7]}, model {sha[:12]})")


if __name__ == "__main__":
    main()
