#!/bin/bash
# Guest side of the Soft-RoCE CI stage (see ci.sh, which builds everything on
# the host and passes the paths in RDMABLK_*). Runs rdmablk's real programs
# over rdma:// between rxe0 (target, 10.77.0.1) and rxe1 (initiator side):
#
#   scratch-fs                an ext4 /tmp on a RAM disk (the guest's tmpfs /tmp
#                             has no O_DIRECT, which the target's file backend needs)
#   conformance-verbs         the fabric conformance suite on the verbs provider
#   rxe-link-used             both rxe devices received packets during it
#   target-cli-rdma           rdmablk-target on rdma://, the rdmablk CLI: list, write
#                             1 MiB at 12288, flush, read back, compare with the input
#                             and the backing file; a misaligned write is refused
#   data-path-rdma            tests/tests/data_path.rs over rdma:// (random offsets
#                             and sizes 4 KiB ... 1 MiB checked against the backing file)
#   read-only-rejection-rdma  data_path's read-only volume test
#   bad-commands-rdma         tests/tests/bad_commands.rs over rdma://
#   malicious-target-rdma     tests/tests/scoping.rs over rdma://: a fake target writes
#                             outside the command, after the response and with an old
#                             rkey; the initiator's memory windows refuse every write
#   fence-rdma                tests/tests/fence.rs over rdma://: a reconnected session
#                             never sees a write of the session it replaced land
#                             after its own (the old writes held at the "disk")
#   command-slots-rdma        tests/tests/command_slots.rs over rdma://: a verifying
#                             load at queue depths 4 to 32 never meets QueueFull (rxe
#                             on Linux 6.12 reports send completions after the
#                             initiator's next command)
#   capacity-rdma             tests/tests/capacity.rs over rdma://: 160 sessions on a
#                             two-reactor target (more than one rxe completion queue
#                             holds per reactor) are all served, the 161st is refused
#   nvme-rdma-hostile         target-daemon/tests/nvme_rdma.rs on verbs: an NVMe/RDMA
#                             host on the fabric API (keyed SGLs, SEND with
#                             Invalidate) and hostile input: bad CM private data,
#                             keys outside the host's memory, bad SGLs, short capsules
#                             (all of that file's tests but nvme-rdma-reset's)
#   nvme-rdma-reset           nvme_rdma.rs's reset test on verbs: 50 rounds (or
#                             RDMABLK_RESET_ROUNDS) of an association (admin queue, 2
#                             I/O queues) with 32 commands in flight (keyed writes by
#                             RDMA READ, in-capsule writes, reads by RDMA WRITE) whose
#                             queue pairs all go at once without an NVMe Disconnect;
#                             the same host NQN's admin Connect succeeds within 1 s,
#                             and no old write lands after it was answered
#   nbd-fs-rdma               rdmablk nbd over rdma:// on a unix socket, the kernel's
#                             nbd-client on /dev/nbd0: mkfs.ext4, mount, the small
#                             file tree (tree_write), unmount, disconnect, reconnect,
#                             mount, every sha256 checked, e2fsck -fn clean; SIGTERM
#                             ends rdmablk nbd with 0
#   ublk-fs-rdma              rdmablk attach over rdma:// (ublk, /dev/ublkb0): mkfs.ext4,
#                             mount, a tree of about 210 MiB (0 B to 48 MiB, odd sizes,
#                             a sparse file, 300 small files in nested directories),
#                             sync, detach refused while mounted, unmount, e2fsck -fn
#                             clean, detach, attach again, mount, every sha256 checked;
#                             then fio on the raw device (io_uring, direct=1, random
#                             writes of 4 KiB to 1 MiB at QD32, crc32c verify of
#                             64 MiB) and fio --verify_only failing over a block
#                             zeroed behind its back; SIGTERM ends attach with 0
#   ublk-fs-tcp               the same round trip over tcp:// with the small tree
#                             (about 42 MiB), no raw fio
#   ublk-boot-rdma            rdmablk attach --config (the boot unit's command) started
#                             before its target: retries, attaches once the target is
#                             up, says READY=1 on NOTIFY_SOCKET, I/O through the device
#   ublk-reconnect-rdma       rdmablk attach --ctrl_loss_tmo=90 with ext4 mounted: fio
#                             (io_uring, direct=1, 4 KiB to 128 KiB random writes at
#                             QD16 with crc32c verify, 96 MiB) writes a file while
#                             the target is SIGKILLed and restarted 5 s later; fio
#                             ends 0 with no verify failure and no request failed,
#                             e2fsck -fn clean after unmount, fio --verify_only clean
#                             after a remount. Then with --ctrl_loss_tmo=3s a killed
#                             target makes reads fail with EIO; detach works
#   ublk-recover-rdma         ublk user recovery: rdmablk attach SIGKILLed while fio writes
#                             (verify=crc32c) through ext4; a restarted attach takes the
#                             same device back, fio ends 0, e2fsck -fn clean; an attach
#                             killed and not restarted: detach deletes the device
#   ublk-vs-bench-rdma        fio on /dev/ublkb0 against rdmablk-bench on the same
#                             volume and target, same queue depth and runtime: 4 KiB
#                             randread QD1 and QD16, 128 KiB read QD16, two rounds;
#                             the ratios (IOPS, mean latency) go to
#                             $RES/ublk-vs-bench.txt (figures only, TCG)
#   bench-verify-rdma         rdmablk-bench --verify=crc32c, 3 s at each queue depth
#                             4, 8, 16 and 32 (SKIPPED, and shown as such, while
#                             rdmablk-bench is not built)
#   scoping-cost-rdma         4 KiB random reads with rkey_scoping on and off (figures)
#   nvme-tcp-fs               rdmablk-target on tcp:// and nvme+tcp://SIP:4420 at once, the
#                             kernel's NVMe/TCP host (nvme-cli): discover, connect,
#                             id-ctrl/id-ns, ext4 round trip with the small tree,
#                             e2fsck -fn, fio crc32c verify on the raw namespace while
#                             the rdmablk CLI reads the same volume over tcp://,
#                             Write Zeroes and discard, disconnect; no I/O error or
#                             "Firmware bug" in the host's messages (nvme-of.sh)
#   nvme-tcp-sighup           a [[volume]] added by SIGHUP shows up on the connected
#                             host as namespace 2 (AEN, rescan), no reconnect
#   nvme-tcp-large-io         max_io_size 4 MiB: id-ctrl mdts 10, `nvme connect -Q 1024`
#                             gives 1024-entry queues, nvme-cli's `nvme write` / `nvme
#                             read` of 4 MiB and 1 MiB in one command each read back
#                             identical (nvme-of.sh)
#   nvme-tcp-multipath        two gateways of one volume (issue 54): two rdmablk-target
#                             processes, one backing file, one subsystem NQN, disjoint
#                             nvme_cntlid ranges; the host's native multipath has one
#                             head disk with two optimized paths (ANA group 1); fio's
#                             verify stays clean while gateway A is SIGKILLed, and A's
#                             path comes back optimized when it restarts (nvme-of.sh)
#   nvme-tcp-restart          the target SIGKILLed and restarted under a mounted ext4
#                             with fio writing: the host reconnects, fio's verify and
#                             e2fsck -fn are clean
#   nvme-tcp-auth             in-band authentication (DH-HMAC-CHAP) with nvme-cli's
#                             --dhchap-secret: ext4 round trip; a wrong secret refused;
#                             bidirectional with --dhchap-ctrl-secret (nvme-of.sh)
#   nvme-rbd-multipath-failover
#                             a dev Ceph cluster in the guest; two rdmablk-target
#                             gateways of one RBD image (A owner, B standby) under one
#                             NQN; the host's native multipath over both, ext4 on the
#                             head; cycles of: fio (crc32c verify) writing, the owner
#                             SIGSTOPped, the host failing over to the standby, which
#                             takes the image over (the frozen one blocklisted); an
#                             overwrite; SIGCONT: its held writes refused, its path
#                             inaccessible, the overwrite verifies; SIGHUP reopens it
#                             as the standby. e2fsck -fn clean (nvme-rbd-failover.sh;
#                             SKIPPED without ceph-mon, ceph-osd, ceph, rbd)
#   nvme-tcp-vs-nvmet         rdmablk-target's NVMe/TCP against the kernel's nvmet-tcp,
#                             same host and boot: IOPS, latency, CPU per I/O
#                             ($RES/nvme-tcp-vs-nvmet.md; figures only)
#   nvme-tcp-vs-fio-rbd       not in the default list (a measurement of about 10
#                             minutes; CI's time): only when RDMABLK_CI_STEPS names
#                             it, as bench/vs-rbd-vm.sh does. fio on the kernel's
#                             NVMe/TCP host over rdmablk-target's rbd volume against
#                             fio's own rbd engine on the same in-guest dev cluster
#                             ($RES/nvme-tcp-vs-fio-rbd.md; nvme-vs-fio-rbd.sh)
#   nvme-rdma-fs, -sighup, -large-io, -restart, -auth, -vs-nvmet
#                             the same four over NVMe/RDMA: the kernel's nvme-rdma
#                             host over rxe against nvme+rdma://SIP:4420 beside
#                             rdma://, the rdmablk CLI over rdma:// on the other
#                             volume at the same time, and nvmet-rdma as the peer
#                             ($RES/nvme-rdma-vs-nvmet.md)
#   port-down-logged          taking the server's link down makes rdmablk-target log
#                             the RDMA port going down (runs last: it breaks the link)
#
# Called with a step body's name (`ci-guest.sh cli`), it runs that body; the
# `step` helper of guest-lib.sh records each one.
#
# RDMABLK_CI_STEPS="GLOB..." (a development aid: run.sh --script ci-guest.sh
# -e RDMABLK_BIN_DIR=... -e RDMABLK_CI_STEPS='nvme-rdma-*') runs only the steps
# whose names match one of the globs, plus scratch-fs. A matching step that
# runs a test executable of ci-build.sh's (nvme-rdma-hostile, nvme-rdma-reset:
# the variable RDMABLK_NVME_RDMA_TESTS, ...) is shown SKIPPED unless its -e is
# given. Without --script (tests/rdma-vm/ci.sh -e 'RDMABLK_CI_STEPS=nvme-rdma-*')
# ci-build.sh builds everything and gives every executable.
# RDMABLK_CI_REPEAT=N (with RDMABLK_CI_STEPS) runs each named step up to N
# times and stops at its first failure, whose files ($WORK) are left as the
# step left them: a hunt for a rare failure.
set -u
SELF=$(readlink -f "$0")
SIP=${RDMAVM_SERVER_IP:-10.77.0.1}
BIN=${RDMABLK_BIN_DIR:?}
RES=${RDMAVM_RESULTS:-/tmp}
WORK=/tmp/rdmablk-ci

