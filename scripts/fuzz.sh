#!/usr/bin/env bash
# Runs the cargo-fuzz targets in fuzz/ on stable Rust.
#
#   scripts/fuzz.sh [seconds-per-target] [target...]
#
# Default: 30 seconds for each of capsule_decode, tcp_frames, nvme_tcp_pdus,
# nvme_commands, config_parse.
# Installs what is missing (g++ for libFuzzer, cargo-fuzz), builds the
# targets with AddressSanitizer and debug assertions (integer overflow
# panics), replays every crash kept in fuzz/regressions/<target>/, then
# fuzzes each target from the committed corpus. New inputs go to a scratch
# copy of the corpus under target/fuzz/, never into the repository. Exits
# non-zero on any crash, timeout or leak and prints where the input is.
#
# Environment: FUZZ_SANITIZER (address, the default, or none),
# FUZZ_WORK (scratch directory, default target/fuzz), FUZZ_ARGS (extra
# libFuzzer flags; not -jobs, whose logs libFuzzer writes to the current
# directory, the repository).
set -euo pipefail
cd "$(dirname "$0")/.."

all_targets=(capsule_decode tcp_frames nvme_tcp_pdus nvme_commands config_parse)
seconds=${1:-30}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")
case "$seconds" in
    '' | *[!0-9]*) echo "usage: $0 [seconds-per-target] [target...]" >&2; exit 2 ;;
esac
for t in "${targets[@]}"; do
    [ -d "fuzz/corpus/$t" ] || { echo "unknown fuzz target $t (have: ${all_targets[*]})" >&2; exit 2; }
done

# libFuzzer is C++; rdmablk-common's default `verbs` feature builds
# rdma-mummy-sys (cmake, libclang).
. scripts/lib/build-deps.sh
install_build_deps c++:g++
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "==> installing cargo-fuzz"
    cargo install --locked cargo-fuzz
fi

# cargo-fuzz passes unstable rustc flags (-Zsanitizer, sanitizer coverage);
# RUSTC_BOOTSTRAP=1 lets the stable toolchain accept them.
export RUSTC_BOOTSTRAP=1
sanitizer=${FUZZ_SANITIZER:-address}
work=${FUZZ_WORK:-target/fuzz}
# The libFuzzer binaries need the fuzz crate's `libfuzzer` feature (it
# keeps libfuzzer-sys out of the normal workspace build); -a: debug
# assertions and overflow checks in an optimised build.
flags=(--fuzz-dir fuzz --features libfuzzer -s "$sanitizer" -a)

echo "==> building the fuzz targets (sanitizer: $sanitizer)"
for t in "${targets[@]}"; do
    cargo fuzz build "${flags[@]}" "$t"
done

failed=()
report_artifacts() {
    local t=$1 dir=$2
    local found
    found=$(find "$dir" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' -o -name 'slow-unit-*' \) 2>/dev/null | sort)
    if [ -n "$found" ]; then
        echo "!!! $t: failing inputs (replay: cargo fuzz run ${flags[*]} $t <file>):"
        echo "$found" | sed 's/^/!!!   /'
    fi
}

for t in "${targets[@]}"; do
    artifacts="$work/$t/artifacts"
    corpus="$work/$t/corpus"
    mkdir -p "$artifacts" "$corpus"
    if compgen -G "fuzz/regressions/$t/*" >/dev/null; then
        echo "==> $t: replaying fuzz/regressions/$t"
        if ! cargo fuzz run "${flags[@]}" "$t" "fuzz/regressions/$t" -- \
            -runs=0 -artifact_prefix="$artifacts/" -timeout=30 >"$work/$t/regressions.log" 2>&1; then
            tail -n 40 "$work/$t/regressions.log"
            echo "!!! $t: a regression input fails again"
            report_artifacts "$t" "$artifacts"
            failed+=("$t")
            continue
        fi
    fi

    echo "==> $t: fuzzing for ${seconds}s (corpus: fuzz/corpus/$t, new inputs: $corpus)"
    dict=()
    [ -f "fuzz/dicts/$t.dict" ] && dict=(-dict="fuzz/dicts/$t.dict")
    # Further seeds kept where they live (rdmablk_fuzz::seeds::extra_seed_dirs).
    extra=()
    [ "$t" = config_parse ] && extra=(configs)
    log="$work/$t/fuzz.log"
    # The scratch corpus comes first: libFuzzer writes new inputs there only.
    # shellcheck disable=SC2086 # FUZZ_ARGS is a list of flags
    if cargo fuzz run "${flags[@]}" "$t" "$corpus" "fuzz/corpus/$t" "${extra[@]}" -- \
        -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
        -artifact_prefix="$artifacts/" "${dict[@]}" ${FUZZ_ARGS:-} >"$log" 2>&1; then
        status=ok
    else
        status=FAILED
        failed+=("$t")
    fi
    # libFuzzer's closing lines: the last status line and its final stats.
    grep -E '^#[0-9]+.*(DONE|pulse|NEW|REDUCE)' "$log" | tail -n 1 || true
    grep -E '^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)' "$log" || true
    echo "==> $t: $status (log: $log, corpus now $(find "$corpus" -type f | wc -l) files)"
    if [ "$status" = FAILED ]; then
        grep -E -m 5 -A 15 'panicked at|ERROR: (AddressSanitizer|libFuzzer|LeakSanitizer)|deadly signal' "$log" | head -n 60 || true
        report_artifacts "$t" "$artifacts"
    fi
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz: FAILED: ${failed[*]}"
    exit 1
fi
echo "fuzz: ${#targets[@]} targets ran ${seconds}s each without a failure"
