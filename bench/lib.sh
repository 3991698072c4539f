# Helpers shared by the bench scripts (compare.sh, ceiling.sh); source it.

# A free TCP port on 127.0.0.1.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Waits (10 s at most) until something listens on 127.0.0.1:PORT, failing
# early if the server process PID died.
wait_port() { # PORT PID
    for _ in $(seq 1 200); do
        if python3 -c "import socket,sys; s=socket.socket(); s.settimeout(0.2); sys.exit(s.connect_ex(('127.0.0.1', $1)))" 2>/dev/null; then return 0; fi
        kill -0 "$2" 2>/dev/null || { echo "${0##*/}: server (pid $2) died" >&2; return 1; }
        sleep 0.05
    done
    echo "${0##*/}: nothing listens on port $1" >&2; return 1
}

# CPU seconds (user+system, all threads) of a process so far.
cpu_secs() { python3 -c "
import os
f=open('/proc/$1/stat').read().rsplit(')',1)[1].split()
print((int(f[11])+int(f[12]))/os.sysconf('SC_CLK_TCK'))"; }

# Installs with apt-get each PACKAGE whose COMMAND is missing.
install_missing() { # COMMAND:PACKAGE ...
    local need=() pair
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
    done
    if [ ${#need[@]} -gt 0 ]; then
        echo "==> installing ${need[*]}" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
}