counters() {
    local d
    for d in ${RDMAVM_SERVER_DEV:-rxe0} ${RDMAVM_CLIENT_DEV:-rxe1}; do
        echo "$d $(cat /sys/class/infiniband/$d/ports/1/hw_counters/rcvd_pkts) $(cat /sys/class/infiniband/$d/ports/1/hw_counters/sent_pkts)"
    done
}

scratch_fs() {
    set -e
    local dev
    if modprobe brd rd_nr=1 rd_size=$((1024 * 1024)) max_part=0 && [[ -b /dev/ram0 ]]; then
        dev=/dev/ram0
    else
        echo "no brd: using a loop device over a tmpfs file"
        truncate -s 1G /dev/shm/scratch.img
        dev=$(losetup --find --show /dev/shm/scratch.img)
    fi
    mkfs.ext4 -q -F -O ^has_journal "$dev"
    # A repository under /tmp (rdmavm.keep=, see initramfs-init.sh) must stay
    # visible through the new /tmp: set it aside and put it back on top.
    local keep="" arg
    for arg in $(cat /proc/cmdline); do
        case "$arg" in rdmavm.keep=/tmp/*) keep=${arg#rdmavm.keep=} ;; esac
    done
    if [[ -n $keep ]]; then
        mkdir -p /run/rdmavm-keep
        mount --bind "$keep" /run/rdmavm-keep
    fi
    mount -o noatime "$dev" /tmp
    chmod 1777 /tmp
    if [[ -n $keep ]]; then
        mkdir -p "$keep"
        mount --move /run/rdmavm-keep "$keep"
        echo "kept $keep visible over the scratch /tmp"
    fi
    dd if=/dev/zero of=/tmp/.odirect bs=4096 count=1 oflag=direct status=none
    rm -f /tmp/.odirect
    df -h /tmp
}

link_used() {
    echo "topology: ${RDMAVM_TOPOLOGY:-?} (server ${RDMAVM_SERVER_DEV:-?}, client ${RDMAVM_CLIENT_DEV:-?})"
    echo "device rcvd_pkts sent_pkts, before:"; cat "$RES/counters.before"
    echo "after:"; cat "$RES/counters.after"
    [[ ${RDMAVM_SERVER_DEV:-} != "${RDMAVM_CLIENT_DEV:-}" ]] || { echo "one device talks to itself: no link to check"; return 1; }
    # Both devices must have received RoCE packets: the traffic crossed the veth link.
    awk 'NR == FNR { before[$1] = $2; next }
         { got = $2 - before[$1]; printf "%s received %d RoCE packets during the conformance suite\n", $1, got
           if (got < 1000) { print $1 " received (almost) nothing: the traffic did not cross the link"; bad = 1 } }
         END { exit bad }' "$RES/counters.before" "$RES/counters.after"
}

# Starts rdmablk-target on rdma://$SIP:0 and tcp://$SIP:0 at once, with a
# file volume vol0 in $WORK (256 MiB, or the size given: start_target 512MiB);
# sets URL (rdma), TCP_URL and TPID.
start_target() {
    local size=${1:-256MiB}
    mkdir -p "$WORK"
    # A fresh volume each time: the target refuses a file larger than the
    # size, and a step's data must not come from an earlier step.
    rm -f "$WORK/vol0.img"
    cat >"$WORK/target.toml" <<EOF
[target]
name = "ci"
listen = ["rdma://$SIP:0", "tcp://$SIP:0"]
reactors = 2

[[volume]]
name = "vol0"
backend = "file"
path = "$WORK/vol0.img"
size = "$size"
allow_any_host = true
EOF
    RUST_LOG=info "$BIN/rdmablk-target" --config "$WORK/target.toml" 2>"$WORK/target.log" &
    TPID=$!
    URL=
    for _ in $(seq 1 300); do
        URL=$(grep -o 'listening on rdma://[^ ",]*' "$WORK/target.log" | head -n1 | sed 's/listening on //') || true
        TCP_URL=$(grep -o 'listening on tcp://[^ ",]*' "$WORK/target.log" | head -n1 | sed 's/listening on //') || true
        [[ -n $URL && -n $TCP_URL ]] && break
        kill -0 "$TPID" 2>/dev/null || break
        sleep 0.1
    done
    if [[ -z $URL || -z $TCP_URL ]]; then
        echo "rdmablk-target did not start:"; cat "$WORK/target.log"; return 1
    fi
    echo "target at $URL and $TCP_URL (pid $TPID)"
}

# The steps' EXIT traps begin with `set +e`: the steps run under errexit,
# which would end a trap at its first failing command (a kill of a process
# already gone), leaving the rest, such as the target it should stop, to
# the next steps (ublk-reconnect-rdma's target on a fixed port did).

# Stops a server process with SIGTERM and requires exit status 0; shows its
# log and keeps a copy in the results. From here on only the target is left
# for the EXIT trap to kill.
sigterm_exits_zero() { # PID WHAT LOG RESULT_FILE
    kill -TERM "$1"
    local rc=0
    wait "$1" || rc=$?
    trap 'kill $TPID 2>/dev/null' EXIT
    echo "--- $2 log"; cat "$3"
    cp "$3" "$RES/$4" 2>/dev/null || true
    [[ $rc -eq 0 ]] || { echo "$2 exited with $rc after SIGTERM"; exit 1; }
}

stop_target() {
    kill -TERM "$TPID" 2>/dev/null
    local rc=0
    wait "$TPID" || rc=$?
    echo "--- target log"; cat "$WORK/target.log"
    cp "$WORK/target.log" "$RES/$1-target.log" 2>/dev/null
    if grep -q 'panicked' "$WORK/target.log"; then echo "the target panicked"; return 1; fi
    [[ $rc -eq 0 ]] || { echo "rdmablk-target exited with $rc after SIGTERM"; return 1; }
}

cli() {
    set -euo pipefail
    start_target
    trap 'kill $TPID 2>/dev/null' EXIT
    r() { echo "+ rdmablk $*"; "$BIN/rdmablk" --target "$URL" "$@"; }
    "$BIN/rdmablk" --target "$URL" list | tee "$WORK/list.txt"
    grep -q vol0 "$WORK/list.txt"
    head -c 1048576 /dev/urandom >"$WORK/input"
    r write vol0 --offset 12288 --input "$WORK/input"
    r flush vol0
    r read vol0 --offset 12288 --length 1MiB --output "$WORK/output"
    cmp "$WORK/input" "$WORK/output"
    echo "read back: identical"
    dd if="$WORK/vol0.img" of="$WORK/file.bin" bs=4096 skip=3 count=256 status=none
    cmp "$WORK/input" "$WORK/file.bin"
    echo "backing file at 12288: identical"
    # The same daemon serves tcp:// at the same time.
    "$BIN/rdmablk" --target "$TCP_URL" read vol0 --offset 12288 --length 1MiB --output "$WORK/output.tcp"
    cmp "$WORK/input" "$WORK/output.tcp"
    echo "read back over $TCP_URL: identical"
    head -c 4096 /dev/urandom >"$WORK/small"
    if r write vol0 --offset 12289 --input "$WORK/small" 2>"$WORK/misaligned.err"; then
        echo "a misaligned write was accepted"; exit 1
    fi
    cat "$WORK/misaligned.err"
    grep -q 12289 "$WORK/misaligned.err" && grep -q 4096 "$WORK/misaligned.err"
    [[ $(wc -l <"$WORK/misaligned.err") -eq 1 ]] || { echo "expected one line"; exit 1; }
    trap - EXIT
    stop_target cli
}

bench() {
    set -euo pipefail
    start_target
    trap 'kill $TPID 2>/dev/null' EXIT
    local qd
    for qd in 4 8 16 32; do
        "$BIN/rdmablk-bench" --target="$URL" --volume=vol0 --eta=never \
            --name="verify-qd$qd" --rw=randwrite --bs=4k --iodepth="$qd" --size=64M --runtime=3s --time_based --verify=crc32c
    done
    trap - EXIT
    stop_target bench
}

# Sectors the block device DEV (/dev/NAME) has written since it appeared
# (the seventh field of its stat).
sectors_written() { # DEV
    awk '{ print $7 }' "/sys/block/${1##*/}/stat"
}

