#!/usr/bin/env bash
# Builds the Debian package from the debug build (scripts/build-deb.sh
# --profile dev) and checks it without installing it: its control fields,
# that every file the README promises is in it, that the packaged binaries
# run, that the packaged units pass systemd-analyze verify, that the man
# pages render and the bash completions load, and that the maintainer
# scripts create and purge the directories.
#
#   scripts/verify-deb.sh             the checks above (CI)
#   scripts/verify-deb.sh --install   also installs it with dpkg, checks the
#                                     directories, `man -w` and the completions
#                                     in place, then removes and purges it (a
#                                     machine where rdmablk is not installed)
set -euo pipefail
cd "$(dirname "$0")/.."
install=0
case ${1:-} in
    --install) install=1 ;;
    "") ;;
    *) echo "usage: $0 [--install]" >&2; exit 2 ;;
esac
. scripts/lib/build-deps.sh
install_build_deps man:man-db
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
    usr/share/doc/rdmablk/copyright \
    usr/share/man/man1/rdmablk.1.gz usr/share/man/man1/rdmablk-attach.1.gz usr/share/man/man1/rdmablk-bench.1.gz \
    usr/share/man/man8/rdmablk-target.8.gz \
    usr/share/bash-completion/completions/rdmablk usr/share/bash-completion/completions/rdmablk-target \
    usr/share/bash-completion/completions/rdmablk-bench \
    usr/share/zsh/vendor-completions/_rdmablk usr/share/fish/vendor_completions.d/rdmablk.fish; do
    [ -e "$tmp/root/$f" ] || fail "missing /$f"
done
# The pages render, and say what their commands take.
for page in man1/rdmablk.1.gz:--target man1/rdmablk-attach.1.gz:--config man1/rdmablk-bench.1.gz:--iodepth \
    man8/rdmablk-target.8.gz:--check; do
    text=$(MANWIDTH=100 man -l "$tmp/root/usr/share/man/${page%%:*}" 2>&1) || fail "man -l ${page%%:*}: $text"
    grep -q -- "${page#*:}" <<<"$text" || fail "${page%%:*} does not mention ${page#*:}"
done
# The completions load into bash, each for its command.
for cmd in rdmablk rdmablk-target rdmablk-bench; do
    bash -c "source $tmp/root/usr/share/bash-completion/completions/$cmd && complete -p $cmd" >/dev/null \
        || fail "the bash completion of $cmd does not load"
done
# The units are installed but neither enabled nor started by the package.
if [ -f "$tmp/control/postinst" ] && grep -q 'deb-systemd-invoke start\|systemctl start' "$tmp/control/postinst"; then
    fail "postinst starts a service"
fi
# postinst creates the directories (DPKG_ROOT: into $tmp/root, as dpkg --root
# runs it); postrm purge removes the empty ones and keeps one with a file.
# Only the scripts' own part runs here: the systemd part cargo-deb puts in
# place of #DEBHELPER# would act on this machine's systemd.
marker='# Automatically added by cargo-deb'
own_part() {
    grep -qx "$marker" "$tmp/control/$1" || fail "$1: no '$marker' line to cut the systemd part at"
    sed "/^$marker\$/,\$d" "$tmp/control/$1"
    echo 'exit 0'
}
own_part postinst >"$tmp/postinst" && own_part postrm >"$tmp/postrm"
dirs="etc/rdmablk:755 etc/rdmablk/attach:755 var/lib/rdmablk:700"
DPKG_ROOT=$tmp/root sh "$tmp/postinst" configure || fail "postinst configure failed"
for d in $dirs; do
    [ "$(stat -c %a "$tmp/root/${d%%:*}" 2>/dev/null)" = "${d#*:}" ] || fail "postinst: /${d%%:*} is not a directory of mode ${d#*:}"
done
touch "$tmp/root/var/lib/rdmablk/volume.img"
DPKG_ROOT=$tmp/root sh "$tmp/postrm" purge 2>"$tmp/postrm.err" || fail "postrm purge failed"
[ ! -e "$tmp/root/etc/rdmablk" ] || fail "postrm purge left the empty /etc/rdmablk"
[ -f "$tmp/root/var/lib/rdmablk/volume.img" ] || fail "postrm purge deleted a volume file"
grep -q /var/lib/rdmablk "$tmp/postrm.err" || fail "postrm purge did not say it kept /var/lib/rdmablk"
"$tmp/root/usr/bin/rdmablk-target" --version >/dev/null || fail "rdmablk-target --version failed"
"$tmp/root/usr/bin/rdmablk" --help >/dev/null || fail "rdmablk --help failed"
./scripts/verify-systemd.sh "$tmp/root/usr/bin/rdmablk-target" >/dev/null
if [ $install -eq 1 ]; then
    dpkg -s rdmablk >/dev/null 2>&1 && fail "--install: rdmablk is installed on this machine already"
    for d in /etc/rdmablk /var/lib/rdmablk; do
        [ ! -e $d ] || fail "--install: $d exists already: its creation cannot be checked here"
    done
    trap 'dpkg --purge rdmablk >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
    dpkg -i "$deb" >/dev/null || fail "dpkg -i failed"
    for d in $dirs; do
        [ "$(stat -c %a "/${d%%:*}" 2>/dev/null)" = "${d#*:}" ] || fail "installed: /${d%%:*} is not a directory of mode ${d#*:}"
    done
    [ "$(man -w rdmablk)" = /usr/share/man/man1/rdmablk.1.gz ] || fail "man -w rdmablk: $(man -w rdmablk 2>&1)"
    [ "$(man -w 8 rdmablk-target)" = /usr/share/man/man8/rdmablk-target.8.gz ] || fail "man -w 8 rdmablk-target"
    bash -c 'source /usr/share/bash-completion/completions/rdmablk && complete -p rdmablk' >/dev/null || fail "installed bash completion"
    # Remove keeps the directories; purge takes the empty ones.
    dpkg -r rdmablk >/dev/null || fail "dpkg -r failed"
    [ -d /etc/rdmablk/attach ] && [ -d /var/lib/rdmablk ] || fail "dpkg -r removed the configuration or state directory"
    dpkg --purge rdmablk >/dev/null 2>&1 || fail "dpkg --purge failed"
    [ ! -e /etc/rdmablk ] && [ ! -e /var/lib/rdmablk ] || fail "dpkg --purge left an empty /etc/rdmablk or /var/lib/rdmablk"
    echo "verify-deb: installed, checked in place, removed and purged"
fi
echo "verify-deb: $(basename "$deb") OK ($(dpkg-deb --contents "$deb" | wc -l) entries)"
