# The kernel's NVMe/TCP host on rdmablk-target over an RBD volume against
# fio's own rbd engine on the same Ceph cluster (issue 54, item 6): step
# nvme-tcp-vs-fio-rbd of the Soft-RoCE VM. A measurement (it fails only on
# errors), not in the CI stage's default step list: it runs only when
# RDMABLK_CI_STEPS names it, as bench/vs-rbd-vm.sh does. Sourced by
# ci-guest.sh after nvme-of.sh, whose helpers it uses (nvme_connect,
# nvme_dmesg_mark, nvme_dmesg_since, nvme_show_dmesg, busy_ticks,
# proc_ticks), as it does WORK, SIP, BIN and RES of ci-guest.sh.
#
#   - The dev Ceph cluster in the guest (scripts/ceph-dev-cluster.sh in
#     $WORK/ceph, on the scratch ext4; memstore of at most 1 GiB), an image
#     rbd/bench of 256 MiB, written fully first (rbd bench --io-type write
#     --io-pattern seq --io-size 4M) so that reads reach the OSD's objects.
#   - Two systems, each one fio job (one thread) with the same options:
#       fio-rbd  fio's rbd engine: librbd in fio's process, the bound for
#                any gateway in front of the same image;
#       rdmablk  fio (io_uring, direct=1) on /dev/nvmeXnY of the kernel's
#                NVMe/TCP host (nvme-tcp, nvme-cli) connected to
#                rdmablk-target at nvme+tcp://SIP:4433, whose one volume
#                (backend = "rbd", lock_at_start, NSID 1) is the same image
#                as client.rdmablk (rbd_cache off, as fio's client has it).
#   - rdmablk-target holds the image's exclusive lock explicitly while it
#     runs and does not hand it over on request (fio's writes would get
#     EROFS): each rdmablk run starts the target (which must log that it
#     owns the image), connects the host, runs fio, disconnects and stops
#     the target (SIGTERM, exit 0: the lock released). No target runs
#     during fio's rbd runs.
#   - Cases (RDMABLK_RBD_VS_CASES, names; default all six):
#     randread-4k-qd1 randwrite-4k-qd1 randread-4k-qd32 randwrite-4k-qd32
#     read-128k-qd16 write-128k-qd16. Each run: 10 s after a 2 s ramp
#     (RDMABLK_RBD_VS_RUNTIME, RDMABLK_RBD_VS_RAMP), --randrepeat=0.
#     RDMABLK_RBD_VS_ROUNDS rounds (default 2): every round runs each case
#     on both systems back to back, the order swapped in even rounds.
#   - $RES/nvme-tcp-vs-fio-rbd.md: per case, each system's IOPS and mean
#     (total) latency, medians over the rounds, and the IOPS ratio rdmablk
#     / fio-rbd of each round (the two runs of a round are adjacent in
#     time) and their median. A second table: the guest's CPU during each
#     run (all CPUs' busy ticks from /proc/stat over fio's process, as a
#     share of both vCPUs and per I/O) and rdmablk-target's own CPU per
#     I/O: whether a run was CPU-bound, and what the extra hop costs.
#     $RES/nvme-tcp-vs-fio-rbd/ keeps every run's fio JSON and CPU sample.
#   - RDMABLK_RBD_VS_TARGET: the rdmablk-target to run (default
#     $BIN/rdmablk-target; bench/vs-rbd-vm.sh gives a release build).
#
# Under TCG only the ratios within one run mean anything; the absolute
# figures are an emulated machine's.

RBDVS_NQN=nqn.2014-08.io.rdmablk.ci:rbd-vs-fio
RBDVS_PORT=4433
RBDVS_IMAGE=bench
RBDVS_SIZE_MIB=256
RBDVS_ALL_CASES="randread-4k-qd1 randwrite-4k-qd1 randread-4k-qd32 randwrite-4k-qd32 read-128k-qd16 write-128k-qd16"

