#!/usr/bin/env bash
# bench/vs-rbd.sh: rdmablk over an RBD volume against fio's own rbd engine
# on the same Ceph cluster (issue 54).
#
# fio's rbd engine is librbd in the benchmark's process: the bound for any
# gateway in front of the same image. rdmablk-bench goes one hop further:
# rdmablk v1 over loopback TCP to rdmablk-target, whose volume is the same
# image through librbd (cache off, as fio's client also has it from the
# cluster's ceph.conf). Both run one job (one thread) at the same queue
# depth, against a fully written image (reads of never-written objects
# would not reach an OSD), interleaved: every repeat runs each case on
# both, the order swapped every other repeat. The cluster is the repo's
# dev cluster (scripts/ceph-dev-cluster.sh: one monitor, one memstore OSD),
# started in its own directory for the run and stopped after it; monitor,
# OSD, target and benchmark share the machine's CPUs.
#
# usage: bench/vs-rbd.sh [--runtime SECONDS] [--ramp SECONDS] [--repeat N]
#                        [--size SIZE] [--case NAME]... [--no-build] [--keep]
#                        [--json FILE]
#   --runtime S     seconds per run (default 10), after --ramp S (default 2)
#   --repeat N      runs per case and client (default 3); medians are reported
#   --size SIZE     the image (default 1G), written fully before the runs
#   --case NAME     only this case (repeatable); cases: randread-4k-qd1
#                   randwrite-4k-qd1 randread-4k-qd32 randwrite-4k-qd32
#                   read-128k-qd16 write-128k-qd16
#   --no-build      use target/release as it is (BIN=DIR: binaries elsewhere)
#   --keep          leave the work directory (fio and bench JSON) and the cluster
#   --json FILE     also write the table's rows, and the idle polling in force, as JSON
# Environment: VS_RBD_DIR (work directory, default /var/tmp/rdmablk-vs-rbd),
# CEPH_DEV_MON_PORT (default 13400, so as not to meet the tests' cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

RUNTIME=10
RAMP=2
REPEAT=3
SIZE=1G
BUILD=1
KEEP=0
JSON_OUT=""
ONLY=()
while [ $# -gt 0 ]; do
    case "$1" in
        --runtime) RUNTIME=$2; shift 2 ;;
        --ramp) RAMP=$2; shift 2 ;;
        --repeat) REPEAT=$2; shift 2 ;;
        --size) SIZE=$2; shift 2 ;;
        --case) ONLY+=("$2"); shift 2 ;;
        --no-build) BUILD=0; shift ;;
        --keep) KEEP=1; shift ;;
        --json) JSON_OUT=$(realpath -m "$2"); shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "vs-rbd.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
log() { echo "==> $*" >&2; }

# case name, rw, bs, iodepth
ALL_CASES=(
    "randread-4k-qd1 randread 4k 1"
    "randwrite-4k-qd1 randwrite 4k 1"
    "randread-4k-qd32 randread 4k 32"
    "randwrite-4k-qd32 randwrite 4k 32"
    "read-128k-qd16 read 128k 16"
    "write-128k-qd16 write 128k 16"
)
for o in "${ONLY[@]}"; do
    printf '%s\n' "${ALL_CASES[@]}" | grep -q "^$o " || { echo "vs-rbd.sh: unknown case $o (see --help)" >&2; exit 2; }