# Waits until DEV has written BYTES beyond FROM (its sectors_written before
# the job started) while process PID runs. Fails if PID ends first or after
# 120 s. A step that kills a server during a job's writes waits for them
# with this, not for a fixed time: a host that runs the VM fast had fio
# write all of its file before a 2 s sleep ended.
wait_written() { # DEV FROM BYTES PID
    local want=$(($2 + $3 / 512))
    for _ in $(seq 1 1200); do
        (($(sectors_written "$1") >= want)) && return 0
        kill -0 "$4" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# A tree of files for the file system round trips, written by one python3
# process (a process start costs about 0.3 s under TCG):
#   tree_write DIR SUMS [full|small]
# writes files of many sizes under DIR: 0 B, 1 B, odd sizes around 512 and
# 4096, 64 KiB, MiBs, odd MiBs, a sparse file with a hole, nested
# directories of small files and (full) files of tens of MiB. full is about
# 210 MiB, small about 42 MiB. The sums of what was written, relative to DIR,
# go to SUMS in sha256sum's format.
#   tree_check DIR SUMS
# reads every file back with sha256sum -c and checks that DIR holds exactly
# the files of SUMS.
tree_write() {
    /usr/bin/python3 - "$@" <<'PY'
import hashlib, os, random, sys, time
root, sums = sys.argv[1], sys.argv[2]
scale = sys.argv[3] if len(sys.argv) > 3 else "full"
seed = int.from_bytes(os.urandom(8), "little")
rng = random.Random(seed)
K, M = 1 << 10, 1 << 20
files = [("f0", 0), ("f1", 1), ("f511", 511), ("f512", 512), ("f4095", 4095), ("f4096", 4096),
         ("f4097", 4097), ("f65535", 65535), ("f65537", 65537), ("f128k", 128 * K),
         ("f1000003", 1000003), ("f1m", M), ("f1m+1", M + 1), ("f2m+4097", 2 * M + 4097),
         ("f3m-1", 3 * M - 1), ("f5m", 5 * M), ("f7m+3", 7 * M + 3), ("big/f16m", 16 * M)]
if scale == "full":
    files += [("big/f24m+4097", 24 * M + 4097), ("big/f32m-1", 32 * M - 1),
              ("big/f40m+5", 40 * M + 5), ("big/f48m+3", 48 * M + 3)]
    nsmall = 300
else:
    nsmall = 60
for i in range(nsmall):
    kind = i % 3
    size = 0 if i % 29 == 0 else rng.randrange(1, 4 * K) if kind == 0 else \
        rng.randrange(4 * K, 64 * K) if kind == 1 else rng.randrange(64 * K, 512 * K)
    files.append((f"tree/d{i % 7}/e{i % 5}/s{i:03d}", size))
t0 = time.monotonic()
total = 0
out = []
for name, size in files:
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    h = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            chunk = rng.randbytes(min(left, 4 * M))
            f.write(chunk)
            h.update(chunk)
            left -= len(chunk)
    out.append(f"{h.hexdigest()}  {name}\n")
    total += size
# a sparse file: 4097 bytes after a hole of 10 MiB + 123
h = hashlib.sha256()
data = rng.randbytes(4097)
with open(os.path.join(root, "sparse"), "wb") as f:
    f.seek(10 * M + 123)
    f.write(data)
h.update(bytes(10 * M + 123))
h.update(data)
out.append(f"{h.hexdigest()}  sparse\n")
total += 4097
with open(sums, "w") as f:
    f.writelines(out)
print(f"tree_write: {len(out)} files, {total} bytes of data ({total / M:.1f} MiB), "
      f"sizes {min(s for _, s in files)} to {max(s for _, s in files)}, seed {seed:#x}, "
      f"{time.monotonic() - t0:.1f} s")
PY
}

tree_check() {
    local dir=$1 sums=$2 t0 want got
    t0=$(date +%s.%N)
    (cd "$dir" && sha256sum --quiet --strict -c "$sums") || { echo "tree_check: sha256 mismatch in $dir"; return 1; }
    want=$(wc -l <"$sums")
    got=$(cd "$dir" && find . -type f | wc -l)
    [[ $got -eq $want ]] || { echo "tree_check: $dir holds $got files, $sums lists $want"; return 1; }
    echo "tree_check: all $want files of $sums match their sha256 in $dir" \
        "($(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s)"
}

# The kernel's NBD client on rdmablk nbd over rdma://: a file system round
# trip through /dev/nbd0, with a disconnect and a reconnect in the middle.
nbd_fs() {
    set -euo pipefail
    command -v nbd-client >/dev/null || { echo "nbd-client is not installed on the host (run.sh installs it)"; exit 1; }
    start_target
    sock=$WORK/nbd.sock mnt=$WORK/mnt dev=/dev/nbd0
    mkdir -p "$mnt"
    "$BIN/rdmablk" --target "$URL" nbd vol0 --socket "$sock" >"$WORK/nbd.uri" 2>"$WORK/nbd.log" &
    npid=$!
    trap 'set +e; umount "$mnt" 2>/dev/null; nbd-client -d '"$dev"' 2>/dev/null; kill $npid $TPID 2>/dev/null; cat "$WORK/nbd.log"' EXIT
    for _ in $(seq 1 300); do [[ -s $WORK/nbd.uri ]] && break; sleep 0.1; done
    echo "rdmablk nbd serves $(cat "$WORK/nbd.uri")"
    modprobe nbd nbds_max=2
    # nbd-client asks for no block sizes: it must be told the volume's.
    connect() {
        nbd-client -u "$sock" "$dev" -N vol0 -b 4096
        for _ in $(seq 1 100); do [[ $(cat /sys/block/nbd0/size) -gt 0 ]] && break; sleep 0.1; done
        echo "$dev: $(($(cat /sys/block/nbd0/size) * 512)) bytes, logical block $(cat /sys/block/nbd0/queue/logical_block_size)"
    }
    connect
    mkfs.ext4 -q -F "$dev"
    mount "$dev" "$mnt"
    tree_write "$mnt" "$WORK/sums" small
    sync
    umount "$mnt"
    nbd-client -d "$dev"
    echo "disconnected; reconnecting"
    connect
    mount "$dev" "$mnt"
    tree_check "$mnt" "$WORK/sums"
    umount "$mnt"
    e2fsck -fn "$dev"
    nbd-client -d "$dev"
    sigterm_exits_zero "$npid" "rdmablk nbd" "$WORK/nbd.log" nbd-fs-nbd.log
    if grep -q 'panicked\| WARN ' "$WORK/nbd.log"; then echo "rdmablk nbd logged a warning or panicked"; exit 1; fi
    trap - EXIT
    stop_target nbd-fs
}

# rdmablk attach (ublk) over SCHEME (rdma or tcp): a file system round trip
# through /dev/ublkbN with a detach and a second attach in the middle:
#   ublk_roundtrip SCHEME full|small
# attach, mkfs.ext4, mount, tree_write, sync, `rdmablk detach` refused while
# mounted, unmount, e2fsck -fn, detach (attach exits 0, the device is gone),
# attach again, mount, tree_check, unmount. Leaves the device attached
# ($dev, $upid) for the caller, which ends with ublk_end.
ublk_roundtrip() {
    local scheme=$1 scale=$2 url size=256MiB
    [[ $scale == full ]] && size=512MiB
    modprobe ublk_drv
    start_target "$size"
    case $scheme in rdma) url=$URL ;; tcp) url=$TCP_URL ;; *) echo "bad scheme $scheme"; return 1 ;; esac
    mnt=$WORK/umnt
    mkdir -p "$mnt"
    : >"$WORK/ublk.log"
    attach() {
        : >"$WORK/ublk.dev"
        RDMABLK_LOG=info "$BIN/rdmablk" --target "$url" attach vol0 --queues 2 --depth 32 >"$WORK/ublk.dev" 2>>"$WORK/ublk.log" &
        upid=$!
        for _ in $(seq 1 300); do [[ -s $WORK/ublk.dev ]] && break; kill -0 $upid || break; sleep 0.1; done
        dev=$(cat "$WORK/ublk.dev")
        [[ -b $dev ]] || { echo "rdmablk attach gave no device"; cat "$WORK/ublk.log"; exit 1; }
        local sysd=/sys/block/${dev#/dev/}
        echo "$dev over $url: $(($(cat $sysd/size) * 512)) bytes, logical block $(cat $sysd/queue/logical_block_size)," \
            "max $(cat $sysd/queue/max_hw_sectors_kb) KiB, discard max $(cat $sysd/queue/discard_max_bytes)"
    }
    trap 'set +e; umount "$mnt" 2>/dev/null; kill $upid $TPID 2>/dev/null; cat "$WORK/ublk.log"' EXIT
    attach
    mkfs.ext4 -q -F "$dev"
    mount "$dev" "$mnt"
    tree_write "$mnt" "$WORK/usums" "$scale"
    local t0; t0=$(date +%s.%N)
    sync
    echo "sync: $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s; $(df -h "$mnt" | tail -n1)"
    if "$BIN/rdmablk" detach "$dev" 2>"$WORK/detach.err"; then
        echo "detach of a device with a mounted file system succeeded"; exit 1
    fi
    cat "$WORK/detach.err"
    grep -q mounted "$WORK/detach.err"
    umount "$mnt"
    # e2fsck reads the device, not metadata blocks the page cache kept.
    blockdev --flushbufs "$dev"
    e2fsck -fn "$dev"
    "$BIN/rdmablk" detach "$dev"
    local rc=0
    wait "$upid" || rc=$?
    [[ $rc -eq 0 ]] || { echo "rdmablk attach exited with $rc after detach"; exit 1; }
    [[ ! -e $dev ]] || { echo "$dev still exists after detach"; exit 1; }
    echo "detached; attaching again"
    attach
    mount "$dev" "$mnt"
    tree_check "$mnt" "$WORK/usums"
    umount "$mnt"
}

