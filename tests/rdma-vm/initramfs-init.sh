#!/bin/busybox sh
# /init of the rdma-vm initramfs (busybox only). Loads the 9p modules, mounts
# the host root read-only, hides the host's scratch dirs behind tmpfs, mounts
# the writable results share at /run/rdmavm and switch_roots into the host
# root to run /run/rdmavm/bin/guest-main.sh.
/bin/busybox mkdir -p /usr/bin /sbin /usr/sbin
/bin/busybox --install -s
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

die() {
    echo "rdma-vm init: $*"
    echo "RDMAVM_EXIT_STATUS=125"
    echo o >/proc/sysrq-trigger
    sleep 30
}

for m in $(cat /mods/order); do
    insmod "/mods/$m" || die "insmod $m failed"
done

OPTS=trans=virtio,version=9p2000.L,msize=512000
mount -t 9p -o "$OPTS,ro,cache=loose" hostroot /newroot || die "cannot mount the host root"
# rdmavm.keep=PATH: a host directory under one of the hidden scratch dirs
# (a CI clone in /tmp, say) stays visible at the same path: set it aside
# before the tmpfs goes over its parent and move it back on top afterwards.
KEEP=
for arg in $(cat /proc/cmdline); do
    case "$arg" in rdmavm.keep=*) KEEP="${arg#rdmavm.keep=}" ;; esac
done
if [ -n "$KEEP" ]; then
    mkdir -p /keep
    mount --bind "/newroot$KEEP" /keep || die "cannot keep $KEEP visible"
fi
mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp || die "tmpfs /tmp"
mount -t tmpfs -o mode=1777 tmpfs /newroot/var/tmp || die "tmpfs /var/tmp"
mount -t tmpfs -o mode=0755 tmpfs /newroot/run || die "tmpfs /run"
mount -t tmpfs -o mode=0700 tmpfs /newroot/root || die "tmpfs /root"
if [ -n "$KEEP" ]; then
    mkdir -p "/newroot$KEEP" && mount --move /keep "/newroot$KEEP" || die "cannot restore $KEEP"
fi
mount --move /dev /newroot/dev || die "move /dev"
mkdir -p /newroot/dev/shm /newroot/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
ln -sf /proc/self/fd /newroot/dev/fd
ln -sf /proc/self/fd/0 /newroot/dev/stdin
ln -sf /proc/self/fd/1 /newroot/dev/stdout
ln -sf /proc/self/fd/2 /newroot/dev/stderr
mkdir -p /newroot/run/rdmavm
mount -t 9p -o "$OPTS" rdmavm /newroot/run/rdmavm || die "cannot mount the results share"
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
exec switch_root /newroot /bin/bash /run/rdmavm/bin/guest-main.sh
die "switch_root failed"
