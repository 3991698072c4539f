#!/usr/bin/env bash
# A real one-node Ceph cluster for development and tests (issue 54): one
# ceph-mon and one ceph-osd as plain processes (no systemd, no containers),
# bound to 127.0.0.1 only, cephx on, msgr2 only, no mgr.
#
#   scripts/ceph-dev-cluster.sh start  DIR   create DIR if needed and start the cluster, or find it running
#   scripts/ceph-dev-cluster.sh stop   DIR   stop the daemons started in DIR and wait for them to exit
#   scripts/ceph-dev-cluster.sh status DIR   `ceph -s`, or exit 1 when it is not running
#
# What start builds in DIR: ceph.conf (keyring = DIR/ceph.$name.keyring, so
# `-c DIR/ceph.conf --id admin` and `--id rdmablk` both work), the keyrings of
# client.admin and client.rdmablk (mon 'profile rbd', osd 'profile rbd
# pool=rbd': a gateway's identity), mon.a/ and osd.0/ (data), log/ and run/
# (pid files, admin sockets); pool "rbd" (size 1, application rbd, `rbd pool
# init`). It waits until the pool takes an `rbd create`/`rbd rm`, and prints
# what a user needs (export CEPH_CONF=...).
#
# The OSD is memstore: its objects live in RAM, at most 6 GiB
# (memstore_device_bytes; CEPH_DEV_OSD_BYTES overrides), used as written. It
# is not kept across a stop (osd_fast_shutdown skips the unmount that would
# save it): start after stop (or after a crash or reboot) wipes DIR's
# cluster state and builds a new, empty cluster with new keys. One OSD, pool
# size 1: nothing here survives a failure, on purpose.
#
# Monitor: [v2:127.0.0.1:13300] (CEPH_DEV_MON_PORT overrides), below the
# ephemeral port range and away from Ceph's own 3300/6789; the OSD binds
# ports PORT+1..PORT+99. Without a mgr, `ceph -s` shows no PG or pool
# statistics (mon_mgr_mkfs_grace keeps MGR_DOWN away, health is HEALTH_OK);
# the rbd CLI (create, rm, bench, import, export), rados, librbd (fio's rbd
# engine) and `ceph osd blocklist` work: they need the monitor and the OSD
# only. client.rdmablk's 'profile rbd' may `osd blocklist add ADDR/NONCE`
# (what breaking a dead owner's lock does) and `osd blocklist ls`, not
# `osd blocklist rm` nor a whole address without nonce: client.admin removes.
#
# Time (2 cores): a fresh start about 10 s, a start that finds the cluster
# running under 1 s, stop about 4 s.
set -euo pipefail