# Ends what ublk_roundtrip left attached: SIGTERM ends rdmablk attach with 0,
# the device is removed, its log has no failed request, error or panic;
# then the target stops.
ublk_end() { # NAME
    sigterm_exits_zero "$upid" "rdmablk attach" "$WORK/ublk.log" "$1-attach.log"
    [[ ! -e $dev ]] || { echo "$dev still exists after SIGTERM"; exit 1; }
    # A reconnection under the emulated VM's load is allowed (the data checks above
    # decide); a request that failed, an error or a panic is not.
    if grep -q 'panicked\|ublk request failed\|ERROR' "$WORK/ublk.log"; then echo "rdmablk attach logged a failed request, an error or a panic"; exit 1; fi
    grep -c 'reconnected' "$WORK/ublk.log" | sed 's/^/reconnections: /' || true
    trap - EXIT
    stop_target "$1"
}

# ublk over rdma://: the round trip with the full tree (about 210 MiB), then
# fio on the raw device: io_uring, O_DIRECT, random writes of mixed sizes at
# queue depth 32 with crc32c verify; then one 4 KiB block fio wrote is zeroed
# behind fio's back and fio --verify_only must find it.
ublk_fs() {
    set -euo pipefail
    ublk_roundtrip rdma full
    command -v fio >/dev/null || { echo "fio is not installed on the host (run.sh installs it)"; exit 1; }
    local job=(--name=raw --filename="$dev" --ioengine=io_uring --direct=1 --rw=randwrite
        --bssplit=4k/30:8k/10:16k/15:64k/20:128k/20:1m/5 --iodepth=32 --size=64M
        --verify=crc32c --verify_fatal=1 --verify_state_save=0 --randrepeat=1)
    fio "${job[@]}" --do_verify=1 --output="$WORK/raw.fio"
    cat "$WORK/raw.fio"
    # The verify phase is the read half of the job: every byte written was read back and checked.
    grep -q 'read: IOPS=' "$WORK/raw.fio" || { echo "fio shows no verify (read) phase"; exit 1; }
    if grep -qi 'verify.*fail\|bad magic\|bad header' "$WORK/raw.fio"; then echo "fio reported a verify failure"; exit 1; fi
    echo "fio randwrite 4k..1m QD32 + crc32c verify of 64 MiB on $dev: ok"
    cp "$WORK/raw.fio" "$RES/ublk-fs-raw.fio" 2>/dev/null || true
    # The verify is real: zero one block fio wrote and replay the job's verify.
    dd if=/dev/zero of="$dev" bs=4096 seek=$((32 * 256)) count=1 oflag=direct status=none
    if fio "${job[@]}" --verify_only >"$WORK/raw-corrupt.fio" 2>&1; then
        cat "$WORK/raw-corrupt.fio"; echo "fio --verify_only passed over a zeroed block"; exit 1
    fi
    grep -i 'verify\|bad magic\|bad header' "$WORK/raw-corrupt.fio" | head -n 5
    grep -qi 'bad magic\|verify.*fail\|crc32c' "$WORK/raw-corrupt.fio" || { cat "$WORK/raw-corrupt.fio"; exit 1; }
    echo "fio --verify_only found the block zeroed at 32 MiB: the verify checks"
    ublk_end ublk-fs
}

# ublk over tcp://: the same round trip with the small tree (about 42 MiB).
ublk_fs_tcp() {
    set -euo pipefail
    ublk_roundtrip tcp small
    ublk_end ublk-fs-tcp
}

