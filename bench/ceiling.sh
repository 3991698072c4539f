#!/usr/bin/env bash
# The loopback-TCP ceiling that bounds the performance targets, measured.
#
# Runs, interleaved, --repeat times:
#   1. tcp-ceiling (bench/src/bin/tcp-ceiling.rs): the best case any block
#      protocol can reach for a READ over loopback TCP — 64-byte requests,
#      16-byte header + payload answers, TCP_NODELAY, one read for every
#      message waiting and one writev per batch, server and client as two
#      processes. Cases: 4k QD32 (no batch cap; --batch 1: one system call
#      per message each way; --batch 4), 4k QD1 sleeping and busy-polled,
#      128k QD16.
#   2. tcp-ceiling --file: the same, with the disk in: the server reads every
#      answer from the file with the target's io_uring engine (O_DIRECT, fixed
#      file and buffers), 4k random, QD32 and QD1, sleeping and busy-polled.
#      Busy-polled, the server runs on the CPU that takes the disk's
#      interrupts and the client on the other one, as compare.sh places its
#      polled target and bench. Against local fio on this file it bounds
#      what a block protocol over loopback TCP can reach: the bound under
#      targets 1 and 2 of compare.sh.
#   3. fio, ioengine=io_uring, direct=1, randread 4k QD32 and QD1, on a local
#      file under /var/tmp (the disk ceiling of compare.sh, started the same way).
#   4. fio's nbd engine against `nbdkit null` at 4k randread QD32 (as
#      compare.sh does), for the nbdkit side's CPU per I/O.
# For every run: IOPS, MiB/s, p50/p99, CPU microseconds per operation of the
# server and of the client separately, system calls per operation
# (tcp-ceiling counts its own), the machine's busy CPU per operation from
# /proc/stat (everything: softirqs, kworkers, other processes), the load
# average before the run and the CPU that other processes used during it.
# Prints a markdown table of medians with the range of the runs.
#
# usage: bench/ceiling.sh [--runtime S] [--ramp S] [--repeat N] [--file PATH]
#                         [--size SIZE] [--no-nbd] [--no-build] [--json FILE]
#   --runtime S   seconds per measurement (default 10)
#   --ramp S      warm-up seconds before each measurement (default 1)
#   --repeat N    runs of every measurement, interleaved (default 3)
#   --file PATH   fio's file (default /var/tmp/rdmablk-ceiling.img; not on a
#                 tmpfs: O_DIRECT); written fully allocated when missing
#   --size SIZE   its size (default 1G)
#   --no-nbd      skip nbdkit null
#   --no-build    use target/release/tcp-ceiling as it is (or $BIN/tcp-ceiling:
#                 BIN=DIR, relative to the repository, picks another build)
#   --json FILE   also write every run as JSON
#   --quiet-wait S  before each measurement, wait up to S seconds (default
#                 120; 0: do not wait) until the machine was >= 90 % idle
#                 over 2 s: other engineers share it
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

RUNTIME=10
RAMP=1
REPEAT=3
FILE=/var/tmp/rdmablk-ceiling.img
SIZE=1G
NBD=1
BUILD=1
JSON_OUT=""
QUIET_WAIT=120
while [ $# -gt 0 ]; do
    case "$1" in
        --runtime) RUNTIME=$2; shift 2 ;;
        --ramp) RAMP=$2; shift 2 ;;
        --repeat) REPEAT=$2; shift 2 ;;
        --file) FILE=$2; shift 2 ;;
        --size) SIZE=$2; shift 2 ;;
        --no-nbd) NBD=0; shift ;;
        --no-build) BUILD=0; shift ;;
        --json) JSON_OUT=$(realpath -m "$2"); shift 2 ;;
        --quiet-wait) QUIET_WAIT=$2; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "ceiling.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

log() { echo "==> $*" >&2; }

# free_port, wait_port, cpu_secs, bin_dir, install_missing, placement, size_bytes, fill_file, tcp_ceiling
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
tools=(fio:fio python3:python3)
if [ "$NBD" = 1 ]; then tools+=(nbdkit:nbdkit); fi
install_missing "${tools[@]}"
if [ "$BUILD" = 1 ]; then
    log "building tcp-ceiling"
    cargo build --release -q -p rdmablk-bench --bin tcp-ceiling
fi