# The fio job of case NAME: sets RW, BS and QD.
rbdvs_case() { # NAME
    case $1 in
        randread-4k-qd1) RW=randread BS=4k QD=1 ;;
        randwrite-4k-qd1) RW=randwrite BS=4k QD=1 ;;
        randread-4k-qd32) RW=randread BS=4k QD=32 ;;
        randwrite-4k-qd32) RW=randwrite BS=4k QD=32 ;;
        read-128k-qd16) RW=read BS=128k QD=16 ;;
        write-128k-qd16) RW=write BS=128k QD=16 ;;
        *) return 1 ;;
    esac
}

# Starts rdmablk-target on $NVME_DIR/rbd-vs.toml; waits for its NVMe/TCP
# listener and requires that it logged owning the image; sets TPID.
rbdvs_start_target() {
    local log=$NVME_DIR/target.log from up=0
    touch "$log"
    from=$(wc -l <"$log")
    RUST_LOG=info "$RBDVS_TARGET" --config "$NVME_DIR/rbd-vs.toml" 2>>"$log" &
    TPID=$!
    for _ in $(seq 1 300); do
        tail -n +$((from + 1)) "$log" | grep -q "listening on nvme+tcp://$SIP:$RBDVS_PORT" \
            && ss -Hltn "sport = :$RBDVS_PORT" | grep -q . && { up=1; break; }
        kill -0 "$TPID" 2>/dev/null || break
        sleep 0.1
    done
    if [[ $up -ne 1 ]]; then
        tail -n +$((from + 1)) "$log"
        echo "FAIL: rdmablk-target did not start listening on nvme+tcp://$SIP:$RBDVS_PORT"
        return 1
    fi
    if ! tail -n +$((from + 1)) "$log" | grep -q "owns it now"; then
        tail -n +$((from + 1)) "$log"
        echo "FAIL: rdmablk-target (lock_at_start) did not log that it owns rbd/$RBDVS_IMAGE"
        return 1
    fi
}

# SIGTERM; requires exit 0 and no panic (the image's lock is released).
rbdvs_stop_target() {
    local rc=0
    kill -TERM "$TPID"
    wait "$TPID" || rc=$?
    TPID=
    if grep -q 'panicked' "$NVME_DIR/target.log"; then echo "FAIL: rdmablk-target panicked"; return 1; fi
    [[ $rc -eq 0 ]] || { tail -n 20 "$NVME_DIR/target.log"; echo "FAIL: rdmablk-target exited with $rc after SIGTERM"; return 1; }
}

rbdvs_cleanup() {
    local rc=${1:-$?}
    set +e
    nvme disconnect -n "$RBDVS_NQN" >/dev/null 2>&1
    [[ -z ${TPID:-} ]] || { kill "$TPID" 2>/dev/null; wait "$TPID" 2>/dev/null; }
    [[ -z ${CEPH_DIR:-} || ! -d ${CEPH_DIR:-/nonexistent} ]] || bash "$RBDVS_CDC" stop "$CEPH_DIR" 2>&1 | tail -n 2
    echo "--- kernel messages during the step"; nvme_dmesg_since
    if [[ $rc -ne 0 ]]; then
        echo "--- target log (last 60 lines)"; tail -n 60 "$NVME_DIR/target.log" 2>/dev/null
        echo "--- ceph logs (last lines)"; tail -n 15 "$CEPH_DIR"/log/mon.a.log "$CEPH_DIR"/log/osd.0.log 2>/dev/null
    fi
    cp "$NVME_DIR/target.log" "$RES/nvme-tcp-vs-fio-rbd-target.log" 2>/dev/null
}

