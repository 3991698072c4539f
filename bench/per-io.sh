#!/usr/bin/env bash
# Cost of one I/O: CPU microseconds of the target process and of the
# rdmablk-bench job per I/O, and of that the user-space part (the rest is
# the kernel's), and (with --syscalls) system calls and context
# switches per I/O of each, counted with `perf stat -e
# 'syscalls:sys_enter_*,context-switches'` over each whole process (a
# target per case) and divided by the I/Os the bench reports. Starts its
# own rdmablk-target on tcp://127.0.0.1 with a null volume and a file
# volume; uses the release binaries in target/release.
#
# usage: bench/per-io.sh [--syscalls] [--runtime S] [--file PATH] [--target-extra TOML]
#                        [--bench-extra "ARGS"] [--target-cpus LIST] [--bench-cpus LIST] CASE...
#   CASE          VOLUME:RW:BS:QD, VOLUME being null or file,
#                 e.g. null:randread:4k:32 file:randread:4k:1
#   --syscalls    also count system calls and context switches (needs perf:
#                 apt-get install linux-perf)
#   --runtime S   seconds per case (default 5)
#   --file PATH   the file volume's backing file (default /var/tmp/rdmablk-per-io.img,
#                 created with random data at 1 GiB; not on a tmpfs: O_DIRECT)
#   --target-extra TOML   lines added to [target], e.g. 'busy_poll = "1ms"'
#   --bench-extra ARGS    added to every rdmablk-bench command, e.g. "--hipri"
#   --target-cpus LIST    run the target on these CPUs (taskset -c), e.g. 1
#   --bench-cpus LIST     run rdmablk-bench on these CPUs, e.g. 0
set -euo pipefail
cd "$(dirname "$0")/.."
SYSCALLS=0
RUNTIME=5
FILE=/var/tmp/rdmablk-per-io.img
TARGET_EXTRA=""
BENCH_EXTRA=""
TARGET_PIN=()
BENCH_PIN=()
CASES=()
while [ $# -gt 0 ]; do
    case "$1" in
        --syscalls) SYSCALLS=1; shift ;;
        --runtime) RUNTIME=$2; shift 2 ;;
        --file) FILE=$2; shift 2 ;;
        --target-extra) TARGET_EXTRA=$2; shift 2 ;;
        --bench-extra) BENCH_EXTRA=$2; shift 2 ;;
        --target-cpus) TARGET_PIN=(taskset -c "$2"); shift 2 ;;
        --bench-cpus) BENCH_PIN=(taskset -c "$2"); shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        -*) echo "per-io.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) CASES+=("$1"); shift ;;
    esac
