#!/usr/bin/env bash
# Single-stream decode against llama.cpp in one sitting, alternating rounds (issue 45):
#   scripts/bench_decode.sh LLAMA_BENCH [ROUNDS] [STRATA]
# LLAMA_BENCH: llama.cpp's llama-bench (built from the llama-cpp-python sdist's vendor/llama.cpp
# with -DGGML_NATIVE=ON; never committed). STRATA: the binary to measure (default
# ./target/release/strata). Each round runs llama-bench -t 2 -p 0 -n 64 -d 512,2048 -r 2, then
# `strata model bench --decode-context 512` and `--decode-context 2048` (64 tokens, best of 2);
# prints every round and the medians with their ratio. The model is the reference GGUF.
set -euo pipefail
LB=${1:?usage: scripts/bench_decode.sh LLAMA_BENCH [ROUNDS] [STRATA]}
ROUNDS=${2:-4}
ST=${3:-./target/release/strata}
M=$("$ST" model fetch 2>/dev/null | tail -1)
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs); threads: 2; model: $M"
out=$(mktemp)
for r in $(seq 1 "$ROUNDS"); do
  "$LB" -m "$M" -t 2 -p 0 -n 64 -d 512,2048 -r 2 -o csv 2>/dev/null |
    python3 -c 'import csv,sys
for row in csv.DictReader(sys.stdin):
    print("llama.cpp", row["n_depth"], row["avg_ts"])' | sed "s/^/$r /" >>"$out"
  for c in 512 2048; do
    t=$("$ST" model bench --prefill 16 --decode-context "$c" --reps 2 2>&1 |
      sed -n "s/^decode at context $c: *\([0-9.]*\) tok\/s.*/\1/p")
    echo "$r strata $c $t" >>"$out"
  done
  tail -4 "$out"
done
python3 - "$out" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1])]
for c in ("512", "2048"):
    ll = [float(r[3]) for r in rows if r[1] == "llama.cpp" and r[2] == c]
    sa = [float(r[3]) for r in rows if r[1] == "strata" and r[2] == c]
    ratios = [s / l for s, l in zip(sa, ll)]
    print(f"context {c}: llama.cpp median {st.median(ll):.1f} tok/s, strata median "
          f"{st.median(sa):.1f} tok/s, ratio of medians {st.median(sa)/st.median(ll):.2f}x "
          f"(per round {', '.join(f'{x:.2f}' for x in ratios)})")
PY
