#!/bin/bash
# usage: [WS="1 2 3"] run2.sh NAME SEED [train flags...]: the bare run's 24,576 images (6,144 steps at small's batch 4; later
# flags override, e.g. --max_train_steps 1536 at batch 16), class-conditional, on the labelled photos; then sample.py 300 images
# at each w in WS and the class match and photos FD of each (bench.labelled score)
cd ${TREE:-/work/wt-lab}
export OMP_NUM_THREADS=1
name=$1; seed=$2; shift 2
WS=${WS:-1 2 3}
if [ ! -e /tmp/lab/$name.claimed ]; then
  touch /tmp/lab/$name.claimed
  start=$(date +%s)
  python train.py --dataset /tmp/lab/set/train --class_conditional --image_size 32 --max_train_steps 6144 --seed $seed \
    --output_dir /tmp/lab/$name --overwrite_output_dir --save_images_epochs 1000 --logging_steps 500 "$@" > /tmp/lab/$name.log 2>&1
  end=$(date +%s)
else
  start=0; end=0
fi
for w in $WS; do
  python sample.py /tmp/lab/$name --num_images 300 --batch_size 100 --guidance_scale $w --seed 0 --output /tmp/lab/$name-w$w > /tmp/lab/$name-w$w-sample.log 2>&1
  score=$(python -m bench.labelled score /tmp/lab/set /tmp/lab/$name-w$w --run /tmp/lab/$name --json /tmp/lab/$name-w$w.json --grid /tmp/lab/$name-w$w-grid.png 2>&1 | tail -1)
  echo "$name seed $seed [$*] w=$w train_s=$((end-start)) | $score" >> /tmp/lab/scores2.txt
done
