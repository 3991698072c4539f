#!/usr/bin/env bash
# Cost of one I/O: CPU microseconds of the target process and of the
# rdmablk-bench job per I/O, and (with --syscalls) system calls per I/O of
# each, counted with `perf stat -e 'syscalls:sys_enter_*'` over the middle
# of the run. Starts its own rdmablk-target on tcp://127.0.0.1 with a null
# volume and a file volume; uses the release binaries in target/release.
#
# usage: bench/per-io.sh [--syscalls] [--runtime S] [--file PATH] [--target-extra TOML]
#                        [--bench-extra "ARGS"] [--target-cpus LIST] [--bench-cpus LIST] CASE...
#   CASE          VOLUME:RW:BS:QD, VOLUME being null or file,
#                 e.g. null:randread:4k:32 file:randread:4k:1
#   --syscalls    also count system calls (needs perf: apt-get install linux-perf)
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
# bin_dir, free_port, wait_port
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BIN=$(bin_dir rdmablk-target rdmablk-bench)
if [ "$SYSCALLS" = 1 ] && ! command -v perf >/dev/null; then
    echo "per-io.sh: --syscalls needs perf (apt-get install linux-perf)" >&2; exit 1
fi
[ -f "$FILE" ] || { echo "==> writing 1 GiB of random data to $FILE" >&2
    dd if=/dev/urandom of="$FILE" bs=1M count=1024 status=none; }

WORK=$(mktemp -d)
PORT=$(free_port)
cat >"$WORK/target.toml" <<EOF
[target]
listen = ["tcp://127.0.0.1:$PORT"]
$TARGET_EXTRA

[[volume]]
name = "null"
backend = "null"
size = "1GiB"
allow_any_host = true

[[volume]]
name = "file"
backend = "file"
path = "$FILE"
allow_any_host = true
EOF
RUST_LOG=warn "${TARGET_PIN[@]}" "$BIN/rdmablk-target" --config "$WORK/target.toml" 2>"$WORK/target.log" &
TP=$!
trap 'kill $TP 2>/dev/null; wait $TP 2>/dev/null; rm -rf "$WORK"' EXIT
wait_port "$PORT" "$TP"
tick=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }

for c in "${CASES[@]}"; do
    IFS=: read -r vol rw bs qd <<<"$c"
    # shellcheck disable=SC2086 # BENCH_EXTRA is a list of options
    "${BENCH_PIN[@]}" "$BIN/rdmablk-bench" --name=j --target="tcp://127.0.0.1:$PORT" --volume="$vol" --rw="$rw" --bs="$bs" \
        --iodepth="$qd" --runtime="$RUNTIME" --time_based --output-format=json $BENCH_EXTRA >"$WORK/out.json" &
    BP=$!
    t0=$(cpu $TP)
    if [ "$SYSCALLS" = 1 ]; then
        # The middle of the run: after connection set-up, before the end.
        window=$(python3 -c "print(max(1, $RUNTIME - 2))")
        sleep 1
        perf stat -x, -e 'syscalls:sys_enter_*' -p "$TP" -o "$WORK/t.perf" -- sleep "$window" &
        PP=$!
        perf stat -x, -e 'syscalls:sys_enter_*' -p "$BP" -o "$WORK/c.perf" -- sleep "$window"
        wait "$PP"
    fi
    wait "$BP"
    t1=$(cpu $TP)
    WORK="$WORK" CASE="$c" TCPU=$(python3 -c "print(($t1 - $t0) / $tick)") SYSCALLS="$SYSCALLS" \
        WINDOW="${window:-0}" python3 - <<'PY'
import json, os
work = os.environ["WORK"]
d = json.load(open(f"{work}/out.json"))
j = d["jobs"][0]
io = j["read"] if j["read"]["total_ios"] >= j["write"]["total_ios"] else j["write"]
ios = j["read"]["total_ios"] + j["write"]["total_ios"]
iops = j["read"]["iops"] + j["write"]["iops"]
runtime = io["runtime"] / 1000
client = (j["usr_cpu"] + j["sys_cpu"]) / 100 * runtime
line = (f"{os.environ['CASE']:<22} {iops:9,.0f} IOPS  p50 {io['clat_ns']['percentile']['50.000000']/1000:7.1f} us  "
        f"CPU per I/O: target {float(os.environ['TCPU'])/ios*1e6:5.1f} us, client {client/ios*1e6:5.1f} us")
print(line)
if os.environ["SYSCALLS"] == "1":
    n = iops * float(os.environ["WINDOW"])
    for who, name in (("t", "target"), ("c", "client")):
        rows = []
        for l in open(f"{work}/{who}.perf"):
            f = l.strip().split(",")
            if len(f) > 3 and f[0].isdigit() and int(f[0]) > 0:
                rows.append((int(f[0]), f[2].replace("syscalls:sys_enter_", "")))
        rows.sort(reverse=True)
        print(f"    {name} syscalls per I/O {sum(r[0] for r in rows)/n:.2f}: " +
              ", ".join(f"{c} {k/n:.2f}" for k, c in rows[:8]))
PY
done
