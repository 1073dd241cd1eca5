#!/usr/bin/env bash
# The main job. Until `strata up` lands (model runtime and server issues), this builds the CLI
# and runs the cache simulator over the shared Mooncake trace: per-tier hit rates at 5 % and the
# miss-ratio sweep with Belady's bound, plot written to out/sim-sweep.svg.
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${TRACE:-../shared/traces/mooncake_synthetic_trace.jsonl}
mkdir -p out
cargo build --release -p strata
./target/release/strata sim --trace "$TRACE" --device 5% --host 25% --storage 100% "$@"
./target/release/strata sim --trace "$TRACE" --sweep --plot out/sim-sweep.svg
