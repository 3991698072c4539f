#!/usr/bin/env bash
# rdmablk-target's NVMe-oF front end side by side with the Linux kernel's own
# NVMe-oF target (nvmet), in one VM boot, driven by the kernel's NVMe-oF
# host with the same fio jobs.
#
# It boots the Soft-RoCE VM of tests/rdma-vm (Debian's 6.12 kernel under
# qemu; run.sh installs what it needs) with release binaries and runs the
# CI stage's measurement steps, nvme-tcp-vs-nvmet and/or nvme-rdma-vs-nvmet
# (tests/rdma-vm/nvme-of.sh, nvme_vs_nvmet): both targets export a 256 MiB
# file-backed namespace on the same scratch file system; fio (io_uring,
# direct=1, 10 s per run) runs each case on one, then the other, the order
# swapped in every other round; IOPS, mean latency and CPU time per I/O
# (the target process's utime+stime, and the whole system's busy time minus
# fio's and the idle rate, which is the only column that charges nvmet, a
# kernel target, in full) are printed as a markdown table per transport.
#
# Cases: NVMe/TCP: 4 KiB randread QD1 and QD16, 128 KiB read QD16, 4 KiB
# randwrite QD16. NVMe/RDMA: the same with 128 KiB reads at QD4.
#
# Under TCG only the ratios within one table mean anything, and rounds vary:
# use --rounds and --cases to look longer at one row.
#
# --perf CASE records a system-wide profile (perf record -a -g) of that
# case's first round on each target and prints the top symbols.
#
# usage: bench/vs-nvmet.sh [--transport tcp|rdma|both] [--rounds N]
#                          [--cases "randread-4k-qd1 ..."] [--perf CASE]
#                          [--out DIR] [--debug]
# Run as root (the VM harness needs it), from anywhere in the repository.
set -euo pipefail

ROOT=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
transport=both rounds=2 cases= out= profile=release perf=

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --transport) transport=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --cases) cases=$2; shift 2 ;;
        --perf) perf=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --debug) profile=debug; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "vs-nvmet.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case $transport in
    tcp) steps=nvme-tcp-vs-nvmet ;;
    rdma) steps=nvme-rdma-vs-nvmet ;;
    both) steps="nvme-tcp-vs-nvmet nvme-rdma-vs-nvmet" ;;
    *) echo "vs-nvmet.sh: --transport is tcp, rdma or both" >&2; exit 2 ;;
esac
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "vs-nvmet.sh: --rounds must be a positive number" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "vs-nvmet.sh: run as root (the VM harness needs it)" >&2; exit 2; }

cd "$ROOT"
# shellcheck source=../scripts/lib/build-deps.sh
source scripts/lib/build-deps.sh
install_build_deps
echo "==> building the $profile binaries"
if [[ $profile == release ]]; then
    cargo build --release --locked --bins -p rdmablk-target -p rdmablk-initiator
else
    cargo build --locked --bins -p rdmablk-target -p rdmablk-initiator
fi
bin=$(cargo metadata --format-version 1 --no-deps | grep -o '"target_directory":"[^"]*"' | sed 's/.*:"\(.*\)"/\1/')/$profile
out=${out:-$ROOT/target/vs-nvmet-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
envs=(-e "RDMABLK_BIN_DIR=$bin" -e "RDMABLK_NVME_VS_TARGET=$bin/rdmablk-target" -e "RDMABLK_NVME_VS_ROUNDS=$rounds"
    -e "RDMABLK_CI_STEPS=$steps")
[[ -z $cases ]] || envs+=(-e "RDMABLK_NVME_VS_CASES=$cases")
[[ -z $perf ]] || envs+=(-e "RDMABLK_NVME_VS_PERF=$perf")
echo "==> booting the VM for: $steps ($rounds rounds; about 2 minutes per round and transport under TCG, plus a minute of setup)"
rc=0
# The guest's limit for each step is 280 s + 40 s per case and round, at
# least 600 s (ci-guest.sh); the boot and scratch file system about a
# minute more. The whole run's limit covers the steps' limits.
ncases=4
[[ -z $cases ]] || ncases=$(wc -w <<<"$cases")
ntransports=$(wc -w <<<"$steps")
step_limit=$((280 + 40 * rounds * ncases))
((step_limit >= 600)) || step_limit=600
tests/rdma-vm/run.sh --no-smoke --topology routed --timeout $((180 + ntransports * step_limit)) \
    --script tests/rdma-vm/ci-guest.sh "${envs[@]}" --out "$out" || rc=$?
shown=0
for s in $steps; do
    f=$(find "$out" -name "$s.md" 2>/dev/null | head -n1)
    if [[ -n $f ]]; then
        echo
        cat "$f"
        shown=1
    fi
done
[[ $shown -eq 1 ]] || echo "no table was produced; the step logs are in $out/run/logs"
echo
echo "logs, fio JSON and CPU samples: $out"
exit $rc
