#!/usr/bin/env bash
# SmolLM2's decode-step logits next to llama.cpp's (docs/BENCHMARKS.md, "Decode logits next to
# llama.cpp"): builds scripts/llamacpp/logits.c against a llama.cpp built with shared
# libraries (see scripts/llamacpp/reference.py for the cmake line; llama-cpp-python 0.3.36's
# vendor/llama.cpp), runs it on four templated chat questions with 24 greedy decode steps each
# (F32 K/V cache), then replays llama.cpp's tokens through Strata with 8-bit and with f32
# decode activations.
# usage: scripts/llamacpp/decode_logits.sh vendor/llama.cpp
set -euo pipefail
L=$(cd "${1:?usage: $0 LLAMA_CPP_DIR}" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
gcc -O2 -o "$T/logits" "$ROOT/scripts/llamacpp/logits.c" -I"$L/include" -I"$L/ggml/include" \
    -L"$L/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$L/build/bin"
cd "$ROOT"
cargo build -q --release -p strata-model --example decode_vs_llama_cpp
EX=target/release/examples/decode_vs_llama_cpp
"$EX" prompts > "$T/prompts.tsv"
MODEL=$("$EX" model)
"$T/logits" "$MODEL" "$T/prompts.tsv" 2 f32 > "$T/llama.jsonl" 2> "$T/llama.err" ||
    { cat "$T/llama.err" >&2; exit 1; }
"$EX" compare "$T/llama.jsonl"
"$EX" compare "$T/llama.jsonl" f32-decode
