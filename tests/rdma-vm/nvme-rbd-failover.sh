# The fenced failover of an RBD volume on the kernel's NVMe/TCP host with
# native multipath (issue 54): step nvme-rbd-multipath-failover of the
# Soft-RoCE CI stage. Sourced by ci-guest.sh after nvme-of.sh, whose
# helpers it uses (nvme_connect, nvme_dmesg_*, nvme_show_dmesg), as it
# does WORK, SIP, BIN, RES, sectors_written and wait_written of ci-guest.sh.
#
#   - A one-node Ceph cluster in the guest (scripts/ceph-dev-cluster.sh in
#     $WORK/ceph, the scratch ext4 on a RAM disk; memstore OSD of at most
#     1 GiB; 30 to 75 s under TCG), an image rbd/failover of 256 MiB.
#   - Two gateways, two rdmablk-target processes A and B, export it as
#     volume "shared", NSID 1, under one subsystem NQN on SIP:4430 (A) and
#     SIP:4431 (B) (nvme+tcp://), controller ids
#     1..=999 and 1000..=1999, as client.rdmablk; A with lock_at_start (the
#     owner), B a standby.
#   - The host connects to both (nvme_core multipath must be Y): one head
#     /dev/nvmeXnY with two paths, A optimized and B non-optimized (sysfs
#     ana_state and nvme list-subsys). --keep-alive-tmo=3: a gateway that
#     stops answering loses its path 3 to 4.5 s later; --reconnect-delay=1
#     --ctrl-loss-tmo=-1: the host keeps reconnecting to it, so that the
#     path comes back for the next cycle.
#   - ext4 on the head, mounted. Then each cycle, the owner O and the
#     standby S swapping roles every cycle:
#       1. fio writes a new 8 MiB file through ext4 (libaio, direct=1,
#          random writes of 4 to 64 KiB at QD32, verify=crc32c, a seed per
#          cycle); once 2 MiB are written, O is frozen (SIGSTOP) with
#          commands in its sockets, its reactor and librbd.
#       2. The host's keep-alive to O times out, it tears that path down
#          and fails the commands over to S (non-optimized), which takes
#          the image over at its first command: it breaks O's exclusive
#          lock (Ceph blocklists O's client) and owns it; its path turns
#          optimized (ANA change notice). fio ends 0, every block verified.
#       3. With O still frozen, a second fio (another seed) overwrites the
#          whole file through S: every block O may hold a write for has
#          newer data.
#       4. SIGCONT O: what it held goes to the OSD, which refuses it (O is
#          blocklisted); O logs that Ceph fenced it off and (the engine's
#          debug lines) each command it refused: at least one per cycle,
#          at least one write over the cycles. Its path comes back
#          inaccessible. fio --verify_only of the second fio's data is
#          clean: none of O's old writes landed.
#       5. SIGHUP O: the reload reopens the image under a new RADOS client
#          as a standby; its path turns non-optimized. O and S swap.
#     One TIMING line per cycle: freeze to path down, to S owning the
#     image, to writes completing again, to fio's end; how long O was
#     frozen, SIGCONT to fenced and to inaccessible; the reload.
#   - Cycles: RDMABLK_RBD_FAILOVER_CYCLES (default 20, the issue's 20/20),
#     but no new one once RDMABLK_RBD_FAILOVER_BUDGET seconds (default
#     420) have passed since the first began, at least two (one each way);
#     the log says how many ran. A cycle takes about 16 s under TCG on the
#     2-core development machine (up to 45 s on a busy one): CI runs the 20
#     when a cycle takes under 21 s.
#   - After the last cycle (before its reload): nvme list-subsys and nvme
#     ana-log of both controllers show the last owner optimized and the
#     gateway it took the image from inaccessible; ceph osd blocklist ls
#     holds a client per takeover. The fenced gateway is reloaded, the file
#     system unmounted, e2fsck -fn clean, both controllers disconnected,
#     both gateways stopped (a standby's known non-zero exit is named, see
#     rbdfo_stop), the cluster stopped; no "I/O Error" from the host.
#
# ci-guest.sh shows the step SKIPPED when ceph-mon, ceph-osd, ceph or rbd
# is missing on the host.