# rdmablk attach across a target restart (I/O waits), and past
# ctrl_loss_timeout (I/O fails with EIO). The target listens on a fixed port
# so that the restarted one is where the session reconnects.
ublk_reconnect() {
    set -euo pipefail
    modprobe ublk_drv
    mkdir -p "$WORK/rmnt"
    local mnt=$WORK/rmnt url=rdma://$SIP:4421 conf=$WORK/reconnect.toml
    cat >"$conf" <<EOF
[target]
name = "ci"
listen = ["$url"]
reactors = 2

[[volume]]
name = "vol0"
backend = "file"
path = "$WORK/rvol0.img"
size = "256MiB"
allow_any_host = true
EOF
    target() {
        RUST_LOG=info "$BIN/rdmablk-target" --config "$conf" 2>>"$WORK/rtarget.log" &
        TPID=$!
        for _ in $(seq 1 300); do grep -q "listening on rdma" "$WORK/rtarget.log" && break; sleep 0.1; done
    }
    attach() { # CTRL_LOSS_TMO
        : >"$WORK/rdev"
        RDMABLK_LOG=info "$BIN/rdmablk" --target "$url" --ctrl_loss_tmo="$1" attach vol0 --queues 2 --depth 16 \
            >"$WORK/rdev" 2>>"$WORK/rattach.log" &
        upid=$!
        for _ in $(seq 1 300); do [[ -s $WORK/rdev ]] && break; kill -0 $upid || break; sleep 0.1; done
        dev=$(cat "$WORK/rdev")
        [[ -b $dev ]] || { echo "rdmablk attach gave no device"; exit 1; }
    }
    trap 'set +e; kill $fio 2>/dev/null; umount "$mnt" 2>/dev/null; kill $upid $TPID 2>/dev/null; cat "$WORK/rattach.log"' EXIT
    fio=
    target
    attach 90
    mkfs.ext4 -q -F "$dev"
    mount "$dev" "$mnt"
    # fio writes through the file system (io_uring, O_DIRECT, 4 KiB to 128 KiB
    # at random, queue depth 16) and then reads every block back and checks
    # its crc32c; the target dies and comes back during the writes: once the
    # device has written a quarter of them (fio lays its file out with
    # fallocate, which writes no data).
    local job=(--name=rc --directory="$mnt" --filename=rc.dat --size=96M --rw=randwrite --bsrange=4k-128k
        --direct=1 --ioengine=io_uring --iodepth=16 --verify=crc32c --verify_fatal=1 --verify_state_save=0
        --randrepeat=1)
    local written; written=$(sectors_written "$dev")
    fio "${job[@]}" --do_verify=1 --output="$WORK/rfio.out" &
    fio=$!
    local t0; t0=$(date +%s.%N)
    wait_written "$dev" "$written" $((24 << 20)) "$fio" \
        || { cat "$WORK/rfio.out"; echo "fio ended (or wrote too little in 120 s) before the target was killed"; exit 1; }
    kill -0 "$fio" 2>/dev/null || { cat "$WORK/rfio.out"; echo "fio ended before the target was killed"; exit 1; }
    kill -KILL "$TPID"; wait "$TPID" || true
    echo "target killed at $(date +%T.%N) while fio writes"
    sleep 5
    kill -0 "$fio" 2>/dev/null || { cat "$WORK/rfio.out"; echo "fio ended while the target was down"; exit 1; }
    target
    echo "target restarted at $(date +%T.%N)"
    local rc=0
    wait "$fio" || rc=$?
    cat "$WORK/rfio.out"
    echo "fio ended $rc at $(date +%T.%N), $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s after its start"
    [[ $rc -eq 0 ]] || { echo "fio failed across the restart"; exit 1; }
    grep -q 'read: IOPS=' "$WORK/rfio.out" || { echo "fio shows no verify (read) phase"; exit 1; }
    if grep -qi 'verify.*fail\|bad magic\|bad header' "$WORK/rfio.out"; then echo "fio reported a verify failure"; exit 1; fi
    grep -q "reconnected" "$WORK/rattach.log" || { echo "the session never reconnected"; exit 1; }
    if grep -q "ublk request failed" "$WORK/rattach.log"; then echo "a request failed across the restart"; exit 1; fi
    umount "$mnt"
    blockdev --flushbufs "$dev"
    e2fsck -fn "$dev"
    mount "$dev" "$mnt"
    fio "${job[@]}" --verify_only --output="$WORK/rfio-verify.out"
    grep -q 'read: IOPS=' "$WORK/rfio-verify.out" || { cat "$WORK/rfio-verify.out"; exit 1; }
    echo "after a remount, fio --verify_only checked every block written across the restart: ok"
    cp "$WORK/rfio.out" "$RES/ublk-reconnect-fio.out" 2>/dev/null || true
    umount "$mnt"
    "$BIN/rdmablk" detach "$dev"
    wait "$upid"
    # Past ctrl_loss_timeout: EIO, and the device can still be detached.
    attach 3s
    kill -KILL "$TPID"; wait "$TPID" || true
    echo "target killed at $(date +%T.%N), not restarted"
    if dd if="$dev" of=/dev/null bs=4096 count=1 iflag=direct 2>"$WORK/rdd.err"; then
        echo "a read succeeded with the target gone"; exit 1
    fi
    echo "read failed at $(date +%T.%N): $(cat "$WORK/rdd.err")"
    grep -q "Input/output error" "$WORK/rdd.err"
    grep -q "ublk request failed" "$WORK/rattach.log"
    "$BIN/rdmablk" detach "$dev"
    local rc=0
    wait "$upid" || rc=$?
    echo "rdmablk attach exited with $rc after the detach of a lost session's device"
    [[ ! -e $dev ]] || { echo "$dev still exists after detach"; exit 1; }
    trap - EXIT
    cp "$WORK/rattach.log" "$RES/ublk-reconnect-attach.log" 2>/dev/null || true
}

