#!/usr/bin/env bash
# Builds the rdmablk Debian package with cargo-deb (installed, pinned, when
# missing): the daemon, the `rdmablk` CLI, rdmablk-bench, the systemd units
# (installed, not enabled), the example configuration under
# /usr/share/doc/rdmablk/examples, the docs, and the man pages and bash, zsh
# and fish completions rdmablk-docgen generates from the command-line
# definitions. Prints the .deb's path.
#
#   scripts/build-deb.sh             release build -> target/debian/rdmablk_*.deb
#   scripts/build-deb.sh --install   the same, then apt-get install it
#   scripts/build-deb.sh --profile dev   package the debug build (CI's check)
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO_DEB_VERSION=3.8.0
profile=release install=0
while [ $# -gt 0 ]; do
    case $1 in
        --install) install=1 ;;
        --profile) profile=$2; shift ;;
        *) echo "usage: $0 [--install] [--profile release|dev]" >&2; exit 2 ;;
    esac
    shift
done
. scripts/lib/build-deps.sh
install_build_deps dpkg-deb:dpkg
if [ "$(cargo deb --version 2>/dev/null | awk '{print $2}')" != "$CARGO_DEB_VERSION" ]; then
    echo "==> installing cargo-deb $CARGO_DEB_VERSION" >&2
    cargo install --locked --quiet cargo-deb --version "=$CARGO_DEB_VERSION" >&2
fi
echo "==> building the binaries ($profile)" >&2
cargo build --locked --quiet --profile "$profile" --workspace --bins >&2
# The man pages and completions, where the package's assets take them
# (target/release/deb-docs in target-daemon/Cargo.toml: cargo-deb reads
# target/release as the profile's directory).
profile_dir=$profile
[ "$profile" = dev ] && profile_dir=debug
build_dir=${CARGO_TARGET_DIR:-target}/$profile_dir
rm -rf "$build_dir/deb-docs"
echo "==> generating man pages and shell completions" >&2
"$build_dir/rdmablk-docgen" "$build_dir/deb-docs" >/dev/null
# Debian's man pages are gzipped (-n: no name or time stamp, the same bytes
# for the same page); cargo-deb compresses only what it finds outside the
# target directory.
gzip -9n "$build_dir"/deb-docs/man*/*
out=target/debian
mkdir -p "$out"
deb=$(cargo deb --locked --no-build --profile "$profile" -p rdmablk-target --output "$out" 2>&1 | tail -n1)
[ -f "$deb" ] || { echo "cargo deb did not produce a package: $deb" >&2; exit 1; }
if [ $install -eq 1 ]; then
    echo "==> installing $deb" >&2
    apt-get install -y -qq "$(realpath "$deb")" >&2
    echo "installed; next: cp /usr/share/doc/rdmablk/examples/target.toml /etc/rdmablk/target.toml, edit it, systemctl enable --now rdmablk-target" >&2
fi
echo "$deb"
