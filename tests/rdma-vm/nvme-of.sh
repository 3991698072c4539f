# NVMe-oF steps of the Soft-RoCE CI stage: the kernel's NVMe-oF host
# (nvme-tcp or nvme-rdma, nvme-cli) against rdmablk-target's NVMe-oF front
# end (`nvme+tcp://` or `nvme+rdma://` in [target] listen, beside `tcp://`
# or `rdma://`), and the kernel's own nvmet-tcp or nvmet-rdma target as a
# measured peer. Sourced by ci-guest.sh, which records each body as one
# step (`step nvme-tcp-fs ... bash ci-guest.sh nvme_tcp_fs`) and provides
# WORK, SIP, BIN, RES, tree_write, tree_check, sectors_written and
# wait_written. Every body runs for both
# transports: nvme_tcp_X and nvme_rdma_X set NVME_TRANSPORT (tcp, rdma) and
# run nvme_X; below, "tcp" stands for either (rdma: the v1 listener is
# rdma://, the host connects with -t rdma over rxe, nvmet-rdma is the peer).
#
#   nvme-tcp-fs        rdmablk-target with two file volumes, listening on
#                      tcp:// and nvme+tcp://SIP:4420 at once; modprobe nvme-tcp;
#                      `nvme discover` lists the subsystem NQN (the default,
#                      nqn.2014-08.io.rdmablk:ci) with trtype tcp; `nvme connect` gives
#                      /dev/nvmeXnY; id-ctrl (mn, sn, subnqn) and id-ns (nsze *
#                      LBA size = the volume's size) are sane; mkfs.ext4, mount,
#                      the small file tree, unmount, e2fsck -fn clean, mount,
#                      every sha256 checked; fio on the raw namespace (io_uring,
#                      direct=1, 4 KiB to 128 KiB random writes at QD16, crc32c
#                      verify of 64 MiB) while the rdmablk CLI, over tcp:// in a
#                      loop, reads the same volume (bytes written through NVMe,
#                      compared) and writes, reads back and checks 1 MiB of the
#                      other volume (nvol1); a write over tcp:// is read back through
#                      NVMe; Write Zeroes (blkdiscard -z, read back as zeroes)
#                      and Dataset Management (blkdiscard) through the
#                      namespace; `nvme disconnect`; SIGTERM ends the target with 0
#   nvme-tcp-sighup    connected host; a second [[volume]] appended to the
#                      config and SIGHUP: the host shows namespace 2 without a
#                      reconnect (the same controller, "rescanning namespaces"
#                      from the namespace-attribute-changed event), and 1 MiB
#                      goes through it
#   nvme-tcp-large-io  single commands as large as MDTS (issue 53): the target
#                      with max_io_size = "4MiB"; `nvme connect -Q 1024`; id-ctrl
#                      says mdts 10 and the host's I/O queues have 1024 entries;
#                      nvme-cli's `nvme write` and `nvme read` of 4 MiB (-c 1023
#                      -z 4194304, one command each) and of 1 MiB read back
#                      identical and are in the backing file (capped, and said so,
#                      at the host's max_hw_sectors_kb should the transport's
#                      host driver allow less than MDTS: nvme-rdma allows 1 MiB
#                      and 256 entries)
#   nvme-tcp-restart   `nvme connect --ctrl-loss-tmo=60 --reconnect-delay=1`
#                      (explicit [target] nqn), ext4 mounted, files written; fio
#                      (verify=crc32c) writes through the file system while the
#                      target is SIGKILLed and restarted 3 s later; the host
#                      reconnects, fio ends 0 with its verify clean, more files
#                      are written, every sha256 checked, unmount, e2fsck -fn clean
#                      (mkfs without discard: DSM is nvme-tcp-fs's to check)
#   nvme-tcp-vs-nvmet  a measurement (fails only on errors): see the comment of
#                      nvme_tcp_vs_nvmet below
#   nvme-tcp-auth      in-band authentication (DH-HMAC-CHAP): secrets from
#                      `nvme gen-dhchap-key`, a [[host]] with dhchap_key_file and
#                      dhchap_ctrl_key_file (ffdhe2048, SHA-256); connect with
#                      --dhchap-secret, ext4 round trip; a wrong secret refused
#                      (nvme connect fails, the target logs the host NQN);
#                      bidirectional with --dhchap-ctrl-secret, 1 MiB read back
#   nvme-rdma-auth     the same over NVMe/RDMA
#   nvme-tcp-multipath two gateways of one volume (issue 54): two
#                      rdmablk-target processes export one backing file under
#                      one subsystem NQN, on SIP:4420 and SIP:4422, with
#                      disjoint nvme_cntlid ranges; `nvme connect` to each; the
#                      host's native multipath has one subsystem with two
#                      controllers (ids in their ranges), one head disk, two
#                      paths, each ana_state optimized in ANA group 1, and
#                      no complaint (duplicate cntlid, MNAN, ANA log size, ids
#                      that differ); 8 MiB read back through the head; with
#                      iopolicy round-robin, fio (crc32c verify) writes through
#                      the head while gateway A is SIGKILLed: fio ends clean on
#                      gateway B's path; A restarted, its controller reconnects
#                      and its path is optimized again; disconnect of both
#
# The ports are fixed (a restarted target must be where the host reconnects):
# rdmablk-target's NVMe/TCP on SIP:4420, nvmet-tcp on SIP:4421. The host
# side's messages ("nvme nvmeN: ...") are printed at the end of each step,
# and a step fails when they hold a command the target failed ("I/O Error")
# or a "Firmware bug" (an Identify field the kernel rejects).

NVME_PORT=4420
NVMET_PORT=4421
NVME_DIR=$WORK/nvme
NVME_DEFAULT_NQN=nqn.2014-08.io.rdmablk:ci
NVME_TRANSPORT=${NVME_TRANSPORT:-tcp}

# The step bodies for each transport.
nvme_tcp_fs() { NVME_TRANSPORT=tcp nvme_fs; }
nvme_tcp_sighup() { NVME_TRANSPORT=tcp nvme_sighup; }
nvme_tcp_restart() { NVME_TRANSPORT=tcp nvme_restart; }
nvme_tcp_vs_nvmet() { NVME_TRANSPORT=tcp nvme_vs_nvmet; }
nvme_rdma_fs() { NVME_TRANSPORT=rdma nvme_fs; }
nvme_rdma_sighup() { NVME_TRANSPORT=rdma nvme_sighup; }
nvme_rdma_restart() { NVME_TRANSPORT=rdma nvme_restart; }
nvme_rdma_vs_nvmet() { NVME_TRANSPORT=rdma nvme_vs_nvmet; }
nvme_tcp_auth() { NVME_TRANSPORT=tcp nvme_auth; }
nvme_rdma_auth() { NVME_TRANSPORT=rdma nvme_auth; }
nvme_tcp_large_io() { NVME_TRANSPORT=tcp nvme_large_io; }
nvme_tcp_multipath() { NVME_TRANSPORT=tcp nvme_multipath; }
nvme_rdma_large_io() { NVME_TRANSPORT=rdma nvme_large_io; }

# The kernel's messages since nvme_dmesg_mark (for each step's log).
nvme_dmesg_mark() { NVME_DMESG0=$(dmesg | wc -l); }
nvme_dmesg_since() { dmesg | tail -n +$((${NVME_DMESG0:-0} + 1)); }

# Writes $NVME_DIR/target.toml: rdmablk-target on tcp://SIP:0 and
# nvme+tcp://SIP:4420 (rdma: rdma:// and nvme+rdma://) with the file
# volumes given as NAME:SIZE[:NSID]...;
# NVME_NQN, when set, goes in as [target] nqn.
nvme_target_conf() {
    local v name size nsid
    mkdir -p "$NVME_DIR"
    {
        echo '[target]'
        echo 'name = "ci"'
        echo "listen = [\"$NVME_TRANSPORT://$SIP:0\", \"nvme+$NVME_TRANSPORT://$SIP:$NVME_PORT\"]"
        echo 'reactors = 2'
        [[ -z ${NVME_NQN:-} ]] || echo "nqn = \"$NVME_NQN\""
    } >"$NVME_DIR/target.toml"
    for v in "$@"; do nvme_conf_volume "$v" >>"$NVME_DIR/target.toml"; done
}

nvme_conf_volume() { # NAME:SIZE[:NSID]
    local name size nsid
    IFS=: read -r name size nsid <<<"$1"
    printf '\n[[volume]]\nname = "%s"\nbackend = "file"\npath = "%s"\nsize = "%s"\nallow_any_host = true\n' \
        "$name" "$NVME_DIR/$name.img" "$size"
    [[ -z $nsid ]] || echo "nsid = $nsid"
}

# Starts rdmablk-target on $NVME_DIR/target.toml (appending to its log);
# waits for tcp:// in the log and the NVMe/TCP port in `ss` (rdma: rdma://
# and nvme+rdma:// in the log: rdma_cm ports are not sockets); sets TPID and
# TCP_URL (the v1 listener's URL, rdma:// for rdma).
nvme_start_target() {
    local log=$NVME_DIR/target.log
    touch "$log"
    local from; from=$(wc -l <"$log")
    RUST_LOG=info "${NVME_TARGET_BIN:-$BIN/rdmablk-target}" --config "$NVME_DIR/target.toml" 2>>"$log" &
    TPID=$!
    TCP_URL=
    local up=0
    for _ in $(seq 1 300); do
        TCP_URL=$(tail -n +$((from + 1)) "$log" | grep -o "listening on $NVME_TRANSPORT://[^ \",]*" | head -n1 | sed 's/listening on //') || true
        if [[ -n $TCP_URL ]]; then
            if [[ $NVME_TRANSPORT == tcp ]]; then
                ss -Hltn "sport = :$NVME_PORT" | grep -q . && { up=1; break; }
            else
                tail -n +$((from + 1)) "$log" | grep -q "listening on nvme+rdma://$SIP:$NVME_PORT" && { up=1; break; }
            fi
        fi
        kill -0 "$TPID" 2>/dev/null || break
        sleep 0.1
    done
    if [[ $up -ne 1 ]]; then
        echo "rdmablk-target did not start listening on $NVME_TRANSPORT:// and port $NVME_PORT:"; cat "$log"; return 1
    fi
    echo "rdmablk-target (pid $TPID) at $TCP_URL and nvme+$NVME_TRANSPORT://$SIP:$NVME_PORT"
}

