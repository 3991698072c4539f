# Helpers shared by the bench scripts (compare.sh, ceiling.sh, per-io.sh, instr-per-io.sh, qd1-legs.sh, placement.sh, vs-rbd.sh); source it.

# A free TCP port on 127.0.0.1.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Waits (10 s at most) until something listens on 127.0.0.1:PORT, failing
# early if the server process PID died.
wait_port() { # PORT PID
    for _ in $(seq 1 200); do
        if python3 -c "import socket,sys; s=socket.socket(); s.settimeout(0.2); sys.exit(s.connect_ex(('127.0.0.1', $1)))" 2>/dev/null; then return 0; fi
        kill -0 "$2" 2>/dev/null || { echo "${0##*/}: server (pid $2) died" >&2; return 1; }
        sleep 0.05
    done
    echo "${0##*/}: nothing listens on port $1" >&2; return 1
}

# The config of a target for the bench scripts: listening on
# tcp://127.0.0.1:PORT, a 1 GiB volume "null" (null backend) and a volume
# "file" on FILE; EXTRA lines go into [target].
null_and_file_target_config() { # PORT FILE [EXTRA]
    cat <<EOF
[target]
listen = ["tcp://127.0.0.1:$1"]
${3:-}

[[volume]]
name = "null"
backend = "null"
size = "1GiB"
allow_any_host = true

[[volume]]
name = "file"
backend = "file"
path = "$2"
allow_any_host = true
EOF
}

