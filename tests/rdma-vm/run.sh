#!/usr/bin/env bash
# Run commands inside a throw-away qemu VM that has Soft-RoCE (rdma_rxe) devices.
#
#   tests/rdma-vm/run.sh [options] [-- CMD ARGS...]
#
# Without a payload or --script it runs rdmablk's CI stage: it builds the
# binaries and test executables on the host (ci-build.sh), then runs the real
# programs over rdma:// in the VM (ci-guest.sh). --smoke-only runs just the
# smoke steps.
#
# The build/CI kernel has no RDMA support, so this boots Debian's 6.12 kernel
# (installed when missing; RDMAVM_KERNEL picks another, such as 6.1) under qemu TCG, shares the host / read-only into the
# guest (9p) plus a writable results share, sets up rxe devices
# (guest-setup.sh), runs the built-in smoke steps, then the payload.
# Every guest step is recorded (name, PASS/FAIL, seconds); the host prints a
# summary and exits 0 only if every step passed (a step a script records as
# SKIPPED is shown and does not fail the run). See README.md.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${RDMAVM_OUT:-$HERE/out}
TIMEOUT=${RDMAVM_TIMEOUT:-900}
# The CI stage (ci-build.sh) has a longer default unless a limit is given.
TIMEOUT_GIVEN=${RDMAVM_TIMEOUT:+1}
STEP_TIMEOUT=
SMOKE=1
SMOKE_ONLY=0
TOPOLOGY=${RDMAVM_TOPOLOGY:-auto}
MEM=${RDMAVM_MEM:-2048}
SMP=${RDMAVM_SMP:-2}
# The guest's TSC: "unstable" (default: the clocksource is the emulated
# HPET, clock_gettime is a system call and CPU time is counted in ticks);
# "reliable" makes the guest trust TCG's TSC (no watchdog), so that CPU time
# is measured by sched_clock instead of sampled by the tick.
TSC=${RDMAVM_TSC:-unstable}
VERBOSE=0
NAME=payload
SCRIPTS=()
ENVS=()
CMD=()

usage() {
    cat <<'USAGE'
usage: run.sh [options] [-- CMD ARGS...]

Boots a Soft-RoCE VM, runs the smoke steps, then the payload, prints a step summary.
Without a payload or --script: rdmablk's CI stage (builds on the host, then the
conformance suite, target + CLI, system tests and bench over rdma:// in the VM).
Exit status: 0 only if every step passed (and the guest finished in time);
SKIPPED steps are shown and do not fail the run.

options:
  --timeout SECS       overall wall-clock limit; qemu is killed after it (default 900;
                       2400 for the CI stage)
  --step-timeout SECS  limit for each payload/script step (default: the overall limit)
  --script FILE        run FILE (bash) in the guest as one step named after FILE;
                       may be given several times; the file is copied into the VM,
                       it can `source "$RDMAVM_LIB"` to record sub-steps with `step`
  --name NAME          step name for the `-- CMD` payload (default: payload)
  -e, --env NAME=VAL   export NAME=VAL to the guest steps (repeatable)
  --topology T         auto (default: routed, else loopback) | routed | netns | loopback
  --no-smoke           skip the built-in smoke steps (ibv_devices, pingpong, rping)
  --smoke-only         run only the smoke steps (instead of the CI stage)
  --mem MB             guest memory (default 2048)       env RDMAVM_MEM
  --smp N              guest vCPUs (default 2)            env RDMAVM_SMP
  (env RDMAVM_TSC=reliable: the guest trusts the TSC; default unstable)
  --out DIR            work dir (default tests/rdma-vm/out) env RDMAVM_OUT
  -v, --verbose        stream the guest console
  -h, --help

The host root is visible read-only in the guest, except /tmp, /run, /var/tmp,
/root and /dev/shm (tmpfs in the guest): keep binaries elsewhere (e.g. target/).
Guest environment for payloads: RDMAVM_TOPOLOGY, RDMAVM_SERVER_DEV/_IP,
RDMAVM_CLIENT_DEV/_IP, RDMAVM_CLIENT_NETNS, RDMAVM_GID_INDEX, RDMAVM_RESULTS
(writable dir, copied back to the host), RDMAVM_LIB; `in-client CMD...` runs CMD
on the client side (inside the client netns if there is one).
USAGE
}

