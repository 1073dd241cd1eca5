"""Reference token ids from llama.cpp for Strata's tokenizer: the fixture
crates/strata-model/tests/fixtures/tiny_tokens.json.

For each pre-tokenizer (smollm, gpt-2, llama-bpe, qwen2, deepseek-v3) and a SentencePiece
vocabulary (spm) Strata's generator writes a
tiny file with more merges (`cargo run -p strata-model --example write_tiny -- tok-PRE FILE`,
seeded; its SHA-256 goes in the fixture) and scripts/llamacpp/tokens.c, built against
llama.cpp's libllama (see reference.py for the build), tokenizes every text of TEXTS with and
without special tokens added, and with special tokens written in the text read as text
(`parse_special = false`, as Strata tokenizes a chat message's content).

python3 scripts/llamacpp/tokens.py --llama-cpp /path/to/llama-cpp-python-0.3.36/vendor/llama.cpp
"""

import argparse
import hashlib
import json
import os
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRES = ["smollm", "gpt-2", "llama-bpe", "qwen2", "deepseek-v3", "spm"]
# Contractions, digit runs, runs of spaces and newlines, punctuation, non-ASCII letters, CJK,
# special tokens in the text (each vocabulary's control tokens: BPE's `<|endoftext|>`,
# SentencePiece's `<s>`, `</s>`, `<unk>`, both's `<|im_start|>`), and the empty text.
TEXTS = [
    "hello world", "Hello World!!", "the 12345 and 123 and 4567890", "it's what's THEY'RE",
    "  two  spaces   three", "tabs\tand\nnew\n\nlines\r\n", "héllo wörld ça va", "日本語のテキスト",
    "x=1+2; y = 'a'!", "<|im_start|>user\nhi<|im_end|>", "   ", "", "1 12 123 1234 12345",
    "hello!!! hello!!!!", "ok\n\n\n\nok", "say <|endoftext|> now", "<s>hi</s> <unk>x",
    "a<|im_start|>b<|im_end|>c", "<|im_end|>",
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--llama-cpp", required=True, help="llama.cpp source tree with build/bin")
    p.add_argument("--sdist", default="llama-cpp-python 0.3.36")
    a = p.parse_args()
    out_path = os.path.join(ROOT, "crates/strata-model/tests/fixtures/tiny_tokens.json")
    lib = os.path.join(a.llama_cpp, "build", "bin")
    commit = subprocess.run(["git", "-C", a.llama_cpp, "rev-parse", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    out = {"about": "llama.cpp's token ids for Strata's tiny tokenizer files "
                    "(scripts/llamacpp/tokens.py)",
           "llama_cpp": {"source": a.sdist + " sdist, vendor/llama.cpp", "commit": commit},
           "texts": TEXTS, "files": {}}
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "tokens")
        subprocess.run(["gcc", "-O2", "-o", exe, os.path.join(ROOT, "scripts/llamacpp/tokens.c"),
                        "-I" + os.path.join(a.llama_cpp, "include"),
                        "-I" + os.path.join(a.llama_cpp, "ggml/include"), "-L" + lib,
                        "-lllama", "-lggml", "-lggml-base", "-Wl,-rpath," + lib], check=True)
        texts = os.path.join(d, "texts.bin")
        with open(texts, "wb") as f:
            for t in TEXTS:
                f.write(t.encode() + b"\0")
        for pre in PRES:
            model = os.path.join(d, f"{pre}.gguf")
            subprocess.run(["cargo", "run", "-q", "-p", "strata-model", "--example",
                            "write_tiny", "--", "tok-" + pre, model], check=True, cwd=ROOT)
            sha = hashlib.sha256(open(model, "rb").read()).hexdigest()
            res = subprocess.run([exe, model, texts], capture_output=True, text=True, check=True)
            rows = [json.loads(l) for l in res.stdout.splitlines()]
            assert len(rows) == len(TEXTS)
            out["files"][pre] = {"model_sha256": sha, "ids": rows}
    with open(out_path, "w") as f:
        json.dump(out, f, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {out_path} ({os.path.getsize(out_path)} bytes; llama.cpp {commit[:7]})")


if __name__ == "__main__":
    main()
