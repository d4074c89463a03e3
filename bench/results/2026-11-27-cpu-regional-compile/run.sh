#!/bin/bash
# usage: run.sh WORKLOAD VARIANT BATCH STEPS: one speed-ladder row in a process of its own, pinned to core 0, one
# thread, with empty Inductor and Triton caches (a cold compile); its printed output in /tmp/cc/W-V.log
cd /work/main
w=$1; v=$2; b=$3; n=$4
export OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d /tmp/cc/ind.XXXX) TRITON_CACHE_DIR=$(mktemp -d /tmp/cc/tri.XXXX)
start=$(date +%s.%N)
taskset -c 0 python -m bench --workload $w --variants $v --batch_sizes $b --steps $n --warmup 1 --output /tmp/cc/out --tag $w-$v > /tmp/cc/$w-$v.log 2>&1
echo "$w $v batch $b rc=$? wall_s=$(echo "$(date +%s.%N) - $start" | bc)" >> /tmp/cc/summary.txt
