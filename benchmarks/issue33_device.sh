#!/usr/bin/env bash
# Issue 33 on the GPU host: the lean link (resp_link) against one dedicated redis-py connection, side by side
# (the 2-core box's noise was larger than the difference on the hop and throughput).  Run from the repo root
# with the project installed; writes under $OUT.
set -euo pipefail
OUT=${OUT:-/tmp/issue33_out}
mkdir -p "$OUT"
redis-server --port 6379 --save "" --appendonly no --daemonize yes
export PYTHONPATH=$PWD
python benchmarks/resp_link.py --rounds 3000 --blocks 3 | tee "$OUT/resp_link_micro_h200.txt"
python benchmarks/side_by_side.py --rounds 5 --hop-iters 400 --logs "$OUT/logs" \
  --a link=.:STAGEFERRY_REDIS_LINK=1 --b redis-py=.:STAGEFERRY_REDIS_LINK=redis-py \
  -- --tasks T2VA --replicas 1,4 --requests 100 --edges nixl | tee "$OUT/resp_link_vs_redispy_h200.txt"