# ublk user recovery: rdmablk attach is SIGKILLed while fio writes (with
# verify) through ext4 on the device; a new rdmablk attach of the same
# target and volume takes the same device back (the kernel held the
# requests meanwhile and re-issues them); fio ends 0 with no verify error,
# e2fsck -fn is clean. Then an attach killed and not restarted: detach
# deletes the orphaned device.
ublk_recover() {
    set -euo pipefail
    modprobe ublk_drv
    start_target
    mkdir -p "$WORK/cmnt"
    local mnt=$WORK/cmnt upid=0 fpid=0 dev first log=$WORK/cattach.log
    attach() {
        : >"$WORK/cdev"
        RDMABLK_LOG=info "$BIN/rdmablk" --target "$URL" attach vol0 --queues 2 --depth 16 >"$WORK/cdev" 2>>"$log" &
        upid=$!
        for _ in $(seq 1 600); do [[ -s $WORK/cdev ]] && break; kill -0 $upid || break; sleep 0.1; done
        dev=$(cat "$WORK/cdev")
        [[ -b $dev ]] || { echo "rdmablk attach gave no device"; exit 1; }
        echo "$dev served by rdmablk attach pid $upid"
    }
    trap 'set +e; kill $fpid 2>/dev/null; umount "$mnt" 2>/dev/null; kill $upid $TPID 2>/dev/null; cat "$log"' EXIT
    attach
    first=$dev
    mkfs.ext4 -q -F "$dev"
    mount "$dev" "$mnt"
    # The attach dies during the writes: once the device has written a
    # quarter of them (fio lays its file out with fallocate).
    local written; written=$(sectors_written "$dev")
    fio --name=recover --directory="$mnt" --rw=randwrite --bs=4k-128k --size=96M --ioengine=io_uring \
        --direct=1 --iodepth=16 --verify=crc32c --verify_fatal=1 >"$WORK/cfio.out" 2>&1 &
    fpid=$!
    wait_written "$dev" "$written" $((24 << 20)) "$fpid" \
        || { echo "fio ended (or wrote too little in 120 s) before the kill"; cat "$WORK/cfio.out"; exit 1; }
    kill -0 "$fpid" || { echo "fio ended before the kill: nothing was in flight"; cat "$WORK/cfio.out"; exit 1; }
    kill -KILL "$upid"; wait "$upid" || true
    echo "rdmablk attach killed at $(date +%T.%N) while fio writes"
    local rec=/run/rdmablk/ublk/${dev##*/}.toml
    [[ -s $rec ]] || { echo "no attach record $rec"; exit 1; }
    cat "$rec"
    sleep 2
    attach
    echo "taken back at $(date +%T.%N)"
    [[ $dev == "$first" ]] || { echo "a new device $dev instead of $first"; exit 1; }
    grep -q "taking back $dev" "$log"
    grep -q "ublk device taken back" "$log"
    local frc=0
    wait "$fpid" || frc=$?
    fpid=0
    cat "$WORK/cfio.out"
    [[ $frc -eq 0 ]] || { echo "fio exited with $frc across the takeover"; exit 1; }
    grep -q "err= 0" "$WORK/cfio.out"
    if grep -qi "verify.*fail\|bad magic\|crc32c: verify" "$WORK/cfio.out"; then echo "fio found bad data"; exit 1; fi
    umount "$mnt"
    e2fsck -fn "$dev"
    "$BIN/rdmablk" detach "$dev"
    wait "$upid"
    [[ ! -e $rec ]] || { echo "the record outlived a normal detach"; exit 1; }
    # Killed and never restarted: the orphan is deleted by detach.
    attach
    kill -KILL "$upid"; wait "$upid" || true
    sleep 1
    "$BIN/rdmablk" detach "$dev" | tee "$WORK/cdetach.out"
    grep -q "had ended" "$WORK/cdetach.out"
    [[ ! -e $dev ]] || { echo "$dev still exists after detach"; exit 1; }
    if grep -q 'panicked' "$log"; then echo "rdmablk attach panicked"; exit 1; fi
    trap - EXIT
    cp "$log" "$RES/ublk-recover-attach.log" 2>/dev/null || true
    stop_target ublk-recover
}

# The boot path of rdmablk-attach@.service: `rdmablk attach --config FILE`
# started before its target exists keeps trying, attaches once the target
# is up (within a retry), and says READY=1 on systemd's notification socket
# (a datagram socket this step listens on, as systemd would).
ublk_boot() {
    set -euo pipefail
    modprobe ublk_drv
    local url=rdma://$SIP:4422 conf=$WORK/boot-target.toml afile=$WORK/boot-attach.toml
    printf '[target]\nname = "ci"\nlisten = ["%s"]\nreactors = 1\n\n[[volume]]\nname = "bootvol"\nbackend = "memory"\nsize = "64MiB"\nallow_any_host = true\n' \
        "$url" >"$conf"
    printf 'target = "%s"\nvolume = "bootvol"\nqueues = 1\ndepth = 16\nconnect_retry = "1s"\n' "$url" >"$afile"
    # systemd's side of sd_notify: a datagram socket whose messages we keep.
    /usr/bin/python3 -c 'import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
out = open(sys.argv[2], "ab", buffering=0)
while True:
    out.write(s.recv(4096) + b"\n")' "$WORK/notify.sock" "$WORK/notify.log" &
    local npid=$! tpid=
    for _ in $(seq 1 50); do [[ -S $WORK/notify.sock ]] && break; sleep 0.1; done
    : >"$WORK/bdev"
    NOTIFY_SOCKET=$WORK/notify.sock "$BIN/rdmablk" attach --config "$afile" >"$WORK/bdev" 2>"$WORK/battach.log" &
    local upid=$!
    trap 'set +e; kill $upid $tpid $npid 2>/dev/null; cat "$WORK/battach.log"' EXIT
    sleep 4
    [[ ! -s $WORK/bdev ]] || { echo "attached with no target"; exit 1; }
    grep -q "waiting for the target $url" "$WORK/battach.log" || { echo "no retry line"; exit 1; }
    echo "no target yet: $(grep -c 'waiting for the target' "$WORK/battach.log") attempts logged"
    RUST_LOG=info "$BIN/rdmablk-target" --config "$conf" 2>"$WORK/btarget.log" &
    tpid=$!
    for _ in $(seq 1 300); do [[ -s $WORK/bdev ]] && break; kill -0 $upid || break; sleep 0.1; done
    local dev; dev=$(cat "$WORK/bdev")
    [[ -b $dev ]] || { echo "rdmablk attach --config gave no device"; exit 1; }
    echo "attached as $dev once the target came up"
    for _ in $(seq 1 50); do grep -q "READY=1" "$WORK/notify.log" 2>/dev/null && break; sleep 0.1; done
    grep -q "READY=1" "$WORK/notify.log" || { echo "no READY=1 notification"; exit 1; }
    grep -a "STATUS=" "$WORK/notify.log" | tail -n 2
    head -c 4M /dev/urandom >"$WORK/bsrc"
    dd if="$WORK/bsrc" of="$dev" bs=1M oflag=direct status=none
    cmp <(dd if="$dev" bs=1M count=4 iflag=direct status=none) "$WORK/bsrc"
    echo "4 MiB written and read back through $dev"
    "$BIN/rdmablk" detach "$dev"
    wait "$upid"
    trap - EXIT
    kill $tpid $npid 2>/dev/null || true
}

# The cost of the block-layer path: fio on /dev/ublkbN (io_uring, O_DIRECT;
# the kernel's block layer, ublk and rdmablk attach in the path) against
# rdmablk-bench (the initiator library alone), on the same volume, target,
# queue depth and runtime: 4 KiB random reads at QD1 and QD16 and 128 KiB
# sequential reads at QD16 (rdmablk-bench's compare cases). Two rounds, the
# order of the two swapped in the second. TCG-emulated: the table
# ($RES/ublk-vs-bench.txt) gives ratios, not absolute figures; the step fails
# only if a run fails.
ublk_vs_bench() {
    set -euo pipefail
    modprobe ublk_drv
    start_target
    local out=$RES/ublk-vs-bench
    mkdir -p "$out"
    RDMABLK_LOG=info "$BIN/rdmablk" --target "$URL" attach vol0 --queues 1 --depth 32 >"$WORK/vdev" 2>"$WORK/vattach.log" &
    upid=$!
    # On a failure: the attach log, then the target's last lines (the host
    # shows only a failed step's last 40 lines; a closed connection's
    # reason is in the target's log).
    trap 'set +e; kill $upid $TPID 2>/dev/null; echo "--- rdmablk attach log (last lines)"; tail -n 8 "$WORK/vattach.log"; echo "--- target log (last lines)"; tail -n 20 "$WORK/target.log"' EXIT
    for _ in $(seq 1 300); do [[ -s $WORK/vdev ]] && break; kill -0 $upid || break; sleep 0.1; done
    dev=$(cat "$WORK/vdev")
    [[ -b $dev ]] || { echo "rdmablk attach gave no device"; exit 1; }
    echo "$dev attached over $URL (1 queue, depth 32)"
    # A file volume's holes cost the target less than data: fill the region.
    dd if=/dev/urandom of="$dev" bs=1M count=64 oflag=direct status=none
    local common=(--size=64M --runtime=4s --ramp_time=1s --time_based)
    local c name rw bs qd round sys
    for round in 1 2; do
        for c in "randread-4k-qd1 randread 4k 1" "randread-4k-qd16 randread 4k 16" "read-128k-qd16 read 128k 16"; do
            read -r name rw bs qd <<<"$c"
            local order=(ublk bench)
            [[ $round -eq 2 ]] && order=(bench ublk)
            for sys in "${order[@]}"; do
                echo "round $round: $name on $sys"
                if [[ $sys == ublk ]]; then
                    fio --name="$name" --filename="$dev" --direct=1 --ioengine=io_uring --rw="$rw" --bs="$bs" \
                        --iodepth="$qd" "${common[@]}" --output-format=json --output="$out/$name.ublk.$round.json"
                else
                    "$BIN/rdmablk-bench" --target="$URL" --volume=vol0 --eta=never --name="$name" --rw="$rw" --bs="$bs" \
                        --iodepth="$qd" "${common[@]}" --output_format=json --output="$out/$name.bench.$round.json"
                fi
            done
        done
    done
    /usr/bin/python3 - "$out" "$(uname -r)" >"$RES/ublk-vs-bench.txt" <<'PY'
import json, os, sys
out, kver = sys.argv[1], sys.argv[2]
cases = ["randread-4k-qd1", "randread-4k-qd16", "read-128k-qd16"]
def load(case, sys_, rnd):
    with open(os.path.join(out, f"{case}.{sys_}.{rnd}.json")) as f:
        j = json.load(f)["jobs"][0]
    if j.get("error", 0):
        raise SystemExit(f"{case} {sys_} round {rnd}: error {j['error']}")
    r = j["read"]
    return r["iops"], r["bw_bytes"] / 2**20, r["lat_ns"]["mean"] / 1000
print(f"fio on /dev/ublkb0 (ublk) vs rdmablk-bench, same rdma:// target and volume, kernel {kver}, qemu TCG")
print("ratio = ublk / bench; IOPS and latency are means of 2 rounds of 4 s (1 s ramp), alternated")
print("TCG-emulated: read the ratios, not the absolute figures")
print()
hdr = f"{'case':<18} {'ublk IOPS':>10} {'bench IOPS':>10} {'IOPS ratio':>10} {'per round':>11} {'ublk MiB/s':>10} {'bench MiB/s':>11} {'ublk lat us':>11} {'bench lat us':>12} {'lat ratio':>9}"
print(hdr)
print("-" * len(hdr))
for c in cases:
    u = [load(c, "ublk", r) for r in (1, 2)]
    b = [load(c, "bench", r) for r in (1, 2)]
    m = lambda xs, i: sum(x[i] for x in xs) / len(xs)
    per = "/".join(f"{u[k][0] / b[k][0]:.2f}" for k in range(2))
    print(f"{c:<18} {m(u,0):>10.0f} {m(b,0):>10.0f} {m(u,0)/m(b,0):>10.2f} {per:>11} {m(u,1):>10.1f} {m(b,1):>11.1f} "
          f"{m(u,2):>11.0f} {m(b,2):>12.0f} {m(u,2)/m(b,2):>9.2f}")
PY
    cat "$RES/ublk-vs-bench.txt"
    "$BIN/rdmablk" detach "$dev"
    wait "$upid"
    trap 'kill $TPID 2>/dev/null' EXIT
    echo "--- rdmablk attach log"; cat "$WORK/vattach.log"
    trap - EXIT
    stop_target ublk-vs-bench
}

# The cost of per-command memory windows on rxe: the same 4 KiB random-read
# run with scoping on and off. Figures only (TCG-emulated, not a benchmark);
# the step fails only if a run fails.
scoping_cost() {
    set -euo pipefail
    start_target
    trap 'kill $TPID 2>/dev/null' EXIT
    local s
    for s in 1 0 1 0; do
        "$BIN/rdmablk-bench" --target="$URL" --volume=vol0 --eta=never --name="rkey_scoping=$s" \
            --rw=randread --bs=4k --iodepth=16 --size=64M --runtime=3s --time_based --rkey_scoping="$s" |
            grep -E 'rkey_scoping|IOPS=|^ +clat \(|cpu'
    done
    trap - EXIT
    stop_target scoping-cost
}

# The NVMe-oF step bodies (nvme_tcp_fs ... nvme_rdma_vs_nvmet) live in
# nvme-of.sh beside this script in the
# repository. run.sh copies only this file into the VM, so it is found
# through the directory the steps run in (the repository's root in the CI
# stage) when it is not next to this file.
NVME_TCP_SH=
for _f in "$(dirname "$SELF")/nvme-of.sh" "${RDMAVM_CWD:-$PWD}/tests/rdma-vm/nvme-of.sh" "$PWD/tests/rdma-vm/nvme-of.sh"; do
    if [[ -r $_f ]]; then NVME_TCP_SH=$_f; break; fi
done
if [[ -n $NVME_TCP_SH ]]; then
    # shellcheck source=nvme-of.sh
    source "$NVME_TCP_SH"
    # The fenced failover of an RBD volume (nvme_rbd_failover), beside it.
    if [[ -r $(dirname "$NVME_TCP_SH")/nvme-rbd-failover.sh ]]; then
        # shellcheck source=nvme-rbd-failover.sh
        source "$(dirname "$NVME_TCP_SH")/nvme-rbd-failover.sh"
    fi
    # fio on the kernel's NVMe/TCP host over an rbd volume against fio's
    # rbd engine (nvme_tcp_vs_fio_rbd), beside it.
    if [[ -r $(dirname "$NVME_TCP_SH")/nvme-vs-fio-rbd.sh ]]; then
        # shellcheck source=nvme-vs-fio-rbd.sh
        source "$(dirname "$NVME_TCP_SH")/nvme-vs-fio-rbd.sh"
    fi
fi

# ------------------------------------------------------------------ steps
skip() { # NAME WHY: a visible SKIPPED line in the summary
    printf '%s\tSKIPPED\t0.0\t-\n' "$1" >>"$RDMAVM_STEPS"
    echo "<<< step $1: SKIPPED ($2)" >/dev/console 2>/dev/null || true
}
main() {
local rc=0
export RUST_BACKTRACE=1
if [[ -n ${RDMABLK_CI_STEPS:-} ]]; then
    # Only the steps named (and scratch-fs): `step` and `skip` pass over the
    # others quietly. A named step whose command has an empty word is one of
    # the test executables ci-build.sh finds (RDMABLK_CONFORMANCE ...), not
    # given to this run: it is shown SKIPPED.
    eval "$(declare -f step | sed '1s/^step /_ci_step /')"
    eval "$(declare -f skip | sed '1s/^skip /_ci_skip /')"
    _ci_selected() {
        local p
        for p in scratch-fs $RDMABLK_CI_STEPS; do
            # shellcheck disable=SC2053
            [[ $1 == $p ]] && return 0
        done
        return 1
    }
    step() {
        _ci_selected "$1" || return 0
        local a
        for a in "$@"; do
            if [[ -z $a ]]; then
                _ci_skip "$1" "its test executable was not given (run.sh -e RDMABLK_CONFORMANCE=PATH and the like: see ci-build.sh)"
                return 0
            fi
        done
        local round repeat=${RDMABLK_CI_REPEAT:-1}
        [[ $1 != scratch-fs ]] || repeat=1
        for ((round = 1; round <= repeat; round++)); do
            if ! _ci_step "$@"; then
                [[ $repeat -eq 1 ]] || echo "RDMABLK_CI_REPEAT: $1 failed in round $round of $repeat"
                return 1
            fi
        done
    }
    skip() { _ci_selected "$1" || return 0; _ci_skip "$@"; }
    : "${RDMABLK_CONFORMANCE:=}" "${RDMABLK_DATA_PATH:=}" "${RDMABLK_BAD_COMMANDS:=}" "${RDMABLK_SCOPING:=}"
    : "${RDMABLK_FENCE:=}" "${RDMABLK_COMMAND_SLOTS:=}" "${RDMABLK_CAPACITY:=}" "${RDMABLK_NVME_RDMA_TESTS:=}"
    echo "RDMABLK_CI_STEPS: only scratch-fs $RDMABLK_CI_STEPS${RDMABLK_CI_REPEAT:+, each up to $RDMABLK_CI_REPEAT times}"
fi
step scratch-fs --timeout 120 bash "$SELF" scratch_fs || rc=1
counters >"$RES/counters.before"
# rxe (Linux 6.1) checks an access through a memory window against the
# window's parent region, not the window's own bounds (rxe_resp.c check_rkey):
# the two window-bounds tests fail on it, as they would not on hardware. The
# deviation is documented in SECURITY.md ("Providers").
rxe_defects=(--skip window_refuses_a_byte_before --skip window_refuses_a_byte_past)
# rxe from Linux 6.9 on ("RDMA/rxe: Fix multiple rxe_qp_error calls") moves
# the queue pair to the error state on a local protection fault and reports
# the faulting work request itself as flushed (WR_FLUSH_ERR), where hardware
# and rxe on 6.1 report LOC_PROT_ERR (or LOC_QP_OP_ERR) for it. The two
# tests pass on 6.1 and check the hardware behaviour; on later kernels they
# are skipped, and the summary says so.
case $(uname -r) in
    6.1.*) ;;
    *) rxe_defects+=(--skip invalid_local_lkey_in_send --skip local_sge_outside_its_region)
       echo "rxe on $(uname -r): the faulting work request of a local protection error is reported flushed; skipping its two tests" ;;
