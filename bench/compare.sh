#!/usr/bin/env bash
# Same-run comparison of rdmablk against the local disk and against NBD.
#
# One invocation, one file, one machine, one after another:
#   1. fio, ioengine=io_uring, direct=1, on the local file: the disk ceiling;
#   2. rdmablk-bench against a separately started rdmablk-target
#      (tcp://127.0.0.1) serving that file;
#   3. fio's nbd engine against nbdkit serving the same file (cache=none);
#   4. fio's nbd engine against `rdmablk nbd` (the rdmablk CLI's NBD server)
#      listening on TCP 127.0.0.1 — as nbdkit does, so that fio's libnbd
#      client pays the same loopback TCP on both — whose volume is vol0 of
#      the rdmablk-target of 2 (tcp://127.0.0.1): the same file, through
#      one more hop (rows "fio nbd -> rdmablk nbd -> rdmablk-target");
# then the null case: rdmablk's null backend against nbdkit's null plugin,
# and one iperf3 loopback stream, the fabric's ceiling.
#
# Every file case (and the null QD1 case) also runs rdmablk polled:
# rdmablk-bench --hipri against a second target with busy_poll = "1ms"
# (rows marked --hipri / busy_poll). That target is pinned to the CPU that
# takes the disk's interrupts and the polling bench to the other CPUs, so
# that two pollers never share a CPU and completions are handled where the
# target runs; without a disk interrupt to go by, neither is pinned.
# The random-read cases also run the bound under targets 1 and 2:
# tcp-ceiling --file (bench/src/bin/tcp-ceiling.rs), a server with no
# protocol that reads each request's 4 KiB from the same file with the
# target's io_uring engine and answers over loopback TCP — sleeping, and
# busy-polled, placed as the polled target and bench are. What it reaches
# against local fio bounds what a block protocol over loopback TCP can reach
# in that run: the same reads and TCP, with no protocol work at all.
# The null QD1 case runs tcp-ceiling without --file (the null bound): the
# same request and 4 KiB answer over loopback TCP between two sleeping
# processes, the floor under both null rows.
# The page cache is dropped before every run (nbdkit file reads through it;
# the others use O_DIRECT), or a warning says it could not be, and nbdkit
# file's page cache is held to the target's buffer memory (a memory cgroup)
# so that a run re-reading the file does not read it from memory; the
# "disk / served" column shows what each row took from the disk.
# Cases: 4 KiB randread QD1, 4 KiB randread QD32, 4 KiB randwrite QD32,
# 128 KiB sequential read QD16. Prints a markdown table (IOPS, bandwidth,
# p50/p99 latency, ratios against the ceiling and the peer, CPU time of
# the serving side and IOPS per CPU-second of it) and the performance
# targets of the issue with PASS/MISS. The serving side of the rdmablk nbd
# rows is rdmablk nbd and rdmablk-target together (both serve each request,
# as nbdkit alone does on its rows); their CPU seconds are summed.
#
# usage: bench/compare.sh [--json FILE] [--runtime SECONDS] [--ramp SECONDS]
#                         [--size SIZE] [--dir DIR] [--keep] [--no-build]
#                         [--repeat N] [--case NAME]... [--guest-halt-poll NS]
#                         [--only nbd] [--results FILE] [--chart FILE]
#   --json FILE     also write the rows (and the targets) as JSON
#   --results FILE  where the rows go as a tab-separated table (case, system,
#                   IOPS, MiB/s, p50, p99, vs ceiling, vs peer; default
#                   DIR/compare.tsv, replaced by the next run), the input
#                   of rdmablk-plot compare
#   --chart FILE    where the chart of that table goes: an SVG of grouped
#                   bars, a group per case, a bar per system with its ratio
#                   to local fio (null rows: to nbdkit null) (default
#                   DIR/compare.svg; drawn by rdmablk-plot, which is built
#                   with rdmablk-bench; without it, a warning and no chart)
#   --runtime S     seconds per measurement (default 10)
#   --ramp S        warm-up seconds before each measurement (default 1)
#   --size SIZE     size of the test file (default 1G)
#   --dir DIR       where the test file and the raw results go (default
#                   /var/tmp/rdmablk-compare; must not be a tmpfs: O_DIRECT)
#   --keep          keep the test file and raw results
#   --no-build      use the release binaries already in target/release
#   --repeat N      run every measurement N times, interleaved; the table
#                   shows medians and the IOPS range, and targets 1 and 2
#                   also set each rdmablk run against the fio run of the
#                   same repeat (default 1)
#   --case NAME     run only this case (repeatable): randread-4k-qd1,
#                   randread-4k-qd32, randwrite-4k-qd32, read-128k-qd16;
#                   iperf3 runs only with read-128k-qd16
#   --only nbd      run only the NBD comparison: fio nbd against nbdkit file
#                   and against rdmablk nbd (no local ceiling, no
#                   rdmablk-bench, no bound, no null rows, no iperf3; the
#                   polled target and nbdkit null are not started); target 5
#                   is the only one judged. A few minutes with --runtime 10
#   --guest-halt-poll NS
#                   in a KVM guest whose haltpoll cpuidle governor is in
#                   force (booted with cpuidle_haltpoll.force=1; refused
#                   otherwise): let an idle vCPU poll up to NS ns before it
#                   halts (the kernel's default is 200000; some hosts boot
#                   guests with 0) for the run, and restore the old value
#                   after. Applies to every system measured; the header
#                   reports the idle polling in force.
#
# BIN=DIR takes rdmablk-bench, rdmablk-target, tcp-ceiling and rdmablk (the
# CLI, for rdmablk nbd) from DIR (relative to the repository) instead of
# target/release, with --no-build; scripts/test.sh smoke-runs the debug
# build this way.
#
# Needs root for apt-get only when fio, nbdkit, iperf3 or python3 are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

JSON_OUT=""
RESULTS_OUT=""
CHART_OUT=""
RUNTIME=10
RAMP=1
SIZE=1G
DIR=/var/tmp/rdmablk-compare
KEEP=0
BUILD=1
REPEAT=1
ONLY=()
ONLY_NBD=0
HALT_POLL_SET=""
while [ $# -gt 0 ]; do
    case "$1" in
        --json) JSON_OUT=$(realpath -m "$2"); shift 2 ;;
        --results) RESULTS_OUT=$(realpath -m "$2"); shift 2 ;;
        --chart) CHART_OUT=$(realpath -m "$2"); shift 2 ;;
        --runtime) RUNTIME=$2; shift 2 ;;
        --ramp) RAMP=$2; shift 2 ;;
        --size) SIZE=$2; shift 2 ;;
        --dir) DIR=$2; shift 2 ;;
        --keep) KEEP=1; shift ;;
        --no-build) BUILD=0; shift ;;
        --repeat) REPEAT=$2; shift 2 ;;
        --case) ONLY+=("$2"); shift 2 ;;
        --only) [ "${2:-}" = nbd ] || { echo "compare.sh: --only takes nbd" >&2; exit 2; }
            ONLY_NBD=1; shift 2 ;;
        --guest-halt-poll) HALT_POLL_SET=$2; shift 2
            [[ "$HALT_POLL_SET" =~ ^[0-9]+$ ]] || { echo "compare.sh: --guest-halt-poll takes nanoseconds, e.g. 200000" >&2; exit 2; } ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "compare.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

