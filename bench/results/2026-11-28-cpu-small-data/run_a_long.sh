#!/bin/bash
# Part A, second budget: 16 and 2,000 images at 2,000 steps (800 did not memorise 16 images),
# checkpoints at 1,000 sampled too. One chain per seed: bash run_a_long.sh 1 & bash run_a_long.sh 2 &
set -e
SEED=$1
STEPS=${STEPS:-2000}
OUT=${OUT:-/tmp/sd/runs}
LOGS=$(dirname "$0")/logs
mkdir -p "$OUT" "$LOGS"
export OMP_NUM_THREADS=1
for SET in 16 2000; do
  if [ $SET = 2000 ]; then DATA=/tmp/sd/lab/train; else DATA=/tmp/sd/flat$SET; fi
  RUN=$OUT/a$STEPS-n$SET-s$SEED
  nice -n 10 python train.py --dataset $DATA --model small --image_size 32 --train_batch_size 16 \
    --max_train_steps $STEPS --seed $SEED --save_images_epochs 100000 --checkpointing_steps 1000 \
    --logger none --dataloader_num_workers 0 --output_dir $RUN 2>&1 | tr '\r' '\n' | grep --line-buffered -v '%|' \
    > $LOGS/train-$STEPS-n$SET-s$SEED.txt
  cp $RUN/train_config.json $LOGS/train_config-$STEPS-n$SET-s$SEED.json
  nice -n 10 python sample.py $RUN --num_images 200 --device cpu --output $OUT/gen$STEPS-n$SET-s$SEED 2>&1 \
    | tr '\r' '\n' | grep --line-buffered -v '%|' > $LOGS/sample-$STEPS-n$SET-s$SEED.txt
  nice -n 10 python sample.py $RUN/checkpoints/checkpoint-1000 --num_images 200 --device cpu --output $OUT/gen$STEPS-n$SET-s$SEED-at1000 2>&1 \
    | tr '\r' '\n' | grep --line-buffered -v '%|' > $LOGS/sample-$STEPS-n$SET-s$SEED-at1000.txt
done
