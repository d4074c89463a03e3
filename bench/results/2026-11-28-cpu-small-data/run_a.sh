#!/bin/bash
# Part A: the copy share against set size. One chain per seed; run the two seeds side by side:
#   bash run_a.sh 1 & bash run_a.sh 2 &
# Data: python -m bench.labelled write /tmp/sd/lab; /tmp/sd/flat16 and /tmp/sd/flat200 are the first
# 16 and 200 files taken round-robin over the sorted classes (make_subsets.py).
set -e
SEED=$1
STEPS=${STEPS:-800}
OUT=${OUT:-/tmp/sd/runs}
LOGS=$(dirname "$0")/logs
mkdir -p "$OUT" "$LOGS"
export OMP_NUM_THREADS=1
for SET in 16 2000 200; do
  if [ $SET = 2000 ]; then DATA=/tmp/sd/lab/train; else DATA=/tmp/sd/flat$SET; fi
  RUN=$OUT/a-n$SET-s$SEED
  nice -n 10 python train.py --dataset $DATA --model small --image_size 32 --train_batch_size 16 \
    --max_train_steps $STEPS --seed $SEED --save_images_epochs 100000 --checkpointing_steps 400 \
    --logger none --dataloader_num_workers 0 --output_dir $RUN 2>&1 | grep --line-buffered -v '%|' > $LOGS/train-n$SET-s$SEED.txt
  cp $RUN/train_config.json $LOGS/train_config-n$SET-s$SEED.json
  nice -n 10 python sample.py $RUN --num_images 200 --device cpu --output $OUT/gen-n$SET-s$SEED 2>&1 \
    | grep --line-buffered -v '%|' > $LOGS/sample-n$SET-s$SEED.txt
done
