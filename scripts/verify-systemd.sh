#!/usr/bin/env bash
# systemd-analyze verify of systemd/rdmablk-target.service. verify checks
# that ExecStart= is executable, so the unit is checked as a copy whose
# /usr/bin/rdmablk-target points at the binary just built. Fails on any
# warning. Needs: systemd (systemd-analyze) and a built rdmablk-target.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-target/debug/rdmablk-target}"
[ -x "$bin" ] || { echo "build it first: cargo build -p rdmablk-target ($bin missing)" >&2; exit 1; }
command -v systemd-analyze >/dev/null || { echo "systemd-analyze missing: apt-get install -y systemd" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sed "s#/usr/bin/rdmablk-target#$(realpath "$bin")#g" systemd/rdmablk-target.service >"$tmp/rdmablk-target.service"
out=$(systemd-analyze verify --man=no "$tmp/rdmablk-target.service" 2>&1) || { echo "$out" >&2; exit 1; }
if [ -n "$out" ]; then echo "$out" >&2; exit 1; fi
echo "systemd-analyze verify: rdmablk-target.service OK"