# One fio run of case NAME on system SYS in round ROUND: the JSON in
# $out/NAME.SYS.ROUND.json; fails on fio's failure or a job error.
rbdvs_run() { # NAME SYS ROUND
    local name=$1 sys=$2 round=$3 base engine=()
    base=$out/$name.$sys.$round
    rbdvs_case "$name"
    if [[ $sys == rdmablk ]]; then
        rbdvs_start_target
        nvme_connect "$RBDVS_NQN" "$RBDVS_PORT" 1 >"$base.connect" \
            || { cat "$base.connect"; echo "FAIL: nvme connect to rdmablk-target"; return 1; }
        local size; size=$(blockdev --getsize64 "$DEV")
        [[ $size -eq $((RBDVS_SIZE_MIB << 20)) ]] \
            || { echo "FAIL: $DEV has $size bytes, the image $((RBDVS_SIZE_MIB << 20))"; return 1; }
        engine=(--filename="$DEV" --ioengine=io_uring --direct=1)
    else
        engine=(--ioengine=rbd --clientname=rdmablk --pool=rbd --rbdname="$RBDVS_IMAGE")
    fi
    local rc=0 b0 b1 w0 w1 p0=0 p1=0
    [[ $sys != rdmablk ]] || p0=$(proc_ticks "$TPID")
    b0=$(busy_ticks); w0=$(date +%s.%N)
    fio --name="$name" "${engine[@]}" --rw="$RW" --bs="$BS" --iodepth="$QD" --size=${RBDVS_SIZE_MIB}M \
        --runtime="$RUNTIME" --ramp_time="$RAMP" --time_based --randrepeat=0 \
        --output-format=json --output="$base.json" 2>"$base.err" || rc=$?
    b1=$(busy_ticks); w1=$(date +%s.%N)
    [[ $sys != rdmablk ]] || p1=$(proc_ticks "$TPID")
    echo "busy $((b1 - b0)) proc $((p1 - p0)) wall $w0 $w1 hz $(getconf CLK_TCK) cpus $(nproc)" >"$base.cpu"
    if [[ $sys == rdmablk ]]; then
        nvme disconnect -n "$RBDVS_NQN" >"$base.disconnect" 2>&1 || rc=1
        grep -q "disconnected 1 controller" "$base.disconnect" || { cat "$base.disconnect"; echo "FAIL: nvme disconnect"; rc=1; }
        rbdvs_stop_target || rc=1
    fi
    if [[ $rc -ne 0 ]]; then
        cat "$base.err" "$base.json" 2>/dev/null
        echo "FAIL: fio $name on $sys (round $round)"
        return 1
    fi
    /usr/bin/python3 - "$base.json" "$name $sys round $round" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
j = json.loads(text[text.index("{"):])["jobs"][0]
d = j["write"] if j["write"]["total_ios"] > j["read"]["total_ios"] else j["read"]
if j.get("error", 0) or d["total_ios"] == 0:
    raise SystemExit(f"FAIL: {sys.argv[2]}: fio error {j.get('error')}, {d['total_ios']} I/Os")
print(f"{sys.argv[2]}: {d['iops']:.0f} IOPS, mean lat {d['lat_ns']['mean'] / 1000:.0f} µs")
PY
}

