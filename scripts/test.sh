#!/usr/bin/env bash
# The whole test run, from a fresh Debian 12 machine: installs what is
# missing, builds everything, lints, and runs every test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null || need_apt+=(gcc)
command -v systemd-analyze >/dev/null || need_apt+=(systemd)
# The verbs provider (rdma://, default feature of rdmablk-common) builds
# rdma-mummy-sys: cmake for its C part, libclang for bindgen.
command -v cmake >/dev/null || need_apt+=(cmake)
command -v clang >/dev/null || need_apt+=(clang)
dpkg -s libclang-dev 2>/dev/null | grep -q '^Status: install ok installed' || need_apt+=(libclang-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "==> installing ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi
if ! cargo nextest --version >/dev/null 2>&1; then
    echo "==> installing cargo-nextest"
    cargo install --locked cargo-nextest
fi

echo "==> build"
cargo build --workspace --all-targets --locked
echo "==> systemd unit"
./scripts/verify-systemd.sh
echo "==> clippy (warnings are errors; every unsafe block needs a SAFETY comment)"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "==> tests"
cargo nextest run --workspace --locked --no-fail-fast
echo "==> doc tests"
cargo test --workspace --doc --locked
echo "==> fuzzing (30 s per target; crashes fail the run)"
./scripts/fuzz.sh 30
echo "==> Soft-RoCE VM stage: the verbs provider over rdma:// inside qemu (tests/rdma-vm)"
./tests/rdma-vm/ci.sh
