#!/usr/bin/env bash
# Where one QD1 read's time goes, for rdmablk and for its bound side by
# side: `rdmablk-bench` against `rdmablk-target`, then `tcp-ceiling` (the
# same reads with no protocol), alternated for --rounds. Neither side is
# pinned. For each run:
# - placement: both serving and client threads' CPU sampled at 200 Hz for
#   --trace seconds; the share of samples with both on one CPU, and with
#   the server on the CPU that takes the disk's interrupts;
# - legs: for --trace seconds `perf record` of both processes' send and
#   receive system calls, and the cycle split into
#     A  the server's send of the answer -> the client's receive returns it
#     B  the client's receive returned -> its send of the next request
#     C  the client's send -> the server's receive returns the request
#     D  the server's receive returned -> its send of the answer (disk inside)
#   (medians; the client's latency is about C + D + A, B is outside it).
#   Tracing adds about 1 us per traced call, and the two sides make
#   different numbers of calls: read the legs against each other, the p50
#   printed beside them (the whole run's, the traced seconds included) for
#   the untraced truth.
# Uses the release binaries in target/release; needs perf (apt-get install
# linux-perf). Measures the sleeping configuration only.
#
# usage: bench/qd1-legs.sh [--volume file|null] [--rounds N] [--runtime S] [--trace S] [--file PATH]
#   --volume    file (default): the file volume and `tcp-ceiling --file`;
#               null: the null volume and `tcp-ceiling`
#   --rounds N  alternations (default 3)
#   --runtime S seconds per run (default 6; placement and trace take the
#               middle 2 x --trace seconds)
#   --trace S   seconds of placement sampling, then of tracing (default 1)
#   --file PATH the file volume's backing file (default /var/tmp/rdmablk-per-io.img,
#               created with random data at 1 GiB; not on a tmpfs: O_DIRECT)
#   KEEP=1      keep the work directory (the last run's trace) and print it
set -euo pipefail
cd "$(dirname "$0")/.."
VOLUME=file
ROUNDS=3
RUNTIME=6
TRACE=1
FILE=/var/tmp/rdmablk-per-io.img
while [ $# -gt 0 ]; do
    case "$1" in
        --volume) VOLUME=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --runtime) RUNTIME=$2; shift 2 ;;
        --trace) TRACE=$2; shift 2 ;;
        --file) FILE=$2; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "qd1-legs.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$VOLUME" in file|null) ;; *) echo "qd1-legs.sh: --volume is file or null" >&2; exit 2 ;; esac
if ! python3 -c "import sys; sys.exit(0 if $RUNTIME >= 2 * $TRACE + 2 else 1)"; then
    echo "qd1-legs.sh: --runtime must be at least 2 x --trace + 2 seconds" >&2; exit 2
fi
# bin_dir, free_port, wait_port, disk_irq_cpu, null_and_file_target_config, tcp_ceiling_listening
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BIN=$(bin_dir rdmablk-target rdmablk-bench tcp-ceiling)
command -v perf >/dev/null || { echo "qd1-legs.sh: needs perf (apt-get install linux-perf)" >&2; exit 1; }
[ -f "$FILE" ] || { echo "==> writing 1 GiB of random data to $FILE" >&2
    dd if=/dev/urandom of="$FILE" bs=1M count=1024 status=none; }
IRQ_CPU=$(disk_irq_cpu "$FILE")

WORK=$(mktemp -d)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; if [ -n "${KEEP:-}" ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi' EXIT
PORT=$(free_port)
null_and_file_target_config "$PORT" "$FILE" >"$WORK/target.toml"

# The thread of PID that switched most: a process's serving (or job) thread.
busiest_thread() { # PID
    for t in /proc/"$1"/task/*; do
        echo "$(awk '/^nr_switches/ { print $3; exit }' "$t/sched" 2>/dev/null || echo 0) ${t##*/}"
    done | sort -n | tail -1 | cut -d' ' -f2
}

