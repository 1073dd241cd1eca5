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
# The observability test runs a real Prometheus (and promtool) from Debian's package.
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  echo "== installing Debian's prometheus package (for the observability test)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends prometheus curl
fi
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
echo "== strata model fetch (the reference model for end-to-end tests; cached after the first run)"
cargo run -q -p strata -- model fetch
echo "== cargo test"
cargo test --workspace
