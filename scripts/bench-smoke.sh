#!/usr/bin/env bash
# Smoke runs of the benchmark scripts on the debug build: bench/compare.sh
# (every row of one short case measured, the no-protocol bounds (file and
# null) and rdmablk nbd included, and nothing it started left running;
# the JSON carries the targets with their per-repeat pairs and bounds, and
# every file row what it read from the disk),
# bench/ceiling.sh (every measurement made), bench/per-io.sh and
# bench/instr-per-io.sh (one null case each), bench/qd1-legs.sh (one null round, traced) and bench/placement.sh
# (one round). No figure is judged (timing does not
# belong in the test suite); this only catches a script that no longer runs.
set -euo pipefail
cd "$(dirname "$0")/.."

out=$(mktemp -d /var/tmp/rdmablk-bench-smoke.XXXXXX)
trap 'rm -rf "$out"' EXIT
BIN=target/debug bench/compare.sh --no-build --runtime 1 --ramp 0 --size 64M --repeat 2 \
    --case randread-4k-qd1 --dir "$out" --json "$out/compare.json" >"$out/table.md"
# Every server it started is gone when it returns (they run from copies
# under its --dir).
if left=$(pgrep -af "$out/"); then
    echo "compare.sh left processes running:" >&2; echo "$left" >&2
    pkill -KILL -f "$out/" || true
    exit 1
fi

python3 - "$out/compare.json" "$out/table.md" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
table = open(sys.argv[2]).read()
systems = [r["system"] for r in doc["rows"]]
missing = [r["system"] for r in doc["rows"] if r.get("iops") is None]
assert not missing, f"compare.sh rows without a measurement: {missing}"
for want in ("fio io_uring, local file", "rdmablk-bench -> rdmablk-target, file",
             "rdmablk-bench --hipri -> rdmablk-target busy_poll, file", "fio nbd -> nbdkit file",
             "fio nbd -> rdmablk nbd -> rdmablk-target, file",
             "rdmablk-bench -> rdmablk-target, null", "fio nbd -> nbdkit null",
             "tcp-ceiling --file: disk over TCP", "tcp-ceiling --file --busy: the same",
             "tcp-ceiling: loopback TCP, no disk"):
    assert any(s.startswith(want) for s in systems), f"no row {want!r} in {systems}"
targets = {t["target"].split(" ")[0]: t for t in doc["targets"]}
# A repeat whose runs other processes took CPU from is left out of the
# pairs (compare.sh's FOREIGN_LIMIT): on a busy machine a target may have
# fewer pairs, or none. The smoke run checks their form, not their number.
dropped = []
for name in ("2.", "2'."):
    t = targets.get(name)
    assert t is not None, f"target {name} missing: {list(targets)}"
    for key in ("per_run", "bound"):
        pairs = t.get(key, {"values": []})
        assert isinstance(pairs.get("values"), list) and len(pairs["values"]) <= 2, f"target {name}: malformed {key}: {pairs}"
        assert all(isinstance(v, (int, float)) for v in pairs["values"]), f"target {name}: {key} values {pairs['values']}"
        if len(pairs["values"]) < 2:
            dropped.append(f"{name} {key}: {2 - len(pairs['values'])} of 2")
if dropped:
    print(f"bench smoke: pairs left out for a busy machine: {', '.join(dropped)}")
