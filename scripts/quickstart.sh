#!/usr/bin/env bash
# The main job on an embedded default: build, start rdmablk-target on a sparse
# 1 GiB file over tcp:// on loopback, write 1 MiB of random data at offset
# 12288 with the rdmablk CLI, flush, read it back, and compare both the read
# and the backing file's bytes with the input. Then a short rdmablk-bench run
# against its embedded target, with crc32c verification.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo >/dev/null || { echo "quickstart: cargo is not installed" >&2; exit 1; }
# Build dependencies of the verbs provider (rdma://): cmake and libclang.
. scripts/lib/build-deps.sh
install_build_deps
echo "==> building (release)"
cargo build --release --bins --quiet
bin=target/release

work=$(mktemp -d /var/tmp/rdmablk-quickstart.XXXXXX)
target_pid=
cleanup() {
    [ -n "$target_pid" ] && kill "$target_pid" 2>/dev/null && wait "$target_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/target.toml" <<TOML
[target]
name = "quickstart"
listen = ["tcp://127.0.0.1:0"]

[[volume]]
name = "vol0"
backend = "file"
path = "$work/vol0.img"
size = "1GiB"
allow_any_host = true
TOML

echo "==> checking the config"
"$bin/rdmablk-target" --config "$work/target.toml" --check

echo "==> starting rdmablk-target"
RUST_LOG=info "$bin/rdmablk-target" --config "$work/target.toml" 2> "$work/target.log" &
target_pid=$!
url=
for _ in $(seq 1 100); do
    url=$(grep -o 'listening on tcp://[^ ",]*' "$work/target.log" | head -n1 | sed 's/listening on //') || true
    [ -n "$url" ] && break
    kill -0 "$target_pid" 2>/dev/null || { cat "$work/target.log" >&2; exit 1; }
    sleep 0.1
done
[ -n "$url" ] || { echo "quickstart: target did not start" >&2; cat "$work/target.log" >&2; exit 1; }
echo "    target at $url"

cli() { "$bin/rdmablk" --target "$url" "$@"; }

echo "==> rdmablk list"
cli list
head -c 1048576 /dev/urandom > "$work/input"
echo "==> write 1 MiB at offset 12288"
cli write vol0 --offset 12288 --input "$work/input"
cli flush vol0
echo "==> read it back"
cli read vol0 --offset 12288 --length 1MiB --output "$work/output"
cmp "$work/input" "$work/output"
dd if="$work/vol0.img" of="$work/on-disk" bs=4096 skip=3 count=256 status=none
cmp "$work/input" "$work/on-disk"
echo "==> a misaligned write is refused"
if cli write vol0 --offset 12289 --input "$work/input" 2> "$work/err"; then
    echo "quickstart: misaligned write was accepted" >&2; exit 1
fi
cat "$work/err"
echo "==> rdmablk-bench: 5 s of verified 4 KiB random read/write at QD16 on an embedded target"
"$bin/rdmablk-bench" --name=quickstart --rw=randrw --bs=4k --iodepth=16 --runtime=5s --time_based \
    --size=256MiB --filename="$work/bench.img" --verify=crc32c
echo "quickstart: OK (read-back and backing file match the 1 MiB input; the benchmark verified each read of a block it had written)"