# Samples both threads' CPU for SECONDS; prints "SAME ON_IRQ" (shares).
placement_sample() { # SECONDS SERVER_TID CLIENT_TID
    python3 - "$@" "${IRQ_CPU:-}" <<'PY'
import sys, time
secs, s, c, irq = float(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
def cpu(t):
    with open(f"/proc/{t}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])
n = same = on_irq = 0
end = time.monotonic() + secs
while time.monotonic() < end:
    a, b = cpu(s), cpu(c)
    n += 1; same += a == b; on_irq += irq != "" and a == int(irq)
    time.sleep(0.005)
print(f"{same / n:.2f} {on_irq / n:.2f}" if irq else f"{same / n:.2f} -")
PY
}

EVENTS=syscalls:sys_enter_sendmsg,syscalls:sys_enter_writev,syscalls:sys_exit_recvfrom

# Traces the sends and receives of processes SERVER_PID and CLIENT_PID for
# --trace seconds and prints the legs' medians "A B C D" (us) between
# their threads SERVER_TID and CLIENT_TID, and the cycles counted.
legs() { # SERVER_PID CLIENT_PID SERVER_TID CLIENT_TID
    perf record -q -e "$EVENTS" -o "$WORK/legs.data" -p "$1,$2" -- sleep "$TRACE" 2>/dev/null
    perf script -i "$WORK/legs.data" -F tid,time,event,trace >"$WORK/legs.txt" 2>/dev/null
    python3 - "$3" "$4" "$WORK/legs.txt" <<'PY'
import bisect, re, statistics, sys
server, client = int(sys.argv[1]), int(sys.argv[2])
sends = {server: [], client: []}
recvs = {server: [], client: []}
for line in open(sys.argv[3]):
    m = re.match(r"\s*(\d+)\s+([\d.]+):\s+syscalls:sys_(enter|exit)_(\w+):(.*)", line)
    if not m:
        continue
    tid, t, kind, call, rest = int(m.group(1)), float(m.group(2)) * 1e6, m.group(3), m.group(4), m.group(5)
    if tid not in sends:
        continue
    if kind == "enter" and call in ("sendmsg", "writev"):
        sends[tid].append(t)
    elif kind == "exit" and call == "recvfrom":
        r = re.search(r"0x([0-9a-f]+)", rest)
        if r and int(r.group(1), 16) < 1 << 63 and int(r.group(1), 16) > 0:
            recvs[tid].append(t)
def after(times, t):
    i = bisect.bisect_right(times, t)
    return times[i] if i < len(times) else None
legs = ([], [], [], [])
for t in sends[server]:
    a = after(recvs[client], t)
    b = a and after(sends[client], a)
    c = b and after(recvs[server], b)
    d = c and after(sends[server], c)
    if d is None:
        break
    for leg, v in zip(legs, (a - t, b - a, c - b, d - c)):
        leg.append(v)
if not legs[0]:
    print("- - - - 0")
else:
    print(" ".join(f"{statistics.median(l):.1f}" for l in legs), len(legs[0]))
PY
}

settle() { if [ "$VOLUME" = file ]; then sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true; fi; }
MID=$(python3 -c "print(($RUNTIME - 2 * $TRACE) / 2)")

run_rdmablk() {
    RUST_LOG=warn "$BIN/rdmablk-target" --config "$WORK/target.toml" 2>"$WORK/target.log" &
    local tp=$!; PIDS+=("$tp")
    wait_port "$PORT" "$tp"
    settle
    "$BIN/rdmablk-bench" --name=j --target="tcp://127.0.0.1:$PORT" --volume="$VOLUME" --rw=randread --bs=4k \
        --iodepth=1 --runtime="$RUNTIME" --time_based --output-format=json >"$WORK/bench.json" &
    local bp=$!
    sleep "$MID"
    local s c
    s=$(busiest_thread "$tp"); c=$(busiest_thread "$bp")
    local place legs_out
    place=$(placement_sample "$TRACE" "$s" "$c")
    legs_out=$(legs "$tp" "$bp" "$s" "$c")
    wait "$bp"
    kill -INT "$tp"; wait "$tp" 2>/dev/null || true
    local p50
    p50=$(python3 -c "import json; j=json.load(open('$WORK/bench.json'))['jobs'][0]['read']; print('%.1f' % (j['lat_ns']['percentile']['50.000000'] / 1000))")
    echo "rdmablk $p50 $place $legs_out"
}

run_bound() {
    local port file_arg=()
    port=$(free_port)
    [ "$VOLUME" = file ] && file_arg=(--file "$FILE")
    "$BIN/tcp-ceiling" --json --server "127.0.0.1:$port" --bs 4096 --qd 1 "${file_arg[@]}" --runtime "$RUNTIME" --ramp 0 \
        >"$WORK/server.json" 2>"$WORK/server.err" &
    local sp=$!; PIDS+=("$sp")
    tcp_ceiling_listening "$WORK/server.err" "$sp"
    settle
    "$BIN/tcp-ceiling" --json --connect "127.0.0.1:$port" --bs 4096 --qd 1 "${file_arg[@]}" --runtime "$RUNTIME" --ramp 0 \
        >"$WORK/client.json" &
    local cp=$!
    sleep "$MID"
    local place legs_out
    place=$(placement_sample "$TRACE" "$sp" "$cp")
    legs_out=$(legs "$sp" "$cp" "$sp" "$cp")
    wait "$cp"; wait "$sp" || true
    local p50
    p50=$(python3 -c "import json; print('%.1f' % json.load(open('$WORK/client.json'))['p50_us'])")
    echo "bound $p50 $place $legs_out"
}

echo "# qd1-legs: volume $VOLUME, disk interrupts on CPU ${IRQ_CPU:-?}, $(idle_polling)" >&2
for i in $(seq 1 "$ROUNDS"); do
    run_rdmablk
    run_bound
done >"$WORK/rows"
python3 - "$WORK/rows" <<'PY'
import statistics, sys
rows = {}
head = ("run", "p50 us", "same CPU", "server on IRQ CPU", "A", "B", "C", "D", "cycles")
fmt = "{:<10} {:>7} {:>8} {:>17} {:>6} {:>6} {:>6} {:>6} {:>7}"
print(fmt.format(*head))
for line in open(sys.argv[1]):
    f = line.split()
    rows.setdefault(f[0], []).append(f)
    print(fmt.format(*f))
def median(rs, k):
    v = [float(r[k]) for r in rs if r[k] != "-"]
    return f"{statistics.median(v):.2f}" if v else "-"
for who, rs in rows.items():
    print(fmt.format(who + " med", *(median(rs, k) for k in range(1, 8)), ""))
PY