RBDFO_NQN=nqn.2014-08.io.rdmablk.ci:rbd-failover
RBDFO_IMAGE=failover
declare -A GW_PORT=([A]=4430 [B]=4431) GW_CNTLID=([A]="1 999" [B]="1000 1999")
declare -A GW_PID=() GW_CTRL=()

rbdfo_now() { date +%s.%N; }
rbdfo_since() { awk -v a="$1" -v b="${2:-$(date +%s.%N)}" 'BEGIN{printf "%.1f", b-a}'; }

# The host's ANA state of the path through controller CTRL (sysfs), or
# "none" while it has no path (reconnecting).
rbdfo_ana() { # CTRL
    local f s
    for f in /sys/class/nvme/"$1"/nvme*c*n*/ana_state; do
        [[ -r $f ]] && read -r s <"$f" 2>/dev/null && { echo "$s"; return 0; }
    done
    echo none
}

rbdfo_ctrl_state() { # CTRL
    local s=gone
    [[ -r /sys/class/nvme/$1/state ]] && read -r s <"/sys/class/nvme/$1/state"
    echo "$s"
}

# Waits up to SECS for the host to see the path through CTRL live and in
# ANA state STATE.
rbdfo_wait_ana() { # CTRL STATE SECS
    local i
    for ((i = 0; i < $3 * 5; i++)); do
        [[ $(rbdfo_ctrl_state "$1") == live && $(rbdfo_ana "$1") == "$2" ]] && return 0
        sleep 0.2
    done
    echo "the host's path through $1 is $(rbdfo_ctrl_state "$1"), ANA $(rbdfo_ana "$1"), not live and $2 after $3 s"
    return 1
}

rbdfo_conf() { # NAME LOCK_AT_START
    local n=$1 lo hi
    read -r lo hi <<<"${GW_CNTLID[$n]}"
    cat >"$NVME_DIR/gw-$n.toml" <<EOF
[target]
name = "gw-$n"
listen = ["nvme+tcp://$SIP:${GW_PORT[$n]}"]
reactors = 1
nqn = "$RBDFO_NQN"
nvme_cntlid_min = $lo
nvme_cntlid_max = $hi

[[volume]]
name = "shared"
backend = "rbd"
pool = "rbd"
image = "$RBDFO_IMAGE"
ceph_conf = "$CEPH_DIR/ceph.conf"
client = "rdmablk"
lock_at_start = $2
allow_any_host = true
nsid = 1
EOF
}

# Starts gateway NAME on its config; waits (the rbd volume is opened
# first: the cluster connection, the lock) for its NVMe/TCP listener;
# sets GW_PID.
rbdfo_start() { # NAME
    local n=$1 log=$NVME_DIR/gw-$1.log t0 up=0
    t0=$(rbdfo_now)
    # The engine's debug lines name each command refused because Ceph
    # fenced this gateway off.
    RUST_LOG=info,rdmablk_target::engine=debug "$BIN/rdmablk-target" --config "$NVME_DIR/gw-$n.toml" 2>>"$log" &
    GW_PID[$n]=$!
    for _ in $(seq 1 300); do
        grep -q "listening on nvme+tcp://$SIP:${GW_PORT[$n]}" "$log" && ss -Hltn "sport = :${GW_PORT[$n]}" | grep -q . && { up=1; break; }
        kill -0 "${GW_PID[$n]}" 2>/dev/null || break
        sleep 0.2
    done
    [[ $up -eq 1 ]] || { echo "gateway $n did not start:"; cat "$log"; return 1; }
    echo "gateway $n (pid ${GW_PID[$n]}) at nvme+tcp://$SIP:${GW_PORT[$n]}, up in $(rbdfo_since "$t0") s"
}

