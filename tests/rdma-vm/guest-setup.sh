#!/bin/bash
# Guest-side Soft-RoCE setup (run by guest-main.sh as the "setup" step).
#
# Topologies (RDMAVM_TOPOLOGY_WANT = auto | routed | netns | loopback):
#   routed   (auto tries it first) two rxe devices in the init netns, one on each end of a
#            veth pair: rxe0 on veth0 10.77.0.1 (server side), rxe1 on veth1 10.77.0.2
#            (client side). Policy routing + accept_local make traffic between the two
#            addresses cross the veth pair instead of lo, so RoCE packets really travel
#            between two devices (checked via the rxe hw_counters).
#   netns    (only on request) veth1 + rxe1 in netns "rdmacli". Does NOT work on Debian's
#            6.1 kernel: rxe's UDP tunnel socket and route lookups are init_net only, and
#            "rdma dev set rxe1 netns" returns EOPNOTSUPP.
#   loopback (auto falls back to it) a single rxe0 on veth0 that talks to itself.
# Each candidate is verified with a short ibv_rc_pingpong before it is chosen.
# Writes /run/rdmavm/topology.env (RDMAVM_* variables) and /run/rdmavm/topology.
set -u
R=${RDMAVM_DIR:-/run/rdmavm}
WANT=${RDMAVM_TOPOLOGY_WANT:-auto}
NS=rdmacli
SIP=10.77.0.1 CIP=10.77.0.2

T0=$(date +%s.%N)
el() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.2f", b-a}'; }
x() { echo "+ [$(el)s] $*"; "$@"; }

ulimit -l unlimited
x modprobe -a rdma_rxe ib_uverbs rdma_ucm veth || { echo "modprobe failed"; exit 1; }
ip link set lo up

teardown() {
    for d in $(ls /sys/class/infiniband 2>/dev/null); do rdma link del "$d" 2>/dev/null; done
    ip netns exec $NS rdma link del rxe1 2>/dev/null
    ip link del veth0 2>/dev/null
    ip netns del $NS 2>/dev/null
    rdma system set netns shared 2>/dev/null
    sleep 0.5
}

# probe SERVER_DEV CLIENT_DEV CLIENT_NETNS: quick verbs check (plus rdma_cm for netns);
# with two devices, both must have received RoCE packets (traffic crossed the link).
probe() {
    local sdev=$1 cdev=$2 cns=$3 ok=0 sp d n
    local -a in=()
    [[ -n $cns ]] && in=(ip netns exec "$cns")
    echo "--- probe: [$(el)s] ibv_rc_pingpong $sdev <- $cdev ${cns:+(netns $cns)}"
    timeout 20 ibv_rc_pingpong -d "$sdev" -g 1 -n 3 -p 18515 &
    sp=$!
    # Under TCG the server may need more than a moment to listen, and the
    # client gives up on the first refused TCP connect: retry while the
    # server is still waiting.
    local try
    for try in 1 2 3 4 5 6 7 8 9 10; do
        sleep 0.5
        if timeout 15 "${in[@]}" ibv_rc_pingpong -d "$cdev" -g 1 -n 3 -p 18515 $SIP; then ok=0; break; fi
        ok=1
        kill -0 $sp 2>/dev/null || break
        echo "--- probe: client attempt $try failed; retrying"
    done
    [[ $ok -eq 0 ]] || kill $sp 2>/dev/null
    wait $sp || ok=1
    [[ $ok -eq 0 ]] || { echo "--- probe: ibv_rc_pingpong FAILED"; return 1; }
    if [[ -n $cns ]]; then
        echo "--- probe: [$(el)s] rping"
        timeout 20 rping -s -a $SIP -C 2 -p 18516 &
        sp=$!
        sleep 0.5
        timeout 15 "${in[@]}" rping -c -a $SIP -C 2 -p 18516 || { ok=1; kill $sp 2>/dev/null; }
        wait $sp || ok=1
        [[ $ok -eq 0 ]] || { echo "--- probe: rping FAILED"; return 1; }
    fi
    if [[ $sdev != "$cdev" ]]; then
        for d in $sdev $cdev; do
            n=$(</sys/class/infiniband/$d/ports/1/hw_counters/rcvd_pkts) || n=0
            echo "--- probe: $d rcvd_pkts=$n sent_pkts=$(</sys/class/infiniband/$d/ports/1/hw_counters/sent_pkts)"
            [[ $n -gt 0 ]] || { echo "--- probe: $d received nothing"; return 1; }
        done
    fi
    echo "--- probe: [$(el)s] OK"
}

