# Sourced by the device scripts (benchmarks/*_device.sh): run_step NAME SECONDS COMMAND... runs COMMAND under
# a time limit, headed by the command line, the time, nproc and the load, its output (and rc) both shown and
# saved to $out/NAME.txt.  The caller sets $out.
run_step() {
  local name=$1 limit=$2
  shift 2
  {
    echo "=== \$ $*"
    echo "# $(date -u) nproc=$(nproc) load=$(cut -d' ' -f1-3 /proc/loadavg)"
    timeout "$limit" "$@"
    echo "rc=$?"
  } 2>&1 | tee "$out/$name.txt"
}
