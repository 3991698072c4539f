#!/usr/bin/env bash
# Instructions per I/O at each end, counted with valgrind's callgrind inside
# the rdmablk-bench job loop (`job::Ctx::phase`, with the initiator library
# and the fabric provider under it) and inside the target's reactors
# (`Reactor::run`), each divided by the I/Os the bench reports. One end runs under callgrind
# while the other runs natively, so each case runs twice. Unlike latency
# and CPU time on a shared VM, the counts repeat to within a fraction of a
# percent, so they can show a change of a few hundred instructions that
# per-io.sh cannot. It also prints each end's code footprint: the 64-byte
# lines (and 4 KiB pages) holding an instruction that ran at least once
# every other I/O. That is what an I/O fetches when it finds the caches
# cold (after a sleep, a VM exit, the other end's turn on the CPU), which
# counts say nothing about. Set-up inside the loops (on the target,
# accepting the connection) is counted too: a few thousand instructions
# per run, against tens of thousands of I/Os, and none of it runs often
# enough to count as a line. With --bound it counts tcp-ceiling's server
# and client (`serve_any`, `drive`) the same way: the same reads over
# loopback TCP with no protocol, the yardstick of compare.sh's bound rows.
#
# usage: bench/instr-per-io.sh [--runtime S] [--file PATH] [--top N] [--bound] CASE...
#   CASE          VOLUME:RW:BS:QD as in per-io.sh, e.g. null:randread:4k:1
#                 (default: null:randread:4k:1 file:randread:4k:1)
#   --runtime S   seconds of I/O per run (default 5; under callgrind an end
#                 runs about 30x slower, so a run makes a few thousand I/Os)
#   --file PATH   the file volume's backing file (default /var/tmp/rdmablk-per-io.img,
#                 created with random data at 1 GiB if missing)
#   --top N       also print each end's N functions with the most
#                 instructions of their own, per I/O, with the code lines
#                 each holds (default 0)
#   --bound       also count tcp-ceiling (--file PATH for file cases) at the
#                 case's block size and depth (randread cases only)
#   BIN=DIR       binaries to measure (default target/release)
#
# Installs valgrind if it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNTIME=5
FILE=/var/tmp/rdmablk-per-io.img
TOP=0
BOUND=0
CASES=()
while [ $# -gt 0 ]; do
    case "$1" in
        --runtime) RUNTIME=$2; shift 2 ;;
        --file) FILE=$2; shift 2 ;;
        --top) TOP=$2; shift 2 ;;
        --bound) BOUND=1; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        -*) echo "instr-per-io.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) CASES+=("$1"); shift ;;
    esac
done
[ ${#CASES[@]} -gt 0 ] || CASES=(null:randread:4k:1 file:randread:4k:1)
# bin_dir, free_port, wait_port, null_and_file_target_config, install_missing
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
if [ "$BOUND" = 1 ]; then BIN=$(bin_dir rdmablk-target rdmablk-bench tcp-ceiling); else BIN=$(bin_dir rdmablk-target rdmablk-bench); fi
install_missing valgrind:valgrind
for c in "${CASES[@]}"; do
    IFS=: read -r vol rw bs qd <<<"$c"
    case "$vol" in null|file) ;; *) echo "instr-per-io.sh: volume of $c must be null or file" >&2; exit 2 ;; esac
    [ -n "${qd:-}" ] || { echo "instr-per-io.sh: $c is not VOLUME:RW:BS:QD" >&2; exit 2; }
    [ "$BOUND" = 0 ] || [ "$rw" = randread ] || { echo "instr-per-io.sh: --bound counts reads only, not $c" >&2; exit 2; }
done
[ -f "$FILE" ] || { echo "==> writing 1 GiB of random data to $FILE" >&2
    dd if=/dev/urandom of="$FILE" bs=1M count=1024 status=none; }