while [[ $# -gt 0 ]]; do
    case $1 in
        --timeout) TIMEOUT=$2; TIMEOUT_GIVEN=1; shift 2 ;;
        --step-timeout) STEP_TIMEOUT=$2; shift 2 ;;
        --script) SCRIPTS+=("$2"); shift 2 ;;
        --name) NAME=$2; shift 2 ;;
        -e|--env) ENVS+=("$2"); shift 2 ;;
        --topology) TOPOLOGY=$2; shift 2 ;;
        --no-smoke) SMOKE=0; shift ;;
        --smoke-only) SMOKE_ONLY=1; shift ;;
        --mem) MEM=$2; shift 2 ;;
        --smp) SMP=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        -v|--verbose) VERBOSE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; CMD=("$@"); break ;;
        *) echo "run.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
case $TOPOLOGY in auto|netns|routed|loopback) ;; *) echo "run.sh: bad --topology $TOPOLOGY" >&2; exit 2 ;; esac
[[ $TIMEOUT =~ ^[0-9]+$ ]] || { echo "run.sh: bad --timeout" >&2; exit 2; }
STEP_TIMEOUT_GIVEN=${STEP_TIMEOUT:+1}
STEP_TIMEOUT=${STEP_TIMEOUT:-$TIMEOUT}
for s in "${SCRIPTS[@]}"; do [[ -r $s ]] || { echo "run.sh: cannot read script $s" >&2; exit 2; }; done
[[ $(id -u) -eq 0 ]] || { echo "run.sh: must run as root (installs packages, shares / into the VM)" >&2; exit 2; }

T_START=$(date +%s.%N)
log() { printf '[rdma-vm %6.1fs] %s\n' "$(awk -v a="$T_START" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" "$*" >&2; }

# one run per work dir at a time (also keeps two cold runs from racing apt)
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
if ! flock -n 9; then log "another run.sh is using $OUT, waiting"; flock 9; fi

# ---------------------------------------------------------------- packages
# nbd-client: the guest sees this root read-only, so the kernel NBD step's
# client comes from here.
PKGS=(qemu-system-x86 linux-image-amd64 rdma-core ibverbs-utils ibverbs-providers perftest
      rdmacm-utils busybox-static iproute2 kmod cpio nbd-client)
# fio and e2fsprogs: the ublk step's file system and its verify run.
PKGS+=(fio e2fsprogs)
# python3: the ublk boot step plays systemd's notification socket.
PKGS+=(python3)
# nvme-cli: the NVMe/TCP steps' kernel host (nvme discover/connect/id-ctrl).
PKGS+=(nvme-cli)
missing=()
for p in "${PKGS[@]}"; do
    dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed' || missing+=("$p")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    log "installing: ${missing[*]}"
    # The VM kernel only needs to be unpacked. If this machine does not boot a
    # Debian kernel from /boot, skip building an initrd for it (saves time).
    initrd_env=()
    compgen -G '/boot/vmlinuz-*' >/dev/null || initrd_env=(INITRD=No)
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    env "${initrd_env[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    log "packages installed"
fi
# The VM kernel: Debian's 6.12 (bookworm's linux-image-6.12.*+deb12-amd64-unsigned),
# which has rxe, ublk, nbd and the NVMe-oF host and target; the newest one the
# archive offers is installed when none is. linux-image-amd64 (6.1) stays for
# comparison (RDMAVM_KERNEL=/boot/vmlinuz-6.1...). Only unpacked: no initrd.
if [[ -z ${RDMAVM_KERNEL:-} ]] && ! compgen -G '/boot/vmlinuz-6.12.*-amd64' >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    k612=$(apt-cache search --names-only '^linux-image-6\.12\.[0-9]+\+deb12-amd64-unsigned$' | awk '{print $1}' | sort -V | tail -n1)
    [[ -n $k612 ]] || { echo "run.sh: no linux-image-6.12.*+deb12-amd64-unsigned in the archive" >&2; exit 1; }
    log "installing the VM kernel $k612"
    INITRD=No apt-get install -y -qq --no-install-recommends "$k612" >/dev/null
    log "kernel installed"
fi

