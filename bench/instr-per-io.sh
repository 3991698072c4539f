#!/usr/bin/env bash
# Instructions per I/O at each end, counted with valgrind's callgrind inside
# the rdmablk-bench job loop (`job::Ctx::phase`, with the initiator library
# and the fabric provider under it) and inside the target's reactors
# (`Reactor::run`), each divided by the I/Os the bench reports. One end runs under callgrind
# while the other runs natively, so each case runs twice. Unlike latency
# and CPU time on a shared VM, the counts repeat to within a fraction of a
# percent, so they can show a change of a few hundred instructions that
# per-io.sh cannot; they say nothing about cache misses. Set-up inside the
# loops (on the target, accepting the connection) is counted too: a few
# thousand instructions per run, against tens of thousands of I/Os.
#
# usage: bench/instr-per-io.sh [--runtime S] [--file PATH] [--top N] CASE...
#   CASE          VOLUME:RW:BS:QD as in per-io.sh, e.g. null:randread:4k:1
#                 (default: null:randread:4k:1 file:randread:4k:1)
#   --runtime S   seconds of I/O per run (default 5; under callgrind an end
#                 runs about 30x slower, so a run makes a few thousand I/Os)
#   --file PATH   the file volume's backing file (default /var/tmp/rdmablk-per-io.img,
#                 created with random data at 1 GiB if missing)
#   --top N       also print each end's N functions with the most
#                 instructions of their own, per I/O (default 0)
#   BIN=DIR       binaries to measure (default target/release)
#
# Installs valgrind if it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNTIME=5
FILE=/var/tmp/rdmablk-per-io.img
TOP=0
CASES=()
while [ $# -gt 0 ]; do
    case "$1" in
        --runtime) RUNTIME=$2; shift 2 ;;
        --file) FILE=$2; shift 2 ;;
        --top) TOP=$2; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        -*) echo "instr-per-io.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) CASES+=("$1"); shift ;;
    esac
done
[ ${#CASES[@]} -gt 0 ] || CASES=(null:randread:4k:1 file:randread:4k:1)
# bin_dir, free_port, wait_port, null_and_file_target_config, install_missing
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BIN=$(bin_dir rdmablk-target rdmablk-bench)
install_missing valgrind:valgrind callgrind_annotate:valgrind
for c in "${CASES[@]}"; do
    IFS=: read -r vol rw bs qd <<<"$c"
    case "$vol" in null|file) ;; *) echo "instr-per-io.sh: volume of $c must be null or file" >&2; exit 2 ;; esac
    [ -n "${qd:-}" ] || { echo "instr-per-io.sh: $c is not VOLUME:RW:BS:QD" >&2; exit 2; }
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
    local cg=(valgrind --tool=callgrind --toggle-collect="$loop" --callgrind-out-file="$WORK/$end.cg")
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

for c in "${CASES[@]}"; do
    IFS=: read -r vol rw bs qd <<<"$c"
    run_one client "$vol" "$rw" "$bs" "$qd"
    run_one target "$vol" "$rw" "$bs" "$qd"
    WORK="$WORK" CASE="$c" TOP="$TOP" python3 - <<'PY'
import json, os, re, subprocess
work, top = os.environ["WORK"], int(os.environ["TOP"])

def ios(end):
    j = json.load(open(f"{work}/{end}.json"))["jobs"][0]
    return j["read"]["total_ios"] + j["write"]["total_ios"]

def own_costs(end):
    """Each function's instructions of its own, largest first."""
    rows = []
    out = subprocess.run(["callgrind_annotate", f"{work}/{end}.cg"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) \([ \d.]+%\)\s+(\S.*)$", line)
        if m and "PROGRAM TOTALS" not in line:
            rows.append((int(m.group(1).replace(",", "")), m.group(2)))
    return rows

def loop(end):
    for line in open(f"{work}/{end}.cg"):
        if line.startswith("totals:") and int(line.split()[1]) > 0:
            return int(line.split()[1])
    raise SystemExit(f"instr-per-io.sh: nothing counted in the {end}'s loop (renamed?)")

client_ios, target_ios = ios("client"), ios("target")
client = loop("client") / client_ios
target = loop("target") / target_ios
print(f"{os.environ['CASE']:<22} instructions per I/O: client {client:7,.0f} (rdmablk-bench job loop, {client_ios:,} I/Os), "
      f"target {target:7,.0f} (reactors, {target_ios:,} I/Os)")
for end, n in (("client", client_ios), ("target", target_ios)):
    for count, name in own_costs(end)[:top]:
        name = re.sub(r"\s*\[[^\]]*\]$", "", name).split(":", 1)[-1]
        print(f"    {end}: {count / n:6,.0f}  {name[:110]}")
PY
done
