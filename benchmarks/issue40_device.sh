#!/usr/bin/env bash
# Issue 40 on the GPU machine (one H200), in one device call of about five minutes; no model downloads.
# Every step's output goes to $OUT/<step>.txt, headed by its command line, the time and nproc.
#   bash benchmarks/issue40_device.sh [step ...]     # default: setup streamed_reference streaming
#   bash benchmarks/issue40_device.sh --cpu [step ...]   # the same steps at a small size on CPU (a dry run)
# Carry [".whl"]: setup installs the wheels into python3's own site when nixl is missing there and starts
# the carried redis-server on 6379 unless one answers (as benchmarks/issue39_device.sh does).
#   setup              nixl, redis-py, ... and a Redis
#   streamed_reference the reference pipeline streamed (encoder → diffusion streaming latents → decode writing
#                      fMP4) vs whole (two stages) at the seed's size 1344x768, every stage TP1 on cuda:0:
#                      submit → first playable bytes at the client, → last byte, throughput, side by side
#   streaming          chunked vs whole payloads between two stages on cuda:0 (benchmarks/streaming.py):
#                      time to first chunk, the per-chunk hop p50/p99 vs the whole-payload hop, throughput
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/issue40}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
. benchmarks/device_steps.sh  # run_step
device=cuda size=(--width 1344 --height 768) requests=3 burst=6
if [ "${1:-}" = "--cpu" ]; then
  shift
  device=cpu size=(--width 128 --height 64) requests=2 burst=3
fi
py=$(command -v python3)
setup() {
  if ! python3 -c "import nixl, redis, pydantic, structlog" 2>/dev/null && [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
  fi
  if ! python3 -c "import redis; redis.Redis(socket_timeout=1).ping()" 2>/dev/null && [ -x .whl/redis/redis-server ]; then
    (LD_LIBRARY_PATH=$PWD/.whl/redis .whl/redis/redis-server --port 6379 --save '' --daemonize yes >/dev/null)
    sleep 0.5
  fi
  python3 -c "import torch, nixl, redis; print(torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0), redis.Redis().ping())"
  nvidia-smi -L 2>/dev/null || true
}
for s in ${*:-setup streamed_reference streaming}; do
  case $s in
    setup) setup 2>&1 | tee "$out/setup.txt" ;;
    streamed_reference) run_step "$s" 300 "$py" benchmarks/streamed_reference.py --device "$device" "${size[@]}" \
                          --duration 2 --steps 4 --requests "$requests" --burst "$burst" ;;
    streaming) run_step "$s" 120 "$py" benchmarks/streaming.py --device "$device" --chunks 8 --chunk-kib 2048 --requests 10 ;;
    *) echo "unknown step $s" >&2 ;;
  esac
done
