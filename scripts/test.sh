#!/usr/bin/env bash
# Every test, from a fresh machine: formatting, lints, unit, property and integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null; then
  echo "cargo is required (the Rust toolchain is preinstalled on project machines)" >&2
  exit 1
fi
cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
echo "== strata model fetch (the reference model for end-to-end tests; cached after the first run)"
cargo run -q -p strata -- model fetch
echo "== cargo test"
cargo test --workspace