# CPU seconds (user+system, all threads) of a process so far.
cpu_secs() { python3 -c "
import os
f=open('/proc/$1/stat').read().rsplit(')',1)[1].split()
print((int(f[11])+int(f[12]))/os.sysconf('SC_CLK_TCK'))"; }

# Stops the servers a script started, the last started first, each gone
# before the next is asked: `rdmablk nbd` flushes its volume at SIGTERM, so
# its target must outlive it (killed together, the flush waited for the
# target to come back, and the process outlived the script). One still
# running after 30 s is killed, and said so.
stop_in_reverse() { # PID...
    local i p n
    for ((i = $#; i >= 1; i--)); do
        p=${!i}
        kill "$p" 2>/dev/null || continue
        for ((n = 0; n < 300; n++)); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$p" 2>/dev/null; then
            echo "${0##*/}: pid $p ($(cat "/proc/$p/comm" 2>/dev/null)) still running 30 s after SIGTERM; killing it" >&2
            kill -KILL "$p" 2>/dev/null || true
        fi
        wait "$p" 2>/dev/null || true
    done
}

# The directory holding the binaries to measure: $BIN (relative to the
# repository, where the scripts run) or target/release. Prints it, or fails
# naming the first BINARY that is not there.
bin_dir() { # BINARY...
    local dir b
    dir=$(realpath -m "${BIN:-target/release}")
    for b in "$@"; do
        [ -x "$dir/$b" ] || { echo "${0##*/}: $dir/$b missing: cargo build --release -p rdmablk-bench -p rdmablk-target -p rdmablk-initiator, or BIN=DIR" >&2; return 1; }
    done
    echo "$dir"
}

# Installs with apt-get each PACKAGE whose COMMAND is missing.
install_missing() { # COMMAND:PACKAGE ...
    local need=() pair
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
    done
    if [ ${#need[@]} -gt 0 ]; then
        echo "==> installing ${need[*]}" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
}

# The CPU that has taken most of the interrupts of the disk holding FILE
# (from /proc/interrupts, for virtio-blk and NVMe disks), among the CPUs
# this process may use; prints nothing when it cannot tell.
disk_irq_cpu() { # FILE
    python3 - "$1" <<'PY'
import os, re, sys
st = os.stat(sys.argv[1])
node = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
if os.path.exists(os.path.join(node, "partition")):
    node = os.path.dirname(node)
dev = os.path.join(node, "device")
if not os.path.exists(dev):
    sys.exit(0)
# virtio-blk: device -> .../virtio1, interrupts "virtio1-req.0";
# NVMe: device -> .../nvme0, interrupts "nvme0q1".
name = os.path.basename(os.path.realpath(dev))
pattern = re.compile(rf"^{re.escape(name)}(-req|q)\S*$")
allowed = os.sched_getaffinity(0)
with open("/proc/interrupts") as f:
    cpus = [int(c[3:]) for c in f.readline().split()]
    totals = [0] * len(cpus)
    for line in f:
        fields = line.split()
        if not fields or not pattern.match(fields[-1]):
            continue
        for i, v in enumerate(fields[1:1 + len(cpus)]):
            if v.isdigit():
                totals[i] += int(v)
best = max((t, c) for t, c in zip(totals, cpus) if c in allowed) if cpus else (0, None)
if best[0] > 0:
    print(best[1])
PY
}

# Where a placed server and its client run: sets PLACE_SERVER_CPU to the CPU
# that takes the interrupts of FILE's disk and PLACE_CLIENT_CPUS to the other
# CPUs this process may use. Both are left empty when they cannot be told
# apart (no disk interrupt found, one CPU, or no taskset).
placement() { # FILE
    PLACE_SERVER_CPU=$(disk_irq_cpu "$1")
    PLACE_CLIENT_CPUS=$(python3 -c "import os; print(','.join(str(c) for c in sorted(os.sched_getaffinity(0)) if str(c) != '$PLACE_SERVER_CPU'))")
    if [ -z "$PLACE_SERVER_CPU" ] || [ -z "$PLACE_CLIENT_CPUS" ] || ! command -v taskset >/dev/null; then
        PLACE_SERVER_CPU=""; PLACE_CLIENT_CPUS=""
    fi
}

# Bytes in a size such as 1G, 512M or 4096 (binary units; a trailing B or
# iB is allowed).
size_bytes() { # SIZE
    python3 -c "
s='$1'.strip().lower().rstrip('ib').rstrip('b')
m={'k':1<<10,'m':1<<20,'g':1<<30,'t':1<<40}
print(int(s[:-1])*m[s[-1]] if s[-1] in m else int(s))"
}

# Writes FILE fully allocated (not sparse) at BYTES with fio, unless it
# already has that size: the local disk ceiling reads real blocks.
fill_file() { # FILE BYTES
    if [ ! -f "$1" ] || [ "$(stat -c %s "$1")" != "$2" ]; then
        echo "==> writing $2 bytes to $1 (fully allocated, not sparse)" >&2
        rm -f "$1"
        fio --name=fill --filename="$1" --size="$2" --rw=write --bs=1M --iodepth=8 \
            --direct=1 --ioengine=io_uring --output=/dev/null
    fi
}

# Waits (5 s at most) until a tcp-ceiling server PID, whose standard error
# goes to ERR_FILE, says it listens (it accepts one connection only), or
# has died.
tcp_ceiling_listening() { # ERR_FILE PID
    for _ in $(seq 1 250); do
        grep -q listening "$1" 2>/dev/null && return 0
        kill -0 "$2" 2>/dev/null || return 0
        sleep 0.02
    done
}

# Runs tcp-ceiling (BIN, e.g. a private copy of target/release/tcp-ceiling)
# as two processes, the server pinned to SERVER_CPUS and the client to
# CLIENT_CPUS with taskset (an empty list: not pinned), with ARGS for both;
# prints the client's JSON with the server's side merged in.
tcp_ceiling() { # BIN SERVER_CPUS CLIENT_CPUS ARGS...
    local bin=$1 scpus=$2 ccpus=$3 port spid out sout serr rc=0
    shift 3
    local pin_server=() pin_client=()
    if [ -n "$scpus" ]; then pin_server=(taskset -c "$scpus"); fi
    if [ -n "$ccpus" ]; then pin_client=(taskset -c "$ccpus"); fi
    port=$(free_port)
    sout=$(mktemp); serr=$(mktemp)
    "${pin_server[@]}" "$bin" --json --server "127.0.0.1:$port" "$@" >"$sout" 2>"$serr" &
    spid=$!
    tcp_ceiling_listening "$serr" "$spid"
    if ! out=$("${pin_client[@]}" "$bin" --json --connect "127.0.0.1:$port" "$@"); then
        kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null; rc=1
    elif ! wait "$spid"; then
        cat "$serr" >&2; rc=1
    else
        python3 -c "
import json,sys
c=json.loads(sys.argv[1]); s=json.load(open(sys.argv[2]))
c['server']=s['server']; print(json.dumps(c))" "$out" "$sout" || rc=1
    fi
    rm -f "$sout" "$serr"
    return $rc
}

# The /sys stat file of the block device that holds FILE (a partition's own
# file when FILE is on one), or nothing when FILE is not on a block device
# (tmpfs, overlay): its fields 3 and 7 count the 512-byte sectors read and
# written, so the bytes a run moved to and from the disk can be set against
# the bytes it served.
disk_stat_file() { # FILE
    local dev
    dev=$(stat -c '%Hd:%Ld' "$1" 2>/dev/null) || return 0
    if [ -r "/sys/dev/block/$dev/stat" ]; then echo "/sys/dev/block/$dev/stat"; fi
}

# Creates a memory cgroup named NAME whose limit is BYTES (cgroup v2, or
# v1's memory controller) and prints its directory, or prints nothing when
# this machine has no memory cgroup to create. A command started in it
# (its pid written to the directory's cgroup.procs before it reads
# anything, as compare.sh does for nbdkit) has the page cache it fills
# held to BYTES. The caller removes the directory once the command ended.
memory_cgroup() { # NAME BYTES
    local cg
    if grep -qw memory /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null; then
        cg=/sys/fs/cgroup/$1
        mkdir -p "$cg" && echo "$2" >"$cg/memory.max" || return 0
    elif [ -d /sys/fs/cgroup/memory ]; then
        cg=/sys/fs/cgroup/memory/$1
        mkdir -p "$cg" && echo "$2" >"$cg/memory.limit_in_bytes" || return 0
    else
        return 0
    fi
    echo "$cg"
}

# How an idle vCPU waits, which prices every wake-up of a sleeping end
# (docs/perf-log/what-moved-the-numbers.md#the-halted-vcpu). The haltpoll
# governor polls guest_halt_poll_ns before it halts; under any other
# governor, or with no cpuidle driver at all (a guest booted without
# cpuidle_haltpoll.force=1 on a kernel with no other idle driver: an idle
# vCPU halts at once), that parameter exists and does nothing.
HALT_POLL_PARAM=/sys/module/haltpoll/parameters/guest_halt_poll_ns
haltpoll_in_force() {
    [ "$(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || echo none)" != none ] &&
        [ "$(cat /sys/devices/system/cpu/cpuidle/current_governor 2>/dev/null)" = haltpoll ] && [ -r "$HALT_POLL_PARAM" ]
}
# One line for a run's header: what idle polling was in force.
idle_polling() {
    local driver governor
    driver=$(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || echo none)
    governor=$(cat /sys/devices/system/cpu/cpuidle/current_governor 2>/dev/null || echo none)
    if haltpoll_in_force; then
        echo "guest_halt_poll_ns = $(cat "$HALT_POLL_PARAM")"
    elif [ "$driver" = none ]; then
        echo "no idle polling (no cpuidle driver: an idle vCPU halts at once)"
    else
        echo "no guest halt polling (cpuidle driver $driver, governor $governor)"
    fi
}
