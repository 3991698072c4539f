#!/usr/bin/env bash
# The Linux kernel's NVMe/TCP host on rdmablk-target over an RBD volume
# against fio's own rbd engine on the same Ceph cluster, in one VM boot
# (issue 54, item 6: the VM half of bench/vs-rbd.sh).
#
# It boots the Soft-RoCE VM of tests/rdma-vm (Debian's 6.12 kernel under
# qemu TCG; run.sh installs what it needs) with a release rdmablk-target and
# runs the measurement step nvme-tcp-vs-fio-rbd (tests/rdma-vm/
# nvme-vs-fio-rbd.sh; not in the CI stage's default steps): the dev Ceph
# cluster starts in the guest (scripts/ceph-dev-cluster.sh: one monitor,
# one memstore OSD), an image of 256 MiB is written fully (rbd bench
# --io-type write --io-pattern seq --io-size 4M) so that reads reach the
# OSD; then, per case, one fio job with fio's rbd engine (librbd in fio:
# the bound) and one with io_uring, direct=1 on the namespace of the
# kernel's nvme-tcp host connected to rdmablk-target, whose volume is that
# image (backend = "rbd"). The target holds the image's exclusive lock
# while it runs, so it is started before and stopped after each of its
# runs, and is down during fio's. 10 s per run after a 2 s ramp; each
# round runs every case on both back to back, the order swapped every
# other round. Printed: a markdown table, case | fio rbd IOPS · mean lat |
# kernel NVMe/TCP → rdmablk-target (rbd) IOPS · mean lat | ratio (median
# of the rounds' ratios, and each round's); and a second one of the guest's
# CPU in each system's runs (busy share of both vCPUs, CPU µs per I/O) and
# rdmablk-target's own CPU µs per I/O.
#
# Cases: randread-4k-qd1 randwrite-4k-qd1 randread-4k-qd32
# randwrite-4k-qd32 read-128k-qd16 write-128k-qd16.
#
# Under TCG only the ratios within one table mean anything, and rounds
# vary: use --rounds and --cases to look longer at one row.
#
# usage: bench/vs-rbd-vm.sh [--rounds N] [--cases "randread-4k-qd1 ..."]
#                           [--out DIR] [--debug]
#   --rounds N   rounds (default 2)
#   --cases "…"  only these cases (names as above, space-separated)
#   --out DIR    the VM's work directory (default target/vs-rbd-vm-DATE)
#   --debug      the debug rdmablk-target instead of a release build
# Run as root (the VM harness needs it), from anywhere in the repository.
# The host needs ceph-mon, ceph-osd and ceph-common (the guest runs the
# host's root file system) and a fio with the rbd engine (Debian's).
set -euo pipefail

ROOT=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
rounds=2 cases= out= profile=release
ALL_CASES="randread-4k-qd1 randwrite-4k-qd1 randread-4k-qd32 randwrite-4k-qd32 read-128k-qd16 write-128k-qd16"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --rounds) rounds=${2:?--rounds needs a number}; shift 2 ;;
        --cases) cases=${2:?--cases needs case names}; shift 2 ;;
        --out) out=${2:?--out needs a directory}; shift 2 ;;
        --debug) profile=debug; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "vs-rbd-vm.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "vs-rbd-vm.sh: --rounds must be a positive number" >&2; exit 2; }
for c in $cases; do
    [[ " $ALL_CASES " == *" $c "* ]] || { echo "vs-rbd-vm.sh: unknown case $c (cases: $ALL_CASES)" >&2; exit 2; }
done
[[ $(id -u) -eq 0 ]] || { echo "vs-rbd-vm.sh: run as root (the VM harness needs it)" >&2; exit 2; }
for cmd in ceph-mon ceph-osd ceph rbd fio; do
    command -v $cmd >/dev/null || { echo "vs-rbd-vm.sh: $cmd is missing on the host, which the guest runs: apt-get install ceph-mon ceph-osd ceph-common fio" >&2; exit 1; }
done
fio --enghelp 2>/dev/null | grep -qw rbd || { echo "vs-rbd-vm.sh: this fio has no rbd engine (Debian's fio has it)" >&2; exit 1; }

cd "$ROOT"
# shellcheck source=../scripts/lib/build-deps.sh
source scripts/lib/build-deps.sh
install_build_deps
echo "==> building the $profile rdmablk-target"
if [[ $profile == release ]]; then
    cargo build --release --locked --bins -p rdmablk-target
else
    cargo build --locked --bins -p rdmablk-target
fi
bin=$(cargo metadata --format-version 1 --no-deps | grep -o '"target_directory":"[^"]*"' | sed 's/.*:"\(.*\)"/\1/')/$profile
out=${out:-$ROOT/target/vs-rbd-vm-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
step=nvme-tcp-vs-fio-rbd
envs=(-e "RDMABLK_BIN_DIR=$bin" -e "RDMABLK_RBD_VS_TARGET=$bin/rdmablk-target" -e "RDMABLK_RBD_VS_ROUNDS=$rounds"
    -e "RDMABLK_CI_STEPS=$step")
[[ -z $cases ]] || envs+=(-e "RDMABLK_RBD_VS_CASES=$cases")
ncases=6
[[ -z $cases ]] || ncases=$(wc -w <<<"$cases")
# The step's own limit (ci-guest.sh): 300 s + 75 s per case and round;
# the boot, the package check and the scratch file system about 3 minutes
# more.
step_limit=$((300 + 75 * rounds * ncases))
echo "==> booting the VM for $step ($rounds rounds of $ncases cases: about $((rounds * ncases * 40 / 60 + 3)) minutes under TCG)"
rc=0
tests/rdma-vm/run.sh --no-smoke --topology routed --timeout $((180 + step_limit)) \
    --script tests/rdma-vm/ci-guest.sh "${envs[@]}" --out "$out" || rc=$?
f=$(find "$out" -name "$step.md" 2>/dev/null | head -n1)
if [[ -n $f ]]; then
    echo
    cat "$f"
else
    echo "no table was produced; the step log is $out/run/logs/$step.log"
fi
echo
echo "logs and fio JSON: $out"
exit $rc
