#!/usr/bin/env bash
# Builds the Debian package from the debug build (scripts/build-deb.sh
# --profile dev) and checks it without installing it: its control fields,
# that every file the README promises is in it, that the packaged binaries
# run, and that the packaged units pass systemd-analyze verify.
set -euo pipefail
cd "$(dirname "$0")/.."
deb=$(./scripts/build-deb.sh --profile dev)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "verify-deb: $deb: $*" >&2; exit 1; }
info=$(dpkg-deb --info "$deb")
grep -q '^ Package: rdmablk$' <<<"$info" || fail "Package is not rdmablk"
grep -q '^ Depends: libc6' <<<"$info" || fail "no Depends on libc6"
grep -q '^ Recommends: .*rdma-core' <<<"$info" || fail "no Recommends of rdma-core"
dpkg-deb -x "$deb" "$tmp/root"
dpkg-deb -e "$deb" "$tmp/control"
for f in usr/bin/rdmablk-target usr/bin/rdmablk usr/bin/rdmablk-bench \
    usr/lib/systemd/system/rdmablk-target.service \
    usr/lib/systemd/system/rdmablk-attach@.service \
    usr/share/doc/rdmablk/examples/target.toml usr/share/doc/rdmablk/examples/attach.toml \
    usr/share/doc/rdmablk/README.md \
    usr/share/doc/rdmablk/copyright; do
    [ -e "$tmp/root/$f" ] || fail "missing /$f"
done
# The units are installed but neither enabled nor started by the package.
if [ -f "$tmp/control/postinst" ] && grep -q 'deb-systemd-invoke start\|systemctl start' "$tmp/control/postinst"; then
    fail "postinst starts a service"
fi
"$tmp/root/usr/bin/rdmablk-target" --version >/dev/null || fail "rdmablk-target --version failed"
"$tmp/root/usr/bin/rdmablk" --help >/dev/null || fail "rdmablk --help failed"
./scripts/verify-systemd.sh "$tmp/root/usr/bin/rdmablk-target" >/dev/null
echo "verify-deb: $(basename "$deb") OK ($(dpkg-deb --contents "$deb" | wc -l) entries)"
