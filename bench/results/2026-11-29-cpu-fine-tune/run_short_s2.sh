#!/bin/bash
# Seed 2 in less time (run.sh 2 would end after the session): the fine-tune's run of 2,560 steps (its cosine schedule
# the same as run.sh's) stopped once its checkpoint at 960 is being written, so checkpoints 320 and 640 (a quarter of
# the steps) are complete and scored; scratch trained to 2,560 steps and only its last checkpoint scored.
SEED=2
OUT=/tmp/sd/long
LOGS=$(dirname "$0")/logs
mkdir -p "$OUT" "$LOGS"
export OMP_NUM_THREADS=1
score() {  # score KIND STEP
  GEN=$OUT/gen-$1-s$SEED-$2
  nice -n 5 python sample.py $OUT/b-$1-s$SEED/checkpoints/checkpoint-$2 --num_images 400 --device cpu --no-copies \
    --output $GEN 2>&1 | grep -v '%|' > $LOGS/sample-$1-s$SEED-$2.txt
  echo "$1 s$SEED step $2: $(python -m bench.faces score /tmp/sd/faces $GEN 2>&1 | tail -1)" >> $LOGS/faces-fd-s$SEED.txt
}
common=(--dataset /tmp/sd/faces --model small --image_size 32 --train_batch_size 16 --max_train_steps 2560 --seed $SEED
        --save_images_epochs 100000 --checkpointing_steps 320 --checkpoints_total_limit 100 --logger none
        --dataloader_num_workers 0)
nice -n 5 python train.py "${common[@]}" --output_dir $OUT/b-fine-s$SEED --init_from /tmp/sd/runs/a2000-n2000-s$SEED \
  > $LOGS/train-fine-s$SEED.txt 2>&1 &
train=$!
until [ -d $OUT/b-fine-s$SEED/checkpoints/checkpoint-960 ]; do sleep 5; done
kill $train; wait $train
tr "\r" "\n" < $LOGS/train-fine-s$SEED.txt | grep -v '%|' > $LOGS/train-fine-s$SEED.tmp && mv $LOGS/train-fine-s$SEED.tmp $LOGS/train-fine-s$SEED.txt
cp $OUT/b-fine-s$SEED/train_config.json $LOGS/train_config-fine-s$SEED.json
score fine 320
score fine 640
nice -n 5 python train.py "${common[@]}" --output_dir $OUT/b-scratch-s$SEED 2>&1 | tr "\r" "\n" | grep -v '%|' \
  > $LOGS/train-scratch-s$SEED.txt
cp $OUT/b-scratch-s$SEED/train_config.json $LOGS/train_config-scratch-s$SEED.json
score scratch 2560
