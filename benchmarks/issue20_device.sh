#!/usr/bin/env bash
# Issue 20's rows on the GPU machine (2 x H200, 32 cores), in one device call, each step under its own
# time limit so one hang cannot take the rest with it.  Every step's output goes to $OUT/<step>.txt,
# headed by its command line, the time, nproc and the load average.
#
#   bash benchmarks/issue20_device.sh [step ...]      # default: every step, in the order below
#   STEPS=1 bash benchmarks/issue20_device.sh t2va_gpu # transfer.py also times the steps of put and get
#   COLD=1 ...                                        # and the zero-copy hop without a ready payload, side by side
#   HOT=1 ...                                         # and the zero-copy hop with the consumer's links asleep, side by side
#   REF_ITERS=200 ...                                 # Ref2VA/FL2VA iterations (default 20; inline only in the first 20)
#   BASE_TREE=DIR ... tput_vs hop_vs                  # throughput / GPU hops of this tree and of DIR (another commit's), alternating
# The *_redis_py steps repeat a hop with the hot path on redis-py alone (STAGEFERRY_REDIS_LINK=0).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/issue20}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
. benchmarks/device_steps.sh  # run_step
tx=(python3 benchmarks/transfer.py --scaling-sizes "" --inflight 1 ${STEPS:+--steps} ${COLD:+--ready-cold} ${HOT:+--hot-asleep})
steps=${*:-gpu_tests shm_tests t2va_gpu ref2va_gpu t2va_cpu ref2va_cpu hop fanout fanout_nccl throughput}
for s in $steps; do
  case $s in
    gpu_tests) run_step "$s" 200 python3 -m pytest -q -p no:cacheprovider -rs --tb=short --durations=8 \
                 tests/broker/data/nixl/test_staged_outputs.py tests/broker/data/nixl/test_connector.py \
                 tests/broker/data/nixl/test_consumer.py tests/broker/data/nixl/test_agent.py \
                 tests/broker/data/nixl/test_ready.py \
                 tests/broker/data/test_pool.py tests/broker/data/test_payload_codec.py \
                 "tests/stages/reference/test_reference_models.py::test_the_encoder_payload_stays_on_its_gpu_and_the_diffusion_stage_takes_it_there" ;;
    t2va_gpu) run_step "$s" 90 "${tx[@]}" --device cuda --sizes 359024 --iters 300 --zero-copy ;;
    ref2va_gpu) run_step "$s" 90 "${tx[@]}" --device cuda --sizes 11158136,64963792 --iters "${REF_ITERS:-20}" \
                  --inline-iters 20 --zero-copy ;;
    t2va_cpu) run_step "$s" 90 "${tx[@]}" --sizes 359024 --iters 300 --zero-copy ;;
    t2va_cpu_redis_py) STAGEFERRY_REDIS_LINK=0 run_step "$s" 90 "${tx[@]}" --sizes 359024 --iters 300 --zero-copy ;;
    t2va_gpu_redis_py) STAGEFERRY_REDIS_LINK=0 run_step "$s" 90 "${tx[@]}" --device cuda --sizes 359024 \
                         --iters 300 --zero-copy ;;
    resp_link) run_step "$s" 120 python3 benchmarks/resp_link.py --rounds 1500 --gap-us 1000 ;;
    ref2va_cpu) run_step "$s" 120 "${tx[@]}" --sizes 11158136,64963792 --iters 20 --zero-copy ;;
    prof_gpu) run_step "$s" 120 "${tx[@]}" --device cuda --sizes 359024,64963792 --iters 100 --zero-copy \
                --profile "$out/prof_gpu" ;;
    hop) run_step "$s" 60 python3 benchmarks/hop_breakdown.py --hops 400 ;;
    shm_tests) run_step "$s" 200 python3 -m pytest -q -p no:cacheprovider -rs --tb=short \
                 tests/stages/group/test_group_channel.py tests/stages/group/test_mailbox.py ;;
    phases) run_step "$s" 120 python3 benchmarks/fanout_phases.py --sizes 359024,11158136,64963792 \
              --iters 200 --timeout 50 ;;
    fanout) run_step "$s" 150 python3 benchmarks/fanout.py --mode nixl-fanout --ranks 2 \
              --sizes 359024,11158136,64963792 --iters 200 --timeout 28 --hang-dump 28 ;;
    fanout_nccl) run_step "$s" 120 python3 benchmarks/fanout.py --backend nccl --ranks 2 \
                   --sizes 359024,64963792 --iters 200 --timeout 28 --hang-dump 28 ;;
    tput_hot) i=0; for w in 0.002 0 0.002 0; do  # timeouts.hot_wait on and off, alternately, in one call
                i=$((i + 1)); run_step "${s}_${i}_$w" 100 python3 benchmarks/throughput.py --tasks T2VA --replicas 1,4 \
                  --requests "${REQUESTS:-2000}" --edges nixl --hot-wait "$w"
              done ;;
    hop_vs) for i in 1 2; do for tree in . "${BASE_TREE:?BASE_TREE: a checkout of the code to compare with}"; do
              n=$([ "$tree" = . ] && echo this || echo base)  # GPU hops of the two trees alternately, in one call
              run_step "t2va_gpu_${i}_$n" 90 python3 "$tree/benchmarks/transfer.py" --scaling-sizes "" --inflight 1 \
                --device cuda --sizes 359024 --iters 300 --zero-copy
              run_step "ref2va_gpu_${i}_$n" 90 python3 "$tree/benchmarks/transfer.py" --scaling-sizes "" --inflight 1 \
                --device cuda --sizes 64963792 --iters "${REF_ITERS:-200}" --inline-iters 10 --zero-copy
            done; done ;;
    tput_vs) i=0; for tree in . "${BASE_TREE:?BASE_TREE: a checkout of the code to compare with}" . "$BASE_TREE"; do
               i=$((i + 1)); n=$([ "$tree" = . ] && echo this || echo base)  # the two trees alternately, in one call
               run_step "${s}_${i}_$n" 100 python3 "$tree/benchmarks/throughput.py" --tasks T2VA --replicas 1,4 \
                 --requests "${REQUESTS:-2000}" --edges nixl
             done ;;
    throughput) run_step "$s" 330 python3 benchmarks/throughput.py --tasks T2VA,Ref2VA --replicas 1,2,4 \
                  --requests "${REQUESTS:-600}" --edges nixl ;;
    *) echo "unknown step $s" >&2 ;;
  esac
done