# The EXIT trap: every gateway woken and stopped, the file system and the
# host's controllers gone, the cluster stopped; the logs of a failure.
rbdfo_cleanup() {
    local rc=${1:-$?} n
    set +e
    [[ -z ${FPID:-} ]] || kill "$FPID" 2>/dev/null
    for n in A B; do [[ -z ${GW_PID[$n]:-} ]] || kill -CONT "${GW_PID[$n]}" 2>/dev/null; done
    umount "$NVME_DIR/mnt" 2>/dev/null
    nvme disconnect -n "$RBDFO_NQN" >/dev/null 2>&1
    for n in A B; do [[ -z ${GW_PID[$n]:-} ]] || kill "${GW_PID[$n]}" 2>/dev/null; done
    [[ -z ${CEPH_DIR:-} || ! -d ${CEPH_DIR:-/nonexistent} ]] || bash "$RBDFO_CDC" stop "$CEPH_DIR" 2>&1 | tail -n 2
    echo "--- kernel messages during the step"; nvme_dmesg_since
    if [[ $rc -ne 0 ]]; then
        for n in A B; do echo "--- gateway $n log (last 60 lines)"; tail -n 60 "$NVME_DIR/gw-$n.log" 2>/dev/null; done
        echo "--- ceph logs (last lines)"
        tail -n 15 "$CEPH_DIR"/log/mon.a.log "$CEPH_DIR"/log/osd.0.log 2>/dev/null
    fi
    for n in A B; do cp "$NVME_DIR/gw-$n.log" "$RES/nvme-rbd-failover-gw-$n.log" 2>/dev/null; done
}

# fio on the mounted file system: FILE, SEED, then more options. 8 MiB of
# random writes of 4 KiB to 64 KiB at QD32 (each block once), crc32c in
# every block: under TCG a write costs about 3 ms whatever its size, and
# the test wants many commands in flight at the freeze, not many bytes.
rbdfo_fio() { # FILE SEED OPTIONS...
    local f=$1 seed=$2
    shift 2
    fio --name=fo --filename="$f" --size=8M --rw=randwrite --bssplit=4k/50:16k/25:64k/25 --iodepth=32 \
        --ioengine=libaio --direct=1 --verify=crc32c --verify_fatal=1 --verify_state_save=0 --randseed="$seed" "$@"
}

# Fails on a verify failure in fio's OUTPUT; with "verify", also when it
# shows no read (verify) phase. Prints fio's IOPS lines.
rbdfo_fio_ok() { # OUTPUT WHAT [verify]
    if grep -qi 'verify.*fail\|bad magic\|bad header\|crc32c.*wanted' "$1"; then cat "$1"; echo "FAIL: $2: fio reported a verify failure"; return 1; fi
    if [[ ${3:-} == verify ]]; then
        grep -q 'read: IOPS=' "$1" || { cat "$1"; echo "FAIL: $2: fio shows no verify (read) phase"; return 1; }
    fi
    echo "fio, $2: $(grep -Eo '(read|write): IOPS=[^,]*, BW=[^ ]*' "$1" | tr '\n' ' ')"
}

# The state of ANA group 1 in `nvme ana-log` output FILE (normal format:
# "grpid : 1", then its "state : ..." line).
rbdfo_group1() { # FILE
    awk '$1 == "grpid" { g = $NF } $1 == "state" && g == 1 { print $NF; exit }' "$1"
}