WORK=$(mktemp -d /var/tmp/rdmablk-ceiling.XXXXXX)
# A private copy: a rebuild of target/ during the run cannot swap it.
BIN_DIR=$(bin_dir tcp-ceiling)
cp "$BIN_DIR/tcp-ceiling" "$WORK/tcp-ceiling"
CEIL="$WORK/tcp-ceiling"
PIDS=()
cleanup() {
    stop_in_reverse "${PIDS[@]}"
    rm -rf "$WORK"
}
trap cleanup EXIT

SIZE_BYTES=$(size_bytes "$SIZE")
fill_file "$FILE" "$SIZE_BYTES"

# The machine's CPU counters (/proc/stat) and every process's CPU seconds.
snapshot() { python3 -c "
import json,os
tck=os.sysconf('SC_CLK_TCK')
cpu=[int(x)/tck for x in open('/proc/stat').readline().split()[1:]]
procs={}
for p in os.listdir('/proc'):
    if not p.isdigit(): continue
    try:
        s=open(f'/proc/{p}/stat').read()
        f=s.rsplit(')',1)[1].split()
        procs[p]=[s[s.index('(')+1:s.rindex(')')],(int(f[11])+int(f[12]))/tck]
    except Exception: pass
lines=[l.split() for l in open('/proc/net/snmp') if l.startswith('Tcp:')]
tcp=dict(zip(lines[0][1:],[int(x) for x in lines[1][1:]]))
json.dump({'cpu':cpu,'procs':procs,'load':open('/proc/loadavg').read().split()[:3],
           'tcp_out_segs':tcp['OutSegs']},open('$1','w'))"; }

NNPID=""
if [ "$NBD" = 1 ]; then
    NBD_PORT=$(free_port)
    log "starting nbdkit null on nbd://127.0.0.1:$NBD_PORT"
    nbdkit -f -i 127.0.0.1 -p "$NBD_PORT" null size="$SIZE_BYTES" 2>"$WORK/nbdkit-null.log" &
    NNPID=$!; PIDS+=("$NNPID")
    wait_port "$NBD_PORT" "$NNPID"
fi

# Waits until the machine was >= 90 % idle over 2 s, at most QUIET_WAIT seconds.
wait_quiet() {
    local deadline=$((SECONDS + QUIET_WAIT)) idle
    while :; do
        idle=$(python3 -c "
import time
def r(): return [int(x) for x in open('/proc/stat').readline().split()[1:9]]
a=r(); time.sleep(2); b=r(); d=[y-x for x,y in zip(a,b)]
print(int(100*(d[3]+d[4])/max(1,sum(d))))")
        [ "$idle" -ge 90 ] && return 0
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "the machine is still busy (idle $idle %); measuring anyway"; return 0
        fi
        log "waiting for a quiet machine (idle $idle %)"
        sleep 3
    done
}

# measure NAME KIND SERVER_PID -- COMMAND...: output on $WORK/NAME.json,
# the server's CPU seconds on $WORK/NAME.cpu, snapshots around it.
measure() {
    local name=$1 kind=$2 spid=$3; shift 4
    local c0 c1
    [ "$QUIET_WAIT" -gt 0 ] && wait_quiet
    snapshot "$WORK/$name.snap0"
    c0=$( [ "$spid" = - ] && echo 0 || cpu_secs "$spid")
    "$@" >"$WORK/$name.json" 2>"$WORK/$name.err" || { echo "ceiling.sh: $name failed:" >&2; cat "$WORK/$name.err" >&2; }
    c1=$( [ "$spid" = - ] && echo 0 || cpu_secs "$spid")
    snapshot "$WORK/$name.snap1"
    python3 -c "print($c1 - $c0)" >"$WORK/$name.cpu"
    echo "$kind" >"$WORK/$name.kind"
    echo "$*" >"$WORK/$name.cmd"
}
# Where placed cases run: the server on the CPU that takes the disk's
# interrupts, the client on the others (as compare.sh's polled rows).
placement "$FILE"
if [ -n "$PLACE_SERVER_CPU" ]; then
    PLACEMENT="placed rows: server on CPU $PLACE_SERVER_CPU (the disk's interrupts), client on CPU $PLACE_CLIENT_CPUS"
else
    PLACEMENT="placed rows not pinned (no disk interrupt found, or one CPU)"
fi
log "$PLACEMENT"

# ceiling PLACE ARGS...: tcp-ceiling as two processes; PLACE 1 pins them (see above).
ceiling() {
    local place=$1
    shift
    if [ "$place" = 1 ]; then
        tcp_ceiling "$CEIL" "$PLACE_SERVER_CPU" "$PLACE_CLIENT_CPUS" "$@"
    else
        tcp_ceiling "$CEIL" "" "" "$@"
    fi
}

# name, placed (1) or not, tcp-ceiling arguments
CEIL_CASES=(
    "4k-qd32|0|--bs 4k --qd 32"
    "4k-qd32-batch1|0|--bs 4k --qd 32 --batch 1"
    "4k-qd32-batch4|0|--bs 4k --qd 32 --batch 4"
    "4k-qd1|0|--bs 4k --qd 1"
    "4k-qd1-busy|0|--bs 4k --qd 1 --busy"
    "128k-qd16|0|--bs 128k --qd 16"
    "disk-4k-qd32|0|--bs 4k --qd 32 --file $FILE"
    "disk-4k-qd32-busy|1|--bs 4k --qd 32 --busy --file $FILE"
    "disk-4k-qd1|0|--bs 4k --qd 1 --file $FILE"
    "disk-4k-qd1-busy|1|--bs 4k --qd 1 --busy --file $FILE"
)
COMMON=(--runtime="$RUNTIME" --time_based --ramp_time="$RAMP" --output-format=json --lat_percentiles=1)
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
for rep in $(seq 1 "$REPEAT"); do
    for c in "${CEIL_CASES[@]}"; do
        IFS='|' read -r name place args <<<"$c"
        log "[$rep/$REPEAT] tcp-ceiling $args"
        # shellcheck disable=SC2086 # args is a list of options
        measure "ceiling-$name.$rep" ceiling - -- ceiling "$place" $args --runtime "$RUNTIME" --ramp "$RAMP"
    done
    for qd in 32 1; do
        log "[$rep/$REPEAT] fio io_uring local randread 4k QD$qd"
        measure "fio-4k-qd$qd.$rep" fio - -- fio --name="randread-4k-qd$qd" --rw=randread --bs=4k --iodepth="$qd" \
            --filename="$FILE" --size="$SIZE_BYTES" --direct=1 --ioengine=io_uring "${COMMON[@]}"
    done
    if [ "$NBD" = 1 ]; then
        log "[$rep/$REPEAT] fio nbd -> nbdkit null randread 4k QD32"
        measure "nbdnull-4k-qd32.$rep" fio "$NNPID" -- fio --name=randread-4k-qd32 --rw=randread --bs=4k --iodepth=32 \
            --ioengine=nbd --uri="nbd://127.0.0.1:$NBD_PORT" "${COMMON[@]}"
    fi
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

PLACEMENT="$PLACEMENT" OURS="$NNPID $$ $BASHPID" WORK="$WORK" REPEAT="$REPEAT" RUNTIME="$RUNTIME" RAMP="$RAMP" JSON_OUT="$JSON_OUT" \
LOAD_BEFORE="$LOAD_BEFORE" LOAD_AFTER="$LOAD_AFTER" python3 - <<'PY'
import json, os

work = os.environ["WORK"]
REPEAT = int(os.environ["REPEAT"])
WALL = int(os.environ["RUNTIME"]) + int(os.environ["RAMP"])
ours = set(os.environ["OURS"].split())

def machine(name):
    """Busy CPU-s of the whole machine, steal, and other processes' CPU-s over the run."""
    a = json.load(open(f"{work}/{name}.snap0")); b = json.load(open(f"{work}/{name}.snap1"))
    d = [y - x for x, y in zip(a["cpu"], b["cpu"])]
    # user nice system idle iowait irq softirq steal guest guest_nice
    busy = d[0] + d[1] + d[2] + d[5] + d[6]
    steal = d[7] if len(d) > 7 else 0.0
    # Processes alive at both ends other than ours (the measured commands
    # have exited by the second snapshot, so they are not counted).
    other = sum(max(0.0, t1 - a["procs"][pid][1]) for pid, (comm, t1) in b["procs"].items()
                if pid in a["procs"] and pid not in ours)
    segs = b.get("tcp_out_segs", 0) - a.get("tcp_out_segs", 0)
    return busy, steal, other, float(a["load"][0]), segs

def load1(name):
    try:
        text = open(f"{work}/{name}.json").read()
        doc = json.loads(text[text.index("{"):])
        kind = open(f"{work}/{name}.kind").read().strip()
        server_cpu = float(open(f"{work}/{name}.cpu").read().strip() or 0)
    except Exception:  # noqa: BLE001 - a failed run is left out
        return None
    busy, steal, other, load, segs = machine(name)
    if kind == "ceiling":
        s, c = doc["server"], doc["client"]
        wall = doc["runtime_s"] + int(os.environ["RAMP"])
        return {
            "iops": doc["iops"], "mib_s": doc["mib_s"], "p50_us": doc["p50_us"], "p99_us": doc["p99_us"],
            "server_us": s["cpu_us_per_op"], "client_us": c["cpu_us_per_op"],
            "server_sys": s["reads_per_op"] + s["writes_per_op"], "client_sys": c["reads_per_op"] + c["writes_per_op"],
            "server_ctx": s["ctx_per_op"], "client_ctx": c["ctx_per_op"],
            # The machine's busy time over the whole command (ramp and set-up included).
            "machine_us": busy / (doc["iops"] * wall) * 1e6, "steal_s": steal, "other_s": other, "load": load,
            "segs": segs / (doc["iops"] * wall),
        }
    j = doc["jobs"][0]
    d = j["read"]
    iops = d["iops"]
    lat = d["lat_ns"] if "percentile" in d.get("lat_ns", {}) else d["clat_ns"]
    p = lat.get("percentile", {})
    client_us = (j["usr_cpu"] + j["sys_cpu"]) / 100.0 / iops * 1e6 if iops else None
    return {
        "iops": iops, "mib_s": d["bw_bytes"] / 1048576.0,
        "p50_us": p.get("50.000000", 0) / 1000.0, "p99_us": p.get("99.000000", 0) / 1000.0,
        "server_us": server_cpu / (iops * WALL) * 1e6 if server_cpu > 0 and iops else None,
        "client_us": client_us, "server_sys": None, "client_sys": None,
        "server_ctx": None, "client_ctx": j["ctx"] / (iops * (j["job_runtime"] / 1000.0)) if iops else None,
        "machine_us": busy / (iops * WALL) * 1e6 if iops else None, "steal_s": steal, "other_s": other, "load": load,
        "segs": segs / (iops * WALL) if iops else None,
    }

def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

ROWS = [
    ("ceiling-4k-qd32", "4k randread QD32", "tcp-ceiling, sleeping, no batch cap"),
    ("ceiling-4k-qd32-batch1", "4k randread QD32", "tcp-ceiling, sleeping, 1 message per syscall"),
    ("ceiling-4k-qd32-batch4", "4k randread QD32", "tcp-ceiling, sleeping, <= 4 messages per syscall"),
    ("ceiling-disk-4k-qd32", "4k randread QD32", "tcp-ceiling --file (disk), sleeping"),
    ("ceiling-disk-4k-qd32-busy", "4k randread QD32", "tcp-ceiling --file (disk), busy-polled, placed"),
    ("fio-4k-qd32", "4k randread QD32", "fio io_uring, local file"),
    ("nbdnull-4k-qd32", "4k randread QD32", "fio nbd -> nbdkit null"),
    ("ceiling-4k-qd1", "4k randread QD1", "tcp-ceiling, sleeping"),
    ("ceiling-4k-qd1-busy", "4k randread QD1", "tcp-ceiling, busy-polled"),
    ("ceiling-disk-4k-qd1", "4k randread QD1", "tcp-ceiling --file (disk), sleeping"),
    ("ceiling-disk-4k-qd1-busy", "4k randread QD1", "tcp-ceiling --file (disk), busy-polled, placed"),
    ("fio-4k-qd1", "4k randread QD1", "fio io_uring, local file"),
    ("ceiling-128k-qd16", "128k read QD16", "tcp-ceiling, sleeping, no batch cap"),
]

def f(v, fmt):
    return "-" if v is None else format(v, fmt)

all_runs = {}
print()
print(f"{REPEAT} run(s) of {os.environ['RUNTIME']} s after {os.environ['RAMP']} s ramp per row, interleaved; "
      f"medians, range of the runs in brackets. Load average before {os.environ['LOAD_BEFORE']}, "
      f"after {os.environ['LOAD_AFTER']}. {os.environ['PLACEMENT'][:1].upper() + os.environ['PLACEMENT'][1:]}.")
print()
print("| case | system | IOPS | MiB/s | p50 µs | p99 µs | server CPU-µs/op | client CPU-µs/op "
      "| syscalls/op server, client | TCP segments/op | machine busy CPU-µs/op | load 1-min | other procs CPU-s |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for key, case, system in ROWS:
    runs = [r for r in (load1(f"{key}.{i}") for i in range(1, REPEAT + 1)) if r]
    all_runs[key] = runs
    if not runs:
        continue
    m = {k: median([r[k] for r in runs]) for k in runs[0]}
    def rng(k, fmt):
        xs = [r[k] for r in runs if r[k] is not None]
        if m[k] is None:
            return "-"
        return f"{m[k]:{fmt}}" + (f" [{min(xs):{fmt}}–{max(xs):{fmt}}]" if len(xs) > 1 else "")
    sys_ = "-" if m["server_sys"] is None else f"{m['server_sys']:.2f}, {m['client_sys']:.2f}"
    print(f"| {case} | {system} | {rng('iops', ',.0f')} | {f(m['mib_s'], ',.0f')} | {rng('p50_us', '.1f')} | "
          f"{f(m['p99_us'], '.1f')} | {rng('server_us', '.2f')} | {rng('client_us', '.2f')} | {sys_} | "
          f"{'-' if not m['segs'] else format(m['segs'], '.2f')} | "
          f"{rng('machine_us', '.2f')} | {', '.join(format(r['load'], '.2f') for r in runs)} | "
          f"{', '.join(format(r['other_s'], '.1f') for r in runs)} |")
print()
print("server/client CPU-µs/op: tcp-ceiling's own threads (getrusage RUSAGE_THREAD over the measured window); "
      "for fio the job's usr+sys (the client column) and nbdkit's process CPU over ramp + runtime (the server "
      "column). machine busy CPU-µs/op: the whole machine's non-idle time from /proc/stat over the command, "
      "per operation (includes interrupts, kworkers and anything else that ran). TCP segments/op: the "
      "machine's TCP OutSegs (/proc/net/snmp, both directions, ACKs included) over the command, per operation. Busy-polled rows burn both "
      "CPUs by design: their CPU per op is 1/IOPS, not work.")

# The bound under compare.sh's targets 1 and 2: the disk-over-TCP rows
# against local fio, each run against the fio run of the
# same repeat (taken right after it), as compare.sh pairs its runs.
def pairs(key, ref, fn):
    a, b = {}, {}
    for i in range(1, REPEAT + 1):
        x, y = load1(f"{key}.{i}"), load1(f"{ref}.{i}")
        if x and y:
            a[i], b[i] = x, y
    return [fn(a[i], b[i]) for i in sorted(a)]

bounds = {}
lines = []
for key, what in (("ceiling-disk-4k-qd32", "sleeping"), ("ceiling-disk-4k-qd32-busy", "busy-polled, placed")):
    xs = pairs(key, "fio-4k-qd32", lambda c, l: c["iops"] / l["iops"])
    if xs:
        bounds[key] = {"iops_over_local_fio": xs}
        lines.append(f"- target 1 (file 4k QD32 >= 0.9x local fio IOPS), {what}: disk over TCP reached "
                     f"{median(xs):.2f}x of local fio (runs {', '.join(format(x, '.2f') for x in xs)})")
for key, what in (("ceiling-disk-4k-qd1", "sleeping"), ("ceiling-disk-4k-qd1-busy", "busy-polled, placed")):
    xs = pairs(key, "fio-4k-qd1", lambda c, l: c["p50_us"] - l["p50_us"])
    if xs:
        bounds[key] = {"p50_over_local_fio_us": xs}
        lines.append(f"- target 2 (file 4k QD1 p50 <= local fio p50 + 15 us), {what}: disk over TCP at "
                     f"{median(xs):+.1f} us (runs {', '.join(format(x, '+.1f') for x in xs)})")
if lines:
    print()
    print("Bounds under compare.sh's targets (each disk-over-TCP run against the fio run of its repeat):")
    print("\n".join(lines))

if os.environ.get("JSON_OUT"):
    json.dump({"bounds": bounds, "runs": all_runs, "load_before": os.environ["LOAD_BEFORE"], "load_after": os.environ["LOAD_AFTER"],
               "runtime_s": int(os.environ["RUNTIME"]), "ramp_s": int(os.environ["RAMP"])},
              open(os.environ["JSON_OUT"], "w"), indent=2)
    print(f"\nruns written to {os.environ['JSON_OUT']}")
PY