assert doc["repeat"] == 2 and "guest_halt_poll" in doc and "placement" in doc and "peer_page_cache" in doc
# On a block device every file row says what it took from the disk.
import os
st = os.stat(os.path.dirname(sys.argv[1]))
if os.path.exists(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat"):
    no_disk = [r["system"] for r in doc["rows"] if "null" not in r["system"] and r.get("disk_share") is None]
    assert not no_disk, f"compare.sh file rows without disk / served: {no_disk}"
assert "| target | met | measured |" in table, "no targets table in the output"
print(f"bench smoke: {len(doc['rows'])} rows measured, targets {', '.join(targets)} reported")
PY

BIN=target/debug bench/ceiling.sh --no-build --runtime 1 --ramp 0 --repeat 1 --size 64M \
    --file "$out/ceiling.img" --quiet-wait 0 --json "$out/ceiling.json" >"$out/ceiling.md"
python3 - "$out/ceiling.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
runs = doc["runs"]
empty = [name for name, rs in runs.items() if not rs or any(r.get("iops") is None for r in rs)]
assert len(runs) >= 12 and not empty, f"ceiling.sh: {len(runs)} measurements, without a result: {empty}"
# The disk-over-TCP rows, set against local fio for targets 1 and 2.
bounds = doc["bounds"]
for key, field in (("ceiling-disk-4k-qd32", "iops_over_local_fio"), ("ceiling-disk-4k-qd32-busy", "iops_over_local_fio"),
                   ("ceiling-disk-4k-qd1", "p50_over_local_fio_us"), ("ceiling-disk-4k-qd1-busy", "p50_over_local_fio_us")):
    assert len(bounds[key][field]) == 1, f"ceiling.sh: bound {key} missing: {bounds.get(key)}"
print(f"bench smoke: ceiling.sh made {len(runs)} measurements and {len(bounds)} bounds")
PY

BIN=target/debug bench/per-io.sh --runtime 2 null:randread:4k:1 >"$out/per-io.txt"
grep -Eq '^null:randread:4k:1 +[0-9,]+ IOPS .*CPU per I/O: target +[0-9.]+ us \(user +[0-9.]+\), client +[0-9.]+ us \(user +[0-9.]+\)' "$out/per-io.txt" \
    || { echo "per-io.sh printed no result line:" >&2; cat "$out/per-io.txt" >&2; exit 1; }
echo "bench smoke: per-io.sh measured null:randread:4k:1"

# instr-per-io.sh: one null case at each end under callgrind (installing
# valgrind if missing), and tcp-ceiling's ends (--bound); the lines carry
# both ends' counts and code lines, and the bound's.
BIN=target/debug bench/instr-per-io.sh --runtime 1 --top 1 --bound null:randread:4k:1 >"$out/instr.txt"
grep -Eq '^null:randread:4k:1 +instructions per I/O: client +[0-9,]+ .*target +[0-9,]+ ' "$out/instr.txt" \
    || { echo "instr-per-io.sh printed no result line:" >&2; cat "$out/instr.txt" >&2; exit 1; }
grep -Eq '^null:randread:4k:1 +code lines per I/O: +client +[1-9][0-9,]* \([0-9]+ pages\), target +[1-9][0-9,]* \([0-9]+ pages\)' "$out/instr.txt" \
    || { echo "instr-per-io.sh printed no code lines:" >&2; cat "$out/instr.txt" >&2; exit 1; }
grep -Eq '^null:randread:4k:1 +bound \(tcp-ceiling\): +client +[0-9,]+ instructions, [1-9][0-9,]* lines .*server +[0-9,]+ instructions, [1-9][0-9,]* lines' "$out/instr.txt" \
    || { echo "instr-per-io.sh printed no bound line:" >&2; cat "$out/instr.txt" >&2; exit 1; }
echo "bench smoke: instr-per-io.sh counted null:randread:4k:1"

# qd1-legs.sh: one round on the null volume (its file volume on a small
# file); both runs' rows carry a p50, the placement shares and all four
# legs of a traced cycle.
dd if=/dev/urandom of="$out/legs.img" bs=1M count=64 status=none
BIN=target/debug bench/qd1-legs.sh --volume null --rounds 1 --runtime 3 --trace 0.5 --file "$out/legs.img" >"$out/legs.txt"
python3 - "$out/legs.txt" <<'PY'
import re, sys
# The runs' rows, not the medians' ("rdmablk med ...").
rows = {f[0]: f for f in map(str.split, open(sys.argv[1])) if f and f[0] in ("rdmablk", "bound") and f[1] != "med"}
num = re.compile(r"^[0-9]+(\.[0-9]+)?$")
for who in ("rdmablk", "bound"):
    r = rows.get(who)
    assert r and len(r) == 9 and all(num.match(f) for f in r[1:3] + r[4:9]) and int(r[8]) > 0, \
        f"qd1-legs.sh: no complete {who} row in:\n" + open(sys.argv[1]).read()
print(f"bench smoke: qd1-legs.sh traced {rows['rdmablk'][8]} and {rows['bound'][8]} cycles")
PY

# placement.sh: one round of its six runs on the same small file; the
# summary has a p50 for both systems under each placement. A machine with
# no disk interrupt to place by (or one CPU) is told so and skipped.
if BIN=target/debug bench/placement.sh --rounds 1 --runtime 1 --file "$out/legs.img" >"$out/placement.txt" 2>"$out/placement.err"; then
    python3 - "$out/placement.txt" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
rows = {m.group(1): m for m in re.finditer(r"^(split|together|unpinned) +([0-9.]+) \([0-9.]+-[0-9.]+\) +([0-9.]+) \([0-9.]+-[0-9.]+\) +[-+][0-9.]+$", text, re.M)}
assert set(rows) == {"split", "together", "unpinned"}, "placement.sh: no complete summary in:\n" + text
print("bench smoke: placement.sh ran rdmablk and its bound split, together and unpinned")
PY
elif grep -q "nothing to place" "$out/placement.err"; then
    echo "bench smoke: placement.sh skipped: $(cat "$out/placement.err")"
else
    cat "$out/placement.err" >&2; exit 1
fi
