#!/usr/bin/env bash
# The whole test run, from a fresh Debian 12 machine: installs what is
# missing, builds everything, lints, and runs every test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

# The verbs provider (rdma://, default feature of rdmablk-common) builds
# rdma-mummy-sys: cmake for its C part, libclang for bindgen; the unit check
# needs systemd-analyze, the bench smoke's bench/qd1-legs.sh perf. Volumes
# on Ceph RBD: the tests' development cluster (scripts/ceph-dev-cluster.sh,
# started on demand by tests/src/ceph.rs) runs ceph-mon and ceph-osd, and is
# used with ceph-common's ceph, rbd and rados; librbd and librados headers.
. scripts/lib/build-deps.sh
install_build_deps systemd-analyze:systemd nbdinfo:libnbd-bin qemu-img:qemu-utils mkfs.ext4:e2fsprogs fio:fio perf:linux-perf \
    ceph-mon:ceph-mon ceph-osd:ceph-osd rbd:ceph-common :librbd-dev :librados-dev
if ! cargo nextest --version >/dev/null 2>&1; then
    echo "==> installing cargo-nextest"
    cargo install --locked cargo-nextest
fi

echo "==> build"
cargo build --workspace --all-targets --locked
echo "==> systemd unit"
./scripts/verify-systemd.sh
echo "==> Debian package (cargo-deb, from the debug build; checked, not installed)"
./scripts/verify-deb.sh
echo "==> clippy (warnings are errors; every unsafe block needs a SAFETY comment)"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "==> tests"
cargo nextest run --workspace --locked --no-fail-fast
echo "==> doc tests"
cargo test --workspace --doc --locked
echo "==> benchmark scripts: compare.sh, ceiling.sh and per-io.sh smoke runs on the debug build (no figures judged)"
./scripts/bench-smoke.sh
echo "==> fuzzing (30 s per target; crashes fail the run)"
./scripts/fuzz.sh 30
echo "==> Soft-RoCE VM stage: the verbs provider over rdma:// inside qemu (tests/rdma-vm)"
./tests/rdma-vm/ci.sh
