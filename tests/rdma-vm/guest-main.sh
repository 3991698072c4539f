#!/bin/bash
# PID 1 of the rdma-vm guest (started by the initramfs after switch_root).
# Sets up Soft-RoCE, runs the smoke steps, the --script files and the payload,
# then prints RDMAVM_EXIT_STATUS=N on the console and powers off.
export PATH=/run/rdmavm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TERM=dumb LANG=C.UTF-8
R=/run/rdmavm
export RDMAVM_DIR=$R RDMAVM_LIB=$R/bin/guest-lib.sh RDMAVM_RESULTS=$R/results
export RDMAVM_STEPS=$R/steps.tsv RDMAVM_LOGS=$R/logs
# shellcheck source=/dev/null
source $R/config.sh
export RDMAVM_STEP_TIMEOUT RDMAVM_CWD RDMAVM_TOPOLOGY_WANT
# shellcheck source=guest-lib.sh
source "$RDMAVM_LIB"

poweroff_now() {
    sync
    umount $R 2>/dev/null
    echo o >/proc/sysrq-trigger
    sleep 60
}
trap poweroff_now EXIT

ulimit -l unlimited
ulimit -n 65536
ulimit -c 0
hostname rdmavm 2>/dev/null
mkdir -p /run/netns
echo "rdma-vm guest up: kernel $(uname -r), $(nproc) cpus, uptime $(cut -d' ' -f1 /proc/uptime)s"

rc=0
if step setup --timeout 240 guest-setup.sh; then
    set -a
    # shellcheck source=/dev/null
    source $R/topology.env
    set +a
    echo "topology: $RDMAVM_TOPOLOGY"
    if [[ $RDMAVM_SMOKE == 1 ]]; then
        step ibv_devices --timeout 30 ibv_devices || rc=1
        step ibv_devinfo --timeout 30 ibv_devinfo -v || rc=1
        step ibv_rc_pingpong --timeout 90 pair \
            ibv_rc_pingpong -d "$RDMAVM_SERVER_DEV" -g "$RDMAVM_GID_INDEX" -n 100 \
            --client ibv_rc_pingpong -d "$RDMAVM_CLIENT_DEV" -g "$RDMAVM_GID_INDEX" -n 100 "$RDMAVM_SERVER_IP" || rc=1
        step rping --timeout 90 pair \
            rping -s -a "$RDMAVM_SERVER_IP" -C 20 -S 4096 \
            --client rping -c -a "$RDMAVM_SERVER_IP" -C 20 -S 4096 || rc=1
    fi
    for s in "${RDMAVM_SCRIPTS[@]}"; do
        n=$(basename "$s" .sh); n=${n#[0-9][0-9]-}
        step "$n" bash "$R/$s" || rc=1
    done
    if [[ ${#RDMAVM_PAYLOAD[@]} -gt 0 ]]; then
        step "$RDMAVM_PAYLOAD_NAME" "${RDMAVM_PAYLOAD[@]}" || rc=1
    fi
else
    rc=1
fi
# nested steps (recorded by --script files) count too
grep -q "$(printf '\tFAIL\t')" "$RDMAVM_STEPS" 2>/dev/null && rc=1
echo "RDMAVM_EXIT_STATUS=$rc"
