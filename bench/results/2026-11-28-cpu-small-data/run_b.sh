#!/bin/bash
# Part B: fine-tuned (--init_from part A's 2,000-image run of the same seed) against scratch on
# scikit-image's 200 LFW crops (python -m bench.faces write /tmp/sd/faces). One chain per seed:
#   bash run_b.sh 1 & bash run_b.sh 2 &
set -e
SEED=$1
STEPS=${STEPS:-600}
EVERY=${EVERY:-150}
N=${N:-200}
OUT=${OUT:-/tmp/sd/runs}
LOGS=$(dirname "$0")/logs
mkdir -p "$OUT" "$LOGS"
export OMP_NUM_THREADS=1
for KIND in fine scratch; do
  RUN=$OUT/b-$KIND-s$SEED
  INIT=""; [ $KIND = fine ] && INIT="--init_from $OUT/a-n2000-s$SEED"
  nice -n 10 python train.py --dataset /tmp/sd/faces --model small --image_size 32 --train_batch_size 16 \
    --max_train_steps $STEPS --seed $SEED --save_images_epochs 100000 --checkpointing_steps $EVERY \
    --checkpoints_total_limit 100 --logger none --dataloader_num_workers 0 --output_dir $RUN $INIT 2>&1 | tr "\r" "\n" \
    | grep -v '%|' > $LOGS/train-b-$KIND-s$SEED.txt
  cp $RUN/train_config.json $LOGS/train_config-b-$KIND-s$SEED.json
  for CK in $(ls -d $RUN/checkpoints/checkpoint-* | sort -t- -k2 -n); do
    S=${CK##*-}; GEN=$OUT/gen-b-$KIND-s$SEED-$S
    nice -n 10 python sample.py $CK --num_images $N --device cpu --no-copies --output $GEN 2>&1 | grep -v '%|' \
      > $LOGS/sample-b-$KIND-s$SEED-$S.txt
    echo "$KIND s$SEED step $S: $(python -m bench.faces score /tmp/sd/faces $GEN 2>&1 | tail -1)" >> $LOGS/faces-fd-s$SEED.txt
  done
done
