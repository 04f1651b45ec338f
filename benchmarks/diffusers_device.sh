#!/usr/bin/env bash
# Issue 38 on the GPU machine (one H200), in one device call: the diffusers pair's tests on CUDA, then the
# biggest configuration that fits the lease — Wan2.1-T2V-1.3B's DiT and UMT5-XXL's encoder with random
# weights (no weights can be downloaded) — stage by stage and through `stageferry up` over NIXL.
# Every step's output goes to $OUT/<step>.txt, headed by its command line.
#   bash benchmarks/diffusers_device.sh [step ...]    # default: probe tests big up_big
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/issue38}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
export PATH=$PWD/.whl/redis:$PATH LD_LIBRARY_PATH=$PWD/.whl/redis:${LD_LIBRARY_PATH:-}
. benchmarks/device_steps.sh  # run_step, start_server
big=/tmp/wan-1.3b
for s in ${*:-probe tests big up_big e2e}; do
  case $s in
    probe) run_step "$s" 60 python3 -c "import torch, diffusers, transformers, nixl; print(torch.__version__, diffusers.__version__, transformers.__version__, torch.cuda.get_device_name(0))" ;;
    tests) start_server 6379
           run_step "$s" 150 python3 -m pytest -v -p no:cacheprovider -rs --tb=short --durations=6 --timeout 120 \
             tests/integrations/test_diffusers_stages.py ;;
    e2e) start_server 6379
         run_step "$s" 280 python3 -m pytest -v -p no:cacheprovider -rs --tb=short --durations=6 --timeout 200 \
           tests/integrations/test_diffusers_pipeline.py ;;
    make_big) run_step "$s" 120 python3 examples/diffusers/make_checkpoint.py wan-1.3b "$big" --dtype bfloat16 --device cuda ;;
    big) run_step make_big 120 python3 examples/diffusers/make_checkpoint.py wan-1.3b "$big" --dtype bfloat16 --device cuda
         run_step "$s" 240 python3 benchmarks/diffusers_gpu.py --checkpoint "$big" --family wan --width 832 \
           --height 480 --frames 33 --steps 10 --dtype bfloat16 --dtypes vae=float32 --json "$out/big.json" ;;
    up_big) sed -e "s#/tmp/stageferry-tiny/wan#$big#" -e 's#dtype = "float32"#dtype = "bfloat16"\ndtypes = { vae = "float32" }#' \
              -e '/max_sequence_length = 16/d' -e '/inline_max_bytes = 0/d' examples/diffusers/wan-tiny.toml > /tmp/wan-big.toml
            run_step "$s" 260 python3 -m stageferry --pipeline /tmp/wan-big.toml up --width 832 --height 480 --fps 16 \
              --duration 2 --steps 10 --startup-timeout 150 --timeout 200 --log-dir /tmp/up_logs
            tail -c 6000 /tmp/up_logs/*.log > "$out/up_big_logs.txt" ;;
  esac
done
