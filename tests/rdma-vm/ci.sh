#!/usr/bin/env bash
# The Soft-RoCE VM stage of CI: real RDMA (rdma://) end to end.
#
#   tests/rdma-vm/ci.sh [run.sh options...]      (as root)
#
# The same as run.sh without a payload: installs what is missing (the VM's
# Debian packages; cmake, clang and libclang-dev for the verbs provider),
# builds the binaries and test executables on the host (debug profile, as
# scripts/test.sh does), boots Debian's kernel under qemu with Soft-RoCE on a
# routed veth link (rxe0 10.77.0.1 / rxe1 10.77.0.2), runs ci-guest.sh there,
# prints the step summary and exits 0 only if every step passed (SKIPPED
# steps are shown and do not fail the run). See README.md.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "$HERE/run.sh" "$@"