nvme_tcp_vs_fio_rbd() {
    set -euo pipefail
    NVME_TRANSPORT=tcp
    nvme_dmesg_mark
    local repo=${RDMAVM_CWD:-$PWD}
    RBDVS_CDC=$repo/scripts/ceph-dev-cluster.sh
    [[ -r $RBDVS_CDC ]] || { echo "FAIL: $RBDVS_CDC not found (the dev cluster script)"; exit 1; }
    RBDVS_TARGET=${RDMABLK_RBD_VS_TARGET:-$BIN/rdmablk-target}
    [[ -x $RBDVS_TARGET ]] || { echo "FAIL: $RBDVS_TARGET is not an executable (RDMABLK_RBD_VS_TARGET)"; exit 1; }
    local profile=unknown
    case $(readlink -f "$RBDVS_TARGET") in */release/*) profile=release ;; */debug/*) profile=debug ;; esac
    fio --enghelp 2>/dev/null | grep -qw rbd || { echo "FAIL: this fio has no rbd engine"; exit 1; }
    local rounds=${RDMABLK_RBD_VS_ROUNDS:-2} cases=${RDMABLK_RBD_VS_CASES:-$RBDVS_ALL_CASES} c
    RUNTIME=${RDMABLK_RBD_VS_RUNTIME:-10} RAMP=${RDMABLK_RBD_VS_RAMP:-2}
    [[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "FAIL: RDMABLK_RBD_VS_ROUNDS=$rounds is not a positive number"; exit 1; }
    [[ $RUNTIME =~ ^[1-9][0-9]*$ && $RAMP =~ ^[0-9]+$ ]] \
        || { echo "FAIL: RDMABLK_RBD_VS_RUNTIME=$RUNTIME, RDMABLK_RBD_VS_RAMP=$RAMP: whole seconds"; exit 1; }
    for c in $cases; do rbdvs_case "$c" || { echo "FAIL: unknown case $c (cases: $RBDVS_ALL_CASES)"; exit 1; }; done
    modprobe nvme-tcp
    rm -rf "$NVME_DIR"; mkdir -p "$NVME_DIR"
    out=$RES/nvme-tcp-vs-fio-rbd
    rm -rf "$out"; mkdir -p "$out"
    CEPH_DIR=$WORK/ceph
    TPID=
    trap 'rbdvs_cleanup $?' EXIT

    local t0
    t0=$(date +%s)
    rm -rf "$CEPH_DIR"
    # Its own monitor port: the system tests run in this guest before it
    # (data_path's and bad_commands' rbd twins) leave their cluster on
    # the default port, 13300, for reuse.
    export CEPH_DEV_MON_PORT=13600
    CEPH_DEV_OSD_BYTES=$((1 << 30)) bash "$RBDVS_CDC" start "$CEPH_DIR"
    echo "TIMING ceph cluster started in $(($(date +%s) - t0)) s"
    export CEPH_CONF=$CEPH_DIR/ceph.conf
    local rbd=(rbd -c "$CEPH_CONF" --id rdmablk)
    "${rbd[@]}" create --size "${RBDVS_SIZE_MIB}M" "rbd/$RBDVS_IMAGE"
    "${rbd[@]}" info "rbd/$RBDVS_IMAGE" | grep -E 'size|features'
    t0=$(date +%s)
    "${rbd[@]}" bench --io-type write --io-pattern seq --io-size 4M --io-threads 4 --io-total "$((RBDVS_SIZE_MIB << 20))B" \
        "rbd/$RBDVS_IMAGE" >"$NVME_DIR/fill.out" 2>&1 || { cat "$NVME_DIR/fill.out"; echo "FAIL: rbd bench (the fill)"; exit 1; }
    tail -n 2 "$NVME_DIR/fill.out"
    echo "TIMING the image written fully ($RBDVS_SIZE_MIB MiB) in $(($(date +%s) - t0)) s"
    "${rbd[@]}" du "rbd/$RBDVS_IMAGE" 2>/dev/null || true

    cat >"$NVME_DIR/rbd-vs.toml" <<EOF
[target]
name = "rbd-vs"
listen = ["nvme+tcp://$SIP:$RBDVS_PORT"]
reactors = 2
nqn = "$RBDVS_NQN"

[[volume]]
name = "vol0"
backend = "rbd"
pool = "rbd"
image = "$RBDVS_IMAGE"
ceph_conf = "$CEPH_CONF"
client = "rdmablk"
lock_at_start = true
allow_any_host = true
nsid = 1
EOF
    cat "$NVME_DIR/rbd-vs.toml"
    echo "rdmablk-target: $RBDVS_TARGET ($profile build); fio $(fio --version); kernel $(uname -r)"
    echo "clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null)"

    local round name sys order
    for round in $(seq 1 "$rounds"); do
        order="fio-rbd rdmablk"
        ((round % 2 == 0)) && order="rdmablk fio-rbd"
        for name in $cases; do
            for sys in $order; do
                rbdvs_run "$name" "$sys" "$round"
            done
        done
    done
    # No one holds the image's lock after the runs (the target released it).
    "${rbd[@]}" lock ls "rbd/$RBDVS_IMAGE"

    /usr/bin/python3 - "$out" "$rounds" "$RUNTIME" "$RAMP" "$(uname -r)" "$RBDVS_TARGET ($profile build)" $cases \
        >"$RES/nvme-tcp-vs-fio-rbd.md" <<'PY'
import json, statistics, sys
out, rounds, runtime, ramp, kver, tbin = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
cases = sys.argv[7:]
def load(case, s, k):
    text = open(f"{out}/{case}.{s}.{k}.json").read()
    j = json.loads(text[text.index("{"):])["jobs"][0]
    d = j["write"] if j["write"]["total_ios"] > j["read"]["total_ios"] else j["read"]
    c = open(f"{out}/{case}.{s}.{k}.cpu").read().split()
    busy, proc, wall, hz, cpus = int(c[1]), int(c[3]), float(c[6]) - float(c[5]), int(c[8]), int(c[10])
    # Rates over fio's whole process (start, ramp, run): per I/O at the run's IOPS.
    return {"iops": d["iops"], "lat": d["lat_ns"]["mean"] / 1000,
            "util": busy / hz / wall / cpus * 100, "cpu_us": busy / hz / wall / d["iops"] * 1e6,
            "proc_us": proc / hz / wall / d["iops"] * 1e6}
med = statistics.median
print(f"## Kernel NVMe/TCP host → rdmablk-target (rbd) vs fio's rbd engine (kernel {kver}, qemu TCG, 2 vCPUs)")
print()
print(f"One dev Ceph cluster in the guest (one monitor, one memstore OSD), an image of 256 MiB written fully first. "
      f"fio rbd: fio's rbd engine (librbd in fio). rdmablk: fio (io_uring, direct=1) on the namespace of the kernel's "
      f"nvme-tcp host connected to rdmablk-target, whose volume is the same image through librbd (rbd_cache off in both). "
      f"One fio job, {runtime} s after a {ramp} s ramp per run; {rounds} rounds, each case on both back to back, "
      f"the order swapped in even rounds. IOPS and mean total latency: medians of the rounds; ratio: "
      f"rdmablk ÷ fio rbd IOPS of each round, then their median.")
print(f"rdmablk-target: {tbin}, started before and stopped after each of its runs (it holds the image's lock).")
print("TCG-emulated: compare the ratios within this table, not the absolute figures.")
print()
print("| case | fio rbd IOPS · mean lat µs | kernel NVMe/TCP → rdmablk-target (rbd) IOPS · mean lat µs | ratio rdmablk ÷ fio rbd: median (per round) |")
print("|---|---:|---:|---:|")
# Every run of every case, read once for both tables: (fio rbd's, rdmablk's).
runs = {c: tuple([load(c, s, k) for k in range(1, rounds + 1)] for s in ("fio-rbd", "rdmablk")) for c in cases}
for c, (f, r) in runs.items():
    each = [b["iops"] / a["iops"] for a, b in zip(f, r)]
    cell = lambda xs: f"{med(x['iops'] for x in xs):,.0f} · {med(x['lat'] for x in xs):,.0f}"
    print(f"| {c} | {cell(f)} | {cell(r)} | **{med(each):.2f}** ({' '.join(f'{x:.2f}' for x in each)}) |")
print()
print("Within 10% of the bound: ratio >= 0.90.")
print()
print("The guest's CPU during the runs (medians of the rounds): all "
      "CPUs' busy time from /proc/stat over fio's process (start and ramp included) as a share of all vCPUs, "
      "and per I/O at the run's IOPS (everything: fio, the kernel, the monitor and OSD, rdmablk-target); "
      "rdmablk-target's own utime+stime per I/O.")
print()
print("| case | fio rbd: guest CPU busy · µs per I/O | rdmablk: guest CPU busy · µs per I/O | rdmablk-target's own µs per I/O |")
print("|---|---:|---:|---:|")
for c, (f, r) in runs.items():
    cell = lambda xs: f"{med(x['util'] for x in xs):.0f}% · {med(x['cpu_us'] for x in xs):,.0f}"
    print(f"| {c} | {cell(f)} | {cell(r)} | {med(x['proc_us'] for x in r):,.0f} |")
PY
    cat "$RES/nvme-tcp-vs-fio-rbd.md"
    trap - EXIT
    local end=0
    bash "$RBDVS_CDC" stop "$CEPH_DIR" || end=1
    cp "$NVME_DIR/target.log" "$RES/nvme-tcp-vs-fio-rbd-target.log" 2>/dev/null || true
    # Shown, not failed on: a measurement.
    if grep -E " (ERROR|WARN) " "$NVME_DIR/target.log"; then echo "NOTE: the target logged the warnings above"; fi
    nvme_show_dmesg || end=1
    [[ $end -eq 0 ]] || exit 1
    rm -rf "$NVME_DIR" "$CEPH_DIR"
}
