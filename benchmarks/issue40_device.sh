#!/usr/bin/env bash
# Issue 40 on the GPU machine (one H200), in one device call of about five minutes; no model downloads.
# Every step's output goes to $OUT/<step>.txt, headed by its command line, the time and nproc.
#   bash benchmarks/issue40_device.sh [step ...]     # default: setup streamed_reference streaming
#   bash benchmarks/issue40_device.sh --cpu [step ...]   # the same steps at a small size on CPU (a dry run)
# Carry [".whl"]: setup (device_steps.sh's device_setup) installs the wheels into python3's own site and
# starts the carried redis-server on 6379 unless one answers.
# .whl must hold the gateway's wheels too (../shared/tools/device-wheels.sh .whl msgpack fastapi starlette uvicorn
# h11 click python-multipart prometheus-client httpx httpcore idna certifi sniffio annotated-doc opentelemetry-api:
# fastapi 0.165 imports opentelemetry).
#   setup              nixl, redis-py, ... and a Redis
#   streamed_reference the reference pipeline streamed (encoder → diffusion streaming latents → decode writing
#                      fMP4) vs whole (two stages) at the seed's size 1344x768, every stage TP1 on cuda (GPU 0):
#                      submit → first playable bytes at the client, → last byte, throughput, side by side
#   streamed_chunks2   streamed_reference with chunks of 2 latent frames (fewer, larger chunks)
#   mps                streamed_reference (MPS_CHUNKS="1 2": and streamed_chunks2) again with the CUDA MPS control daemon running
#                      (the stages' kernels share the GPU instead of time-slicing contexts); the daemon is this
#                      call's own (pipe and log dirs under /tmp), quit at the end; no GPU setting is changed
#   streaming          chunked vs whole payloads between two stages on cuda (GPU 0) (benchmarks/streaming.py):
#                      time to first chunk, the per-chunk hop p50/p99 vs the whole-payload hop, throughput
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/issue40}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
. benchmarks/device_steps.sh  # run_step, mps_start, mps_stop
device=cuda size=(--width 1344 --height 768 --gpu-util) requests=3 burst=6
if [ "${1:-}" = "--cpu" ]; then
  shift
  device=cpu size=(--width 128 --height 64) requests=2 burst=3
fi
py=$(command -v python3)
for s in ${*:-setup streamed_reference streaming}; do
  case $s in
    setup) device_setup 2>&1 | tee "$out/setup.txt" ;;
    streamed_reference) run_step "$s" 300 "$py" benchmarks/streamed_reference.py --device "$device" "${size[@]}" \
                          --duration 2 --steps 4 --requests "$requests" --burst "$burst" ;;
    streamed_chunks2) run_step "$s" 300 "$py" benchmarks/streamed_reference.py --device "$device" "${size[@]}" \
                          --duration 2 --steps 4 --requests "$requests" --burst "$burst" --chunk-latent-frames 2 ;;
    mps) if mps_start streamed; then
           for n in ${MPS_CHUNKS:-1}; do
             run_step "mps_streamed_chunks$n" 300 "$py" benchmarks/streamed_reference.py --device "$device" \
               "${size[@]}" --duration 2 --steps 4 --requests "$requests" --burst "$burst" --chunk-latent-frames $n
           done
           mps_stop
         fi ;;
    streaming) run_step "$s" 90 "$py" benchmarks/streaming.py --device "$device" --chunks 8 --chunk-kib 2048 --requests 10 ;;
    *) echo "unknown step $s" >&2 ;;
  esac
done