done
CASES=()
for c in "${ALL_CASES[@]}"; do
    if [ ${#ONLY[@]} -eq 0 ] || [[ " ${ONLY[*]} " == *" ${c%% *} "* ]]; then CASES+=("$c"); fi
done

install_missing fio:fio python3:python3 /usr/bin/time:time
fio --enghelp 2>/dev/null | grep -qw rbd || { echo "vs-rbd.sh: this fio has no rbd engine (Debian's fio has it)" >&2; exit 1; }
if [ "$BUILD" = 1 ]; then
    log "building the release binaries"
    cargo build --release -q -p rdmablk-bench -p rdmablk-target
fi
BIN_DIR=$(bin_dir rdmablk-bench rdmablk-target)

WORK=${VS_RBD_DIR:-/var/tmp/rdmablk-vs-rbd}
rm -rf "$WORK"
mkdir -p "$WORK"
CEPH_DIR=$WORK/ceph
export CEPH_DEV_MON_PORT=${CEPH_DEV_MON_PORT:-13400}
SIZE_BYTES=$(size_bytes "$SIZE")
TPID=""
cleanup() {
    [ -n "$TPID" ] && stop_in_reverse "$TPID"
    if [ "$KEEP" = 0 ]; then
        scripts/ceph-dev-cluster.sh stop "$CEPH_DIR" >/dev/null 2>&1 || true
        rm -rf "$WORK"
    else
        log "kept $WORK; stop the cluster with: scripts/ceph-dev-cluster.sh stop $CEPH_DIR"
    fi
}
trap cleanup EXIT

log "starting a dev cluster in $CEPH_DIR (mon port $CEPH_DEV_MON_PORT)"
scripts/ceph-dev-cluster.sh start "$CEPH_DIR" >"$WORK/cluster.out" 2>&1 || { cat "$WORK/cluster.out" >&2; exit 1; }
export CEPH_CONF=$CEPH_DIR/ceph.conf
IMAGE=bench
rbd --id rdmablk create --size "${SIZE_BYTES}B" "rbd/$IMAGE"
log "writing the whole image ($SIZE) so that reads reach the OSD"
rbd --id rdmablk bench --io-type write --io-pattern seq --io-size 4M --io-threads 4 --io-total "${SIZE_BYTES}B" \
    "rbd/$IMAGE" >"$WORK/fill.out" 2>&1 || { cat "$WORK/fill.out" >&2; exit 1; }

PORT=$(free_port)
cat >"$WORK/target.toml" <<EOF
[target]
listen = ["tcp://127.0.0.1:$PORT"]

[[volume]]
name = "vol0"
backend = "rbd"
pool = "rbd"
image = "$IMAGE"
ceph_conf = "$CEPH_CONF"
client = "rdmablk"
lock_at_start = true
allow_any_host = true
EOF
# The target holds the image's exclusive lock while it runs (it is the
# image's gateway), and a lock taken explicitly is not handed over on
# request: fio's writes would get EROFS. So the target runs only for
# rdmablk's runs, started before each and stopped (lock released) after.
start_target() {
    "$BIN_DIR/rdmablk-target" --config "$WORK/target.toml" >>"$WORK/target.log" 2>&1 &
    TPID=$!
    wait_port "$PORT" "$TPID"
}
stop_target() {
    stop_in_reverse "$TPID"
    TPID=""
}

COMMON=(--runtime="$RUNTIME" --time_based --ramp_time="$RAMP" --output-format=json)
# One run; NAME.json gets its report, NAME.cpu the target's CPU seconds
# over it (0 for fio, whose librbd is in its own process: see usr/sys_cpu).
run() { # NAME -- COMMAND...
    local name=$1 c0=0 c1=0; shift 2
    [ -n "$TPID" ] && c0=$(cpu_secs "$TPID")
    "$@" >"$WORK/$name.json" 2>"$WORK/$name.err" || { echo "vs-rbd.sh: $name failed:" >&2; cat "$WORK/$name.err" >&2; exit 1; }
    [ -n "$TPID" ] && c1=$(cpu_secs "$TPID")
    echo "$*" >"$WORK/$name.cmd"
    python3 -c "print($c1 - $c0)" >"$WORK/$name.cpu"
}
fio_rbd() { # NAME JOB...
    local name=$1; shift
    log "[$rep/$REPEAT] $name: fio rbd engine (librbd in fio)"
    # fio's own usr/sys_cpu count its job thread only, not librbd's
    # threads: time(1) takes the whole process's CPU.
    run "$name.fio.$rep" -- /usr/bin/time -f "%U %S" -o "$WORK/$name.fio.$rep.time" fio "$@" --ioengine=rbd \
        --clientname=rdmablk --pool=rbd --rbdname="$IMAGE" --lat_percentiles=1 "${COMMON[@]}"
}
rdmablk() { # NAME JOB...
    local name=$1; shift
    log "[$rep/$REPEAT] $name: rdmablk-bench -> rdmablk-target -> librbd"
    start_target
    run "$name.rdmablk.$rep" -- /usr/bin/time -f "%U %S" -o "$WORK/$name.rdmablk.$rep.time" "$BIN_DIR/rdmablk-bench" "$@" \
        --target="tcp://127.0.0.1:$PORT" --volume=vol0 --target_pid="$TPID" "${COMMON[@]}"
    stop_target
}
for rep in $(seq 1 "$REPEAT"); do
    for c in "${CASES[@]}"; do
        read -r name rw bs qd <<<"$c"
        job=(--name="$name" --rw="$rw" --bs="$bs" --iodepth="$qd" --size="$SIZE_BYTES")
        if [ $((rep % 2)) = 1 ]; then
            fio_rbd "$name" "${job[@]}"; rdmablk "$name" "${job[@]}"
        else
            rdmablk "$name" "${job[@]}"; fio_rbd "$name" "${job[@]}"
        fi
    done
done
# wait_port's probes show up as handshakes the peer closed: not a problem.
grep -E " (ERROR|WARN) " "$WORK/target.log" | grep -v "handshake: peer closed" >&2 || true

CASE_NAMES=$(printf '%s\n' "${CASES[@]}" | cut -d' ' -f1 | tr '\n' ' ')
python3 - "$WORK" "$REPEAT" "$RUNTIME" "$RAMP" "$JSON_OUT" "$(idle_polling)" $CASE_NAMES <<'PY'
import json, statistics, sys
work, repeat, runtime, ramp, json_out, idle, cases = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[7:]

def load(name):
    text = open(f"{work}/{name}.json").read()
    doc = json.loads(text[text.index("{"):])
    j = doc["jobs"][0]
    d = j["write"] if j["write"]["total_ios"] > j["read"]["total_ios"] else j["read"]
    lat = d["lat_ns"] if "percentile" in d.get("lat_ns", {}) else d["clat_ns"]
    return {"iops": d["iops"], "mib_s": d["bw_bytes"] / 1048576.0,
            "p50_us": lat["percentile"]["50.000000"] / 1000.0,
            "p99_us": lat["percentile"]["99.000000"] / 1000.0,
            "client_cpu_pct": j["usr_cpu"] + j["sys_cpu"],
            "target_cpu_s": float(open(f"{work}/{name}.cpu").read()),
            # The client's whole process, every thread (time(1)).
            "client_cpu_s": sum(map(float, open(f"{work}/{name}.time").read().split()[-2:]))}

rows = []
print()
print("| case | fio rbd (librbd in fio) IOPS · p50 µs | rdmablk-bench → rdmablk-target IOPS · p50 µs | rdmablk ÷ fio rbd (per repeat) | CPU µs per I/O: fio rbd / bench + target |")
print("|---|---:|---:|---:|---:|")
for case in cases:
    fio = [load(f"{case}.fio.{r}") for r in range(1, repeat + 1)]
    rb = [load(f"{case}.rdmablk.{r}") for r in range(1, repeat + 1)]
    med = lambda runs, k: statistics.median(x[k] for x in runs)
    ratio = med(rb, "iops") / med(fio, "iops")
    per = " ".join(f"{b['iops'] / f['iops']:.2f}" for f, b in zip(fio, rb))
    # The target's CPU over the whole command, ramp included, over the
    # I/Os of ramp and run at the run's rate (set-up cost is not spread).
    per_io = lambda runs, f: statistics.median(f(x) * 1e6 / (x["iops"] * (runtime + ramp)) for x in runs)
    fio_cpu = per_io(fio, lambda x: x["client_cpu_s"])
    bench_cpu, target_cpu = per_io(rb, lambda x: x["client_cpu_s"]), per_io(rb, lambda x: x["target_cpu_s"])
    fmt = lambda runs: f"{med(runs, 'iops'):,.0f} · {med(runs, 'p50_us'):,.0f}"
    print(f"| {case} | {fmt(fio)} | {fmt(rb)} | **{ratio:.2f}** ({per}) | {fio_cpu:,.0f} / {bench_cpu:,.0f} + {target_cpu:,.0f} |")
    rows.append({"case": case, "fio_rbd": fio, "rdmablk": rb, "ratio_median": ratio})
print()
# Every wake-up of a sleeping end is priced by how an idle vCPU waits, and
# the gateway's hop adds wake-ups that fio's in-process librbd does not have.
print(f"medians of {repeat} interleaved runs of {runtime:g} s; within 10%: ratio >= 0.90; {idle}")
if json_out:
    json.dump({"idle_polling": idle, "cases": rows}, open(json_out, "w"), indent=1)
PY
