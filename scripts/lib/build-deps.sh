# Sourced by the scripts in scripts/: installs, with apt-get, what building
# this workspace needs and a fresh Debian 12 machine lacks.
#
# install_build_deps [COMMAND:PACKAGE ...]
#   Always checks the C compiler, the verbs provider's build dependencies
#   (rdma-mummy-sys: cmake, clang, libclang-dev) and the rbd backend's
#   (rbd-sys: librbd-dev, librados-dev; the daemon links librbd); each
#   COMMAND:PACKAGE adds a package installed when COMMAND is missing, and
#   :PACKAGE (no command: headers, libraries) one that dpkg does not list
#   as installed.
install_build_deps() {
    local need=() pair
    for pair in cc:gcc cmake:cmake clang:clang :libclang-dev :librbd-dev :librados-dev "$@"; do
        if [ -n "${pair%%:*}" ]; then
            command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
        else
            dpkg -s "${pair#:}" 2>/dev/null | grep -q '^Status: install ok installed' || need+=("${pair#:}")
        fi
    done
    if [ ${#need[@]} -gt 0 ]; then
        echo "==> installing ${need[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
    fi
}