# ---------------------------------------------------------------- CI stage
if [[ ${#CMD[@]} -eq 0 && ${#SCRIPTS[@]} -eq 0 && $SMOKE_ONLY -eq 0 ]]; then
    # shellcheck source=ci-build.sh
    source "$HERE/ci-build.sh"
fi

# ---------------------------------------------------------------- kernel
KERNEL=${RDMAVM_KERNEL:-}
if [[ -z $KERNEL ]]; then
    for k in $(ls -1 /boot/vmlinuz-*-amd64 2>/dev/null | sort -V -r); do
        v=${k#/boot/vmlinuz-}
        if [[ -d /lib/modules/$v/kernel/drivers/infiniband/sw/rxe ]]; then KERNEL=$k; break; fi
    done
fi
[[ -n $KERNEL && -r $KERNEL ]] || { echo "run.sh: no /boot/vmlinuz-*-amd64 with rdma_rxe found" >&2; exit 1; }
KVER=${KERNEL#/boot/vmlinuz-}

# ---------------------------------------------------------------- initramfs
INITRD=$OUT/initramfs-$KVER.cpio.gz
if [[ ! -s $INITRD || $HERE/initramfs-init.sh -nt $INITRD || $HERE/run.sh -nt $INITRD || $KERNEL -nt $INITRD ]]; then
    log "building initramfs for $KVER"
    stage=$(mktemp -d "$OUT/initramfs.XXXXXX")
    mkdir -p "$stage"/{bin,dev,proc,sys,newroot,mods}
    cp /bin/busybox "$stage/bin/busybox"
    : >"$stage/mods/order"
    for m in virtio_pci 9pnet_virtio 9p; do
        modprobe -S "$KVER" --show-depends "$m" | while read -r kind path _; do
            [[ $kind == insmod ]] || continue
            base=$(basename "$path"); base=${base%.xz}; base=${base%.zst}
            grep -qx "$base" "$stage/mods/order" && continue
            case $path in
                *.xz) xz -dc "$path" >"$stage/mods/$base" ;;
                *.zst) zstd -qdc "$path" >"$stage/mods/$base" ;;
                *) cp "$path" "$stage/mods/$base" ;;
            esac
            echo "$base" >>"$stage/mods/order"
        done
    done
    install -m 0755 "$HERE/initramfs-init.sh" "$stage/init"
    (cd "$stage" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1) >"$INITRD.tmp"
    mv "$INITRD.tmp" "$INITRD"
    rm -rf "$stage"
fi

# ---------------------------------------------------------------- results share
RUN=$OUT/run
rm -rf "$RUN"
mkdir -p "$RUN/bin" "$RUN/logs" "$RUN/scripts" "$RUN/results"
install -m 0755 "$HERE/guest-main.sh" "$HERE/guest-setup.sh" "$HERE/guest-lib.sh" "$HERE/in-client" "$HERE/pair" "$RUN/bin/"
cfg=$RUN/config.sh
{
    echo "# written by run.sh"
    printf 'RDMAVM_SMOKE=%q\n' "$SMOKE"
    printf 'RDMAVM_TOPOLOGY_WANT=%q\n' "$TOPOLOGY"
    printf 'RDMAVM_STEP_TIMEOUT=%q\n' "$STEP_TIMEOUT"
    printf 'RDMAVM_CWD=%q\n' "$PWD"
    printf 'RDMAVM_PAYLOAD_NAME=%q\n' "$NAME"
    printf 'RDMAVM_PAYLOAD=('; for a in "${CMD[@]}"; do printf '%q ' "$a"; done; echo ')'
    printf 'RDMAVM_SCRIPTS=('
    i=0
    for s in "${SCRIPTS[@]}"; do
        i=$((i + 1)); b=$(basename "$s"); b=${b%.sh}
        dst="scripts/$(printf '%02d' $i)-$b.sh"
        install -m 0755 "$s" "$RUN/$dst"
        printf '%q ' "$dst"
    done
    echo ')'
    for e in "${ENVS[@]}"; do
        [[ $e == *=* ]] || { echo "run.sh: --env wants NAME=VALUE, got $e" >&2; exit 2; }
        printf 'export %s=%q\n' "${e%%=*}" "${e#*=}"
    done
} >"$cfg"

# ---------------------------------------------------------------- boot
CONSOLE=$OUT/console.log
QEMU=(qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp "$SMP" -m "$MEM"
      -nodefaults -no-user-config -nographic -no-reboot -serial stdio -monitor none -nic none
      -kernel "$KERNEL" -initrd "$INITRD"
      -append "console=ttyS0 panic=-1 oops=panic quiet loglevel=4 tsc=$TSC${RDMAVM_KEEP:+ rdmavm.keep=$RDMAVM_KEEP}"
      -fsdev local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap
      -device virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot
      -fsdev local,id=rdmavm,path="$RUN",security_model=none,multidevs=remap
      -device virtio-9p-pci,fsdev=rdmavm,mount_tag=rdmavm)

QPID= TPID=
cleanup() {
    [[ -n $QPID ]] && kill -KILL "$QPID" 2>/dev/null
    [[ -n $TPID ]] && kill "$TPID" 2>/dev/null
    true
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM

# A boot whose kernel panics before the guest recorded any step (the 6.12
# kernel under TCG panicked in the timer code during boot about once in
# seven boots, before any rdmablk code ran) is tried once more; a panic
# after a step ran is a result and is reported.
for attempt in 1 2; do
    elapsed=$(awk -v a="$T_START" -v b="$(date +%s.%N)" 'BEGIN{printf "%d", b-a}')
    remaining=$((TIMEOUT - elapsed))
    (( remaining > 10 )) || remaining=10
    log "booting $KVER (TCG, ${SMP} vCPU, ${MEM} MiB), time limit ${remaining}s"
    T_BOOT=$(date +%s.%N)
    : >"$CONSOLE"
    "${QEMU[@]}" </dev/null >"$CONSOLE" 2>&1 &
    QPID=$!
    if [[ $VERBOSE -eq 1 ]]; then
        tail -n +1 -f "$CONSOLE" &
        TPID=$!
    fi
    timed_out=0
    deadline=$(( $(date +%s) + remaining ))
    while kill -0 "$QPID" 2>/dev/null; do
        if (( $(date +%s) >= deadline )); then
            timed_out=1
            log "TIMEOUT after ${TIMEOUT}s: killing qemu"
            kill -TERM "$QPID" 2>/dev/null || true
            sleep 2
            kill -KILL "$QPID" 2>/dev/null || true
            break
        fi
        sleep 1
    done
    wait "$QPID" || true
    QPID=
    if [[ -n $TPID ]]; then sleep 0.3; kill "$TPID" 2>/dev/null || true; wait "$TPID" 2>/dev/null || true; TPID=; fi
    T_END=$(date +%s.%N)
    vm_secs=$(awk -v a="$T_BOOT" -v b="$T_END" 'BEGIN{printf "%.1f", b-a}')
    if (( attempt == 1 && timed_out == 0 )) && [[ ! -s $RUN/steps.tsv ]] &&
        grep -aq 'Kernel panic' "$CONSOLE"; then
        log "the guest kernel panicked before any step ran: $(grep -a -m1 'Kernel panic' "$CONSOLE" | tr -d '\r')"
        cp "$CONSOLE" "$OUT/console.panic.log"
        log "booting once more (that console is in $OUT/console.panic.log)"
        continue
    fi
    break
done

# ---------------------------------------------------------------- summary
status_line=$(tr -d '\r' <"$CONSOLE" | grep -a -o 'RDMAVM_EXIT_STATUS=[0-9]*' | tail -n1 || true)
guest_rc=${status_line#RDMAVM_EXIT_STATUS=}
fail=0
echo
echo "==== rdma-vm summary ($KVER, topology: $(cat "$RUN/topology" 2>/dev/null || echo unknown)) ===="
printf '%-28s %-7s %8s\n' STEP RESULT SECONDS
if [[ -s $RUN/steps.tsv ]]; then
    while IFS=$'\t' read -r name result secs rc; do
        printf '%-28s %-7s %8s\n' "$name" "$result" "$secs"
        [[ $result == PASS || $result == SKIPPED ]] || fail=1
    done <"$RUN/steps.tsv"
else
    echo "(no steps recorded)"; fail=1
fi
running=$(tr -d '\r' <"$CONSOLE" | sed -n 's/^>>> step \([^:]*\):.*/\1/p' | tail -n1)
if [[ -n $running ]] && ! cut -f1 "$RUN/steps.tsv" 2>/dev/null | grep -qx "$running"; then
    printf '%-28s %-7s %8s\n' "$running" FAIL "(unfinished)"; fail=1
fi
if [[ $timed_out -eq 1 ]]; then
    printf '%-28s %-7s %8s\n' "vm (overall timeout)" FAIL "$vm_secs"; fail=1
elif [[ -z $guest_rc ]]; then
    printf '%-28s %-7s %8s\n' "vm (no exit status)" FAIL "$vm_secs"; fail=1
else
    [[ $guest_rc == 0 ]] || fail=1
fi
total=$(awk -v a="$T_START" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
echo "vm wall time ${vm_secs}s, total ${total}s; logs: $RUN/logs, console: $CONSOLE"
if [[ $fail -ne 0 ]]; then
    if [[ -s $RUN/steps.tsv ]]; then
        while IFS=$'\t' read -r name result secs rc; do
            [[ $result == PASS || $result == SKIPPED ]] && continue
            echo "---- $name (exit $rc): last lines of $RUN/logs/$name.log"
            tail -n 40 "$RUN/logs/$name.log" 2>/dev/null || true
        done <"$RUN/steps.tsv"
    fi
    if [[ $timed_out -eq 1 || -z $guest_rc ]]; then
        echo "---- last lines of the console"
        tail -n 40 "$CONSOLE" | tr -d '\r'
    fi
    echo "RESULT: FAIL"
    exit 1
fi
echo "RESULT: PASS"
