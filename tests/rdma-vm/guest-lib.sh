# Sourced by guest scripts (export RDMAVM_LIB points here).
#   step NAME [--timeout SECS] CMD ARGS...
# runs CMD (output to $RDMAVM_LOGS/NAME.log), appends
# "NAME<TAB>PASS|FAIL<TAB>seconds<TAB>exit" to $RDMAVM_STEPS and returns CMD's status.
# CMD must be a program, not a shell function (it runs under timeout(1));
# wrap shell code as: step NAME bash -c '...'.
RDMAVM_DIR=${RDMAVM_DIR:-/run/rdmavm}
RDMAVM_STEPS=${RDMAVM_STEPS:-$RDMAVM_DIR/steps.tsv}
RDMAVM_LOGS=${RDMAVM_LOGS:-$RDMAVM_DIR/logs}

step() {
    local name=$1; shift
    local to=${RDMAVM_STEP_TIMEOUT:-600}
    if [[ ${1:-} == --timeout ]]; then to=$2; shift 2; fi
    name=${name//[^A-Za-z0-9_.+-]/_}
    local log=$RDMAVM_LOGS/$name.log
    if [[ -e $log ]]; then local i=2; while [[ -e $RDMAVM_LOGS/$name.$i.log ]]; do i=$((i + 1)); done; name=$name.$i; log=$RDMAVM_LOGS/$name.log; fi
    local t0 t1 rc secs result
    echo ">>> step $name: $*" >/dev/console 2>/dev/null || true
    t0=$(date +%s.%N)
    ( cd "${RDMAVM_CWD:-/}" 2>/dev/null || cd /; exec timeout -k 5 "$to" "$@" ) >"$log" 2>&1 </dev/null
    rc=$?
    t1=$(date +%s.%N)
    [[ $rc -eq 124 || $rc -eq 137 ]] && echo "step $name: timed out after ${to}s" >>"$log"
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
    result=PASS; [[ $rc -eq 0 ]] || result=FAIL
    printf '%s\t%s\t%s\t%s\n' "$name" "$result" "$secs" "$rc" >>"$RDMAVM_STEPS"
    echo "<<< step $name: $result (exit $rc, ${secs}s)" >/dev/console 2>/dev/null || true
    return $rc
}
