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
# Every external program the code and the tests start, with the Debian package that provides
# it (crates/strata/tests/programs.rs keeps this list complete); whatever is missing is
# installed, once.
PROGRAMS="
sh               dash
bash             bash
cp               coreutils
kill             procps
curl             curl
python3          python3
pip              python3-pip
venv             python3-venv
prometheus       prometheus
promtool         prometheus
redis-server     redis-server
redis-cli        redis-tools
ip               iproute2
tc               iproute2
chromium         chromium
"
has() {
  case "$1" in
    pip) python3 -m pip --version >/dev/null 2>&1 ;;
    venv) python3 -c 'import ensurepip, venv' >/dev/null 2>&1 ;;
    *) command -v "$1" >/dev/null ;;
  esac
}
missing=()
while read -r prog pkg; do
  case "$prog" in ''|'#'*) continue ;; esac
  has "$prog" || missing+=("$pkg")
done <<< "$PROGRAMS"
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
  # A Python outside Debian's (e.g. pyenv) gets its pip from ensurepip instead.
  has pip || python3 -m ensurepip --upgrade
  while read -r prog pkg; do
    case "$prog" in ''|'#'*) continue ;; esac
    has "$prog" || { echo "$prog is still missing after installing $pkg" >&2; exit 1; }
  done <<< "$PROGRAMS"
fi
echo "== Python packages the tests use (scripts/requirements-test.txt)"
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
  -r scripts/requirements-test.txt
echo "== instructor in its own virtual environment (scripts/requirements-instructor.txt)"
[ -x target/py-instructor/bin/python ] || python3 -m venv target/py-instructor
target/py-instructor/bin/python -m pip install -q --disable-pip-version-check \
  -r scripts/requirements-instructor.txt
# CI builds once from scratch: incremental state would only take disk.
if [ -n "${CI:-}" ]; then export CARGO_INCREMENTAL=0; fi
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
echo "== strata model fetch (the reference model for end-to-end tests; cached after the first run)"
cargo run -q -p strata -- model fetch
echo "== cargo test"
# A test that hangs fails the run here, named by cargo ("has been running for over 60
# seconds"), instead of using up CI's whole budget (a full run takes about 10 minutes here).
timeout --kill-after=30s 50m cargo test --workspace
echo "== the weight kernels again on AVX2 alone (where the CPU would pick AVX-512)"
STRATA_NO_AVX512=1 cargo test -q -p strata-model --lib qmat
STRATA_NO_AVX512=1 cargo test -q -p strata-model --test real_model
echo "== the weight kernels with the measured one-row kernel (STRATA_ONE_ROW_KERNEL=fastest)"
STRATA_ONE_ROW_KERNEL=fastest cargo test -q -p strata-model --lib qmat
