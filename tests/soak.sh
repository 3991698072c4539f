#!/usr/bin/env bash
# Soak test (not run in CI): the release daemon on a file volume, 4 sessions
# x QD32 of mixed random 4 KiB reads and writes with crc32c verification, for
# MINUTES (default 10). Samples the daemon's RSS and open descriptors every
# 10 s into a CSV and fails when
#   - the bench fails or reports a verify error, or the daemon exits;
#   - RSS grows: the last third's average exceeds the first third's by more
#     than 10 % + 8 MiB (the first minute, pool warm-up, is left out);
#   - descriptors grow: the last third's maximum exceeds the first third's
#     maximum by more than 4.
#
#   tests/soak.sh [MINUTES]        SOAK_DIR=... keeps the work files there
set -euo pipefail

minutes=${1:-10}
[[ $minutes =~ ^[0-9]+$ && $minutes -ge 2 ]] || { echo "usage: $0 [MINUTES >= 2]" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

echo "soak: building release binaries"
nice -n 10 cargo build --release -p rdmablk-target -p rdmablk-bench --bins

work=${SOAK_DIR:-$(mktemp -d /var/tmp/rdmablk-soak.XXXXXX)}
mkdir -p "$work"
csv=$work/soak.csv
log=$work/target.log
daemon_pid=
cleanup() {
    if [[ -n $daemon_pid ]] && kill -0 "$daemon_pid" 2>/dev/null; then
        kill -TERM "$daemon_pid" 2>/dev/null || true
        wait "$daemon_pid" 2>/dev/null || true
    fi
}
trap cleanup EXIT

cat >"$work/target.toml" <<EOF
[target]
listen = ["tcp://127.0.0.1:0"]
reactors = 2
pin_reactors = false
metrics = "127.0.0.1:0"

[[volume]]
name = "soak"
backend = "file"
path = "$work/soak.img"
size = "1GiB"
# No [[host]] entries: this volume is open to any host.
allow_any_host = true
EOF

nice -n 10 target/release/rdmablk-target --config "$work/target.toml" 2>"$log" &
daemon_pid=$!
url=
for _ in $(seq 100); do
    url=$(grep -o 'listening on tcp://[0-9.:]*' "$log" | head -n1 | cut -d' ' -f3 || true)
    [[ -n $url ]] && break
    kill -0 "$daemon_pid" 2>/dev/null || { cat "$log" >&2; echo "soak: the daemon did not start" >&2; exit 1; }
    sleep 0.1
done
[[ -n $url ]] || { echo "soak: no listen URL in $log" >&2; exit 1; }
metrics=$(grep -o 'metrics endpoint: http://[0-9.:]*' "$log" | head -n1 | sed 's/.*http:\/\///')
echo "soak: daemon $daemon_pid on $url (metrics $metrics), $minutes min, work files in $work"

runtime=$((minutes * 60))
# One session per job; each job verifies its own 128 MiB region.
nice -n 10 target/release/rdmablk-bench --name=soak --target="$url" --volume=soak \
    --rw=randrw --bs=4k --iodepth=32 --numjobs=4 --size=128M --offset_increment=128M \
    --verify=crc32c --time_based --runtime="${runtime}s" \
    --output-format=json --output="$work/bench.json" 2>"$work/bench.err" &
bench_pid=$!

sample() {
    local rss fds
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$daemon_pid/status")
    fds=$(find "/proc/$daemon_pid/fd" -mindepth 1 -maxdepth 1 | wc -l)
    echo "$(( $(date +%s) - start )),$rss,$fds" >>"$csv"
}
echo "seconds,rss_kib,fds" >"$csv"
start=$(date +%s)
sample
while kill -0 "$bench_pid" 2>/dev/null; do
    sleep 10
    kill -0 "$daemon_pid" 2>/dev/null || { echo "soak: FAIL: the daemon exited during the run" >&2; tail -n 50 "$log" >&2; exit 1; }
    sample
done
bench_rc=0
wait "$bench_pid" || bench_rc=$?
kill -0 "$daemon_pid" 2>/dev/null || { echo "soak: FAIL: the daemon exited" >&2; exit 1; }
sample

fail=0
if [[ $bench_rc -ne 0 ]]; then
    echo "soak: FAIL: rdmablk-bench exited with $bench_rc" >&2
    tail -n 20 "$work/bench.err" >&2
    fail=1
fi
if grep -qi 'verify' "$work/bench.err"; then
    echo "soak: FAIL: verify errors:" >&2
    grep -i 'verify' "$work/bench.err" | head -n 10 >&2
    fail=1
fi
if grep -q 'panicked' "$log"; then
    echo "soak: FAIL: the daemon panicked" >&2
    fail=1
fi

iops=$(python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
print("%.0f" % sum(j["read"]["iops"] + j["write"]["iops"] for j in d["jobs"]))
' "$work/bench.json" 2>/dev/null || echo "?")

# Growth check over samples after the first minute.
verdict=$(awk -F, -v skip=60 '
    NR > 1 && $1 >= skip { n++; t[n] = $1; r[n] = $2; f[n] = $3 }
    NR > 1 { if ($2 > rmax) rmax = $2; if ($3 > fmax) fmax = $3; if (!rfirst) { rfirst = $2; ffirst = $3 } rlast = $2; flast = $3 }
    END {
        if (n < 6) { print "FAIL too few samples (" n ")"; exit }
        third = int(n / 3)
        for (i = 1; i <= third; i++) { ra += r[i]; if (f[i] > fa) fa = f[i] }
        for (i = n - third + 1; i <= n; i++) { rb += r[i]; if (f[i] > fb) fb = f[i] }
        ra /= third; rb /= third
        status = "OK"
        if (rb > ra * 1.10 + 8192) status = "FAIL rss grows"
        if (fb > fa + 4) status = (status == "OK" ? "FAIL" : status " and") " fds grow"
        printf "%s rss_kib first=%d last=%d max=%d first_third_avg=%.0f last_third_avg=%.0f; fds first=%d last=%d max=%d first_third_max=%d last_third_max=%d\n",
            status, rfirst, rlast, rmax, ra, rb, ffirst, flast, fmax, fa, fb
    }' "$csv")
echo "soak: $verdict"
echo "soak: IOPS (read + write, 4 jobs): $iops; samples in $csv"
[[ $verdict == OK* ]] || fail=1
if [[ $fail -ne 0 ]]; then
    echo "soak: FAIL" >&2
    exit 1
fi
echo "soak: PASS"