# Checks $NVME_DIR/list-subsys.out (nvme list-subsys of the head): the
# path to each gateway NAME live and in ANA state STATE.
rbdfo_check_subsys() { # NAME STATE [NAME STATE...]
    local n st line said=()
    while [[ $# -ge 2 ]]; do
        n=$1 st=$2
        shift 2
        line=$(grep "trsvcid=${GW_PORT[$n]}," "$NVME_DIR/list-subsys.out") || { echo "FAIL: nvme list-subsys shows no path to gateway $n"; return 1; }
        read -ra line <<<"$line"
        [[ ${line[-2]} == live && ${line[-1]} == "$st" ]] \
            || { echo "FAIL: nvme list-subsys: the path to gateway $n is '${line[*]}', expected live $st"; return 1; }
        said+=("$n ${line[-1]}")
    done
    echo "nvme list-subsys: $(IFS=,; echo "${said[*]}" | sed 's/,/, /g')"
}

# Stops gateway NAME with SIGTERM; fails unless it exits 0 without a
# panic. A standby (the image's lock is another gateway's) is known to
# exit 2 after "fdatasync failed: Read-only file system" (its shutdown
# flushes the image, which librbd refuses without the lock; reported in
# issue 54): with "standby", that exact end is said loudly and let pass.
rbdfo_stop() { # NAME [standby]
    local rc=0 log=$NVME_DIR/gw-$1.log
    kill -CONT "${GW_PID[$1]}" 2>/dev/null || true
    kill -TERM "${GW_PID[$1]}"
    wait "${GW_PID[$1]}" || rc=$?
    GW_PID[$1]=
    if grep -q 'panicked' "$log"; then echo "FAIL: gateway $1 panicked"; return 1; fi
    [[ $rc -eq 0 ]] || { tail -n 5 "$log"; echo "FAIL: gateway $1 exited with $rc after SIGTERM"; return 1; }
    echo "gateway $1: exited 0 after SIGTERM"
}

# Reloads the fenced gateway NAME (SIGHUP: the image reopened as a
# standby under a new RADOS client) and waits for the host to see its
# path non-optimized. Prints the time; LOG_FROM is the log line the
# cycle began at.
rbdfo_reload() { # NAME LOG_FROM
    local n=$1 log=$NVME_DIR/gw-$1.log t0 tr=
    kill -HUP "${GW_PID[$n]}"
    t0=$(rbdfo_now)
    for _ in $(seq 1 150); do
        tail -n +$(($2 + 1)) "$log" | grep -q "reload complete: .* 1 replaced" && { tr=$(rbdfo_now); break; }
        sleep 0.2
    done
    [[ -n $tr ]] || { tail -n +$(($2 + 1)) "$log" | tail -n 20; echo "FAIL: $n's reload did not reopen the fenced image within 30 s"; return 1; }
    rbdfo_wait_ana "${GW_CTRL[$n]}" non-optimized 30
    RBDFO_RELOADED="$n reloaded (standby) in $(rbdfo_since "$t0" "$tr") s, its path non-optimized +$(rbdfo_since "$t0") s"
}

nvme_rbd_failover() {
    set -euo pipefail
    NVME_TRANSPORT=tcp
    nvme_dmesg_mark
    local repo=${RDMAVM_CWD:-$PWD}
    RBDFO_CDC=$repo/scripts/ceph-dev-cluster.sh
    [[ -r $RBDFO_CDC ]] || { echo "FAIL: $RBDFO_CDC not found (the dev cluster script)"; exit 1; }
    modprobe nvme-tcp
    local mp
    read -r mp </sys/module/nvme_core/parameters/multipath
    echo "nvme_core multipath: $mp"
    [[ $mp == Y ]] || { echo "FAIL: the host's native multipath is off (nvme_core.multipath=$mp)"; exit 1; }
    rm -rf "$NVME_DIR"; mkdir -p "$NVME_DIR/mnt"
    local mnt=$NVME_DIR/mnt
    CEPH_DIR=$WORK/ceph
    FPID=
    trap 'rbdfo_cleanup $?' EXIT

    # The cluster and the image.
    local t0 tstep
    tstep=$(rbdfo_now)
    t0=$tstep
    rm -rf "$CEPH_DIR"
    # Its own monitor port: the system tests run in this guest before it
    # (data_path's and bad_commands' rbd twins) leave their cluster on
    # the default port, 13300, for reuse.
    export CEPH_DEV_MON_PORT=13500
    CEPH_DEV_OSD_BYTES=$((1 << 30)) bash "$RBDFO_CDC" start "$CEPH_DIR"
    echo "TIMING ceph cluster started in $(rbdfo_since "$t0") s"
    local rbd=(rbd -c "$CEPH_DIR/ceph.conf" --id rdmablk)
    t0=$(rbdfo_now)
    "${rbd[@]}" create --size 256M "rbd/$RBDFO_IMAGE"
    "${rbd[@]}" info "rbd/$RBDFO_IMAGE" | grep -E 'size|features'
    echo "TIMING image created in $(rbdfo_since "$t0") s"

    # The gateways: A owns the image from its start, B stands by.
    rbdfo_conf A true
    rbdfo_conf B false
    cat "$NVME_DIR/gw-A.toml"
    rbdfo_start A
    grep -q "owns it now" "$NVME_DIR/gw-A.log" || { echo "FAIL: gateway A (lock_at_start) did not log that it owns the image"; exit 1; }
    rbdfo_start B
    if grep -q "owns it now" "$NVME_DIR/gw-B.log"; then echo "FAIL: the standby B took the image at its start"; exit 1; fi
    "${rbd[@]}" lock ls "rbd/$RBDFO_IMAGE"

    # The host: one head, two paths.
    local kato=3 dev n lo hi cntlid
    for n in A B; do
        nvme_connect "$RBDFO_NQN" "${GW_PORT[$n]}" 1 --keep-alive-tmo=$kato --reconnect-delay=1 --ctrl-loss-tmo=-1
        GW_CTRL[$n]=$CTRL
        [[ $n == A ]] && dev=$DEV
        [[ $DEV == "$dev" ]] || { echo "FAIL: gateway B's namespace is $DEV, not a second path of $dev"; exit 1; }
        cntlid=$(cat "/sys/class/nvme/$CTRL/cntlid")
        read -r lo hi <<<"${GW_CNTLID[$n]}"
        ((cntlid >= lo && cntlid <= hi)) || { echo "FAIL: controller id $cntlid of gateway $n is outside $lo..$hi"; exit 1; }
        echo "gateway $n: controller $CTRL, cntlid $cntlid"
    done
    # The hidden path disks nvmeXcZnY of the head nvmeXnY, one per controller.
    local head=${dev#/dev/} p paths=()
    for p in /sys/block/"${head%n*}"c*n"${head##*n}"; do [[ -e $p ]] && paths+=("${p##*/}"); done
    echo "paths of $dev: ${paths[*]}"
    [[ ${#paths[@]} -eq 2 ]] || { echo "FAIL: $dev has ${#paths[@]} paths, expected 2"; exit 1; }
    rbdfo_wait_ana "${GW_CTRL[A]}" optimized 10
    rbdfo_wait_ana "${GW_CTRL[B]}" non-optimized 10
    nvme list-subsys "$dev" | tee "$NVME_DIR/list-subsys.out"
    rbdfo_check_subsys A optimized B non-optimized

    t0=$(rbdfo_now)
    mkfs.ext4 -q -F -E nodiscard "$dev"
    mount -o noatime "$dev" "$mnt"
    echo "TIMING mkfs.ext4 and mount: $(rbdfo_since "$t0") s"

    # The cycles.
    local cycles=${RDMABLK_RBD_FAILOVER_CYCLES:-20} budget=${RDMABLK_RBD_FAILOVER_BUDGET:-420}
    [[ $cycles =~ ^[1-9][0-9]*$ && $budget =~ ^[0-9]+$ ]] || { echo "FAIL: RDMABLK_RBD_FAILOVER_CYCLES=$cycles, RDMABLK_RBD_FAILOVER_BUDGET=$budget"; exit 1; }
    local own=A stb=B cycle tc done_cycles=0 tcycles all_writes=0
    tcycles=$(rbdfo_now)
    for ((cycle = 1; cycle <= cycles; cycle++)); do
        tc=$(rbdfo_now)
        local oc=${GW_CTRL[$own]} sc=${GW_CTRL[$stb]} olog=$NVME_DIR/gw-$own.log slog=$NVME_DIR/gw-$stb.log
        local ofrom sfrom
        ofrom=$(wc -l <"$olog"); sfrom=$(wc -l <"$slog")
        echo "=== cycle $cycle: $own owns the image, $stb stands by"
        rbdfo_wait_ana "$oc" optimized 15
        rbdfo_wait_ana "$sc" non-optimized 15
        local f=$mnt/fo$cycle.dat
        rm -f "$mnt"/fo*.dat
        local before
        before=$(sectors_written "$dev")
        rbdfo_fio "$f" "$cycle" --do_verify=1 --output="$NVME_DIR/fio1.out" &
        FPID=$!
        # A quarter of the file written: fio has 32 commands in flight.
        wait_written "$dev" "$before" $((2 << 20)) "$FPID" \
            || { cat "$NVME_DIR/fio1.out"; echo "FAIL: fio ended (or wrote too little) before $own was frozen"; exit 1; }
        kill -STOP "${GW_PID[$own]}"
        local tstop s0 tdown= ttake= tio= s
        tstop=$(rbdfo_now)
        s0=$(sectors_written "$dev")
        # The host: the path through the frozen gateway goes down; the
        # standby takes the image over; writes complete again.
        for _ in $(seq 1 300); do
            [[ -z $tdown && $(rbdfo_ctrl_state "$oc") != live ]] && tdown=$(rbdfo_now)
            [[ -z $ttake ]] && tail -n +$((sfrom + 1)) "$slog" | grep -q "owns it now" && ttake=$(rbdfo_now)
            s=$(sectors_written "$dev")
            [[ -z $tio && -n $ttake ]] && ((s > s0)) && tio=$(rbdfo_now)
            [[ -n $tdown && -n $ttake && -n $tio ]] && break
            kill -0 "$FPID" 2>/dev/null || break
            sleep 0.2
        done
        [[ -n $tdown ]] || { echo "FAIL: the host's path through the frozen $own ($oc) stayed live"; exit 1; }
        [[ -n $ttake ]] || { echo "FAIL: $stb did not take the image over"; exit 1; }
        tail -n +$((sfrom + 1)) "$slog" | grep -E "took the exclusive lock|owns it now" | sed 's/^/  /'
        local frc=0
        wait "$FPID" || frc=$?
        FPID=
        [[ -n $tio ]] || tio=$(rbdfo_now)
        local tfio1; tfio1=$(rbdfo_now)
        cp "$NVME_DIR/fio1.out" "$RES/nvme-rbd-failover-fio-$cycle.out" 2>/dev/null || true
        [[ $frc -eq 0 ]] || { cat "$NVME_DIR/fio1.out"; echo "FAIL: cycle $cycle: fio failed across the failover ($frc)"; exit 1; }
        rbdfo_fio_ok "$NVME_DIR/fio1.out" "writes across the failover, then every block verified" verify
        rbdfo_wait_ana "$sc" optimized 15
        # Every block of the file overwritten while the old owner sleeps
        # on its writes.
        rbdfo_fio "$f" $((cycle + 1000)) --do_verify=0 --output="$NVME_DIR/fio2.out" \
            || { cat "$NVME_DIR/fio2.out"; echo "FAIL: cycle $cycle: the overwrite failed"; exit 1; }
        rbdfo_fio_ok "$NVME_DIR/fio2.out" "the overwrite with $own frozen"
        local tcont tfenced= tinacc
        kill -CONT "${GW_PID[$own]}"
        tcont=$(rbdfo_now)
        for _ in $(seq 1 150); do
            tail -n +$((ofrom + 1)) "$olog" | grep -q "Ceph blocklisted this one" && { tfenced=$(rbdfo_now); break; }
            sleep 0.2
        done
        local refused writes
        refused=$(tail -n +$((ofrom + 1)) "$olog" | grep -c "refused: this gateway was fenced off" || true)
        writes=$(tail -n +$((ofrom + 1)) "$olog" | grep -c "write refused: this gateway was fenced off" || true)
        if [[ -z $tfenced ]]; then
            tail -n +$((ofrom + 1)) "$olog" | tail -n 20
            echo "FAIL: $own did not find itself fenced off within 30 s of SIGCONT ($refused commands refused)"
            exit 1
        fi
        tail -n +$((ofrom + 1)) "$olog" | grep "Ceph blocklisted this one" | sed 's/^/  /'
        ((refused >= 1)) || { echo "FAIL: $own found itself fenced off but refused none of what it held"; exit 1; }
        all_writes=$((all_writes + writes))
        rbdfo_wait_ana "$oc" inaccessible 30
        tinacc=$(rbdfo_now)
        rbdfo_wait_ana "$sc" optimized 5
        # What the frozen gateway held has been refused by now; the
        # overwrite's data must be intact.
        local tv; tv=$(rbdfo_now)
        rbdfo_fio "$f" $((cycle + 1000)) --verify_only --output="$NVME_DIR/fio3.out" \
            || { cat "$NVME_DIR/fio3.out"; echo "FAIL: cycle $cycle: the overwrite's data does not verify after $own woke up"; exit 1; }
        rbdfo_fio_ok "$NVME_DIR/fio3.out" "the overwrite verified after $own woke up" verify
        echo "TIMING cycle $cycle ($own -> $stb): frozen $(rbdfo_since "$tc" "$tstop") s into the cycle;" \
            "path down +$(rbdfo_since "$tstop" "$tdown") s, $stb owner +$(rbdfo_since "$tstop" "$ttake") s," \
            "writes complete again +$(rbdfo_since "$tstop" "$tio") s, fio done +$(rbdfo_since "$tstop" "$tfio1") s;" \
            "SIGCONT after $(rbdfo_since "$tstop" "$tcont") s frozen: $own fenced +$(rbdfo_since "$tcont" "$tfenced") s" \
            "($refused held commands refused, $writes of them writes), inaccessible +$(rbdfo_since "$tcont" "$tinacc") s;" \
            "overwrite verified in $(rbdfo_since "$tv") s"
        done_cycles=$cycle
        if ((cycle == cycles)); then break; fi
        # At least one cycle each way; then as many as the budget allows.
        if ((cycle >= 2)) && [[ $(rbdfo_since "$tcycles" | cut -d. -f1) -ge $budget ]]; then
            echo "NOTE: $done_cycles of $cycles cycles ran: the cycles' budget of $budget s (RDMABLK_RBD_FAILOVER_BUDGET) is spent"
            break
        fi
        rbdfo_reload "$own" "$ofrom"
        echo "TIMING cycle $cycle: $RBDFO_RELOADED; cycle $(rbdfo_since "$tc") s"
        local x=$own; own=$stb; stb=$x
    done
    echo "TIMING $done_cycles of $cycles cycles in $(rbdfo_since "$tcycles") s: $done_cycles failovers, each with fio's verify clean and the frozen gateway fenced; $all_writes held writes refused in all"
    # Over the cycles, the frozen gateways held writes, and the cluster
    # refused them (each cycle's overwrite verify says none landed).
    ((all_writes >= 1)) || { echo "FAIL: no frozen gateway held a write to refuse: the fencing of writes was not exercised"; exit 1; }

    # The host's view after the last cycle: its new owner optimized, the
    # gateway it took the image from inaccessible.
    nvme list-subsys "$dev" | tee "$NVME_DIR/list-subsys.out"
    rbdfo_check_subsys "$stb" optimized "$own" inaccessible
    for n in A B; do
        echo "--- nvme ana-log /dev/${GW_CTRL[$n]} (gateway $n)"
        nvme ana-log "/dev/${GW_CTRL[$n]}" | tee "$NVME_DIR/ana-$n.txt"
    done
    [[ $(rbdfo_group1 "$NVME_DIR/ana-$stb.txt") == optimized ]] || { echo "FAIL: $stb's ANA log does not say group 1 optimized"; exit 1; }
    [[ $(rbdfo_group1 "$NVME_DIR/ana-$own.txt") == inaccessible ]] || { echo "FAIL: $own's ANA log does not say group 1 inaccessible"; exit 1; }
    echo "nvme ana-log: group 1 $(rbdfo_group1 "$NVME_DIR/ana-$stb.txt") on $stb, $(rbdfo_group1 "$NVME_DIR/ana-$own.txt") on $own"
    "${rbd[@]}" lock ls "rbd/$RBDFO_IMAGE"
    local nbl
    ceph -c "$CEPH_DIR/ceph.conf" osd blocklist ls >"$NVME_DIR/blocklist.out" 2>&1 || { cat "$NVME_DIR/blocklist.out"; exit 1; }
    cat "$NVME_DIR/blocklist.out"
    nbl=$(grep -c '^127\.0\.0\.1:' "$NVME_DIR/blocklist.out" || true)
    ((nbl >= done_cycles)) || { echo "FAIL: $nbl clients blocklisted, expected one per takeover ($done_cycles)"; exit 1; }

    # The fenced gateway reloaded as an operator would; then the file
    # system checked and both gateways stopped cleanly.
    rbdfo_reload "$own" "$(wc -l <"$NVME_DIR/gw-$own.log")"
    echo "$RBDFO_RELOADED"
    t0=$(rbdfo_now)
    umount "$mnt"
    blockdev --flushbufs "$dev"
    e2fsck -fn "$dev"
    echo "TIMING umount and e2fsck -fn: $(rbdfo_since "$t0") s"
    nvme disconnect -n "$RBDFO_NQN" | tee "$NVME_DIR/disconnect.out"
    grep -q "disconnected 2 controller" "$NVME_DIR/disconnect.out" || { echo "FAIL: nvme disconnect did not disconnect two controllers"; exit 1; }
    trap - EXIT
    local end=0
    rbdfo_stop "$own" standby || end=1
    rbdfo_stop "$stb" || end=1
    for n in A B; do cp "$NVME_DIR/gw-$n.log" "$RES/nvme-rbd-failover-gw-$n.log" 2>/dev/null || true; done
    bash "$RBDFO_CDC" stop "$CEPH_DIR" || end=1
    nvme_show_dmesg || end=1
    echo "TIMING step $(rbdfo_since "$tstep") s"
    [[ $end -eq 0 ]] || exit 1
    rm -rf "$NVME_DIR" "$CEPH_DIR"
}
