#!/usr/bin/env bash
# systemd-analyze verify of the units in systemd/: rdmablk-target.service and
# an instance of the template rdmablk-attach@.service. verify checks that
# ExecStart= is executable, so each unit is checked as a copy whose
# /usr/bin/rdmablk-target (/usr/bin/rdmablk) points at the binary just
# built. Fails on any warning. Needs: systemd (systemd-analyze) and built
# binaries: the target's path is the first argument (default
# target/debug/rdmablk-target), the CLI is looked for beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-target/debug/rdmablk-target}"
cli="$(dirname "$bin")/rdmablk"
for b in "$bin" "$cli"; do
    [ -x "$b" ] || { echo "build it first: cargo build --workspace --bins ($b missing)" >&2; exit 1; }
done
command -v systemd-analyze >/dev/null || { echo "systemd-analyze missing: apt-get install -y systemd" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
subst() { sed -e "s#/usr/bin/rdmablk-target#$(realpath "$bin")#g" -e "s#/usr/bin/rdmablk #$(realpath "$cli") #g" "$1"; }
subst systemd/rdmablk-target.service >"$tmp/rdmablk-target.service"
subst systemd/rdmablk-attach@.service >"$tmp/rdmablk-attach@.service"
# An instance of the template, as `systemctl enable rdmablk-attach@db` makes.
ln -s rdmablk-attach@.service "$tmp/rdmablk-attach@example.service"
for unit in rdmablk-target.service rdmablk-attach@example.service; do
    out=$(cd "$tmp" && systemd-analyze verify --man=no "$tmp/$unit" 2>&1) || { echo "$unit: $out" >&2; exit 1; }
    if [ -n "$out" ]; then echo "$unit: $out" >&2; exit 1; fi
    echo "systemd-analyze verify: $unit OK"
done