WORK=$(mktemp -d)
TP=""
cleanup() {
    [ -n "$TP" ] && kill "$TP" 2>/dev/null && wait "$TP" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

# Runs CASE once with END (client or target) under callgrind; leaves
# $WORK/END.cg and $WORK/END.json.
run_one() { # END VOLUME RW BS QD
    local end=$1 port
    port=$(free_port)
    null_and_file_target_config "$port" "$FILE" >"$WORK/target.toml"
    local target=("$BIN/rdmablk-target" --config "$WORK/target.toml")
    local bench=("$BIN/rdmablk-bench" --name=j --target="tcp://127.0.0.1:$port" --volume="$2" --rw="$3" --bs="$4"
                 --iodepth="$5" --runtime="$RUNTIME" --time_based --output-format=json)
    # Only the loop is counted (--toggle-collect), so that the self costs
    # below are the loop's, not the start-up's (the pool's zeroing).
    local loop=rdmablk_bench::job::Ctx::phase
    [ "$end" = target ] && loop=rdmablk_target::reactor::Reactor::run
    local cg=(valgrind --tool=callgrind --toggle-collect="$loop" --dump-instr=yes --callgrind-out-file="$WORK/$end.cg")
    if [ "$end" = target ]; then
        "${cg[@]}" "${target[@]}" >"$WORK/target.log" 2>&1 &
    else
        "${target[@]}" >"$WORK/target.log" 2>&1 &
    fi
    TP=$!
    # Under callgrind the target takes seconds to start listening: up to
    # six of wait_port's 10 s waits.
    local tries=0
    until wait_port "$port" "$TP" 2>/dev/null; do
        tries=$((tries + 1))
        [ "$tries" -lt 6 ] && kill -0 "$TP" 2>/dev/null && continue
        echo "instr-per-io.sh: the target did not start listening:" >&2; cat "$WORK/target.log" >&2; exit 1
    done
    if [ "$end" = client ]; then
        "${cg[@]}" "${bench[@]}" >"$WORK/$end.json" 2>"$WORK/bench.err" || { cat "$WORK/bench.err" >&2; exit 1; }
    else
        "${bench[@]}" >"$WORK/$end.json" 2>"$WORK/bench.err" || { cat "$WORK/bench.err" >&2; exit 1; }
    fi
    # SIGTERM: the target shuts down cleanly, so callgrind writes its counts.
    kill -TERM "$TP"; wait "$TP" 2>/dev/null || true
    TP=""
}

# Runs tcp-ceiling once with END (client or server) under callgrind;
# leaves $WORK/bound-END.cg and $WORK/bound-END.json.
run_bound() { # END VOLUME BS QD
    local end=$1 port file=()
    port=$(free_port)
    [ "$2" = file ] && file=(--file "$FILE")
    local server=("$BIN/tcp-ceiling" --server "127.0.0.1:$port" --bs "$3" --qd "$4" --ramp 0 --json "${file[@]}")
    local client=("$BIN/tcp-ceiling" --connect "127.0.0.1:$port" --bs "$3" --qd "$4" --runtime "$RUNTIME" --ramp 0 --json "${file[@]}")
    local loop=tcp_ceiling::drive
    [ "$end" = server ] && loop=tcp_ceiling::serve_any
    local cg=(valgrind --tool=callgrind --toggle-collect="$loop" --dump-instr=yes --callgrind-out-file="$WORK/bound-$end.cg")
    if [ "$end" = server ]; then server=("${cg[@]}" "${server[@]}"); else client=("${cg[@]}" "${client[@]}"); fi
    "${server[@]}" >"$WORK/bound-server.json" 2>"$WORK/bound-server.log" &
    TP=$!
    # Not wait_port: the server serves the first connection only. Under
    # callgrind it takes a few seconds to listen: up to three waits of 5 s.
    for _ in 1 2 3; do tcp_ceiling_listening "$WORK/bound-server.log" "$TP"; done
    grep -q listening "$WORK/bound-server.log" \
        || { echo "instr-per-io.sh: tcp-ceiling did not start listening:" >&2; cat "$WORK/bound-server.log" >&2; exit 1; }
    "${client[@]}" >"$WORK/bound-client.json" 2>"$WORK/bound-client.log" || { cat "$WORK/bound-client.log" >&2; exit 1; }
    wait "$TP" || { cat "$WORK/bound-server.log" >&2; exit 1; }
    TP=""
}

for c in "${CASES[@]}"; do
    IFS=: read -r vol rw bs qd <<<"$c"
    run_one client "$vol" "$rw" "$bs" "$qd"
    run_one target "$vol" "$rw" "$bs" "$qd"
    if [ "$BOUND" = 1 ]; then
        run_bound client "$vol" "$bs" "$qd"
        run_bound server "$vol" "$bs" "$qd"
    fi
    WORK="$WORK" CASE="$c" TOP="$TOP" BOUND="$BOUND" python3 - <<'PY'
import collections, json, os, re
work, top = os.environ["WORK"], int(os.environ["TOP"])

def ios(end):
    if end.startswith("bound-"):
        # tcp-ceiling's own report: the operations of its (whole, --ramp 0) run.
        side = end.removeprefix("bound-")
        return json.load(open(f"{work}/{end}.json"))[side]["ops"]
    j = json.load(open(f"{work}/{end}.json"))["jobs"][0]
    return j["read"]["total_ios"] + j["write"]["total_ios"]

def loop(end):
    for line in open(f"{work}/{end}.cg"):
        if line.startswith("totals:") and int(line.split()[1]) > 0:
            return int(line.split()[1])
    raise SystemExit(f"instr-per-io.sh: nothing counted in the {end}'s loop (renamed?)")

def instructions(end):
    """Instructions executed at each address, and the function holding each
    (from callgrind's --dump-instr=yes output: 'positions: instr line'; an
    address is absolute (0x...), relative to the last (+n, -n) or the same
    (*); the cost line after a calls= line is the call's inclusive cost,
    not the call site's own)."""
    counts, owner, names = collections.Counter(), {}, {}
    fn, addr, after_call = "?", 0, False
    for line in open(f"{work}/{end}.cg"):
        if line.startswith(("fn=", "cfn=")):
            m = re.match(r"c?fn=\((\d+)\)(?: (.*))?$", line.rstrip("\n"))
            if m.group(2):
                names[m.group(1)] = m.group(2)
            if line.startswith("fn="):
                fn = names.get(m.group(1), "?")
            continue
        if line.startswith("calls="):
            after_call = True
            continue
        if not line or line[0] not in "0123456789+-*":
            continue
        fields = line.split()
        pos = fields[0]
        if pos.startswith("0x"):
            addr = int(pos, 16)
        elif pos[0] in "+-":
            addr += int(pos, 0)
        elif pos != "*":
            continue
        if after_call:
            after_call = False
            continue
        if len(fields) >= 3:
            counts[addr] += int(fields[2])
            owner[addr] = fn
    return counts, owner

ends = ["client", "target"] + (["bound-client", "bound-server"] if os.environ["BOUND"] == "1" else [])
n_ios = {end: ios(end) for end in ends}
per_io = {end: loop(end) / n_ios[end] for end in ends}
footprint, by_fn = {}, {}
for end in ends:
    n = n_ios[end]
    counts, owner = instructions(end)
    # Code an I/O runs: what ran at least once every other I/O.
    hot = [a for a, c in counts.items() if 2 * c >= n]
    footprint[end] = (len({a >> 6 for a in hot}), len({a >> 12 for a in hot}))
    own, lines = collections.Counter(), collections.defaultdict(set)
    for a, c in counts.items():
        own[owner[a]] += c
    for a in hot:
        lines[owner[a]].add(a >> 6)
    by_fn[end] = [(c / n, len(lines[f]), f) for f, c in own.most_common(top)]
case = os.environ["CASE"]
print(f"{case:<22} instructions per I/O: client {per_io['client']:7,.0f} (rdmablk-bench job loop, {n_ios['client']:,} I/Os), "
      f"target {per_io['target']:7,.0f} (reactors, {n_ios['target']:,} I/Os)")
print(f"{case:<22} code lines per I/O:   client {footprint['client'][0]:7,} ({footprint['client'][1]} pages), "
      f"target {footprint['target'][0]:7,} ({footprint['target'][1]} pages)")
if "bound-client" in per_io:
    print(f"{case:<22} bound (tcp-ceiling):  client {per_io['bound-client']:7,.0f} instructions, {footprint['bound-client'][0]:,} lines "
          f"({footprint['bound-client'][1]} pages); server {per_io['bound-server']:7,.0f} instructions, "
          f"{footprint['bound-server'][0]:,} lines ({footprint['bound-server'][1]} pages)")
for end in ends:
    for n, lines, name in by_fn[end]:
        print(f"    {end}: {n:6,.0f} instructions {lines:4} lines  {name[:110]}")
PY
done
