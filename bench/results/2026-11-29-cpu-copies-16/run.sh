#!/bin/bash
# Issue 65's copy check on the 16 labelled crops of 2026-11-28-cpu-small-data (/tmp/sd/flat16) past 2,000 steps: `small`,
# 32px, batch 16, 4,000 steps (a schedule of its own, cosine to 4,000), then 200 samples and sample.py's copy check.
# One per seed, side by side: bash run.sh 1 & bash run.sh 2 &
SEED=$1
OUT=/tmp/sd/runs
LOGS=$(dirname "$0")/logs
mkdir -p "$LOGS"
export OMP_NUM_THREADS=1
RUN=$OUT/a4000-n16-s$SEED
nice -n 5 python train.py --dataset /tmp/sd/flat16 --model small --image_size 32 --train_batch_size 16 \
  --max_train_steps 4000 --seed $SEED --save_images_epochs 100000 --checkpointing_steps 1000 \
  --logger none --dataloader_num_workers 0 --output_dir $RUN 2>&1 | tr '\r' '\n' | grep --line-buffered -v '%|' \
  > $LOGS/train-4000-n16-s$SEED.txt
cp $RUN/train_config.json $LOGS/train_config-4000-n16-s$SEED.json
nice -n 5 python sample.py $RUN --num_images 200 --device cpu --output $OUT/gen4000-n16-s$SEED 2>&1 \
  | tr '\r' '\n' | grep --line-buffered -v '%|' > $LOGS/sample-4000-n16-s$SEED.txt