nvme_stop_target() { # RESULT_NAME
    local log=$NVME_DIR/target.log rc=0
    kill -TERM "$TPID" 2>/dev/null
    wait "$TPID" || rc=$?
    echo "--- target log"; cat "$log"
    cp "$log" "$RES/$1-target.log" 2>/dev/null || true
    if grep -q 'panicked' "$log"; then echo "the target panicked"; return 1; fi
    [[ $rc -eq 0 ]] || { echo "rdmablk-target exited with $rc after SIGTERM"; return 1; }
}

# The controller (nvmeN) connected to NQN over $NVME_TRANSPORT at SIP:PORT, live.
nvme_ctrl_of() { # NQN PORT
    local c
    for c in /sys/class/nvme/nvme*; do
        [[ -r $c/subsysnqn ]] || continue
        [[ $(cat "$c/subsysnqn") == "$1" && $(cat "$c/transport") == "$NVME_TRANSPORT" ]] || continue
        grep -Eq "trsvcid=$2(,|$)" "$c/address" || continue
        echo "${c##*/}"; return 0
    done
    return 1
}

# The block device of namespace NSID of subsystem NQN (with native
# multipath, the head disk /dev/nvmeXnY; without, the controller's).
nvme_ns_dev() { # NQN NSID
    local b n
    for b in /sys/block/nvme*; do
        n=${b##*/}
        [[ $n == *c* ]] && continue
        [[ -r $b/nsid && -r $b/device/subsysnqn ]] || continue
        [[ $(cat "$b/device/subsysnqn") == "$1" && $(cat "$b/nsid") == "$2" ]] || continue
        echo "/dev/$n"; return 0
    done
    return 1
}

# nvme connect, then waits (up to 15 s) for namespace NSID's block device;
# sets CTRL and DEV.
nvme_connect() { # NQN PORT NSID [connect options...]
    local nqn=$1 port=$2 nsid=$3 t0
    shift 3
    t0=$(date +%s.%N)
    echo "+ nvme connect -t $NVME_TRANSPORT -a $SIP -s $port -n $nqn $*"
    nvme connect -t "$NVME_TRANSPORT" -a "$SIP" -s "$port" -n "$nqn" "$@"
    DEV= CTRL=
    for _ in $(seq 1 150); do
        CTRL=$(nvme_ctrl_of "$nqn" "$port") && DEV=$(nvme_ns_dev "$nqn" "$nsid") && [[ -b $DEV ]] && break
        DEV=
        sleep 0.1
    done
    [[ -n $DEV ]] || { echo "no block device for $nqn namespace $nsid"; nvme list; ls -l /sys/class/nvme/ /sys/block/; return 1; }
    echo "connected: $CTRL, namespace $nsid is $DEV ($(blockdev --getsize64 "$DEV") bytes," \
        "logical block $(blockdev --getss "$DEV")), $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s"
}

nvme_disconnect() { # NQN
    nvme disconnect -n "$1" | tee "$NVME_DIR/disconnect.out"
    grep -q "disconnected 1 controller" "$NVME_DIR/disconnect.out" || { echo "nvme disconnect did not disconnect one controller"; return 1; }
}

# The EXIT trap of the rdmablk steps: unmount, disconnect, kill, the host's
# messages and the target's log.
nvme_cleanup() { # [RC]
    local rc=${1:-$?}
    # Every step of the cleanup runs: under errexit, the first that fails
    # (umount of what is not mounted) would end the trap there.
    set +e
    [[ -z ${FPID:-} ]] || kill "$FPID" 2>/dev/null
    [[ -z ${RPID:-} ]] || kill "$RPID" 2>/dev/null
    umount "$NVME_DIR/mnt" 2>/dev/null
    nvme disconnect -n "${NQN:-$NVME_DEFAULT_NQN}" >/dev/null 2>&1
    [[ -z ${TPID:-} ]] || kill "$TPID" 2>/dev/null
    echo "--- kernel messages during the step"; nvme_dmesg_since
    if [[ $rc -ne 0 ]]; then echo "--- target log"; cat "$NVME_DIR/target.log" 2>/dev/null; fi
}

# The host side's messages during the step, at the end of a passing step;
# fails on what the host reports as an error of the target: a failed
# command ("I/O Error", "I/O error") or a "Firmware bug" (an Identify field
# the kernel finds invalid).
nvme_show_dmesg() {
    echo "--- kernel messages during the step"; nvme_dmesg_since
    local bad; bad=$(nvme_dmesg_since | grep -E 'I/O [Ee]rror|Firmware bug' || true)
    if [[ -n $bad ]]; then
        echo "--- the host reported errors of the target:"; echo "$bad"
        return 1
    fi
}

# The end of a step that ran to its end: drops the EXIT trap, shows the
# host's messages, stops the target (RESULT_NAME names its saved log;
# none: no target to stop), removes the scratch directory. Fails, after
# all of that, if the host reported errors or the target did not stop
# cleanly, so the next step starts clean either way.
nvme_step_end() { # [RESULT_NAME]
    local rc=0
    trap - EXIT
    nvme_show_dmesg || rc=1
    if [[ -n ${1:-} ]]; then nvme_stop_target "$1" || rc=1; fi
    rm -rf "$NVME_DIR"
    return $rc
}

# nvme id-ctrl / id-ns: mn and sn not blank, subnqn = NQN, nsze * LBA size
# = SIZE bytes (and the block device's size).
nvme_check_ids() { # CTRL DEV NQN SIZE
    nvme id-ctrl "/dev/$1" -o json >"$NVME_DIR/id-ctrl.json"
    nvme id-ns "$2" -o json >"$NVME_DIR/id-ns.json"
    nvme id-ctrl "/dev/$1" | grep -E '^(vid|ssvid|sn|mn|fr|cntlid|ver|mdts|nn|ioccsz|iorcsz|sgls|subnqn|maxcmd|kas|oaes) ' || true
    /usr/bin/python3 - "$NVME_DIR/id-ctrl.json" "$NVME_DIR/id-ns.json" "$3" "$4" "$(blockdev --getsize64 "$2")" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); n = json.load(open(sys.argv[2]))
nqn, size, bdev = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
bad = []
mn, sn, subnqn = c["mn"].strip(), c["sn"].strip(), c["subnqn"].strip()
if not mn: bad.append("id-ctrl mn is blank")
if not sn: bad.append("id-ctrl sn is blank")
if subnqn != nqn: bad.append(f"id-ctrl subnqn {subnqn!r}, expected {nqn!r}")
if c.get("nn", 0) < 1: bad.append(f"id-ctrl nn {c.get('nn')}")
lbaf = n["lbafs"][n["flbas"] & 0xF]
lba = 1 << lbaf["ds"]
print(f"id-ctrl: mn {mn!r} sn {sn!r} subnqn {subnqn!r} nn {c.get('nn')} mdts {c.get('mdts')}")
print(f"id-ns: nsze {n['nsze']} ncap {n['ncap']} nuse {n['nuse']} flbas {n['flbas']} lba {lba} B "
      f"-> {n['nsze'] * lba} bytes; block device {bdev}")
if n["nsze"] * lba != size: bad.append(f"nsze {n['nsze']} * {lba} != {size}")
if bdev != size: bad.append(f"the block device has {bdev} bytes, expected {size}")
if n["ncap"] > n["nsze"]: bad.append("ncap > nsze")
for b in bad: print("BAD:", b)
sys.exit(1 if bad else 0)
PY
}