done
[ ${#CASES[@]} -gt 0 ] || CASES=(null:randread:4k:1 null:randread:4k:32 file:randread:4k:32 null:read:128k:16)
# bin_dir, free_port, wait_port, null_and_file_target_config
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BIN=$(bin_dir rdmablk-target rdmablk-bench)
if [ "$SYSCALLS" = 1 ] && ! command -v perf >/dev/null; then
    echo "per-io.sh: --syscalls needs perf (apt-get install linux-perf)" >&2; exit 1
fi
[ -f "$FILE" ] || { echo "==> writing 1 GiB of random data to $FILE" >&2
    dd if=/dev/urandom of="$FILE" bs=1M count=1024 status=none; }

WORK=$(mktemp -d)
PORT=$(free_port)
null_and_file_target_config "$PORT" "$FILE" "$TARGET_EXTRA" >"$WORK/target.toml"
TP=""
trap 'if [ -n "$TP" ]; then kill "$TP" 2>/dev/null || true; fi; rm -rf "$WORK"' EXIT
tick=$(getconf CLK_TCK)
# User and system CPU ticks of a process (all its threads), one read.
cpu() { awk '{print $14, $15}' "/proc/$1/stat"; }
# The counters: every system call by name, and context switches.
EVENTS='syscalls:sys_enter_*,context-switches'

for c in "${CASES[@]}"; do
    IFS=: read -r vol rw bs qd <<<"$c"
    # A target per case, so that with --syscalls perf counts it (every
    # thread, from its start) exactly as long as this case runs: counts
    # taken by attaching to a running process missed most calls.
    if [ "$SYSCALLS" = 1 ]; then
        RUST_LOG=warn "${TARGET_PIN[@]}" perf stat -x, -e "$EVENTS" -o "$WORK/t.perf" -- \
            "$BIN/rdmablk-target" --config "$WORK/target.toml" 2>"$WORK/target.log" &
        PERF_PID=$!
        for _ in $(seq 50); do TP=$(pgrep -P "$PERF_PID" -x rdmablk-target || true); [ -n "$TP" ] && break; sleep 0.1; done
    else
        RUST_LOG=warn "${TARGET_PIN[@]}" "$BIN/rdmablk-target" --config "$WORK/target.toml" 2>"$WORK/target.log" &
        PERF_PID=$!
        TP=$PERF_PID
    fi
    [ -n "${TP:-}" ] || { echo "per-io.sh: the target did not start" >&2; cat "$WORK/target.log" >&2; exit 1; }
    wait_port "$PORT" "$TP"
    read -r u0 s0 < <(cpu "$TP")
    BENCH=("$BIN/rdmablk-bench" --name=j --target="tcp://127.0.0.1:$PORT" --volume="$vol" --rw="$rw" --bs="$bs"
           --iodepth="$qd" --runtime="$RUNTIME" --time_based --output-format=json)
    # shellcheck disable=SC2086 # BENCH_EXTRA is a list of options
    if [ "$SYSCALLS" = 1 ]; then
        "${BENCH_PIN[@]}" perf stat -x, -e "$EVENTS" -o "$WORK/c.perf" -- "${BENCH[@]}" $BENCH_EXTRA >"$WORK/out.json"
    else
        "${BENCH_PIN[@]}" "${BENCH[@]}" $BENCH_EXTRA >"$WORK/out.json"
    fi
    read -r u1 s1 < <(cpu "$TP")
    kill -INT "$TP"; wait "$PERF_PID" 2>/dev/null || true
    TP=""
    WORK="$WORK" CASE="$c" TUSER=$(((u1 - u0))) TSYS=$(((s1 - s0))) TICK=$tick SYSCALLS="$SYSCALLS" python3 - <<'PY'
import json, os
work = os.environ["WORK"]
d = json.load(open(f"{work}/out.json"))
j = d["jobs"][0]
io = j["read"] if j["read"]["total_ios"] >= j["write"]["total_ios"] else j["write"]
ios = j["read"]["total_ios"] + j["write"]["total_ios"]
iops = j["read"]["iops"] + j["write"]["iops"]
runtime = io["runtime"] / 1000
client_user = j["usr_cpu"] / 100 * runtime
client = client_user + j["sys_cpu"] / 100 * runtime
tick = int(os.environ["TICK"])
target_user = int(os.environ["TUSER"]) / tick
target = target_user + int(os.environ["TSYS"]) / tick
line = (f"{os.environ['CASE']:<22} {iops:9,.0f} IOPS  p50 {io['clat_ns']['percentile']['50.000000']/1000:7.1f} us  "
        f"CPU per I/O: target {target/ios*1e6:5.1f} us (user {target_user/ios*1e6:4.1f}), "
        f"client {client/ios*1e6:5.1f} us (user {client_user/ios*1e6:4.1f})")
print(line)
if os.environ["SYSCALLS"] == "1":
    # Whole-process counts (set-up and teardown included: a few hundred
    # calls, against tens of thousands of I/Os), per I/O of the run.
    for who, name in (("t", "target"), ("c", "client")):
        rows, switches = [], 0
        for l in open(f"{work}/{who}.perf"):
            f = l.strip().split(",")
            if len(f) > 3 and f[0].isdigit() and int(f[0]) > 0:
                if f[2] == "context-switches":
                    switches = int(f[0])
                else:
                    rows.append((int(f[0]), f[2].replace("syscalls:sys_enter_", "")))
        rows.sort(reverse=True)
        print(f"    {name}: {switches/ios:.2f} context switches, {sum(r[0] for r in rows)/ios:.2f} system calls per I/O: " +
              ", ".join(f"{c} {k/ios:.2f}" for k, c in rows[:8]))
PY
done