usage() {
    echo "usage: $0 start|stop|status DIR" >&2
    exit 2
}
[ $# -eq 2 ] || usage
cmd=$1
if [ "$cmd" = start ]; then mkdir -p "$2"; fi
if [ -d "$2" ]; then DIR=$(cd "$2" && pwd); else DIR=$2; fi
PORT=${CEPH_DEV_MON_PORT:-13300}
OSD_BYTES=${CEPH_DEV_OSD_BYTES:-6442450944}
CONF=$DIR/ceph.conf
CLIENT=rdmablk
POOL=rbd
WAIT=${CEPH_DEV_WAIT_SECS:-120}

say() { echo "ceph-dev-cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }

# ceph and rbd calls never hang: a dead monitor makes them fail in seconds.
ceph_() { timeout 20 ceph -c "$CONF" --connect-timeout 10 "$@"; }
rbd_() { timeout 30 rbd -c "$CONF" "$@"; }

# pid of daemon NAME (mon.a, osd.0) if its pid file names a live ceph process of this DIR.
daemon_pid() {
    local f=$DIR/run/$1.pid pid
    [ -s "$f" ] || return 1
    pid=$(cat "$f")
    [ -d "/proc/$pid" ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$CONF" || return 1
    echo "$pid"
}

running() {
    daemon_pid mon.a >/dev/null && daemon_pid osd.0 >/dev/null && [ -f "$CONF" ] && ceph_ -s >/dev/null 2>&1
}

# The OSD first: it tells the monitor it is going down, and waits up to
# 5 s for an answer a stopped monitor would not give.
stop_daemons() {
    local name pid i
    for name in osd.0 mon.a; do
        pid=$(daemon_pid "$name") || continue
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 300; i++)); do
            [ -d "/proc/$pid" ] || break
            sleep 0.1
        done
        if [ -d "/proc/$pid" ]; then
            say "$name (pid $pid) did not exit within 30 s of SIGTERM: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            while [ -d "/proc/$pid" ]; do sleep 0.1; done
        fi
    done
    rm -f "$DIR"/run/*.pid
}

print_usage_lines() {
    cat <<EOF
ceph-dev-cluster: running in $DIR (mon [v2:127.0.0.1:$PORT])
export CEPH_CONF=$CONF
client: client.$CLIENT (rbd --id $CLIENT, fio --clientname=$CLIENT --pool=$POOL), admin: client.admin; pool: $POOL
stop: $0 stop $DIR
EOF
}

# Fails, naming the log, when daemon NAME is no longer running.
check_alive() {
    daemon_pid "$1" >/dev/null || die "$1 is not running (did it die?); see $DIR/log/$1.log"
}

write_conf() {
    local fsid=$1
    cat >"$CONF" <<EOF
# Written by scripts/ceph-dev-cluster.sh: a one-node development cluster.
[global]
fsid = $fsid
mon_host = [v2:127.0.0.1:$PORT]
public_addr = 127.0.0.1
ms_bind_msgr1 = false
ms_bind_msgr2 = true
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
auth_allow_insecure_global_id_reclaim = false
keyring = $DIR/ceph.\$name.keyring
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
mon_allow_pool_delete = true

[mon]
mon_data = $DIR/mon.\$id
keyring = $DIR/mon.\$id/keyring
log_file = $DIR/log/\$name.log
pid_file = $DIR/run/\$name.pid
admin_socket = $DIR/run/\$name.asok
mon_cluster_log_file = $DIR/log/cluster.log
# No mgr runs here, on purpose: a cluster that never had one does not warn
# about it (MGR_DOWN) within this grace after its creation; one year.
mon_mgr_mkfs_grace = 31536000
# DIR shares a developer's disk: warn below 2% free, not 30%.
mon_data_avail_warn = 2
mon_data_avail_crit = 1

[osd]
osd_data = $DIR/osd.\$id
keyring = $DIR/osd.\$id/keyring
log_file = $DIR/log/\$name.log
pid_file = $DIR/run/\$name.pid
admin_socket = $DIR/run/\$name.asok
osd_objectstore = memstore
memstore_device_bytes = $OSD_BYTES
ms_bind_port_min = $((PORT + 1))
ms_bind_port_max = $((PORT + 99))

[client]
# A gateway must not serve reads from a librbd cache: another gateway may
# take the volume over and write it, and a gateway that was fenced off must
# not answer from what it remembers, nor sit on writes it has acknowledged
# but not sent (the writeback cache) when it loses the lock. Every read and
# write goes to the OSDs. rbd_blocklist_on_break_lock keeps its default
# (true): breaking a dead owner's lock blocklists it first.
rbd_cache = false
EOF
}

start_fresh() {
    local fsid osd_uuid osd_key
    say "building a new cluster in $DIR"
    rm -rf "$DIR/mon.a" "$DIR/osd.0" "$DIR/run" "$DIR/monmap" "$DIR/mon.keyring" "$DIR"/ceph.*.keyring "$CONF"
    mkdir -p "$DIR/log" "$DIR/run" "$DIR/osd.0"
    # Logs of the previous cluster stay, one generation back.
    local l
    for l in "$DIR"/log/*.log; do
        [ -e "$l" ] && mv -f "$l" "$l.old"
    done
    fsid=$(cat /proc/sys/kernel/random/uuid)
    write_conf "$fsid"

    # The monitor's keyring: mkfs copies it into mon.a/ (an empty directory it makes).
    ceph-authtool --create-keyring "$DIR/mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    ceph-authtool --create-keyring "$DIR/ceph.client.admin.keyring" --gen-key -n client.admin \
        --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
    ceph-authtool "$DIR/mon.keyring" --import-keyring "$DIR/ceph.client.admin.keyring" >/dev/null
    monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$PORT]" "$DIR/monmap" >/dev/null
    ceph-mon -c "$CONF" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/mon.keyring" \
        >>"$DIR/log/mon.a.log" 2>&1 || die "ceph-mon --mkfs failed; see $DIR/log/mon.a.log"

    say "starting ceph-mon (log: $DIR/log/mon.a.log)"
    ceph-mon -c "$CONF" -i a 9>&- </dev/null >>"$DIR/log/mon.a.log" 2>&1 || die "ceph-mon did not start; see $DIR/log/mon.a.log"
    local t0=$SECONDS
    until ceph_ mon stat >/dev/null 2>&1; do
        check_alive mon.a
        [ $((SECONDS - t0)) -lt "$WAIT" ] || die "the monitor did not answer within $WAIT s; see $DIR/log/mon.a.log"
        sleep 0.5
    done

    say "creating osd.0 (memstore, at most $OSD_BYTES bytes of RAM; log: $DIR/log/osd.0.log)"
    osd_uuid=$(cat /proc/sys/kernel/random/uuid)
    osd_key=$(ceph-authtool --gen-print-key)
    echo "{\"cephx_secret\": \"$osd_key\"}" | ceph_ osd new "$osd_uuid" -i - >/dev/null
    ceph-authtool --create-keyring "$DIR/osd.0/keyring" -n osd.0 --add-key "$osd_key" >/dev/null
    ceph-osd -c "$CONF" -i 0 --mkfs --osd-uuid "$osd_uuid" >>"$DIR/log/osd.0.log" 2>&1 \
        || die "ceph-osd --mkfs failed; see $DIR/log/osd.0.log"
    ceph-osd -c "$CONF" -i 0 9>&- </dev/null >>"$DIR/log/osd.0.log" 2>&1 || die "ceph-osd did not start; see $DIR/log/osd.0.log"
    t0=$SECONDS
    until ceph_ osd dump 2>/dev/null | grep -q '^osd\.0 up '; do
        check_alive osd.0
        check_alive mon.a
        [ $((SECONDS - t0)) -lt "$WAIT" ] || die "osd.0 did not come up within $WAIT s; see $DIR/log/osd.0.log"
        sleep 0.5
    done
    say "osd.0 is up"

    ceph_ osd pool create "$POOL" 8 8 replicated >/dev/null 2>&1
    ceph_ osd pool set "$POOL" size 1 --yes-i-really-mean-it >/dev/null 2>&1
    ceph_ osd pool application enable "$POOL" rbd >/dev/null 2>&1
    rbd_ pool init "$POOL" || die "rbd pool init $POOL failed"
    ceph_ auth get-or-create "client.$CLIENT" mon 'profile rbd' osd "profile rbd pool=$POOL" \
        -o "$DIR/ceph.client.$CLIENT.keyring" >/dev/null
}

# Waits until health is OK and an image can be created and removed in the pool.
wait_usable() {
    local t0=$SECONDS probe=ceph-dev-probe-$$ health
    until rbd_ --id "$CLIENT" create --size 4M "$POOL/$probe" >/dev/null 2>&1; do
        check_alive mon.a
        check_alive osd.0
        [ $((SECONDS - t0)) -lt "$WAIT" ] || die "pool $POOL took no image within $WAIT s; see $DIR/log/osd.0.log and $DIR/log/mon.a.log"
        say "waiting for pool $POOL ($((SECONDS - t0)) s)"
        sleep 1
    done
    rbd_ --id "$CLIENT" rm --no-progress "$POOL/$probe" >/dev/null || die "rbd rm $POOL/$probe failed"
    until health=$(ceph_ health 2>&1) && [[ $health == HEALTH_OK* ]]; do
        check_alive mon.a
        check_alive osd.0
        [ $((SECONDS - t0)) -lt "$WAIT" ] || die "health is not OK after $WAIT s: $health; see $DIR/log/cluster.log"
        sleep 1
    done
}

case $cmd in
start)
    command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null && command -v ceph >/dev/null && command -v rbd >/dev/null \
        || die "ceph-mon, ceph-osd, ceph and rbd are needed: apt-get install ceph-mon ceph-osd ceph-common (scripts/test.sh installs them)"
    # One start at a time per DIR.
    exec 9>"$DIR/.start.lock"
    flock 9
    t_start=$SECONDS
    if running; then
        say "already running"
    else
        stop_daemons
        # Another cluster (the tests' one in /tmp/rdmablk-ceph-dev uses the
        # default port) or any other process on the monitor's port: say so
        # now, not as a monitor that "did not start".
        if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
            die "127.0.0.1:$PORT is in use (another dev cluster? scripts/ceph-dev-cluster.sh status DIR); set CEPH_DEV_MON_PORT to another port"
        fi
        start_fresh
    fi
    wait_usable
    say "ready in $((SECONDS - t_start)) s"
    print_usage_lines
    ;;
stop)
    [ -d "$DIR" ] || { say "$DIR does not exist: nothing to stop"; exit 0; }
    stop_daemons
    say "stopped"
    ;;
status)
    if [ -d "$DIR" ] && running; then
        ceph_ -s
    else
        say "not running in $DIR"
        exit 1
    fi
    ;;
*) usage ;;
esac