show() {
    echo "--- state"
    rdma link show; ip -br addr
    grep -H . /sys/class/infiniband/*/ports/1/gids/1 /sys/class/infiniband/*/ports/1/gid_attrs/types/1 \
        /sys/class/infiniband/*/ports/1/gid_attrs/ndevs/1 2>/dev/null
}

veth_pair() {
    x ip link add veth0 type veth peer name veth1 || return 1
    x ip addr add $SIP/24 dev veth0 && x ip link set veth0 up
}

# Variant A: shared rdma netns mode (default); rxe1 created from inside the netns.
try_netns_shared() {
    echo "=== topology netns (rdma system netns shared)"
    veth_pair || return 1
    x ip netns add $NS || return 1
    x ip link set veth1 netns $NS || return 1
    x ip -n $NS addr add $CIP/24 dev veth1 && x ip -n $NS link set veth1 up && x ip -n $NS link set lo up || return 1
    x rdma link add rxe0 type rxe netdev veth0 || return 1
    x ip netns exec $NS rdma link add rxe1 type rxe netdev veth1 || return 1
    sleep 0.3; show
    probe rxe0 rxe1 $NS
}

# Variant B: exclusive rdma netns mode; rxe1 moved into the client netns.
try_netns_exclusive() {
    echo "=== topology netns (rdma system netns exclusive)"
    x rdma system set netns exclusive || return 1
    veth_pair || return 1
    x ip netns add $NS || return 1
    x ip link set veth1 netns $NS || return 1
    x ip -n $NS addr add $CIP/24 dev veth1 && x ip -n $NS link set veth1 up && x ip -n $NS link set lo up || return 1
    x rdma link add rxe0 type rxe netdev veth0 || return 1
    x ip netns exec $NS rdma link add rxe1 type rxe netdev veth1 || return 1
    rdma dev show rxe1 >/dev/null 2>&1 && { x rdma dev set rxe1 netns $NS || return 1; }
    sleep 0.3; show
    echo "in netns $NS:"; ip netns exec $NS rdma link show
    probe rxe0 rxe1 $NS
}

# Variant C: both devices in the init netns, one on each end of the veth pair.
# Plain routing would deliver 10.77.0.1 <-> 10.77.0.2 via lo (rxe drops that), so
# policy routing sends locally generated traffic for the peer address out of
# the own veth end ("10.77.0.2 is behind veth0, 10.77.0.1 is behind veth1"),
# and accept_local lets the other end take packets with a local source address.
try_routed() {
    echo "=== topology routed (rxe0 on veth0, rxe1 on veth1, policy routing over the veth pair)"
    # one ip process: every exec costs ~0.3 s under TCG
    x ip -batch - <<EOB || return 1
link add veth0 type veth peer name veth1
addr add $SIP/24 dev veth0
addr add $CIP/24 dev veth1
link set veth0 up
link set veth1 up
route add $CIP dev veth0 src $SIP table 100
route add $SIP dev veth1 src $CIP table 101
rule add pref 100 to $CIP iif lo lookup 100
rule add pref 101 to $SIP iif lo lookup 101
rule add pref 1000 lookup local
rule del pref 0 lookup local
EOB
    x sysctl -qw net.ipv4.conf.all.accept_local=1 net.ipv4.conf.default.accept_local=1 \
        net.ipv4.conf.veth0.accept_local=1 net.ipv4.conf.veth1.accept_local=1 \
        net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0 \
        net.ipv4.conf.veth0.rp_filter=0 net.ipv4.conf.veth1.rp_filter=0 || return 1
    x rdma link add rxe0 type rxe netdev veth0 || return 1
    x rdma link add rxe1 type rxe netdev veth1 || return 1
    show
    ip rule
    probe rxe0 rxe1 ""
}

untangle_routed() {
    ip rule del pref 100 2>/dev/null; ip rule del pref 101 2>/dev/null
    ip rule show pref 0 | grep -q . || ip rule add pref 0 lookup local
    ip rule del pref 1000 2>/dev/null
    ip route flush table 100 2>/dev/null; ip route flush table 101 2>/dev/null
}

try_loopback() {
    echo "=== topology loopback (one rxe0 on veth0 talking to itself)"
    veth_pair || return 1
    x ip link set veth1 up
    x rdma link add rxe0 type rxe netdev veth0 || return 1
    sleep 0.3; show
    probe rxe0 rxe0 ""
}

chosen=
if [[ $WANT == netns ]]; then
    if try_netns_shared; then chosen=netns
    else teardown; try_netns_exclusive && chosen=netns; fi
    [[ -n $chosen ]] || teardown
fi
if [[ -z $chosen && ( $WANT == auto || $WANT == routed ) ]]; then
    try_routed && chosen=routed
    [[ -n $chosen ]] || { teardown; untangle_routed; }
fi
if [[ -z $chosen && ( $WANT == auto || $WANT == loopback ) ]]; then
    try_loopback && chosen=loopback
fi
if [[ -z $chosen ]]; then echo "no working topology"; echo failed >"$R/topology"; exit 1; fi

echo "$chosen" >"$R/topology"
{
    echo "RDMAVM_TOPOLOGY=$chosen"
    echo "RDMAVM_SERVER_DEV=rxe0"
    echo "RDMAVM_SERVER_IP=$SIP"
    echo "RDMAVM_GID_INDEX=1"
    case $chosen in
        loopback) echo "RDMAVM_CLIENT_DEV=rxe0"; echo "RDMAVM_CLIENT_IP=$SIP"; echo "RDMAVM_CLIENT_NETNS=" ;;
        routed) echo "RDMAVM_CLIENT_DEV=rxe1"; echo "RDMAVM_CLIENT_IP=$CIP"; echo "RDMAVM_CLIENT_NETNS=" ;;
        *) echo "RDMAVM_CLIENT_DEV=rxe1"; echo "RDMAVM_CLIENT_IP=$CIP"; echo "RDMAVM_CLIENT_NETNS=$NS" ;;
    esac
} >"$R/topology.env"
echo "=== chosen topology: $chosen"
cat "$R/topology.env"
