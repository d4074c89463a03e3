#!/bin/bash
# Issue 65, part B at full length: fine-tuned (--init_from the 2,000-step run on the 2,000 labelled crops of
# 2026-11-28-cpu-small-data, a2000-n2000-sSEED) against scratch on scikit-image's 200 LFW crops (python -m bench.faces
# write /tmp/sd/faces), 2,560 steps of batch 16 (the faces record's budget), a checkpoint every 320 steps, each sampled
# (400 images) and scored by the faces FD. One chain per seed: bash run.sh 1; bash run.sh 2
set -e
SEED=$1
OUT=/tmp/sd/long
LOGS=$(dirname "$0")/logs
mkdir -p "$OUT" "$LOGS"
export OMP_NUM_THREADS=1
for KIND in fine scratch; do
  RUN=$OUT/b-$KIND-s$SEED
  INIT=""; [ $KIND = fine ] && INIT="--init_from /tmp/sd/runs/a2000-n2000-s$SEED"
  nice -n 5 python train.py --dataset /tmp/sd/faces --model small --image_size 32 --train_batch_size 16 \
    --max_train_steps 2560 --seed $SEED --save_images_epochs 100000 --checkpointing_steps 320 \
    --checkpoints_total_limit 100 --logger none --dataloader_num_workers 0 --output_dir $RUN $INIT 2>&1 | tr "\r" "\n" \
    | grep -v '%|' > $LOGS/train-$KIND-s$SEED.txt
  cp $RUN/train_config.json $LOGS/train_config-$KIND-s$SEED.json
  for CK in $(ls -d $RUN/checkpoints/checkpoint-* | sort -t- -k2 -n); do
    S=${CK##*-}; GEN=$OUT/gen-$KIND-s$SEED-$S
    nice -n 5 python sample.py $CK --num_images 400 --device cpu --no-copies --output $GEN 2>&1 | grep -v '%|' \
      > $LOGS/sample-$KIND-s$SEED-$S.txt
    echo "$KIND s$SEED step $S: $(python -m bench.faces score /tmp/sd/faces $GEN 2>&1 | tail -1)" >> $LOGS/faces-fd-s$SEED.txt
  done
done
