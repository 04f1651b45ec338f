#!/usr/bin/env bash
# device driver for i20-tput (not committed): before/after throughput on 32 cores
set -u
root=$(pwd)
step() {  # name side seconds args...
  local name=$1 side=$2 limit=$3; shift 3
  ( cd "$root/.dev-tput/$side" && export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 &&
    { echo "=== [$side] \$ python3 benchmarks/throughput.py $*"; echo "# $(date -u) nproc=$(nproc) load=$(cut -d' ' -f1-3 /proc/loadavg)";
      timeout "$limit" python3 benchmarks/throughput.py "$@"; echo "rc=$?"; } > "$OUT/$name.txt" 2>&1 )
  tail -n 4 "$OUT/$name.txt" | head -n 2; grep -E "^# T2VA|^# Ref2VA|^\| (T2VA|Ref2VA) \|" "$OUT/$name.txt" | head -n 8
}
for s in ${STEPS:-a}; do case $s in
  a) step t2va_x4_before before 60 --tasks T2VA --replicas 4 --requests 600 --edges nixl
     step t2va_x4_after after 60 --tasks T2VA --replicas 4 --requests 600 --edges nixl
     step ref2va_after_inplace after 100 --tasks Ref2VA --replicas 4,8 --requests 600 --edges nixl --output in-place
     step ref2va_x8_after_copy after 60 --tasks Ref2VA --replicas 8 --requests 600 --edges nixl --output copy ;;
  b) step t2va_after after 120 --tasks T2VA --replicas 1,2,4 --requests 600 --edges nixl
     step t2va_x4_before2 before 60 --tasks T2VA --replicas 4 --requests 600 --edges nixl ;;
esac; done
