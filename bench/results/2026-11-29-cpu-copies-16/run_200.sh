#!/bin/bash
# The same on the 200 crops (/tmp/sd/flat200) at 2,000 steps, the budget the earlier record ran 16 and 2,000 images at
# (its 200 images ran 800 steps only). One per seed, side by side: bash run_200.sh 1 & bash run_200.sh 2 &
SEED=$1
OUT=/tmp/sd/runs
LOGS=$(dirname "$0")/logs
mkdir -p "$LOGS"
export OMP_NUM_THREADS=1
RUN=$OUT/a2000-n200-s$SEED
nice -n 5 python train.py --dataset /tmp/sd/flat200 --model small --image_size 32 --train_batch_size 16 \
  --max_train_steps 2000 --seed $SEED --save_images_epochs 100000 --checkpointing_steps 1000 \
  --logger none --dataloader_num_workers 0 --output_dir $RUN 2>&1 | tr '\r' '\n' | grep --line-buffered -v '%|' \
  > $LOGS/train-2000-n200-s$SEED.txt
cp $RUN/train_config.json $LOGS/train_config-2000-n200-s$SEED.json
nice -n 5 python sample.py $RUN --num_images 200 --device cpu --output $OUT/gen2000-n200-s$SEED 2>&1 \
  | tr '\r' '\n' | grep --line-buffered -v '%|' > $LOGS/sample-2000-n200-s$SEED.txt
