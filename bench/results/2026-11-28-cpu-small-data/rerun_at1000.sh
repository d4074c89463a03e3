#!/bin/bash
# run_a_long.sh as first run named the checkpoint $RUN/checkpoint-1000 (it is $RUN/checkpoints/checkpoint-1000,
# fixed there since); these are its last lines, run again after it. bash rerun_at1000.sh SEED
SEED=$1; OUT=/tmp/sd/runs; LOGS=$(dirname "$0")/logs; export OMP_NUM_THREADS=1
for SET in 16 2000; do
  RUN=$OUT/a2000-n$SET-s$SEED
  nice -n 10 python sample.py $RUN/checkpoints/checkpoint-1000 --num_images 200 --device cpu --output $OUT/gen2000-n$SET-s$SEED-at1000 2>&1 \
    | tr '\r' '\n' | grep --line-buffered -v '%|' > $LOGS/sample-2000-n$SET-s$SEED-at1000.txt
done