esac
step conformance-verbs --timeout 600 env RDMABLK_FABRIC_URL="rdma://$SIP:0" \
    "$RDMABLK_CONFORMANCE" --test-threads=1 "${rxe_defects[@]}" || rc=1
counters >"$RES/counters.after"
step rxe-link-used --timeout 30 bash "$SELF" link_used || rc=1
step target-cli-rdma --timeout 300 bash "$SELF" cli || rc=1
sys=(env RDMABLK_TEST_SCHEME=rdma RDMABLK_TEST_HOST="$SIP" RDMABLK_BIN_DIR="$BIN")
# The _on_rbd twins (issue 54) run in the host stage: what they add is the
# rbd store, whose path through the engine does not depend on the fabric,
# and here each would pay a Ceph cluster in the guest under TCG (data_path's
# took 6 minutes, bad_commands' 2, near the stage's time limit).
step data-path-rdma --timeout 900 "${sys[@]}" "$RDMABLK_DATA_PATH" --test-threads=1 \
    --skip read_only_volume_refuses_writes_with_its_status --skip _on_rbd || rc=1
step read-only-rejection-rdma --timeout 300 "${sys[@]}" "$RDMABLK_DATA_PATH" --test-threads=1 \
    --exact read_only_volume_refuses_writes_with_its_status || rc=1
step bad-commands-rdma --timeout 600 "${sys[@]}" "$RDMABLK_BAD_COMMANDS" --test-threads=1 --skip _on_rbd || rc=1
# The write outside the command lands in the same registered buffer, which
# rxe's window check lets through (see rxe_defects above).
step malicious-target-rdma --timeout 300 "${sys[@]}" "$RDMABLK_SCOPING" --test-threads=1 \
    --skip a_write_outside_the_command_fails_and_changes_nothing || rc=1
step fence-rdma --timeout 300 "${sys[@]}" "$RDMABLK_FENCE" --test-threads=1 || rc=1
# The tcp provider's late mode (the second test) does not exist on verbs;
# the kernel's own order is what the first test meets there.
step command-slots-rdma --timeout 300 "${sys[@]}" "$RDMABLK_COMMAND_SLOTS" --test-threads=1 \
    --exact late_send_completions_never_turn_a_legal_queue_depth_into_queue_full || rc=1
step capacity-rdma --timeout 300 "${sys[@]}" "$RDMABLK_CAPACITY" --test-threads=1 || rc=1
# target-daemon/tests/nvme_rdma.rs on real verbs: a host written against
# the fabric API (keyed SGLs, raw rdma_cm private data, SEND with
# Invalidate) and the hostile cases: CM requests with bad fields, keys
# outside the host's registration, bad SGL types, short capsules, a Connect
# for another queue than the CM request named. Its reset test is a step of
# its own (nvme-rdma-reset, below), not run twice.
local nvme_rdma_reset_test=a_host_that_drops_its_queue_pairs_mid_io_reconnects_at_once_and_no_old_write_lands_late
step nvme-rdma-hostile --timeout 300 env RDMABLK_NVME_RDMA_HOST="$SIP" "$RDMABLK_NVME_RDMA_TESTS" --test-threads=1 \
    --skip "$nvme_rdma_reset_test" || rc=1
