#!/usr/bin/env bash
# File QD1 latency of rdmablk and of its bound under each placement of the
# two ends: `rdmablk-bench` against `rdmablk-target`, and `tcp-ceiling
# --file` (the same 4 KiB random reads with no protocol), each run
#   unpinned  as compare.sh runs them (the scheduler decides);
#   split     server on the CPU that takes the disk's interrupts, client on
#             the other CPUs (taskset), as two hosts would be;
#   together  both on the disk's interrupt CPU.
# The six runs alternate for --rounds; the page cache is dropped before
# each. Prints each run's p50 (`lat`, as compare.sh) and then, per system
# and placement, the median and range, and rdmablk's distance to the bound.
# Uses the release binaries in target/release; needs a disk interrupt to go
# by and two CPUs. docs/perf-log/issue-20-looks.md, "Issue 20, fourteenth look", is its first
# use.
#
# usage: bench/placement.sh [--rounds N] [--runtime S] [--file PATH]
#   --rounds N   alternations (default 4)
#   --runtime S  seconds per run, after 1 s of ramp (default 4)
#   --file PATH  the backing file (default /var/tmp/rdmablk-per-io.img,
#                created with random data at 1 GiB; not on a tmpfs: O_DIRECT)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=4
RUNTIME=4
FILE=/var/tmp/rdmablk-per-io.img
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) ROUNDS=$2; shift 2 ;;
        --runtime) RUNTIME=$2; shift 2 ;;
        --file) FILE=$2; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "placement.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
# bin_dir, free_port, wait_port, placement, null_and_file_target_config, tcp_ceiling
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BIN=$(bin_dir rdmablk-target rdmablk-bench tcp-ceiling)
[ -f "$FILE" ] || { echo "==> writing 1 GiB of random data to $FILE" >&2
    dd if=/dev/urandom of="$FILE" bs=1M count=1024 status=none; }
placement "$FILE"
if [ -z "$PLACE_SERVER_CPU" ]; then
    echo "placement.sh: no disk interrupt CPU for $FILE, or one CPU, or no taskset: nothing to place" >&2; exit 1
fi
IRQ=$PLACE_SERVER_CPU
OTHERS=$PLACE_CLIENT_CPUS
echo "==> the disk's interrupts: CPU $IRQ; the client's CPUs when split: $OTHERS; idle: $(idle_polling)" >&2

WORK=$(mktemp -d)
TPID=""
trap 'if [ -n "$TPID" ]; then kill "$TPID" 2>/dev/null || true; fi; rm -rf "$WORK"' EXIT
PORT=$(free_port)
null_and_file_target_config "$PORT" "$FILE" >"$WORK/target.toml"
drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches; }

bound() { # SERVER_CPUS CLIENT_CPUS
    drop_caches
    tcp_ceiling "$BIN/tcp-ceiling" "$1" "$2" --bs 4096 --qd 1 --file "$FILE" --runtime "$RUNTIME" --ramp 1 \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["p50_us"])'
}
rdmablk() { # SERVER_CPUS CLIENT_CPUS
    local pin_server=() pin_client=()
    if [ -n "$1" ]; then pin_server=(taskset -c "$1"); fi
    if [ -n "$2" ]; then pin_client=(taskset -c "$2"); fi
    RUST_LOG=warn "${pin_server[@]}" "$BIN/rdmablk-target" --config "$WORK/target.toml" 2>"$WORK/target.log" &
    TPID=$!
    wait_port "$PORT" "$TPID"
    drop_caches
    "${pin_client[@]}" "$BIN/rdmablk-bench" --name=placement --target="tcp://127.0.0.1:$PORT" --volume=file \
        --rw=randread --bs=4k --iodepth=1 --runtime="$RUNTIME" --time_based --ramp_time=1 --output-format=json \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["read"]["lat_ns"]["percentile"]["50.000000"] / 1000)'
    kill "$TPID"; wait "$TPID" 2>/dev/null || true; TPID=""
}

for r in $(seq 1 "$ROUNDS"); do
    for sys in bound rdmablk; do
        for place in unpinned split together; do
            case $place in
                unpinned) cpus=("" "") ;;
                split) cpus=("$IRQ" "$OTHERS") ;;
                together) cpus=("$IRQ" "$IRQ") ;;
            esac
            p50=$("$sys" "${cpus[@]}")
            echo "$r $sys $place $p50" | tee -a "$WORK/runs"
        done
    done
done
python3 - "$WORK/runs" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    _, system, place, p50 = line.split()
    runs.setdefault((system, place), []).append(float(p50))
print(f"{'placement':<10} {'bound p50 us':>22} {'rdmablk p50 us':>22} {'rdmablk - bound':>16}")
for place in ("split", "together", "unpinned"):
    b, r = runs[("bound", place)], runs[("rdmablk", place)]
    cell = lambda v: f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
    print(f"{place:<10} {cell(b):>22} {cell(r):>22} {statistics.median(r) - statistics.median(b):>+16.1f}")
PY