log() { echo "==> $*" >&2; }

# case name, rw, bs, iodepth
ALL_CASES=(
    "randread-4k-qd1 randread 4k 1"
    "randread-4k-qd32 randread 4k 32"
    "randwrite-4k-qd32 randwrite 4k 32"
    "read-128k-qd16 read 128k 16"
)
CASES=()
for c in "${ALL_CASES[@]}"; do
    if [ ${#ONLY[@]} -eq 0 ] || [[ " ${ONLY[*]} " == *" ${c%% *} "* ]]; then CASES+=("$c"); fi
done
for o in "${ONLY[@]}"; do
    printf '%s\n' "${ALL_CASES[@]}" | grep -q "^$o " || { echo "compare.sh: unknown case $o (see --help)" >&2; exit 2; }
done
CASE_NAMES=$(printf '%s\n' "${CASES[@]}" | cut -d' ' -f1 | tr '\n' ' ')

# --- tools -------------------------------------------------------------------
# free_port, wait_port, cpu_secs, bin_dir, install_missing, placement, size_bytes, fill_file, tcp_ceiling
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
install_missing fio:fio nbdkit:nbdkit iperf3:iperf3 python3:python3
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "compare.sh: this fio has no nbd engine" >&2; exit 1; }

if [ "$BUILD" = 1 ]; then
    log "building release binaries"
    cargo build --release -q -p rdmablk-bench -p rdmablk-target -p rdmablk-initiator
fi

mkdir -p "$DIR"
RESULTS_OUT=${RESULTS_OUT:-$(realpath -m "$DIR/compare.tsv")}
CHART_OUT=${CHART_OUT:-$(realpath -m "$DIR/compare.svg")}
WORK=$(mktemp -d "$DIR/run.XXXXXX")
# Private copies: a rebuild of target/ during the run cannot swap them.
mkdir -p "$WORK/bin"
BIN_DIR=$(bin_dir rdmablk-bench rdmablk-target tcp-ceiling rdmablk)
cp "$BIN_DIR/rdmablk-bench" "$BIN_DIR/rdmablk-target" "$BIN_DIR/tcp-ceiling" "$BIN_DIR/rdmablk" "$WORK/bin/"
BENCH="$WORK/bin/rdmablk-bench"
TARGET="$WORK/bin/rdmablk-target"
CEIL="$WORK/bin/tcp-ceiling"
RDMABLK="$WORK/bin/rdmablk"
# rdmablk-plot draws the chart at the end; a build from before it existed
# still runs, without the chart.
PLOT=""
if [ -x "$BIN_DIR/rdmablk-plot" ]; then
    cp "$BIN_DIR/rdmablk-plot" "$WORK/bin/"
    PLOT="$WORK/bin/rdmablk-plot"
fi
FILE="$DIR/compare.img"
PIDS=()
PEER_CG=""
HALT_POLL_OLD=""
cleanup() {
    if [ -n "$HALT_POLL_OLD" ]; then echo "$HALT_POLL_OLD" >"$HALT_POLL_PARAM" || true; fi
    stop_in_reverse "${PIDS[@]}"
    if [ -n "$PEER_CG" ]; then rmdir "$PEER_CG" 2>/dev/null || true; fi
    if [ "$KEEP" = 0 ]; then rm -rf "$WORK" "$FILE"; else log "kept $WORK and $FILE"; fi
}
trap cleanup EXIT

# --- the guest's idle polling ----------------------------------------------------
# How a halted vCPU is woken costs a VM exit and a host wake-up; it is the
# largest cost of every sleeping row on such a machine (docs/perf-log/what-moved-the-numbers.md).
if [ -n "$HALT_POLL_SET" ]; then
    # The parameter exists whenever the governor is built in, and does
    # nothing unless it is the one in force: refuse rather than report a
    # setting that did not apply.
    haltpoll_in_force || { echo "compare.sh: --guest-halt-poll needs the haltpoll cpuidle governor in force, and it is not: $(idle_polling); a KVM guest gets it by booting with cpuidle_haltpoll.force=1" >&2; exit 1; }
    [ -w "$HALT_POLL_PARAM" ] || { echo "compare.sh: --guest-halt-poll needs root to write $HALT_POLL_PARAM" >&2; exit 1; }
    HALT_POLL_OLD=$(cat "$HALT_POLL_PARAM")
    echo "$HALT_POLL_SET" >"$HALT_POLL_PARAM"
fi
HALT_POLL=$(idle_polling)
# Not `$(test && echo)`: under `set -e` its failure would end the script.
if [ -n "$HALT_POLL_SET" ]; then HALT_POLL+=" (set for this run; was $HALT_POLL_OLD)"; fi

# --- the file ------------------------------------------------------------------
SIZE_BYTES=$(size_bytes "$SIZE")
fill_file "$FILE" "$SIZE_BYTES"
DISK_STAT=$(disk_stat_file "$FILE")

# --- servers -------------------------------------------------------------------
RDMA_PORT=$(free_port)
cat >"$WORK/target.toml" <<EOF
[target]
name = "compare"
listen = ["tcp://127.0.0.1:$RDMA_PORT"]

[[volume]]
name = "vol0"
backend = "file"
path = "$FILE"
size = $SIZE_BYTES
allow_any_host = true

[[volume]]
name = "null0"
backend = "null"
size = $SIZE_BYTES
allow_any_host = true
EOF
log "starting rdmablk-target on tcp://127.0.0.1:$RDMA_PORT"
RUST_LOG=warn "$TARGET" --config "$WORK/target.toml" 2>"$WORK/target.log" &
TPID=$!; PIDS+=("$TPID")
wait_port "$RDMA_PORT" "$TPID"

# The same volumes on a second target whose reactors poll for 1 ms after
# their last work: the file cases also run against it with a polling client
# (--hipri), the way SPDK-style targets and hipri clients trade CPU for latency.
# Two pollers on one CPU would take turns by the scheduler's time slice, so
# the target runs (one reactor) on the CPU that takes the disk's interrupts
# and the bench on the others, as CPUAffinity= would place it in production.
PPID_POLLED=""
PLACEMENT="polled target not started (--only nbd)"
PIN_BENCH=()
if [ "$ONLY_NBD" = 0 ]; then  # not with --only nbd
POLL_PORT=$(free_port)
sed -e "s/:$RDMA_PORT\"/:$POLL_PORT\"/" -e 's/^name = "compare"$/name = "compare-polled"\nbusy_poll = "1ms"/' \
    "$WORK/target.toml" >"$WORK/target-polled.toml"
# The polled bound's server and client go to the same CPUs.
placement "$FILE"
PIN_TARGET=()
PIN_BENCH=()
if [ -n "$PLACE_SERVER_CPU" ]; then
    PIN_TARGET=(taskset -c "$PLACE_SERVER_CPU")
    PIN_BENCH=(taskset -c "$PLACE_CLIENT_CPUS")
    PLACEMENT="polled target on CPU $PLACE_SERVER_CPU (the disk's interrupts), polled bench on CPU $PLACE_CLIENT_CPUS"
else
    PLACEMENT="polled target and bench not pinned (no disk interrupt found, or one CPU)"
fi
log "starting rdmablk-target (busy_poll) on tcp://127.0.0.1:$POLL_PORT; $PLACEMENT"
RUST_LOG=warn "${PIN_TARGET[@]}" "$TARGET" --config "$WORK/target-polled.toml" 2>"$WORK/target-polled.log" &
PPID_POLLED=$!; PIDS+=("$PPID_POLLED")
wait_port "$POLL_PORT" "$PPID_POLLED"
fi

# rdmablk nbd: the CLI's NBD server for vol0 of the first (sleeping) target,
# on TCP 127.0.0.1 like nbdkit. Default queues (one per CPU); each fio job
# is one NBD connection served by one thread of its own.
RNBD_PORT=$(free_port)
log "starting rdmablk nbd vol0 on nbd://127.0.0.1:$RNBD_PORT (-> tcp://127.0.0.1:$RDMA_PORT)"
RDMABLK_LOG=warn "$RDMABLK" --target "tcp://127.0.0.1:$RDMA_PORT" nbd vol0 --listen "127.0.0.1:$RNBD_PORT" \
    >"$WORK/rdmablk-nbd.out" 2>"$WORK/rdmablk-nbd.log" &
RNPID=$!; PIDS+=("$RNPID")
wait_port "$RNBD_PORT" "$RNPID"

NBD_PORT=$(free_port)
log "starting nbdkit file on nbd://127.0.0.1:$NBD_PORT"
# nbdkit file reads through the page cache. cache=none evicts what a read
# asked for, not what the kernel's readahead brought in ahead of it, so a
# sequential run that wraps around the file reads the disk once and memory
# afterwards (docs/perf-log/issue-20-looks.md, "The peer read from memory"). Its page cache is
# therefore held, in a memory cgroup, to the buffer memory rdmablk-target
# has: its pools, DEFAULT_BUFFER_POOL (64 MiB) per reactor, one reactor per
# CPU. The "disk / served" column shows what each row read from the disk.
PEER_CACHE_BYTES=$(( $(nproc) * (64 << 20) ))
PEER_CG=$(memory_cgroup "rdmablk-compare-$$" "$PEER_CACHE_BYTES")
IN_PEER_CG=()
if [ -n "$PEER_CG" ]; then
    PEER_CACHE="nbdkit file's page cache held to $((PEER_CACHE_BYTES >> 20)) MiB (memory cgroup)"
    # Joins the cgroup, then becomes nbdkit (same pid): all it reads is charged there.
    IN_PEER_CG=(sh -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' sh "$PEER_CG")
else
    PEER_CACHE="nbdkit file's page cache not bounded (no memory cgroup here): its sequential rows may read from memory"
    log "warning: $PEER_CACHE"
fi
"${IN_PEER_CG[@]}" nbdkit -f -i 127.0.0.1 -p "$NBD_PORT" file file="$FILE" cache=none 2>"$WORK/nbdkit.log" &
NPID=$!; PIDS+=("$NPID")
wait_port "$NBD_PORT" "$NPID"

NNPID=""
if [ "$ONLY_NBD" = 0 ]; then  # not with --only nbd
NBDNULL_PORT=$(free_port)
log "starting nbdkit null on nbd://127.0.0.1:$NBDNULL_PORT"
nbdkit -f -i 127.0.0.1 -p "$NBDNULL_PORT" null size="$SIZE_BYTES" 2>"$WORK/nbdkit-null.log" &
NNPID=$!; PIDS+=("$NNPID")
wait_port "$NBDNULL_PORT" "$NNPID"
fi

# --- runs ----------------------------------------------------------------------
COMMON=(--runtime="$RUNTIME" --time_based --ramp_time="$RAMP" --output-format=json)

# CPU seconds of every process now (to find other work that ran alongside).
snapshot() { python3 -c "
import json,os
out={}
for p in os.listdir('/proc'):
    if not p.isdigit(): continue
    try:
        s=open(f'/proc/{p}/stat').read()
        comm=s[s.index('(')+1:s.rindex(')')]
        f=s.rsplit(')',1)[1].split()
        kernel=open(f'/proc/{p}/cmdline','rb').read()==b''
        out[p]=[('[%s]' % comm) if kernel else comm,(int(f[11])+int(f[12]))/os.sysconf('SC_CLK_TCK')]
    except Exception: pass
json.dump(out,open('$1','w'))"; }
# CPU seconds of the serving side: the sum over PIDS (comma-separated), or
# 0 for -.
server_cpu() { # PIDS
    local p t=0
    [ "$1" = - ] && { echo 0; return; }
    for p in ${1//,/ }; do t=$(python3 -c "print($t + $(cpu_secs "$p"))"); done
    echo "$t"
}
# measure NAME SERVER_PIDS -- COMMAND...: runs COMMAND with its JSON on
# $WORK/NAME.json and the serving side's CPU seconds (SERVER_PIDS: one pid,
# several joined by commas, or -) on $WORK/NAME.cpu.
# The file leaves the page cache before every run: nbdkit file reads
# through it (cache=none only evicts what it touched afterwards), while
# rdmablk-target and local fio use O_DIRECT; a file left cached by its
# creation or by an earlier run would measure memory for one system and the
# disk for another. Without a writable drop_caches (a container) the runs
# say so once.
DROP_CACHES_OK=1
drop_page_cache() {
    sync
    if ! (echo 3 >/proc/sys/vm/drop_caches) 2>/dev/null; then
        [ "$DROP_CACHES_OK" = 1 ] && log "warning: cannot drop the page cache (/proc/sys/vm/drop_caches not writable): nbdkit rows may read from memory"
        DROP_CACHES_OK=0
    fi
}
# Bytes read and written on the file's disk since boot ("- -" when the file
# is not on a block device).
disk_bytes() {
    if [ -n "$DISK_STAT" ]; then awk '{ printf "%.0f %.0f\n", $3 * 512, $7 * 512 }' "$DISK_STAT"; else echo "- -"; fi
}
measure() {
    local name=$1 spid=$2; shift 3
    local c0 c1 d0 d1
    drop_page_cache
    snapshot "$WORK/$name.procs0"
    c0=$(server_cpu "$spid")
    d0=$(disk_bytes)
    "$@" >"$WORK/$name.json" 2>"$WORK/$name.err" || { echo "compare.sh: $name failed:" >&2; cat "$WORK/$name.err" >&2; }
    d1=$(disk_bytes)
    c1=$(server_cpu "$spid")
    snapshot "$WORK/$name.procs1"
    python3 -c "print($c1 - $c0)" >"$WORK/$name.cpu"
    echo "$d0 $d1" >"$WORK/$name.disk"
    echo "$*" >"$WORK/$name.cmd"
}

snapshot "$WORK/procs0.json"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
if python3 -c "import sys; sys.exit(0 if float('${LOAD_BEFORE%% *}') > 0.5 else 1)"; then
    log "warning: load average is ${LOAD_BEFORE} before the runs; other work on this machine skews the numbers"
fi
# The two NBD rows of a case (uses rep, name, job): nbdkit file, then
# rdmablk nbd in front of the target.
nbd_rows() {
    log "[$rep/$REPEAT] $name: fio nbd -> nbdkit file"
    measure "$name.nbd.$rep" "$NPID" -- fio "${job[@]}" --ioengine=nbd --uri="nbd://127.0.0.1:$NBD_PORT" \
        --lat_percentiles=1 "${COMMON[@]}"
    log "[$rep/$REPEAT] $name: fio nbd -> rdmablk nbd -> rdmablk-target (file)"
    measure "$name.rdmablk-nbd.$rep" "$RNPID,$TPID" -- fio "${job[@]}" --ioengine=nbd \
        --uri="nbd://127.0.0.1:$RNBD_PORT/vol0" --lat_percentiles=1 "${COMMON[@]}"
}
for rep in $(seq 1 "$REPEAT"); do
for c in "${CASES[@]}"; do
    read -r name rw bs qd <<<"$c"
    job=(--name="$name" --rw="$rw" --bs="$bs" --iodepth="$qd")
    if [ "$ONLY_NBD" = 1 ]; then
        nbd_rows
        continue
    fi
    log "[$rep/$REPEAT] $name: fio io_uring on the local file"
    measure "$name.local.$rep" - -- fio "${job[@]}" --filename="$FILE" --size="$SIZE_BYTES" --direct=1 \
        --ioengine=io_uring --lat_percentiles=1 "${COMMON[@]}"
    log "[$rep/$REPEAT] $name: rdmablk-bench -> rdmablk-target (file)"
    measure "$name.rdmablk.$rep" "$TPID" -- "$BENCH" "${job[@]}" --target="tcp://127.0.0.1:$RDMA_PORT" --volume=vol0 \
        --target_pid="$TPID" "${COMMON[@]}"
    log "[$rep/$REPEAT] $name: rdmablk-bench --hipri -> rdmablk-target busy_poll (file)"
    measure "$name.rdmablk-polled.$rep" "$PPID_POLLED" -- "${PIN_BENCH[@]}" "$BENCH" "${job[@]}" --hipri \
        --target="tcp://127.0.0.1:$POLL_PORT" --volume=vol0 --target_pid="$PPID_POLLED" "${COMMON[@]}"
    if [ "$rw" = randread ]; then
        log "[$rep/$REPEAT] $name: tcp-ceiling --file (disk over TCP, no protocol)"
        measure "$name.bound.$rep" - -- tcp_ceiling "$CEIL" "" "" --bs "$bs" --qd "$qd" --file "$FILE" \
            --runtime "$RUNTIME" --ramp "$RAMP"
        log "[$rep/$REPEAT] $name: tcp-ceiling --file --busy (disk over TCP, no protocol, polled)"
        measure "$name.bound-polled.$rep" - -- tcp_ceiling "$CEIL" "$PLACE_SERVER_CPU" "$PLACE_CLIENT_CPUS" --busy \
            --bs "$bs" --qd "$qd" --file "$FILE" --runtime "$RUNTIME" --ramp "$RAMP"
    fi
    nbd_rows
    log "[$rep/$REPEAT] $name: rdmablk-bench -> rdmablk-target (null)"
    measure "$name.rdmablk-null.$rep" "$TPID" -- "$BENCH" "${job[@]}" --target="tcp://127.0.0.1:$RDMA_PORT" \
        --volume=null0 --target_pid="$TPID" "${COMMON[@]}"
    if [ "$qd" = 1 ]; then
        log "[$rep/$REPEAT] $name: rdmablk-bench --hipri -> rdmablk-target busy_poll (null)"
        measure "$name.rdmablk-polled-null.$rep" "$PPID_POLLED" -- "${PIN_BENCH[@]}" "$BENCH" "${job[@]}" --hipri \
            --target="tcp://127.0.0.1:$POLL_PORT" --volume=null0 --target_pid="$PPID_POLLED" "${COMMON[@]}"
        log "[$rep/$REPEAT] $name: tcp-ceiling (loopback TCP, no disk, no protocol)"
        measure "$name.bound-null.$rep" - -- tcp_ceiling "$CEIL" "" "" --bs "$bs" --qd "$qd" \
            --runtime "$RUNTIME" --ramp "$RAMP"
    fi
    log "[$rep/$REPEAT] $name: fio nbd -> nbdkit null"
    measure "$name.nbd-null.$rep" "$NNPID" -- fio "${job[@]}" --ioengine=nbd --uri="nbd://127.0.0.1:$NBDNULL_PORT" \
        --lat_percentiles=1 "${COMMON[@]}"
done
if [ "$ONLY_NBD" = 0 ] && [[ " $CASE_NAMES " == *" read-128k-qd16 "* ]]; then
    IPERF_PORT=$(free_port)
    log "[$rep/$REPEAT] iperf3: one loopback stream"
    iperf3 -s -1 -B 127.0.0.1 -p "$IPERF_PORT" >/dev/null 2>&1 &
    IPID=$!; PIDS+=("$IPID")
    sleep 0.5
    iperf3 -c 127.0.0.1 -p "$IPERF_PORT" -t "$RUNTIME" -O "$RAMP" -J >"$WORK/iperf3.$rep.json" 2>"$WORK/iperf3.$rep.err" || true
    wait "$IPID" 2>/dev/null || true
fi
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
snapshot "$WORK/procs1.json"

# --- table ---------------------------------------------------------------------
OURS="$TPID $PPID_POLLED $NPID $NNPID $RNPID $$ $BASHPID" PLACEMENT="$PLACEMENT" PEER_CACHE="$PEER_CACHE" HALT_POLL="$HALT_POLL" CASE_NAMES="$CASE_NAMES" REPEAT="$REPEAT" WORK="$WORK" JSON_OUT="$JSON_OUT" RESULTS_OUT="$RESULTS_OUT" TREE="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" LOAD_BEFORE="$LOAD_BEFORE" LOAD_AFTER="$LOAD_AFTER" \
RUNTIME="$RUNTIME" RAMP="$RAMP" SIZE_BYTES="$SIZE_BYTES" ONLY_NBD="$ONLY_NBD" python3 - <<'PY'
import datetime, functools, json, os, sys

work = os.environ["WORK"]
cases = os.environ["CASE_NAMES"].split()

REPEAT = int(os.environ.get("REPEAT", "1"))
ONLY_NBD = os.environ.get("ONLY_NBD") == "1"
WALL = int(os.environ["RUNTIME"]) + int(os.environ["RAMP"])

# Each run's files are read once: the medians and the per-repeat pairs share them.
@functools.lru_cache(maxsize=None)
def load1(name):
    try:
        with open(f"{work}/{name}.json") as f:
            text = f.read()
        # fio may print notes before the JSON document.
        doc = json.loads(text[text.index("{"):])
        with open(f"{work}/{name}.cpu") as f:
            cpu = float(f.read().strip() or 0)
        with open(f"{work}/{name}.cmd") as f:
            cmd = f.read().strip()
    except Exception:  # noqa: BLE001 - a failed run is a row of dashes
        return None
    # Bytes the file's disk read and wrote while the command ran.
    disk_read = disk_written = None
    try:
        r0, w0, r1, w1 = open(f"{work}/{name}.disk").read().split()
        disk_read, disk_written = int(r1) - int(r0), int(w1) - int(w0)
    except Exception:  # noqa: BLE001 - not on a block device: no column
        pass
    foreign = None
    try:
        p0 = json.load(open(f"{work}/{name}.procs0")); p1 = json.load(open(f"{work}/{name}.procs1"))
        ours = set(os.environ.get("OURS", "").split())
        foreign = sum(max(0.0, t1 - p0.get(pid, [None, 0.0])[1]) for pid, (comm, t1) in p1.items()
                      if pid not in ours and not comm.startswith("["))
    except Exception:  # noqa: BLE001
        pass
    if "jobs" not in doc:
        # tcp-ceiling: its own report, with CPU per operation of each side.
        iops = doc["iops"]
        return {
            "iops": iops,
            "bw_mib": doc["mib_s"],
            "p50_us": doc["p50_us"],
            "p99_us": doc["p99_us"],
            "client_cpu_pct": doc["client"]["cpu_us_per_op"] * iops / 1e4,
            "server_cpu_pct": doc["server"]["cpu_us_per_op"] * iops / 1e4,
            "iops_per_server_cpu_s": 1e6 / doc["server"]["cpu_us_per_op"] if doc["server"]["cpu_us_per_op"] else None,
            "foreign_cpu_s": foreign,
            "disk_share": disk_share(disk_read, doc["mib_s"]),
            "cmd": cmd,
        }
    j = doc["jobs"][0]
    d = j["write"] if j["write"]["total_ios"] > j["read"]["total_ios"] else j["read"]
    lat = d["lat_ns"] if "percentile" in d.get("lat_ns", {}) else d["clat_ns"]
    pct = lat.get("percentile", {})
    def p(key):
        v = pct.get(key)
        return v / 1000.0 if v is not None else None
    return {
        "iops": d["iops"],
        "bw_mib": d["bw_bytes"] / 1048576.0,
        "p50_us": p("50.000000"),
        "p99_us": p("99.000000"),
        "client_cpu_pct": j["usr_cpu"] + j["sys_cpu"],
        # CPU time of the serving process over the whole command (ramp and
        # connection set-up included), as a share of one CPU.
        "server_cpu_pct": 100.0 * cpu / WALL,
        # IOPS divided by the CPUs the server kept busy: I/Os per CPU-second.
        "iops_per_server_cpu_s": (d["iops"] * WALL / cpu) if cpu > 0 else None,
        "foreign_cpu_s": foreign,
        "disk_share": disk_share(disk_written if d is j["write"] else disk_read, d["bw_bytes"] / 1048576.0),
        "cmd": cmd,
    }

# What the disk moved over what the row served, both over ramp + runtime:
# about 1 for a row served from the disk, well below 1 for one served
# (partly) from the page cache, a little above 1 with readahead.
def disk_share(disk_bytes, served_mib_s):
    if disk_bytes is None or not served_mib_s:
        return None
    return disk_bytes / (served_mib_s * 1048576.0 * WALL)

# Below this disk / served a file row was served partly from memory.
MIN_DISK_SHARE = 0.9

# A run during which other processes used this much CPU is left out of
# the medians when clean runs of the same row exist.
FOREIGN_LIMIT = 1.0

def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

def load(name):
    runs = [r for r in (load1(f"{name}.{i}") for i in range(1, REPEAT + 1)) if r]
    if not runs:
        return None
    clean = [r for r in runs if (r["foreign_cpu_s"] or 0.0) < FOREIGN_LIMIT]
    dirty = len(runs) - len(clean)
    if clean:
        runs = clean
    out = {k: median([r[k] for r in runs]) for k in runs[0] if k != "cmd"}
    out["cmd"] = runs[0]["cmd"]
    out["runs"] = len(runs)
    out["runs_with_other_load"] = dirty
    out["other_load_in_median"] = not clean
    out["iops_min"] = min(r["iops"] for r in runs)
    out["iops_max"] = max(r["iops"] for r in runs)
    return out

iperf_runs = []
for i in range(1, REPEAT + 1):
    try:
        with open(f"{work}/iperf3.{i}.json") as f:
            iperf_runs.append(json.load(f)["end"]["sum_received"]["bits_per_second"] / 8.0)
    except Exception:  # noqa: BLE001
        pass
iperf = median(iperf_runs)

BOUND = "tcp-ceiling --file: disk over TCP, no protocol (bound)"
BOUND_POLLED = "tcp-ceiling --file --busy: the same, polled and placed (bound)"
BOUND_NULL = "tcp-ceiling: loopback TCP, no disk, no protocol (null bound)"

rows = []
def row(case, system, r, ceiling, peer, metric):
    def ratio(a, b):
        if a is None or b is None:
            return None
        va, vb = a[metric], b[metric] if isinstance(b, dict) else b
        return va / vb if vb else None
    rows.append({
        "case": case, "system": system, **(r or {}),
        "vs_ceiling": ratio(r, ceiling) if r else None,
        "vs_peer": ratio(r, peer) if r else None,
        "ratio_metric": metric,
    })

RDMABLK_NBD = "fio nbd -> rdmablk nbd -> rdmablk-target, file"
for c in cases:
    local, rb, nbd = load(f"{c}.local"), load(f"{c}.rdmablk"), load(f"{c}.nbd")
    rnbd = load(f"{c}.rdmablk-nbd")
    if not ONLY_NBD:
        row(c, "fio io_uring, local file (ceiling)", local, None, None, "iops")
        row(c, "rdmablk-bench -> rdmablk-target, file", rb, local, nbd, "iops")
        polled = load(f"{c}.rdmablk-polled")
        if polled:
            row(c, "rdmablk-bench --hipri -> rdmablk-target busy_poll, file", polled, local, nbd, "iops")
    row(c, "fio nbd -> nbdkit file", nbd, local, rnbd if ONLY_NBD else rb, "iops")
    row(c, RDMABLK_NBD, rnbd, local, nbd, "iops")
    for kind, system in (("bound", BOUND), ("bound-polled", BOUND_POLLED)):
        bound = load(f"{c}.{kind}")
        if bound:
            row(c, system, bound, local, None, "iops")
for c in ([] if ONLY_NBD else cases):
    rbn, nbdn = load(f"{c}.rdmablk-null"), load(f"{c}.nbd-null")
    metric = "bw_mib" if c.startswith("read-128k") else "iops"
    ceil = {"bw_mib": iperf / 1048576.0} if (iperf and metric == "bw_mib") else None
    row(c, "rdmablk-bench -> rdmablk-target, null", rbn, ceil, nbdn, metric)
    polled = load(f"{c}.rdmablk-polled-null")
    if polled:
        row(c, "rdmablk-bench --hipri -> rdmablk-target busy_poll, null", polled, ceil, nbdn, metric)
    row(c, "fio nbd -> nbdkit null", nbdn, ceil, rbn, metric)
    bnull = load(f"{c}.bound-null")
    if bnull:
        row(c, BOUND_NULL, bnull, ceil, None, metric)

# Long-lived processes other than our servers that used CPU during the runs.
others = []
try:
    p0 = json.load(open(f"{work}/procs0.json")); p1 = json.load(open(f"{work}/procs1.json"))
    ours = set(os.environ.get("OURS", "").split())
    for pid, (comm, t1) in p1.items():
        if pid in ours or pid not in p0:
            continue
        d = t1 - p0[pid][1]
        if d >= 0.5:
            others.append((d, comm, pid))
    others.sort(reverse=True)
except Exception:  # noqa: BLE001
    pass

def f(v, fmt):
    return "-" if v is None else format(v, fmt)

print()
print(f"Runtime {os.environ['RUNTIME']} s per run after {os.environ['RAMP']} s ramp, {REPEAT} run(s) per row "
      f"(medians{', IOPS range in brackets' if REPEAT > 1 else ''}); file {int(os.environ['SIZE_BYTES'])>>20} MiB; "
      f"load average before {os.environ['LOAD_BEFORE']}, after {os.environ['LOAD_AFTER']}; "
      f"{os.environ['PLACEMENT']}; {os.environ['HALT_POLL']}; page cache dropped before each run; "
      f"{os.environ['PEER_CACHE']}.")
if others:
    print("Other long-lived processes that used CPU during the runs (CPU-seconds): " +
          ", ".join(f"{c} (pid {p}) {d:.1f}" for d, c, p in others[:6]) + ".")
else:
    print("No other long-lived process used more than 0.5 CPU-seconds during the runs.")
print()
print("| case | system | IOPS | MiB/s | p50 µs | p99 µs | vs ceiling | vs peer | client CPU % | server CPU % | IOPS per server CPU-s | disk / served |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
def file_row(r):
    return "null" not in r["system"]
for r in rows:
    iops = f(r.get('iops'), ',.0f')
    if REPEAT > 1 and r.get('iops') is not None:
        iops += f" [{r['iops_min']:,.0f}–{r['iops_max']:,.0f}]"
    local = 'local' in r['system']
    print(f"| {r['case']} | {r['system']} | {iops} | {f(r.get('bw_mib'), ',.1f')} | "
          f"{f(r.get('p50_us'), '.1f')} | {f(r.get('p99_us'), '.1f')} | {f(r['vs_ceiling'], '.2f')} | "
          f"{f(r['vs_peer'], '.2f')} | {f(r.get('client_cpu_pct'), '.0f')} | "
          f"{'-' if local else f(r.get('server_cpu_pct'), '.0f')} | "
          f"{'-' if local else f(r.get('iops_per_server_cpu_s'), ',.0f')} | "
          f"{f(r.get('disk_share'), '.2f') if file_row(r) else '-'} |")
if iperf:
    rng = f" [{min(iperf_runs)/1048576:,.0f}–{max(iperf_runs)/1048576:,.0f}]" if REPEAT > 1 else ""
    print(f"| fabric ceiling | iperf3, one loopback TCP stream | - | {iperf/1048576.0:,.1f}{rng} | - | - | - | - | - | - | - | - |")
print()
# A file row that moved much less on the disk than it served was measured
# (partly) out of memory, against rows that read the disk.
from_memory = [r for r in rows if file_row(r) and r.get("disk_share") is not None and r["disk_share"] < MIN_DISK_SHARE]
if from_memory:
    print("Warning: these file rows moved less than " f"{MIN_DISK_SHARE:.0%} of what they served on the disk, so they were "
          "measured partly out of the page cache: " + "; ".join(f"{r['case']} / {r['system']} ({r['disk_share']:.2f})" for r in from_memory) + ".")
    print()
flagged = [r for r in rows if r.get("runs_with_other_load")]
if len(flagged) > 4:
    print(f"{len(flagged)} of {len(rows)} rows had runs during which other processes used >= 1 CPU-second "
          f"({sum(1 for r in flagged if r['other_load_in_median'])} of them in every run): the machine was not quiet.")
    print()
elif flagged:
    print("Runs during which other processes used >= 1 CPU-second: " +
          "; ".join(f"{r['case']} / {r['system']}: {r['runs_with_other_load']} of {r['runs'] + (0 if r['other_load_in_median'] else r['runs_with_other_load'])}"
                    + (" (all runs affected; median includes them)" if r["other_load_in_median"] else " (left out of the median)")
                    for r in flagged))
    print()
print("disk / served = bytes the file's disk read (written, on write rows) over bytes the row served, over ramp + "
      "runtime: about 1 from the disk, above 1 with readahead, below 1 from the page cache.")
print()
print("client CPU % = the client's job (fio or rdmablk-bench) in usr+sys, of one CPU; server CPU % = the whole "
      "serving side (rdmablk-target or nbdkit, all threads; on the rdmablk nbd rows rdmablk nbd and rdmablk-target "
      "together), of one CPU, over ramp + runtime; IOPS per server CPU-s = IOPS / (server CPU % / 100).")
print()
print("Ratios: vs ceiling = this row / local fio (file rows) or / iperf3 (null 128k, bandwidth); "
      "vs peer = rdmablk / nbdkit (rdmablk-bench and rdmablk nbd rows) and nbdkit / rdmablk-bench on nbdkit rows "
      "(nbdkit / rdmablk nbd with --only nbd). "
      "Null rows compare bandwidth for 128k, IOPS otherwise.")
if any(r["system"] in (BOUND, BOUND_POLLED) for r in rows):
    print()
    print("Bound rows: tcp-ceiling --file, a server with no protocol that reads each request's block from the same "
          "file (the target's io_uring engine, O_DIRECT) and answers over loopback TCP; its client and server CPU are "
          "its own threads'. Their vs ceiling bounds what a block protocol over loopback TCP could reach in this run.")
if any(r["system"] == BOUND_NULL for r in rows):
    print()
    print("Null bound row: tcp-ceiling without --file, two processes exchanging a 64-byte request and a 4 KiB answer "
          "over loopback TCP, each blocking in read: the floor under the null rows, so that what each stack adds "
          "over it can be read off the table.")

def get(case, system_prefix):
    for r in rows:
        if r["case"] == case and r["system"].startswith(system_prefix):
            return r
    return {}

# Appended to a target's detail when its peer row read (partly) from memory.
def peer_note(r):
    share = r.get("disk_share")
    return f" (nbdkit's row partly from memory: disk / served {share:.2f})" if share is not None and share < MIN_DISK_SHARE else ""

targets = []
def target(name, ok, detail, paired=None, bound=None):
    t = {"target": name, "met": ok, "detail": detail + (f"; per run: {paired['summary']}" if paired else "")}
    if paired:
        t["per_run"] = paired
    if bound:
        t["bound"] = bound
        t["detail"] += f"; bound (no protocol): {bound['summary']}"
    targets.append(t)

# The host's speed drifts over minutes, so with --repeat each rdmablk run is
# also set against the fio run of the same repeat (they ran back to back).
# The verdict stays on the medians; this shows how often single pairs pass.
def paired(case, name, metric, passes, fmt, always=False, base="local"):
    if REPEAT < 2 and not always:
        return None
    vals = []
    for i in range(1, REPEAT + 1):
        a, b = load1(f"{case}.{name}.{i}"), load1(f"{case}.{base}.{i}")
        if not (a and b) or max(a["foreign_cpu_s"] or 0.0, b["foreign_cpu_s"] or 0.0) >= FOREIGN_LIMIT:
            continue
        if a.get(metric) is not None and b.get(metric):
            vals.append(a[metric] / b[metric] if metric == "iops" else a[metric] - b[metric])
    if not vals:
        return None
    ok = sum(1 for v in vals if passes(v))
    mid = median(vals)
    summary = (f"median {format(mid, fmt)}, range {format(min(vals), fmt)} to {format(max(vals), fmt)}, "
               f"{ok} of {len(vals)} pairs pass") if len(vals) > 1 else f"{format(mid, fmt)}, {'passes' if ok else 'misses'}"
    return {"values": vals, "median": mid, "pairs_passing": ok, "summary": summary}

# The bound under a target: the no-protocol server against the fio run of
# the same repeat, judged by the target's own rule. Where it misses, no
# block protocol over loopback TCP could have met the target in that run.
def bound(case, kind, metric, passes, fmt):
    return paired(case, kind, metric, passes, fmt, always=True)

a = get("randread-4k-qd32", "rdmablk-bench -> rdmablk-target, file"); b = get("randread-4k-qd32", "fio io_uring")
if a.get("iops") and b.get("iops"):
    target("1. file randread 4k QD32 >= 0.9x local fio IOPS", a["iops"] >= 0.9 * b["iops"], f"{a['iops']:,.0f} vs {b['iops']:,.0f} ({a['iops']/b['iops']:.2f}x)",
           paired("randread-4k-qd32", "rdmablk", "iops", lambda v: v >= 0.9, ".2f"),
           bound("randread-4k-qd32", "bound", "iops", lambda v: v >= 0.9, ".2f"))
a = get("randread-4k-qd32", "rdmablk-bench --hipri -> rdmablk-target busy_poll, file")
if a.get("iops") and b.get("iops"):
    target("1'. the same, polling (--hipri, busy_poll = 1ms)", a["iops"] >= 0.9 * b["iops"], f"{a['iops']:,.0f} vs {b['iops']:,.0f} ({a['iops']/b['iops']:.2f}x)",
           paired("randread-4k-qd32", "rdmablk-polled", "iops", lambda v: v >= 0.9, ".2f"),
           bound("randread-4k-qd32", "bound-polled", "iops", lambda v: v >= 0.9, ".2f"))
a = get("randread-4k-qd1", "rdmablk-bench -> rdmablk-target, file"); b = get("randread-4k-qd1", "fio io_uring")
if a.get("p50_us") and b.get("p50_us"):
    target("2. file randread 4k QD1 p50 <= local p50 + 15 us", a["p50_us"] <= b["p50_us"] + 15, f"{a['p50_us']:.1f} us vs {b['p50_us']:.1f} us ({a['p50_us']-b['p50_us']:+.1f} us)",
           paired("randread-4k-qd1", "rdmablk", "p50_us", lambda v: v <= 15, "+.1f"),
           bound("randread-4k-qd1", "bound", "p50_us", lambda v: v <= 15, "+.1f"))
a = get("randread-4k-qd1", "rdmablk-bench --hipri -> rdmablk-target busy_poll, file")
if a.get("p50_us") and b.get("p50_us"):
    target("2'. the same, polling (--hipri, busy_poll = 1ms)", a["p50_us"] <= b["p50_us"] + 15, f"{a['p50_us']:.1f} us vs {b['p50_us']:.1f} us ({a['p50_us']-b['p50_us']:+.1f} us)",
           paired("randread-4k-qd1", "rdmablk-polled", "p50_us", lambda v: v <= 15, "+.1f"),
           bound("randread-4k-qd1", "bound-polled", "p50_us", lambda v: v <= 15, "+.1f"))
a = get("randread-4k-qd32", "rdmablk-bench -> rdmablk-target, null"); b = get("randread-4k-qd32", "fio nbd -> nbdkit null")
if a.get("iops") and b.get("iops"):
    target("3. null randread 4k QD32 >= 2.5x nbdkit null", a["iops"] >= 2.5 * b["iops"], f"{a['iops']:,.0f} vs {b['iops']:,.0f} ({a['iops']/b['iops']:.2f}x)")
a = get("read-128k-qd16", "rdmablk-bench -> rdmablk-target, null")
if a.get("bw_mib") and iperf:
    ib = iperf / 1048576.0
    target("4. null read 128k QD16 >= 0.6x iperf3 stream", a["bw_mib"] >= 0.6 * ib, f"{a['bw_mib']:,.0f} MiB/s vs {ib:,.0f} MiB/s ({a['bw_mib']/ib:.2f}x)")
# 5: the NBD server against nbdkit on the same file, both behind fio's nbd
# engine over loopback TCP; IOPS at QD32, reads and writes, each not below.
nbd_parts, nbd_oks, nbd_pairs = [], [], {}
for case in ("randread-4k-qd32", "randwrite-4k-qd32"):
    a, b = get(case, RDMABLK_NBD), get(case, "fio nbd -> nbdkit file")
    if a.get("iops") and b.get("iops"):
        nbd_oks.append(a["iops"] >= b["iops"])
        part = f"{case}: {a['iops']:,.0f} vs {b['iops']:,.0f} ({a['iops']/b['iops']:.2f}x){peer_note(b)}"
        pr = paired(case, "rdmablk-nbd", "iops", lambda v: v >= 1.0, ".2f", base="nbd")
        if pr:
            nbd_pairs[case] = pr
            part += f", per run: {pr['summary']}"
        nbd_parts.append(part)
if nbd_oks:
    t = {"target": "5. rdmablk nbd at QD32 is not slower than nbdkit file (4k randread and randwrite, IOPS)",
         "met": all(nbd_oks), "detail": "; ".join(nbd_parts)}
    if nbd_pairs:
        t["per_run"] = nbd_pairs
    targets.append(t)
# 6-8: the sleeping (default) configurations against nbdkit, where a user
# first looks: low-depth latency and sequential reads.
a, b, c = get("randread-4k-qd1", "rdmablk-bench -> rdmablk-target, file"), get("randread-4k-qd1", "fio nbd -> nbdkit file"), get("randread-4k-qd1", BOUND)
if a.get("p50_us") and b.get("p50_us") and a.get("iops") and b.get("iops"):
    ok = a["p50_us"] <= b["p50_us"] and a["iops"] >= b["iops"]
    detail = f"p50 {a['p50_us']:.1f} us vs {b['p50_us']:.1f} us, IOPS {a['iops']/b['iops']:.2f}x{peer_note(b)}"
    if c.get("p50_us"):
        ok = ok and a["p50_us"] <= c["p50_us"] + 10
        detail += f"; sleeping bound p50 {c['p50_us']:.1f} us ({a['p50_us']-c['p50_us']:+.1f} us, within 10 us: {'yes' if a['p50_us'] <= c['p50_us'] + 10 else 'no'})"
        # The bound runs in every repeat too: the clause pair by pair.
        over_bound = paired("randread-4k-qd1", "rdmablk", "p50_us", lambda v: v <= 10, "+.1f", always=True, base="bound")
        if over_bound:
            detail += f"; rdmablk over the bound per run: {over_bound['summary']}"
    target("6. file randread 4k QD1 p50 <= nbdkit file, IOPS >= 1.0x, p50 within 10 us of the sleeping bound", ok, detail,
           paired("randread-4k-qd1", "rdmablk", "p50_us", lambda v: v <= 0, "+.1f", base="nbd"))
a, b = get("randread-4k-qd1", "rdmablk-bench -> rdmablk-target, null"), get("randread-4k-qd1", "fio nbd -> nbdkit null")
if a.get("p50_us") and b.get("p50_us"):
    c = get("randread-4k-qd1", BOUND_NULL)
    over = f"; null bound p50 {c['p50_us']:.1f} us (rdmablk {a['p50_us']-c['p50_us']:+.1f}, nbdkit {b['p50_us']-c['p50_us']:+.1f})" if c.get("p50_us") else ""
    target("7. null randread 4k QD1 p50 <= nbdkit null", a["p50_us"] <= b["p50_us"], f"{a['p50_us']:.1f} us vs {b['p50_us']:.1f} us{over}",
           paired("randread-4k-qd1", "rdmablk-null", "p50_us", lambda v: v <= 0, "+.1f", base="nbd-null"))
a, b = get("read-128k-qd16", "rdmablk-bench -> rdmablk-target, file"), get("read-128k-qd16", "fio nbd -> nbdkit file")
if a.get("bw_mib") and b.get("bw_mib"):
    target("8. file read 128k QD16 >= 1.0x nbdkit file", a["bw_mib"] >= b["bw_mib"], f"{a['bw_mib']:,.0f} MiB/s vs {b['bw_mib']:,.0f} MiB/s ({a['bw_mib']/b['bw_mib']:.2f}x){peer_note(b)}",
           paired("read-128k-qd16", "rdmablk", "iops", lambda v: v >= 1.0, ".2f", base="nbd"))
print()
print("| target | met | measured |")
print("|---|---|---|")
for t in targets:
    print(f"| {t['target']} | {'PASS' if t['met'] else 'MISS'} | {t['detail']} |")

if os.environ.get("JSON_OUT"):
    with open(os.environ["JSON_OUT"], "w") as fh:
        json.dump({"rows": rows, "iperf3_bytes_per_sec": iperf, "targets": targets,
                   "load_before": os.environ["LOAD_BEFORE"], "load_after": os.environ["LOAD_AFTER"],
                   "other_cpu": [{"comm": c, "pid": p, "cpu_s": d} for d, c, p in others],
                   "repeat": REPEAT, "placement": os.environ["PLACEMENT"], "peer_page_cache": os.environ["PEER_CACHE"], "guest_halt_poll": os.environ["HALT_POLL"], "iperf3_runs_bytes_per_sec": iperf_runs,
                   "runtime_s": int(os.environ["RUNTIME"]), "ramp_s": int(os.environ["RAMP"])}, fh, indent=2)
    print(f"\nrows written to {os.environ['JSON_OUT']}")

# The rows as a table for rdmablk-plot compare (bench/src/plot.rs reads it):
# comment lines, the first naming the run, then a tab-separated header and
# a line per row, - where a value is missing. Notes go to stderr: stdout
# stays the markdown above.
def cell(v, fmt):
    return "-" if v is None else format(v, fmt)
with open(os.environ["RESULTS_OUT"], "w") as fh:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fh.write(f"# compare.sh, {when}, tree {os.environ['TREE']}: {REPEAT} run(s) of {os.environ['RUNTIME']} s per row "
             f"after {os.environ['RAMP']} s ramp, medians{' (--only nbd)' if ONLY_NBD else ''}\n")
    if iperf:
        fh.write(f"# fabric ceiling: iperf3, one loopback TCP stream: {iperf / 1048576.0:.1f} MiB/s\n")
    fh.write("case\tsystem\tratio_metric\tiops\tbw_mib\tp50_us\tp99_us\tvs_ceiling\tvs_peer\n")
    for r in rows:
        fh.write("\t".join([r["case"], r["system"], r["ratio_metric"], cell(r.get("iops"), ".2f"), cell(r.get("bw_mib"), ".2f"),
                            cell(r.get("p50_us"), ".2f"), cell(r.get("p99_us"), ".2f"), cell(r["vs_ceiling"], ".4f"),
                            cell(r["vs_peer"], ".4f")]) + "\n")
print(f"==> results table written to {os.environ['RESULTS_OUT']}", file=sys.stderr)
PY
if [ -z "$PLOT" ]; then
    log "warning: no chart: $BIN_DIR/rdmablk-plot missing (cargo build --release -p rdmablk-bench builds it)"
elif "$PLOT" compare "$RESULTS_OUT" -o "$CHART_OUT" 2>"$WORK/plot.err"; then
    log "chart written to $CHART_OUT"
else
    log "warning: no chart: $(cat "$WORK/plot.err")"
fi