# The same file's NVMe/RDMA counterpart of tests/tests/nvme_reset.rs: a host
# whose queue pairs all go at once mid-I/O (no NVMe Disconnect) reconnects
# with the same host NQN; its admin Connect must succeed within 1 s and no
# write of the old association may land after that answer. 50 rounds (about
# 42 s under TCG) unless RDMABLK_RESET_ROUNDS says otherwise (run.sh -e); --nocapture
# keeps the test's summary (Connect times, writes landed) in the step log.
step nvme-rdma-reset --timeout 300 env RDMABLK_NVME_RDMA_HOST="$SIP" "$RDMABLK_NVME_RDMA_TESTS" --test-threads=1 \
    --exact "$nvme_rdma_reset_test" --nocapture || rc=1
step nbd-fs-rdma --timeout 600 bash "$SELF" nbd_fs || rc=1
step ublk-fs-rdma --timeout 600 bash "$SELF" ublk_fs || rc=1
step ublk-fs-tcp --timeout 300 bash "$SELF" ublk_fs_tcp || rc=1
step ublk-reconnect-rdma --timeout 600 bash "$SELF" ublk_reconnect || rc=1
step ublk-boot-rdma --timeout 300 bash "$SELF" ublk_boot || rc=1
step ublk-recover-rdma --timeout 300 bash "$SELF" ublk_recover || rc=1
if [[ -n $NVME_TCP_SH ]]; then
    step nvme-tcp-fs --timeout 600 bash "$SELF" nvme_tcp_fs || rc=1
    step nvme-tcp-sighup --timeout 300 bash "$SELF" nvme_tcp_sighup || rc=1
    step nvme-tcp-large-io --timeout 300 bash "$SELF" nvme_tcp_large_io || rc=1
    step nvme-tcp-multipath --timeout 300 bash "$SELF" nvme_tcp_multipath || rc=1
    step nvme-tcp-restart --timeout 600 bash "$SELF" nvme_tcp_restart || rc=1
    step nvme-tcp-auth --timeout 300 bash "$SELF" nvme_tcp_auth || rc=1
    # Two gateways of one Ceph RBD image (a dev cluster in the guest), the
    # kernel host's native multipath across them, the owner frozen under
    # fio and fenced, cycle after cycle within a budget of 420 s
    # (nvme-rbd-failover.sh): the 20 cycles at about 16 s each, 7 to 8
    # minutes in all under TCG.
    if ! declare -F nvme_rbd_failover >/dev/null; then
        step nvme-rbd-multipath-failover --timeout 30 bash -c "echo 'nvme-rbd-failover.sh not found beside $NVME_TCP_SH'; exit 1" || rc=1
    elif command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null && command -v ceph >/dev/null && command -v rbd >/dev/null; then
        # The cycles' budget plus 300 s for the cluster, the gateways and
        # the host's setup (720 s at the default budget).
        rbd_budget=${RDMABLK_RBD_FAILOVER_BUDGET:-420}
        [[ $rbd_budget =~ ^[0-9]+$ ]] || rbd_budget=420
        step nvme-rbd-multipath-failover --timeout $((rbd_budget + 300)) bash "$SELF" nvme_rbd_failover || rc=1
    else
        skip nvme-rbd-multipath-failover "ceph-mon, ceph-osd, ceph or rbd is not installed on the host (apt-get install ceph-mon ceph-osd ceph-common)"
    fi
    # The measurements take about 15 s per fio run under TCG (10 s of I/O),
    # two runs per case and round, plus about a minute of setup: the limit
    # follows RDMABLK_NVME_VS_ROUNDS and RDMABLK_NVME_VS_CASES (at least
    # 600 s, which the default two rounds of four cases need).
    local vs_cases vs_rounds=${RDMABLK_NVME_VS_ROUNDS:-2} vs_timeout
    read -ra vs_cases <<<"${RDMABLK_NVME_VS_CASES:-a b c d}"
    [[ $vs_rounds =~ ^[1-9][0-9]*$ ]] || vs_rounds=2
    vs_timeout=$((280 + vs_rounds * ${#vs_cases[@]} * 2 * 20))
    ((vs_timeout >= 600)) || vs_timeout=600
    step nvme-tcp-vs-nvmet --timeout "$vs_timeout" bash "$SELF" nvme_tcp_vs_nvmet || rc=1
    # The kernel's NVMe/TCP host on rdmablk-target over an RBD image against
    # fio's rbd engine on the same in-guest cluster (issue 54, item 6): not
    # in the default list, CI's time being near its limit; only when
    # RDMABLK_CI_STEPS names it exactly (bench/vs-rbd-vm.sh), not through a
    # glob such as nvme-tcp-*. Its limit: about 75 s for the cluster and
    # the fill, about 45 s per case and round (two runs of 12 s, fio's and
    # the target's starts, connect and disconnect under TCG): 75 s with margin.
    if [[ " ${RDMABLK_CI_STEPS:-} " == *" nvme-tcp-vs-fio-rbd "* ]]; then
        local rv_cases rv_rounds=${RDMABLK_RBD_VS_ROUNDS:-2}
        read -ra rv_cases <<<"${RDMABLK_RBD_VS_CASES:-a b c d e f}"
        [[ $rv_rounds =~ ^[1-9][0-9]*$ ]] || rv_rounds=2
        if ! declare -F nvme_tcp_vs_fio_rbd >/dev/null; then
            step nvme-tcp-vs-fio-rbd --timeout 30 bash -c "echo 'nvme-vs-fio-rbd.sh not found beside $NVME_TCP_SH'; exit 1" || rc=1
        elif command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null && command -v ceph >/dev/null && command -v rbd >/dev/null; then
            step nvme-tcp-vs-fio-rbd --timeout $((300 + rv_rounds * ${#rv_cases[@]} * 75)) \
                bash "$SELF" nvme_tcp_vs_fio_rbd || rc=1
        else
            skip nvme-tcp-vs-fio-rbd "ceph-mon, ceph-osd, ceph or rbd is not installed on the host (apt-get install ceph-mon ceph-osd ceph-common)"
        fi
    fi
    step nvme-rdma-fs --timeout 600 bash "$SELF" nvme_rdma_fs || rc=1
    step nvme-rdma-sighup --timeout 300 bash "$SELF" nvme_rdma_sighup || rc=1
    step nvme-rdma-large-io --timeout 300 bash "$SELF" nvme_rdma_large_io || rc=1
    step nvme-rdma-restart --timeout 600 bash "$SELF" nvme_rdma_restart || rc=1
    step nvme-rdma-auth --timeout 300 bash "$SELF" nvme_rdma_auth || rc=1
    step nvme-rdma-vs-nvmet --timeout "$vs_timeout" bash "$SELF" nvme_rdma_vs_nvmet || rc=1
else
    # Recorded as failed: the steps exist, their script was not found.
    step nvme-tcp-fs --timeout 30 bash -c "echo 'nvme-of.sh not found (next to $SELF or under ${RDMAVM_CWD:-$PWD}/tests/rdma-vm)'; exit 1" || rc=1
fi
if [[ -x $BIN/rdmablk-bench ]]; then
    step bench-verify-rdma --timeout 300 bash "$SELF" bench || rc=1
    step scoping-cost-rdma --timeout 300 bash "$SELF" scoping_cost || rc=1
    step ublk-vs-bench-rdma --timeout 400 bash "$SELF" ublk_vs_bench || rc=1
else
    skip bench-verify-rdma "$BIN/rdmablk-bench is not built"
    skip ublk-vs-bench-rdma "$BIN/rdmablk-bench is not built"
fi
step port-down-logged --timeout 120 bash "$SELF" port_down || rc=1
return $rc
}

# A step body runs in its own bash (`ci-guest.sh BODY`); without arguments
# the steps are recorded. One `exit` after the if: bash resumes there even
# after an expansion error inside a body.
port_down() {
    set -euo pipefail
    start_target
    local netdev
    netdev=$(cat /sys/class/infiniband/${RDMAVM_SERVER_DEV:-rxe0}/ports/1/gid_attrs/ndevs/0)
    trap 'set +e; kill $TPID 2>/dev/null; ip link set "$netdev" up' EXIT
    echo "+ ip link set $netdev down"
    ip link set "$netdev" down
    for _ in $(seq 1 100); do
        grep -q "RDMA port down" "$WORK/target.log" && break
        sleep 0.1
    done
    ip link set "$netdev" up
    grep "RDMA port" "$WORK/target.log" || true
    grep -q "RDMA port down" "$WORK/target.log"
    trap - EXIT
    stop_target port-down
}

if [[ $# -gt 0 ]]; then
    "$@"
else
    # shellcheck source=guest-lib.sh
    source "$RDMAVM_LIB"
    main
fi
exit $?
