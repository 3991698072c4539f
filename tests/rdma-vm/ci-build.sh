# Sourced by run.sh when it runs without a payload or --script: the rdmablk
# CI stage. Installs the build dependencies of the verbs provider when
# missing (cmake, clang, libclang-dev), builds the binaries and the test
# executables on the host (debug profile, as scripts/test.sh does, so CI
# reuses its build), and sets run.sh up to run ci-guest.sh in the VM on the
# routed two-device topology without the smoke steps.
ROOT=$(cd "$HERE/../.." && pwd)
hidden() {
    case "$1/" in
        /tmp/* | /run/* | /var/tmp/* | /root/* | /dev/shm/*) return 0 ;;
    esac
    return 1
}
RDMAVM_KEEP=
if hidden "$ROOT"; then
    # The guest puts tmpfs over these dirs; keep the repository (and its
    # target/) visible at the same path there.
    case "$ROOT" in
        *[[:space:]]*) echo "run.sh: $ROOT is hidden inside the VM and has a space in it; clone the repository elsewhere" >&2; exit 2 ;;
    esac
    RDMAVM_KEEP=$ROOT
fi
cd "$ROOT"

# rdma-mummy-sys (under sideway) builds a small C library with cmake and
# generates its bindings with bindgen, which needs libclang.
build_missing=()
command -v cmake >/dev/null || build_missing+=(cmake)
command -v clang >/dev/null || build_missing+=(clang)
dpkg -s libclang-dev 2>/dev/null | grep -q '^Status: install ok installed' || build_missing+=(libclang-dev)
if [[ ${#build_missing[@]} -gt 0 ]]; then
    log "installing build dependencies: ${build_missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${build_missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "run.sh: cargo is not installed" >&2; exit 1; }

log "building rdmablk (binaries and test executables)"
cargo build --workspace --bins --locked --quiet
tests_json=$(
    cargo test --locked --no-run --message-format=json -p rdmablk-common --test fabric_conformance 2>/dev/null
    cargo test --locked --no-run --message-format=json -p rdmablk-target --test nvme_rdma 2>/dev/null
    cargo test --locked --no-run --message-format=json -p rdmablk-system-tests --test data_path --test bad_commands --test scoping \
        --test fence --test command_slots --test capacity 2>/dev/null
)
test_executable() { # test target name -> its executable
    grep '"reason":"compiler-artifact"' <<<"$tests_json" | grep "\"name\":\"$1\"" |
        grep -o '"executable":"[^"]*"' | tail -n1 | sed 's/"executable":"\(.*\)"/\1/' || true
}
ci_conformance=$(test_executable fabric_conformance)
ci_data_path=$(test_executable data_path)
ci_bad_commands=$(test_executable bad_commands)
ci_scoping=$(test_executable scoping)
ci_fence=$(test_executable fence)
ci_command_slots=$(test_executable command_slots)
ci_capacity=$(test_executable capacity)
ci_nvme_rdma=$(test_executable nvme_rdma)
ci_target_dir=$(cargo metadata --format-version 1 --no-deps | grep -o '"target_directory":"[^"]*"' | sed 's/.*:"\(.*\)"/\1/')
ci_bin=$ci_target_dir/debug
for f in "$ci_conformance" "$ci_data_path" "$ci_bad_commands" "$ci_scoping" "$ci_fence" "$ci_command_slots" "$ci_capacity" "$ci_nvme_rdma" \
    "$ci_bin/rdmablk-target" "$ci_bin/rdmablk"; do
    [[ -n $f && -x $f ]] || { echo "run.sh: missing build output: '$f'" >&2; exit 1; }
done
if hidden "$ci_target_dir" && [[ $ci_target_dir/ != "$ROOT"/* ]]; then
    echo "run.sh: the cargo target directory $ci_target_dir is hidden inside the VM; set CARGO_TARGET_DIR elsewhere" >&2
    exit 2
fi
log "built: conformance suite, system tests and binaries in $ci_bin"

SMOKE=0
[[ $TOPOLOGY == auto ]] && TOPOLOGY=routed
NAME=rdmablk-ci
SCRIPTS+=("$HERE/ci-guest.sh")
ENVS+=("RDMABLK_BIN_DIR=$ci_bin" "RDMABLK_CONFORMANCE=$ci_conformance"
       "RDMABLK_DATA_PATH=$ci_data_path" "RDMABLK_BAD_COMMANDS=$ci_bad_commands"
       "RDMABLK_SCOPING=$ci_scoping" "RDMABLK_FENCE=$ci_fence" "RDMABLK_COMMAND_SLOTS=$ci_command_slots"
       "RDMABLK_CAPACITY=$ci_capacity" "RDMABLK_NVME_RDMA_TESTS=$ci_nvme_rdma")
# 900 s no longer leaves room: the stage took 7 to 8.5 minutes before, and
# the ublk steps (ublk-fs-rdma moves about 500 MiB through ublk at 2 to 4
# MiB/s under TCG on shared cores) added about 8 minutes in one loaded run;
# the NVMe/RDMA steps (issue 22) about 8 more (the stage took 973 s before
# them). --timeout or RDMAVM_TIMEOUT still win.
if [[ -z $TIMEOUT_GIVEN ]]; then
    TIMEOUT=2400
    [[ -n $STEP_TIMEOUT_GIVEN ]] || STEP_TIMEOUT=$TIMEOUT
fi
# The time limit covers the VM, not the build.
T_START=$(date +%s.%N)