# ------------------------------------------------------- nvme-tcp-fs, nvme-rdma-fs
nvme_fs() {
    set -euo pipefail
    local t=$NVME_TRANSPORT
    nvme_dmesg_mark
    modprobe "nvme-$t"
    rm -rf "$NVME_DIR"; mkdir -p "$NVME_DIR/mnt"
    local mnt=$NVME_DIR/mnt size=$((256 << 20))
    NQN=$NVME_DEFAULT_NQN FPID= RPID= TPID=
    # nvol1 is the rdmablk initiator's while the kernel host uses nvol0.
    nvme_target_conf nvol0:256MiB nvol1:64MiB
    cat "$NVME_DIR/target.toml"
    trap nvme_cleanup EXIT
    nvme_start_target
    echo "+ nvme discover -t $t -a $SIP -s $NVME_PORT"
    nvme discover -t "$t" -a "$SIP" -s "$NVME_PORT" | tee "$NVME_DIR/discover.out"
    grep -q "subnqn: *$NQN\$" "$NVME_DIR/discover.out" || { echo "discovery does not list $NQN"; exit 1; }
    grep -q "trsvcid: *$NVME_PORT\$" "$NVME_DIR/discover.out" || { echo "discovery gives no trsvcid $NVME_PORT"; exit 1; }
    grep -q "trtype: *$t\$" "$NVME_DIR/discover.out" || { echo "discovery does not say trtype $t"; exit 1; }
    nvme_connect "$NQN" "$NVME_PORT" 1
    nvme list
    nvme_check_ids "$CTRL" "$DEV" "$NQN" "$size"

    mkfs.ext4 -q -F "$DEV"
    mount "$DEV" "$mnt"
    tree_write "$mnt" "$NVME_DIR/sums" small
    local t0; t0=$(date +%s.%N)
    sync
    echo "sync: $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s; $(df -h "$mnt" | tail -n1)"
    umount "$mnt"
    blockdev --flushbufs "$DEV"
    e2fsck -fn "$DEV"
    mount "$DEV" "$mnt"
    tree_check "$mnt" "$NVME_DIR/sums"
    umount "$mnt"

    # Raw namespace: fio's verified random writes in the first 64 MiB while
    # the rdmablk CLI, over tcp:// (rdma: rdma://) in a loop, reads 4 MiB at
    # 128 MiB (bytes written there through NVMe first) and writes, flushes
    # and reads back 1 MiB of fresh bytes on the other volume, nvol1.
    local ref=$NVME_DIR/ref4m
    head -c 4M /dev/urandom >"$ref"
    dd if="$ref" of="$DEV" bs=1M seek=128 oflag=direct status=none
    local job=(--name=nraw --filename="$DEV" --ioengine=io_uring --direct=1 --rw=randwrite
        --bssplit=4k/30:8k/10:16k/20:64k/20:128k/20 --iodepth=16 --size=64M
        --verify=crc32c --verify_fatal=1 --verify_state_save=0 --randrepeat=1)
    (
        set +e
        n=0
        while [[ ! -e $NVME_DIR/fio.done ]]; do
            "$BIN/rdmablk" --target "$TCP_URL" read nvol0 --offset $((128 << 20)) --length 4MiB \
                --output "$NVME_DIR/tcpread" || { echo "rdmablk read over $TCP_URL failed"; exit 1; }
            cmp "$ref" "$NVME_DIR/tcpread" || { echo "rdmablk read over $TCP_URL: not the bytes written through NVMe"; exit 1; }
            head -c 1M /dev/urandom >"$NVME_DIR/v1ref"
            "$BIN/rdmablk" --target "$TCP_URL" write nvol1 --offset $(((n % 32) << 20)) --input "$NVME_DIR/v1ref" &&
                "$BIN/rdmablk" --target "$TCP_URL" flush nvol1 &&
                "$BIN/rdmablk" --target "$TCP_URL" read nvol1 --offset $(((n % 32) << 20)) --length 1MiB \
                    --output "$NVME_DIR/v1read" || { echo "rdmablk write/read of nvol1 over $TCP_URL failed"; exit 1; }
            cmp "$NVME_DIR/v1ref" "$NVME_DIR/v1read" || { echo "nvol1 over $TCP_URL: read back differs from what was written"; exit 1; }
            cmp "$NVME_DIR/v1ref" <(dd if="$NVME_DIR/nvol1.img" bs=1M skip=$((n % 32)) count=1 status=none) ||
                { echo "nvol1's backing file does not hold what was written over $TCP_URL"; exit 1; }
            n=$((n + 1))
        done
        echo "$n rounds over $TCP_URL during fio: 4 MiB of nvol0 identical to what NVMe wrote; 1 MiB of nvol1 written, read back and in its file"
        [[ $n -ge 1 ]]
    ) >"$NVME_DIR/tcpreads.out" 2>&1 &
    RPID=$!
    local frc=0
    fio "${job[@]}" --do_verify=1 --output="$NVME_DIR/raw.fio" || frc=$?
    touch "$NVME_DIR/fio.done"
    local rrc=0
    wait "$RPID" || rrc=$?
    RPID=
    cat "$NVME_DIR/raw.fio"
    cp "$NVME_DIR/raw.fio" "$RES/nvme-$t-fs-raw.fio" 2>/dev/null || true
    [[ $frc -eq 0 ]] || { echo "fio exited with $frc"; exit 1; }
    grep -q 'read: IOPS=' "$NVME_DIR/raw.fio" || { echo "fio shows no verify (read) phase"; exit 1; }
    if grep -qi 'verify.*fail\|bad magic\|bad header' "$NVME_DIR/raw.fio"; then echo "fio reported a verify failure"; exit 1; fi
    echo "fio randwrite 4k..128k QD16 + crc32c verify of 64 MiB on $DEV: ok"
    cat "$NVME_DIR/tcpreads.out"
    [[ $rrc -eq 0 ]] || { echo "the concurrent rdmablk I/O over $t:// failed"; exit 1; }
    # Deeper than a queue's 32 chunks: 128 KiB writes at Linux's queue
    # depth, each beyond the 32nd asked for (R2T, RDMA READ) only when a
    # chunk frees; then every block checked.
    fio --name=ndeep --filename="$DEV" --ioengine=io_uring --direct=1 --rw=randwrite --bs=128k --iodepth=128 \
        --offset=64M --size=32M --verify=crc32c --verify_fatal=1 --verify_state_save=0 --randrepeat=1 --do_verify=1 \
        --output="$NVME_DIR/deep.fio" || { cat "$NVME_DIR/deep.fio"; echo "fio at QD128 failed"; exit 1; }
    cp "$NVME_DIR/deep.fio" "$RES/nvme-$t-fs-deep.fio" 2>/dev/null || true
    grep -q 'read: IOPS=' "$NVME_DIR/deep.fio" || { cat "$NVME_DIR/deep.fio"; echo "fio at QD128 shows no verify (read) phase"; exit 1; }
    if grep -qi 'verify.*fail\|bad magic\|bad header' "$NVME_DIR/deep.fio"; then cat "$NVME_DIR/deep.fio"; echo "fio at QD128 reported a verify failure"; exit 1; fi
    echo "fio randwrite 128k QD128 + crc32c verify of 32 MiB on $DEV: ok ($(grep -o 'write: IOPS=[^,]*' "$NVME_DIR/deep.fio" | head -1))"
    # The other way: written over tcp://, read through NVMe.
    head -c 1M /dev/urandom >"$NVME_DIR/ref1m"
    "$BIN/rdmablk" --target "$TCP_URL" write nvol0 --offset $((192 << 20)) --input "$NVME_DIR/ref1m"
    "$BIN/rdmablk" --target "$TCP_URL" flush nvol0
    cmp "$NVME_DIR/ref1m" <(dd if="$DEV" bs=1M skip=192 count=1 iflag=direct status=none)
    echo "1 MiB written over $TCP_URL at 192 MiB: read back identical through $DEV"
    # Deallocate (DSM) and Write Zeroes, as the block layer sends them
    # (the namespace advertises both in ONCS).
    local q=/sys/block/${DEV#/dev/}/queue
    echo "discard_max_bytes $(cat $q/discard_max_bytes) write_zeroes_max_bytes $(cat $q/write_zeroes_max_bytes)"
    local wz=0 dc=0
    head -c 4M /dev/urandom | dd of="$DEV" bs=1M seek=200 oflag=direct status=none
    if [[ $(cat $q/write_zeroes_max_bytes) -gt 0 ]]; then
        blkdiscard -z -o $((200 << 20)) -l $((2 << 20)) "$DEV" || wz=1
        if [[ $wz -eq 0 ]] && cmp -n $((2 << 20)) /dev/zero <(dd if="$DEV" bs=1M skip=200 count=2 iflag=direct status=none); then
            echo "blkdiscard -z (Write Zeroes) of 2 MiB at 200 MiB: reads back zeroes"
        else
            echo "blkdiscard -z (Write Zeroes) of 2 MiB at 200 MiB failed or left data"; wz=1
        fi
    else
        echo "the host sees no Write Zeroes (write_zeroes_max_bytes 0)"; wz=1
    fi
    if [[ $(cat $q/discard_max_bytes) -gt 0 ]]; then
        if blkdiscard -o $((202 << 20)) -l $((2 << 20)) "$DEV"; then
            echo "blkdiscard (Dataset Management, deallocate) of 2 MiB at 202 MiB: ok"
        else
            echo "blkdiscard (Dataset Management, deallocate) of 2 MiB at 202 MiB failed"; dc=1
        fi
    else
        echo "the host sees no discard (discard_max_bytes 0)"; dc=1
    fi

    nvme_disconnect "$NQN"
    sleep 0.5
    [[ ! -e $DEV ]] || { echo "$DEV still exists after nvme disconnect"; exit 1; }
    # A host's disconnect (and `nvme discover`'s) ends its controller; it
    # is not a fault, and a WARN for each would hide the real ones.
    if grep "torn down: admin queue closed" "$NVME_DIR/target.log"; then
        echo "FAIL: a clean disconnect was logged as a teardown (above)"; exit 1
    fi
    grep "ended: admin queue closed" "$NVME_DIR/target.log" | tail -n 2
    local end=0
    nvme_step_end "nvme-$t-fs" || end=1
    [[ $wz -eq 0 ]] || { echo "FAIL: Write Zeroes through the namespace"; exit 1; }
    [[ $dc -eq 0 ]] || { echo "FAIL: discard (DSM deallocate) through the namespace"; exit 1; }
    [[ $end -eq 0 ]] || exit 1
}

# ----------------------------------------------- nvme-tcp-sighup, nvme-rdma-sighup
nvme_sighup() {
    set -euo pipefail
    nvme_dmesg_mark
    modprobe "nvme-$NVME_TRANSPORT"
    rm -rf "$NVME_DIR"; mkdir -p "$NVME_DIR"
    NQN=$NVME_DEFAULT_NQN FPID= RPID= TPID=
    nvme_target_conf nvol0:64MiB
    trap nvme_cleanup EXIT
    nvme_start_target
    nvme_connect "$NQN" "$NVME_PORT" 1
    local ctrl=$CTRL dev1=$DEV cntlid
    cntlid=$(cat "/sys/class/nvme/$ctrl/cntlid")
    local mark; mark=$(dmesg | wc -l)
    nvme_conf_volume nvol1:32MiB >>"$NVME_DIR/target.toml"
    echo "--- the config with a second volume"; cat "$NVME_DIR/target.toml"
    local t0; t0=$(date +%s.%N)
    kill -HUP "$TPID"
    echo "SIGHUP sent at $(date +%T.%N)"
    local dev2=
    for _ in $(seq 1 150); do
        dev2=$(nvme_ns_dev "$NQN" 2) && [[ -b $dev2 ]] && break
        dev2=
        sleep 0.1
    done
    local secs; secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
    [[ -n $dev2 ]] || { echo "no namespace 2 within $secs s of SIGHUP"; nvme list; exit 1; }
    echo "namespace 2 appeared as $dev2 $secs s after SIGHUP"
    nvme list
    [[ $(blockdev --getsize64 "$dev2") -eq $((32 << 20)) ]] || { echo "$dev2 has $(blockdev --getsize64 "$dev2") bytes, expected 32 MiB"; exit 1; }
    # No reconnect: the same controller, live, with the same controller id.
    [[ $(nvme_ctrl_of "$NQN" "$NVME_PORT") == "$ctrl" ]] || { echo "the controller changed"; exit 1; }
    [[ $(cat "/sys/class/nvme/$ctrl/state") == live ]] || { echo "$ctrl is $(cat "/sys/class/nvme/$ctrl/state")"; exit 1; }
    [[ $(cat "/sys/class/nvme/$ctrl/cntlid") == "$cntlid" ]] || { echo "the controller id changed: a new association"; exit 1; }
    local after; after=$(dmesg | tail -n +$((mark + 1)))
    echo "--- kernel messages after SIGHUP"; echo "$after"
    if grep -qi 'reconnect\|resetting\|creating' <<<"$after"; then echo "the host reconnected"; exit 1; fi
    grep -q "$ctrl: rescanning namespaces" <<<"$after" || { echo "no \"$ctrl: rescanning namespaces\": the rescan was not driven by the event"; exit 1; }
    [[ -b $dev1 ]] || { echo "$dev1 went away"; exit 1; }
    grep -i 'reload\|volume' "$NVME_DIR/target.log" | tail -n 5 || true
    # I/O through both namespaces.
    head -c 1M /dev/urandom >"$NVME_DIR/ref1m"
    dd if="$NVME_DIR/ref1m" of="$dev2" bs=1M seek=3 oflag=direct status=none
    cmp "$NVME_DIR/ref1m" <(dd if="$dev2" bs=1M skip=3 count=1 iflag=direct status=none)
    cmp "$NVME_DIR/ref1m" <(dd if="$NVME_DIR/nvol1.img" bs=1M skip=3 count=1 status=none)
    dd if="$NVME_DIR/ref1m" of="$dev1" bs=1M seek=5 oflag=direct status=none
    cmp "$NVME_DIR/ref1m" <(dd if="$NVME_DIR/nvol0.img" bs=1M skip=5 count=1 status=none)
    echo "1 MiB through $dev2 and $dev1: read back and in the backing files"
    nvme_disconnect "$NQN"
    nvme_step_end "nvme-$NVME_TRANSPORT-sighup" || exit 1
}

# ---------------------------------------------- nvme-tcp-large-io, nvme-rdma-large-io
nvme_large_io() {
    set -euo pipefail
    local t=$NVME_TRANSPORT
    nvme_dmesg_mark
    modprobe "nvme-$t"
    rm -rf "$NVME_DIR"; mkdir -p "$NVME_DIR"
    NQN=$NVME_DEFAULT_NQN FPID= RPID= TPID=
    nvme_target_conf nvol0:64MiB
    sed -i 's/^reactors = 2$/reactors = 2\nmax_io_size = "4MiB"/' "$NVME_DIR/target.toml"
    grep -q '^max_io_size = "4MiB"$' "$NVME_DIR/target.toml" || { echo "max_io_size did not go into the config"; exit 1; }
    trap nvme_cleanup EXIT
    nvme_start_target
    nvme_connect "$NQN" "$NVME_PORT" 1 -Q 1024
    local mdts sqsize hw_kb
    mdts=$(nvme id-ctrl "/dev/$CTRL" | awk '$1 == "mdts" {print $3}')
    sqsize=$(cat "/sys/class/nvme/$CTRL/sqsize")
    hw_kb=$(cat "/sys/block/${DEV#/dev/}/queue/max_hw_sectors_kb")
    echo "id-ctrl mdts $mdts; the host's sqsize $sqsize (0-based); $DEV max_hw_sectors_kb $hw_kb"
    [[ $mdts == 10 ]] || { echo "FAIL: mdts $mdts, expected 10 (4 MiB in 4 KiB pages)"; exit 1; }
    # The Linux nvme-rdma host takes at most 256 entries whatever the
    # controller offers (NVME_RDMA_MAX_QUEUE_SIZE: "ctrl sqsize 1024 > max
    # queue size 256, clamping down"); nvme-tcp takes what -Q asks.
    local entries=1024
    [[ $t == rdma ]] && entries=256
    [[ $sqsize == $((entries - 1)) ]] || { echo "FAIL: the host's queues have $((sqsize + 1)) entries, expected $entries (-Q 1024)"; exit 1; }
    local big=$((4 << 20))
    # nvme-rdma's host maps a command with one fast-registration MR of at
    # most 256 pages (NVME_RDMA_MAX_SEGMENTS): 1 MiB whatever MDTS says.
    if ((hw_kb * 1024 < big)); then
        echo "NOTE: the nvme-$t host driver allows $hw_kb KiB per command, less than MDTS: the large commands are $hw_kb KiB"
        big=$((hw_kb * 1024))
    fi
    head -c "$big" /dev/urandom >"$NVME_DIR/ref"
    local size slba rc=0 sizes=("$big")
    ((big <= 1 << 20)) || sizes+=($((1 << 20)))
    for size in "${sizes[@]}"; do
        slba=$(( size == big ? 0 : 4096 ))
        echo "+ nvme write $DEV -s $slba -c $((size / 4096 - 1)) -z $size -d ref"
        nvme write "$DEV" -s "$slba" -c $((size / 4096 - 1)) -z "$size" -d "$NVME_DIR/ref" || { echo "FAIL: nvme write of $size bytes"; rc=1; continue; }
        echo "+ nvme read $DEV -s $slba -c $((size / 4096 - 1)) -z $size -d back"
        nvme read "$DEV" -s "$slba" -c $((size / 4096 - 1)) -z "$size" -d "$NVME_DIR/back" || { echo "FAIL: nvme read of $size bytes"; rc=1; continue; }
        cmp -n "$size" "$NVME_DIR/ref" "$NVME_DIR/back" || { echo "FAIL: $size bytes read back differ"; rc=1; continue; }
        cmp -n "$size" "$NVME_DIR/ref" <(dd if="$NVME_DIR/nvol0.img" bs=4096 skip="$slba" count=$((size / 4096)) status=none) \
            || { echo "FAIL: the backing file differs at block $slba"; rc=1; continue; }
        echo "$size bytes: one nvme write and one nvme read, read back identical and in the backing file"
    done
    grep -E 'nvme.*(Write|Read).*(Invalid|error)' "$NVME_DIR/target.log" || true
    [[ $rc -eq 0 ]] || exit 1
    nvme_disconnect "$NQN"
    nvme_step_end "nvme-$t-large-io" || exit 1
}

# ---------------------------------------------------------- nvme-tcp-multipath
# The subsystem (nvme-subsysN) whose NQN is NQN.
nvme_subsys_of() { # NQN
    local s
    for s in /sys/class/nvme-subsystem/nvme-subsys*; do
        [[ $(cat "$s/subsysnqn" 2>/dev/null) == "$1" ]] && { echo "${s##*/}"; return 0; }
    done
    return 1
}

# The path devices (nvmeXcZnY) of head disk DEV (/dev/nvmeXnY).
nvme_paths_of() { # DEV
    local head=${1#/dev/} p
    for p in /sys/block/"${head%n*}"c*n"${head##*n}"; do
        [[ -e $p ]] && echo "${p##*/}"
    done
    return 0
}

# The controller (nvmeN) of path device PATH (nvmeXcZnY).
nvme_ctrl_of_path() { # PATH
    local c
    for c in "/sys/block/$1/device" "/sys/block/$1/device/device"; do
        [[ -r $c/cntlid ]] && { basename "$(readlink -f "$c")"; return 0; }
    done
    return 1
}

# Writes DIR/target.toml of a gateway: tcp://SIP:0 and nvme+tcp://SIP:PORT,
# the shared NQN, controller ids MIN..=MAX, volume "shared" (nsid 1) on IMG.
nvme_gateway_conf() { # DIR NAME PORT MIN MAX IMG
    mkdir -p "$1"
    cat >"$1/target.toml" <<CONF
[target]
name = "$2"
listen = ["$NVME_TRANSPORT://$SIP:0", "nvme+$NVME_TRANSPORT://$SIP:$3"]
nqn = "$NQN"
reactors = 2
nvme_cntlid_min = $4
nvme_cntlid_max = $5
# A target's readahead does not see another target's writes to the file.
readahead = 0

[[volume]]
name = "shared"
backend = "file"
path = "$6"
size = "64MiB"
nsid = 1
allow_any_host = true
CONF
}

nvme_multipath_cleanup() {
    local rc=$?
    set +e
    [[ -z ${FPID:-} ]] || kill "$FPID" 2>/dev/null
    nvme disconnect -n "$NQN" >/dev/null 2>&1
    [[ -z ${TPID_A:-} ]] || kill "$TPID_A" 2>/dev/null
    [[ -z ${TPID_B:-} ]] || kill "$TPID_B" 2>/dev/null
    echo "--- kernel messages during the step"; nvme_dmesg_since
    if [[ $rc -ne 0 ]]; then
        echo "--- gateway A's log"; cat "$NVME_DIR/a/target.log" 2>/dev/null
        echo "--- gateway B's log"; cat "$NVME_DIR/b/target.log" 2>/dev/null
    fi
}

# Every path of DEV: its controller, cntlid, address, state, ANA state and group.
nvme_show_paths() { # DEV
    local p c
    for p in $(nvme_paths_of "$1"); do
        c=$(nvme_ctrl_of_path "$p") || c=?
        echo "  $p: $c cntlid $(cat "/sys/class/nvme/$c/cntlid" 2>/dev/null) $(cat "/sys/class/nvme/$c/address" 2>/dev/null)," \
            "state $(cat "/sys/class/nvme/$c/state" 2>/dev/null), ana_state $(cat "/sys/block/$p/ana_state"), ana_grpid $(cat "/sys/block/$p/ana_grpid")"
    done
}

nvme_multipath() {
    set -euo pipefail
    local t=$NVME_TRANSPORT port_b=4422
    nvme_dmesg_mark
    modprobe "nvme-$t"
    local mp; mp=$(cat /sys/module/nvme_core/parameters/multipath 2>/dev/null || echo "?")
    [[ $mp == Y ]] || { echo "native NVMe multipath is off (nvme_core.multipath=$mp)"; exit 1; }
    rm -rf "$NVME_DIR"; mkdir -p "$NVME_DIR"
    NQN=nqn.2014-08.io.rdmablk.ci:multipath FPID= TPID= TPID_A= TPID_B=
    local img=$NVME_DIR/shared.img
    truncate -s 64M "$img"
    nvme_gateway_conf "$NVME_DIR/a" gw-a "$NVME_PORT" 1 99 "$img"
    nvme_gateway_conf "$NVME_DIR/b" gw-b "$port_b" 100 199 "$img"
    cat "$NVME_DIR/a/target.toml"
    trap nvme_multipath_cleanup EXIT
    NVME_DIR=$NVME_DIR/a nvme_start_target; TPID_A=$TPID
    NVME_DIR=$NVME_DIR/b NVME_PORT=$port_b nvme_start_target; TPID_B=$TPID
    TPID=
    nvme_connect "$NQN" "$NVME_PORT" 1 --reconnect-delay=1
    local ctrl_a=$CTRL dev=$DEV
    nvme_connect "$NQN" "$port_b" 1 --reconnect-delay=1
    local ctrl_b=$CTRL
    [[ $DEV == "$dev" ]] || { echo "FAIL: gateway B's namespace is $DEV, gateway A's $dev: two namespaces, not two paths of one"; exit 1; }
    nvme list-subsys || true
    local subsys; subsys=$(nvme_subsys_of "$NQN") || { echo "FAIL: no subsystem of $NQN"; exit 1; }
    local ctrls; ctrls=$(find "/sys/class/nvme-subsystem/$subsys/" -maxdepth 1 -regex '.*/nvme[0-9]+' | wc -l)
    [[ $ctrls == 2 ]] || { echo "FAIL: $subsys has $ctrls controllers, expected 2"; ls -l "/sys/class/nvme-subsystem/$subsys/"; exit 1; }
    local id_a id_b
    id_a=$(cat "/sys/class/nvme/$ctrl_a/cntlid"); id_b=$(cat "/sys/class/nvme/$ctrl_b/cntlid")
    echo "$subsys: $ctrl_a (gateway A, cntlid $id_a) and $ctrl_b (gateway B, cntlid $id_b); head $dev"
    ((id_a >= 1 && id_a <= 99 && id_b >= 100 && id_b <= 199)) || { echo "FAIL: controller ids $id_a and $id_b outside the gateways' ranges"; exit 1; }
    # The host reads the ANA log at connect; a path is live once its state is known.
    local paths=() p ok=0
    for _ in $(seq 1 100); do
        mapfile -t paths < <(nvme_paths_of "$dev")
        ok=1
        ((${#paths[@]} == 2)) || ok=0
        for p in "${paths[@]}"; do [[ $(cat "/sys/block/$p/ana_state" 2>/dev/null) == optimized ]] || ok=0; done
        ((ok)) && break
        sleep 0.1
    done
    nvme_show_paths "$dev"
    ((ok)) || { echo "FAIL: expected two paths of $dev, each optimized"; exit 1; }
    for p in "${paths[@]}"; do
        [[ $(cat "/sys/block/$p/ana_grpid") == 1 ]] || { echo "FAIL: $p is in ANA group $(cat "/sys/block/$p/ana_grpid"), expected 1 (the NSID)"; exit 1; }
    done
    # nvme-cli reads the ANA log as libnvme does, in 4 KiB pieces.
    local c
    for c in "$ctrl_a" "$ctrl_b"; do
        nvme ana-log "/dev/$c" -o json >"$NVME_DIR/ana-$c.json" || { echo "FAIL: nvme ana-log /dev/$c"; cat "$NVME_DIR/ana-$c.json"; exit 1; }
        /usr/bin/python3 - "$NVME_DIR/ana-$c.json" "$c" <<'PY' || { echo "FAIL: $c's ANA log has not one group, 1, optimized"; exit 1; }
import json, sys
log = json.load(open(sys.argv[1]))
def groups(x):
    if isinstance(x, dict):
        if "grpid" in x:
            yield x
        for v in x.values():
            yield from groups(v)
    elif isinstance(x, list):
        for v in x:
            yield from groups(v)
gs = list(groups(log))
print(f"{sys.argv[2]}: ANA log {json.dumps(log)}")
ok = [g for g in gs if int(g["grpid"]) == 1 and str(g.get("state", "")).strip() == "optimized"]
sys.exit(0 if len(gs) == 1 and ok else 1)
PY
    done
    nvme id-ctrl "/dev/$ctrl_b" | grep -E '^(cntlid|cmic|oaes|anatt|anacap|anagrpmax|nanagrpid|mnan|subnqn) ' || true
    nvme id-ns "$dev" | grep -E '^(nmic|anagrpid|nguid|eui64) ' || true
    local bad
    bad=$(nvme_dmesg_since | grep -Ei "duplicate cntlid|invalid mnan|ana log page size|disabling ana|ids don't match|duplicate unshared|does not support multiple controllers|duplicate ids" || true)
    [[ -z $bad ]] || { echo "FAIL: the host complained:"; echo "$bad"; exit 1; }
    # Data through the head, checked in the backing file both gateways serve.
    head -c $((8 << 20)) /dev/urandom >"$NVME_DIR/ref"
    dd if="$NVME_DIR/ref" of="$dev" bs=1M oflag=direct status=none
    cmp "$NVME_DIR/ref" <(dd if="$dev" bs=1M count=8 iflag=direct status=none) || { echo "FAIL: 8 MiB read back through $dev differ"; exit 1; }
    cmp "$NVME_DIR/ref" <(head -c $((8 << 20)) "$img") || { echo "FAIL: the backing file differs"; exit 1; }
    echo "8 MiB written and read back through $dev, in the backing file"
    # Failover: both paths in use (round-robin), gateway A killed mid-write.
    echo round-robin >"/sys/class/nvme-subsystem/$subsys/iopolicy"
    local job=(--name=mp --filename="$dev" --offset=16M --size=32M --rw=randwrite --bsrange=4k-64k --direct=1
        --ioengine=io_uring --iodepth=16 --verify=crc32c --verify_fatal=1 --verify_state_save=0 --randrepeat=1)
    local written; written=$(sectors_written "$dev")
    fio "${job[@]}" --do_verify=1 --output="$NVME_DIR/fio.out" &
    FPID=$!
    wait_written "$dev" "$written" $((8 << 20)) "$FPID" \
        || { cat "$NVME_DIR/fio.out"; echo "fio ended (or wrote too little in 120 s) before gateway A was killed"; exit 1; }
    kill -KILL "$TPID_A"; wait "$TPID_A" || true
    TPID_A=
    echo "gateway A killed at $(date +%T.%N) while fio writes"
    local rc=0
    wait "$FPID" || rc=$?
    FPID=
    cat "$NVME_DIR/fio.out"
    cp "$NVME_DIR/fio.out" "$RES/nvme-$t-multipath-fio.out" 2>/dev/null || true
    [[ $rc -eq 0 ]] || { echo "FAIL: fio failed when gateway A went ($rc)"; exit 1; }
    grep -q 'read: IOPS=' "$NVME_DIR/fio.out" || { echo "FAIL: fio shows no verify (read) phase"; exit 1; }
    if grep -qi 'verify.*fail\|bad magic\|bad header' "$NVME_DIR/fio.out"; then echo "FAIL: fio reported a verify failure"; exit 1; fi
    echo "fio ended clean on gateway B's path; $ctrl_a is $(cat "/sys/class/nvme/$ctrl_a/state")"
    nvme_show_paths "$dev"
    # Gateway A back: its controller reconnects and its path is optimized again.
    NVME_DIR=$NVME_DIR/a nvme_start_target; TPID_A=$TPID
    TPID=
    local live=0 pa=
    for p in $(nvme_paths_of "$dev"); do [[ $(nvme_ctrl_of_path "$p") == "$ctrl_a" ]] && pa=$p; done
    [[ -n $pa ]] || { echo "FAIL: no path of $dev through $ctrl_a"; nvme_show_paths "$dev"; exit 1; }
    for _ in $(seq 1 300); do
        [[ $(cat "/sys/class/nvme/$ctrl_a/state") == live && $(cat "/sys/block/$pa/ana_state") == optimized ]] && { live=1; break; }
        sleep 0.1
    done
    nvme_show_paths "$dev"
    ((live)) || { echo "FAIL: $ctrl_a not live with its path optimized 30 s after gateway A restarted"; exit 1; }
    cmp "$NVME_DIR/ref" <(dd if="$dev" bs=1M count=8 iflag=direct status=none) || { echo "FAIL: 8 MiB read back after the failover differ"; exit 1; }
    nvme disconnect -n "$NQN" | tee "$NVME_DIR/disconnect.out"
    grep -q "disconnected 2 controller" "$NVME_DIR/disconnect.out" || { echo "FAIL: nvme disconnect did not disconnect two controllers"; exit 1; }
    trap - EXIT
    local end=0 g
    nvme_show_dmesg || end=1
    for g in a b; do
        if [[ $g == a ]]; then TPID=$TPID_A; else TPID=$TPID_B; fi
        NVME_DIR=$NVME_DIR/$g nvme_stop_target "nvme-$t-multipath-$g" || end=1
    done
    rm -rf "$NVME_DIR"
    return $end
}

# ---------------------------------------------------- nvme-tcp-auth, nvme-rdma-auth
nvme_auth() {
    set -euo pipefail
    local t=$NVME_TRANSPORT
    nvme_dmesg_mark
    modprobe "nvme-$t"
    rm -rf "$NVME_DIR"; mkdir -p "$NVME_DIR/mnt"
    local mnt=$NVME_DIR/mnt hostnqn key ctrl_key wrong
    hostnqn="nqn.2014-08.org.nvmexpress:uuid:$(cat /proc/sys/kernel/random/uuid)"
    NQN=$NVME_DEFAULT_NQN FPID= RPID= TPID=
    key=$(nvme gen-dhchap-key --hmac=1 --nqn="$hostnqn")
    ctrl_key=$(nvme gen-dhchap-key --hmac=0 --nqn="$NQN")
    wrong=$(nvme gen-dhchap-key --hmac=1 --nqn="$hostnqn")
    echo "host secret ${key:0:14}..., controller secret ${ctrl_key:0:14}... (nvme gen-dhchap-key)"
    (umask 077; echo "$key" >"$NVME_DIR/host.key"; echo "$ctrl_key" >"$NVME_DIR/ctrl.key")
    nvme_target_conf nvol0:64MiB
    printf '\n[[host]]\nid = "kernel"\nnqn = "%s"\ndhchap_key_file = "%s"\ndhchap_ctrl_key_file = "%s"\n' \
        "$hostnqn" "$NVME_DIR/host.key" "$NVME_DIR/ctrl.key" >>"$NVME_DIR/target.toml"
    cat "$NVME_DIR/target.toml"
    trap nvme_cleanup EXIT
    nvme_start_target

    # The right secret: every queue authenticates, then an ext4 round trip.
    nvme_connect "$NQN" "$NVME_PORT" 1 --hostnqn="$hostnqn" --dhchap-secret="$key"
    nvme_dmesg_since | grep -q "qid 0: authenticated" || { echo "the host did not report qid 0 authenticated"; exit 1; }
    mkfs.ext4 -q -F "$DEV"
    mount "$DEV" "$mnt"
    head -c 3M /dev/urandom >"$NVME_DIR/ref"
    cp "$NVME_DIR/ref" "$mnt/ref"
    umount "$mnt"
    blockdev --flushbufs "$DEV"
    e2fsck -fn "$DEV"
    mount "$DEV" "$mnt"
    cmp "$NVME_DIR/ref" "$mnt/ref"
    umount "$mnt"
    nvme_disconnect "$NQN"

    # A wrong secret: nvme connect fails, the target logs and counts it.
    echo "+ nvme connect ... --dhchap-secret=<a wrong one> (must fail)"
    if nvme connect -t "$t" -a "$SIP" -s "$NVME_PORT" -n "$NQN" --hostnqn="$hostnqn" --dhchap-secret="$wrong"; then
        echo "nvme connect with a wrong secret succeeded"; exit 1
    fi
    grep "nvme authentication refused" "$NVME_DIR/target.log" | grep -q "$hostnqn" ||
        { echo "the target did not log the refusal with the host NQN"; exit 1; }
    grep "nvme authentication refused" "$NVME_DIR/target.log"

    # Bidirectional: the controller proves its secret too.
    nvme_connect "$NQN" "$NVME_PORT" 1 --hostnqn="$hostnqn" --dhchap-secret="$key" --dhchap-ctrl-secret="$ctrl_key"
    grep -q "authenticated (queue 0, and the controller to it)" "$NVME_DIR/target.log" ||
        { echo "the target did not log a bidirectional authentication"; exit 1; }
    head -c 1M /dev/urandom >"$NVME_DIR/ref1m"
    dd if="$NVME_DIR/ref1m" of="$DEV" bs=1M count=1 seek=8 oflag=direct status=none
    dd if="$DEV" of="$NVME_DIR/back1m" bs=1M count=1 skip=8 iflag=direct status=none
    cmp "$NVME_DIR/ref1m" "$NVME_DIR/back1m"
    nvme_disconnect "$NQN"
    # The refused connect's "I/O Error"-free messages are expected here; the
    # host reports the failed authentication itself.
    nvme_step_end "nvme-$t-auth"
}

# --------------------------------------------- nvme-tcp-restart, nvme-rdma-restart
nvme_restart() {
    set -euo pipefail
    nvme_dmesg_mark
    modprobe "nvme-$NVME_TRANSPORT"
    rm -rf "$NVME_DIR"; mkdir -p "$NVME_DIR/mnt"
    local mnt=$NVME_DIR/mnt
    NQN=nqn.2014-08.io.rdmablk.ci:restart FPID= RPID= TPID=
    NVME_NQN=$NQN nvme_target_conf nvol0:256MiB
    cat "$NVME_DIR/target.toml"
    trap nvme_cleanup EXIT
    nvme_start_target
    nvme_connect "$NQN" "$NVME_PORT" 1 --ctrl-loss-tmo=60 --reconnect-delay=1
    local ctrl=$CTRL dev=$DEV
    # nodiscard: Dataset Management is nvme-tcp-fs's to check; this step is
    # about the restart.
    mkfs.ext4 -q -F -E nodiscard "$dev"
    mount "$dev" "$mnt"
    mkdir "$mnt/a" "$mnt/b"
    tree_write "$mnt/a" "$NVME_DIR/sums-a" small
    sync
    # fio writes a file through ext4 and then checks every block; the target
    # dies (SIGKILL) during the writes, once the namespace has written a
    # quarter of them (fio lays its file out with fallocate, which writes no
    # data), and is back 3 s later.
    local job=(--name=rs --directory="$mnt" --filename=rs.dat --size=48M --rw=randwrite --bsrange=4k-128k
        --direct=1 --ioengine=io_uring --iodepth=16 --verify=crc32c --verify_fatal=1 --verify_state_save=0
        --randrepeat=1)
    local written; written=$(sectors_written "$dev")
    fio "${job[@]}" --do_verify=1 --output="$NVME_DIR/rfio.out" &
    FPID=$!
    wait_written "$dev" "$written" $((12 << 20)) "$FPID" \
        || { cat "$NVME_DIR/rfio.out"; echo "fio ended (or wrote too little in 120 s) before the target was killed"; exit 1; }
    kill -0 "$FPID" 2>/dev/null || { cat "$NVME_DIR/rfio.out"; echo "fio ended before the target was killed"; exit 1; }
    kill -KILL "$TPID"; wait "$TPID" || true
    echo "target killed at $(date +%T.%N) while fio writes"
    sleep 3
    kill -0 "$FPID" 2>/dev/null || { cat "$NVME_DIR/rfio.out"; echo "fio ended while the target was down"; exit 1; }
    echo "host: $ctrl is $(cat "/sys/class/nvme/$ctrl/state") while the target is down"
    nvme_start_target
    echo "target restarted at $(date +%T.%N)"
    local t0; t0=$(date +%s.%N) live=0
    for _ in $(seq 1 300); do
        [[ $(cat "/sys/class/nvme/$ctrl/state" 2>/dev/null) == live ]] && { live=1; break; }
        sleep 0.1
    done
    [[ $live -eq 1 ]] || { echo "$ctrl not live 30 s after the restart: $(cat "/sys/class/nvme/$ctrl/state" 2>/dev/null)"; exit 1; }
    echo "$ctrl live again $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s after the restart"
    local rc=0
    wait "$FPID" || rc=$?
    FPID=
    cat "$NVME_DIR/rfio.out"
    cp "$NVME_DIR/rfio.out" "$RES/nvme-$NVME_TRANSPORT-restart-fio.out" 2>/dev/null || true
    [[ $rc -eq 0 ]] || { echo "fio failed across the restart ($rc)"; exit 1; }
    grep -q 'read: IOPS=' "$NVME_DIR/rfio.out" || { echo "fio shows no verify (read) phase"; exit 1; }
    if grep -qi 'verify.*fail\|bad magic\|bad header' "$NVME_DIR/rfio.out"; then echo "fio reported a verify failure"; exit 1; fi
    nvme_dmesg_since | grep -q "$ctrl: Successfully reconnected" || { echo "no \"$ctrl: Successfully reconnected\" from the host"; exit 1; }
    [[ $(nvme_ns_dev "$NQN" 1) == "$dev" ]] || { echo "the namespace is no longer $dev"; exit 1; }
    # The mounted file system keeps working.
    tree_write "$mnt/b" "$NVME_DIR/sums-b" small
    sync
    tree_check "$mnt/a" "$NVME_DIR/sums-a"
    tree_check "$mnt/b" "$NVME_DIR/sums-b"
    umount "$mnt"
    blockdev --flushbufs "$dev"
    e2fsck -fn "$dev"
    nvme_disconnect "$NQN"
    nvme_step_end "nvme-$NVME_TRANSPORT-restart" || exit 1
}

# ----------------------------------------------------------- nvme-tcp-vs-nvmet
# rdmablk-target's NVMe/TCP front end against the kernel's nvmet-tcp, same
# boot, same host: the kernel's nvme-tcp host connects to both at once
# (rdmablk on SIP:4420, nvmet on SIP:4421, another NQN), each exporting a
# 256 MiB file of its own on the same ext4 scratch file system (written
# full beforehand, so that no read hits a hole; both targets open it
# O_DIRECT: nvmet's file backend does unless buffered_io is set). fio on the
# namespaces (io_uring, direct=1, size=256M, 10 s time_based, no ramp):
# 4 KiB randread QD1, 4 KiB randread QD16, 128 KiB read QD16, 4 KiB randwrite
# QD16; each case on both targets in turn, the order swapped in round 2.
# Recorded: IOPS, mean total latency (lat, not clat: under TCG the host's
# nvme-tcp spends most of a request inside submission) and CPU per I/O.
#
# CPU per I/O, and what is fair:
#  - rdmablk-target: utime+stime of its process (/proc/PID/stat; all its
#    threads, io_uring workers included) over the fio run, divided by the
#    I/Os fio completed. This leaves out kernel work done for the target in
#    softirq or in kworkers (its TCP receive processing, the block layer
#    under its files), so it is a lower bound of the target's cost.
#  - nvmet-tcp runs in kworkers and softirq, not in a process of its own, so
#    its cost is only visible system-wide: busy time from /proc/stat (user +
#    nice + system + irq + softirq) over the fio run, minus fio's own CPU
#    (user + system of the fio process and its job processes, from the
#    shell's `times` around it: the whole process, startup included, like
#    the window; fio's JSON usr_cpu/sys_cpu cover only the job's runtime;
#    fio's system time holds the host's submission path, as nvme-tcp sends
#    in the submitter's context when it can),
#    minus the idle rate (measured for 5 s before the runs, both targets up,
#    times the run's wall time). That figure also holds the host side's
#    kernel work not charged to fio (nvme-tcp's receive kworkers, softirq)
#    and the idle noise's variance.
#  - So the like-for-like comparison is the same system-wide figure for
#    both targets (columns "sys-fio"): the host side's share is the same
#    kernel code for both. The rdmablk process column is shown beside it.
#  Tick-sampled accounting (HZ 250, USER_HZ 100, no IRQ time accounting)
#  under TCG: the CPU figures are coarse; compare ratios within this boot.
#  rdmablk-target's threads are also sampled one by one (which of them
#  spent the CPU), listed under the table.
# The table goes to $RES/nvme-tcp-vs-nvmet.md and the step log, the fio
# JSON and CPU samples to $RES/nvme-tcp-vs-nvmet/. The step fails only if
# something does not work (a connect, a fio run), never on the numbers.
# RDMABLK_NVME_VS_SYSTEMS="nvmet" measures the kernel's target alone;
# RDMABLK_NVME_VS_TARGET=PATH measures another rdmablk-target binary (the
# CI stage builds the debug profile, whose per-I/O CPU is not the release
# build's: the table names the binary it measured).
# RDMABLK_NVME_VS_ROUNDS=N (default 2) and RDMABLK_NVME_VS_CASES="NAME..."
# (default the four rows) take a longer look at fewer rows; read-1m-qd4
# and write-1m-qd4 (not among the defaults) are single commands of 1 MiB.

nvmet_cfs=/sys/kernel/config/nvmet

# Exports FILE through the kernel's nvmet-tcp (rdma: nvmet-rdma) as
# namespace 1 of NQN on SIP:PORT (port id PORTID).
nvmet_export() { # NQN PORTID PORT FILE
    local nqn=$1 pid=$2 port=$3 file=$4
    modprobe -a nvmet "nvmet-$NVME_TRANSPORT"
    mountpoint -q /sys/kernel/config || mount -t configfs none /sys/kernel/config
    local s=$nvmet_cfs/subsystems/$nqn p=$nvmet_cfs/ports/$pid
    mkdir "$s"
    echo 1 >"$s/attr_allow_any_host"
    mkdir "$s/namespaces/1"
    echo -n "$file" >"$s/namespaces/1/device_path"
    echo 1 >"$s/namespaces/1/enable"
    mkdir "$p"
    echo "$NVME_TRANSPORT" >"$p/addr_trtype"
    echo ipv4 >"$p/addr_adrfam"
    echo "$SIP" >"$p/addr_traddr"
    echo "$port" >"$p/addr_trsvcid"
    ln -s "$s" "$p/subsystems/$nqn"
    echo "nvmet-$NVME_TRANSPORT exports $file as $nqn namespace 1 on $SIP:$port" \
        "(buffered_io $(cat "$s/namespaces/1/buffered_io" 2>/dev/null || echo ?))"
}

nvmet_unexport() { # NQN PORTID
    local s=$nvmet_cfs/subsystems/$1 p=$nvmet_cfs/ports/$2
    rm -f "$p/subsystems/$1"
    rmdir "$p" 2>/dev/null || true
    [[ -d $s/namespaces/1 ]] && { echo 0 >"$s/namespaces/1/enable"; rmdir "$s/namespaces/1"; }
    rmdir "$s" 2>/dev/null || true
}

# Busy time of all CPUs in USER_HZ ticks (no fork: under TCG a process
# start costs about 0.3 s, which would land in the window).
busy_ticks() {
    local _c u n s i w q sq _rest
    read -r _c u n s i w q sq _rest </proc/stat
    echo $((u + n + s + q + sq))
}
# One line per thread of PID: "tid comm ticks" (utime + stime).
thread_ticks() { # PID
    local t line rest comm
    for t in /proc/$1/task/*; do
        read -r line <"$t/stat" || continue
        rest=${line##*) }
        comm=${line#*(}; comm=${comm%%)*}
        # shellcheck disable=SC2086
        set -- $rest
        echo "${t##*/} ${comm// /_} $((${12} + ${13}))"
    done
}
proc_ticks() { # PID: utime + stime
    local line rest
    read -r line <"/proc/$1/stat"
    rest=${line##*) }
    # shellcheck disable=SC2086
    set -- $rest
    echo $((${12} + ${13}))
}

nvme_vs_nvmet() {
    set -euo pipefail
    local t=$NVME_TRANSPORT
    nvme_dmesg_mark
    modprobe -a "nvme-$t" nvmet "nvmet-$t"
    # global: the EXIT trap reads it
    NVME_VS_SYSTEMS=${RDMABLK_NVME_VS_SYSTEMS:-rdmablk nvmet}
    local systems=$NVME_VS_SYSTEMS
    NVME_TARGET_BIN=${RDMABLK_NVME_VS_TARGET:-$BIN/rdmablk-target}
    local profile=unknown
    case $(readlink -f "$NVME_TARGET_BIN") in */release/*) profile=release ;; */debug/*) profile=debug ;; esac
    local out=$RES/nvme-$t-vs-nvmet knqn=nqn.2014-08.io.rdmablk.ci:nvmet
    rm -rf "$NVME_DIR"; mkdir -p "$NVME_DIR" "$out"
    NQN=nqn.2014-08.io.rdmablk.ci:vs FPID= RPID= TPID=
    df -h /tmp
    # Both backing files written full (zeroes are data: no holes).
    local f
    for f in nvmet nvol0; do
        dd if=/dev/zero of="$NVME_DIR/$f.img" bs=1M count=256 conv=fsync status=none
    done
    declare -A dev=()
    trap 'rc=$?; set +e; if [[ " $NVME_VS_SYSTEMS " == *" nvmet "* ]]; then nvme disconnect -n '"$knqn"' >/dev/null 2>&1; nvmet_unexport '"$knqn"' 1; fi; nvme_cleanup $rc; exit $rc' EXIT
    local s
    for s in $systems; do
        case $s in
            rdmablk)
                NVME_NQN=$NQN nvme_target_conf nvol0:256MiB
                nvme_start_target
                nvme_connect "$NQN" "$NVME_PORT" 1
                dev[rdmablk]=$DEV ;;
            nvmet)
                nvmet_export "$knqn" 1 "$NVMET_PORT" "$NVME_DIR/nvmet.img"
                nvme_connect "$knqn" "$NVMET_PORT" 1
                dev[nvmet]=$DEV ;;
            *) echo "unknown system $s"; exit 1 ;;
        esac
    done
    nvme list
    for s in $systems; do
        local n=$NQN; [[ $s == nvmet ]] && n=$knqn
        echo "--- $s: ${dev[$s]}"
        nvme_check_ids "$(nvme_ctrl_of "$n" "$([[ $s == nvmet ]] && echo $NVMET_PORT || echo $NVME_PORT)")" "${dev[$s]}" "$n" $((256 << 20))
    done
    local hz; hz=$(getconf CLK_TCK)
    echo "clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null)" \
        "(not tsc: clock_gettime is a system call here)"
    # The idle rate: both targets up, nothing to do.
    local b0 b1 w0 w1
    b0=$(busy_ticks); w0=$(date +%s.%N)
    sleep 5
    b1=$(busy_ticks); w1=$(date +%s.%N)
    echo "idle $((b1 - b0)) $w0 $w1" >"$out/idle.cpu"
    echo "idle: $((b1 - b0)) busy ticks in $(awk -v a="$w0" -v b="$w1" 'BEGIN{printf "%.2f", b-a}') s (USER_HZ $hz)"
    local round c name rw bs qd p0 p1
    # RDMABLK_NVME_VS_ROUNDS (default 2; even rounds swap the order) and
    # RDMABLK_NVME_VS_CASES (names, default all four) for a longer look at
    # one row: TCG's noise needs more rounds than CI can afford.
    local rounds=${RDMABLK_NVME_VS_ROUNDS:-2}
    # NVMe/RDMA's rows are issue 22's: 128 KiB reads at QD4.
    local default_cases="randread-4k-qd1 randread-4k-qd16 read-128k-qd16 randwrite-4k-qd16"
    [[ $t == rdma ]] && default_cases="randread-4k-qd1 randread-4k-qd16 read-128k-qd4 randwrite-4k-qd16"
    local cases=${RDMABLK_NVME_VS_CASES:-$default_cases}
    for round in $(seq 1 "$rounds"); do
        local order=($systems)
        ((round % 2 == 0)) && order=($(printf '%s\n' $systems | tac))
        for name in $cases; do
            case $name in
                randread-4k-qd1) rw=randread bs=4k qd=1 ;;
                randread-4k-qd16) rw=randread bs=4k qd=16 ;;
                read-128k-qd16) rw=read bs=128k qd=16 ;;
                read-128k-qd4) rw=read bs=128k qd=4 ;;
                # Issue 53's rows: one command per I/O up to MDTS (1 MiB
                # by default); not among the defaults (CI's time).
                read-1m-qd4) rw=read bs=1m qd=4 ;;
                write-1m-qd4) rw=write bs=1m qd=4 ;;
                randwrite-4k-qd16) rw=randwrite bs=4k qd=16 ;;
                *) echo "unknown case $name"; exit 1 ;;
            esac
            for s in "${order[@]}"; do
                local base=$out/$name.$s.$round
                p0=0
                if [[ $s == rdmablk ]]; then thread_ticks "$TPID" >"$base.threads0"; p0=$(proc_ticks "$TPID"); fi
                # RDMABLK_NVME_VS_PERF=CASE: a system-wide profile of that
                # case's first round on each system (perf record -a -g for
                # the run's 10 s; the report is written after the rounds).
                local perf_pid=
                if [[ ${RDMABLK_NVME_VS_PERF:-} == "$name" && $round -eq 1 ]]; then
                    # Its data in the guest's RAM: writing it to the results
                    # directory (9p) would be most of what it records.
                    perf record -q -a -g -o "/dev/shm/$name.$s.perf.data" -- sleep 10 >/dev/null 2>&1 &
                    perf_pid=$!
                fi
                b0=$(busy_ticks); w0=$(date +%s.%N)
                (
                    fio --name="$name" --filename="${dev[$s]}" --ioengine=io_uring --direct=1 --rw="$rw" \
                        --bs="$bs" --iodepth="$qd" --size=256M --runtime=10 --time_based --randrepeat=0 \
                        --output-format=json --output="$base.json"
                    rc=$?
                    times >"$base.times"
                    exit $rc
                ) || { echo "fio $name on $s (${dev[$s]}) failed"; cat "$base.json"; exit 1; }
                b1=$(busy_ticks); w1=$(date +%s.%N)
                [[ -z $perf_pid ]] || wait "$perf_pid" || true
                p1=0
                if [[ $s == rdmablk ]]; then p1=$(proc_ticks "$TPID"); thread_ticks "$TPID" >"$base.threads1"; fi
                echo "busy $((b1 - b0)) proc $((p1 - p0)) wall $w0 $w1 hz $hz" >"$base.cpu"
                echo "round $round: $name on $s: $(grep -o '"iops" : [0-9.]*' "$base.json" | head -n2 | tr '\n' ' ')" \
                     "busy $((b1 - b0)) proc $((p1 - p0)) ticks"
            done
        done
    done
    if [[ -n ${RDMABLK_NVME_VS_PERF:-} ]]; then
        for s in $systems; do
            local data=/dev/shm/$RDMABLK_NVME_VS_PERF.$s.perf.data
            [[ -f $data ]] || { echo "no profile for $s"; continue; }
            echo "--- perf: $RDMABLK_NVME_VS_PERF on $s, by symbol (self), the whole system"
            perf report -i "$data" --no-children --sort comm,sym --stdio 2>/dev/null \
                | awk '/^ +[0-9.]+%/ && n++ < 60' | tee "$RES/nvme-$t-perf-$s.txt"
            rm -f "$data"
        done
    fi
    local tname=NVMe/TCP; [[ $t == rdma ]] && tname=NVMe/RDMA
    /usr/bin/python3 - "$out" "$systems" "$(uname -r)" "$NVME_TARGET_BIN ($profile build)" "$rounds" "$cases" "$t" "$tname" >"$RES/nvme-$t-vs-nvmet.md" <<'PY'
import json, os, re, sys
out, systems, kver, tbin = sys.argv[1], sys.argv[2].split(), sys.argv[3], sys.argv[4]
rounds, cases = int(sys.argv[5]), sys.argv[6].split()
t, tname = sys.argv[7], sys.argv[8]
def secs(t):
    m = re.fullmatch(r"(\d+)m([\d.]+)s", t)
    return int(m.group(1)) * 60 + float(m.group(2))
idle = open(os.path.join(out, "idle.cpu")).read().split()
idle_rate = int(idle[1]) / (float(idle[3]) - float(idle[2]))  # ticks per second
def load(case, s, rnd):
    base = os.path.join(out, f"{case}.{s}.{rnd}")
    j = json.load(open(base + ".json"))["jobs"][0]
    if j.get("error", 0):
        raise SystemExit(f"{case} {s} round {rnd}: fio error {j['error']}")
    d = j["write"] if "write" in case else j["read"]
    ios = j["read"]["total_ios"] + j["write"]["total_ios"]
    c = open(base + ".cpu").read().split()
    busy, proc, w0, w1, hz = int(c[1]), int(c[3]), float(c[5]), float(c[6]), int(c[8])
    wall = w1 - w0
    # `times`: line 2 is the children (fio): "XmY.YYYs XmY.YYYs"
    tl = open(base + ".times").read().split("\n")[1].split()
    fio_cpu = secs(tl[0]) + secs(tl[1])
    sysfio = (busy - idle_rate * wall) / hz - fio_cpu
    return dict(iops=d["iops"], lat=d["lat_ns"]["mean"] / 1000, ios=ios,
                proc_us=proc / hz / ios * 1e6 if s == "rdmablk" else None,
                sys_us=sysfio / ios * 1e6, fio_us=fio_cpu / ios * 1e6, wall=wall,
                all_us=(busy - idle_rate * wall) / hz / ios * 1e6)
def mean(xs): return sum(xs) / len(xs)
r = {(c, s): [load(c, s, k) for k in range(1, rounds + 1)] for c in cases for s in systems}
def m(c, s, key):
    if (c, s) not in r: return None
    return mean([x[key] for x in r[(c, s)]])
def f(v, fmt): return "-" if v is None else format(v, fmt)
print(f"## rdmablk-target {tname} vs the kernel's nvmet-{t} (kernel {kver}, qemu TCG, 2 vCPUs" + (", Soft-RoCE" if t == "rdma" else "") + ")")
print()
print(f"fio on the kernel's nvme-{t} host, io_uring, direct=1, 256 MiB file-backed namespaces, "
      f"10 s per run, {rounds} rounds alternated (order swapped in even rounds); figures are the means of the rounds.")
print("lat = mean total latency. CPU per I/O: `proc` = rdmablk-target's own utime+stime; "
      "`sys-fio` = all CPUs' busy time minus fio's CPU minus the idle rate "
      f"({idle_rate:.1f} ticks/s), which includes the host's nvme-{t} kernel work for both targets; "
      "`all` = all CPUs' busy time minus the idle rate, fio and the host included (on loopback the "
      "sender's context runs the receiver's TCP work, so only this column charges each side in full).")
if "rdmablk" in systems:
    print(f"rdmablk-target: {tbin}.")
print("TCG-emulated: compare ratios within this table, not absolute figures.")
if t == "rdma":
    print("Soft-RoCE: the RDMA work itself (rxe's packet processing for both targets and the host) is "
          "kernel CPU, in the submitting context or in rxe's tasks: `proc` holds the part rdmablk-target's "
          "own system calls run, `sys-fio` all of it for both.")
print()
print("| case | rdmablk IOPS | nvmet IOPS | IOPS ratio rdmablk/nvmet (per round) "
      "| IOPS per CPU-s ratio rdmablk/nvmet, sys-fio (per round) | rdmablk lat µs | nvmet lat µs "
      "| rdmablk-target CPU µs/IO (proc) | rdmablk CPU µs/IO (sys-fio) | nvmet CPU µs/IO (sys-fio) | fio CPU µs/IO rdmablk / nvmet "
      "| all CPU µs/IO rdmablk / nvmet |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
def median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2
for c in cases:
    ri, ni = m(c, "rdmablk", "iops"), m(c, "nvmet", "iops")
    ratio = per_cpu = "-"
    if ri is not None and ni is not None:
        per = "/".join(f"{r[(c,'rdmablk')][k]['iops'] / r[(c,'nvmet')][k]['iops']:.2f}" for k in range(rounds))
        ratio = f"{ri / ni:.2f} ({per})"
        # IOPS per CPU-second is 1 / (CPU µs per I/O): nvmet's over ours.
        each = [r[(c, 'nvmet')][k]['sys_us'] / r[(c, 'rdmablk')][k]['sys_us'] for k in range(rounds)]
        per_cpu = f"median {median(each):.2f} (" + "/".join(f"{x:.2f}" for x in each) + ")"
    print(f"| {c} | {f(ri, '.0f')} | {f(ni, '.0f')} | {ratio} | {per_cpu} | {f(m(c, 'rdmablk', 'lat'), '.0f')} "
          f"| {f(m(c, 'nvmet', 'lat'), '.0f')} | {f(m(c, 'rdmablk', 'proc_us'), '.1f')} "
          f"| {f(m(c, 'rdmablk', 'sys_us'), '.1f')} | {f(m(c, 'nvmet', 'sys_us'), '.1f')} "
          f"| {f(m(c, 'rdmablk', 'fio_us'), '.1f')} / {f(m(c, 'nvmet', 'fio_us'), '.1f')} "
          f"| {f(m(c, 'rdmablk', 'all_us'), '.0f')} / {f(m(c, 'nvmet', 'all_us'), '.0f')} |")
print()
print("A/A: each system against itself across the rounds of this run (the noise the ratios above sit in): "
      "the spread of its per-round IOPS and sys-fio CPU µs/IO, (max - min) / median.")
print()
print("| case | " + " | ".join(f"{s} IOPS spread | {s} CPU/IO spread" for s in systems) + " |")
print("|---|" + "---:|---:|" * len(systems))
for c in cases:
    cells = []
    for s in systems:
        for key in ("iops", "sys_us"):
            xs = [x[key] for x in r[(c, s)]]
            cells.append(f"{(max(xs) - min(xs)) / median(xs) * 100:.0f}%")
    print(f"| {c} | " + " | ".join(cells) + " |")
if "rdmablk" in systems:
    print()
    print("rdmablk-target's threads with the most CPU during each run (ticks of 1/100 s; thread name, tid):")
    print()
    for c in cases:
        for k in range(1, rounds + 1):
            base = os.path.join(out, f"{c}.rdmablk.{k}")
            def rd(p):
                d = {}
                try:
                    for line in open(p):
                        tid, comm, t = line.split()
                        d[tid] = (comm, int(t))
                except FileNotFoundError:
                    pass
                return d
            a, b = rd(base + ".threads0"), rd(base + ".threads1")
            deltas = sorted(((b[t][1] - a.get(t, (None, 0))[1], b[t][0], t) for t in b), reverse=True)
            top = ", ".join(f"{comm}/{tid} {d}" for d, comm, tid in deltas[:4] if d > 0)
            print(f"- {c} round {k}: {top or 'none'}")
PY
    cat "$RES/nvme-$t-vs-nvmet.md"
    for s in $systems; do
        case $s in
            rdmablk) nvme_disconnect "$NQN" ;;
            nvmet) nvme_disconnect "$knqn"; nvmet_unexport "$knqn" 1 ;;
        esac
    done
    local result=
    if [[ " $systems " == *" rdmablk "* ]]; then result=nvme-$t-vs-nvmet; fi
    nvme_step_end "$result" || exit 1
}
