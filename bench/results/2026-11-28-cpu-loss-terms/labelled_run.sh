#!/bin/bash
# usage: labelled_run.sh NAME SEED [train flags...]: the 2026-11-27 labelled protocol (its labelled_run.sh) with paths moved and
# sampled at w = 1 only: 6,144 steps of the bare run's settings (small, batch 4, no EMA; objective flow, the default now),
# class-conditional, on the labelled photos; then sample.py 300 images at w = 1, class match and photos FD.
# One process at a time, one thread, on core 1.
cd /work/wt-lt
export OMP_NUM_THREADS=1
R="nice -n 5 taskset -c 1"
name=$1; seed=$2; shift 2
[ -e /tmp/lt/lab/$name.claimed ] && exit 0; touch /tmp/lt/lab/$name.claimed
start=$(date +%s)
$R python train.py --dataset /tmp/lt/lab/set/train --class_conditional --image_size 32 --max_train_steps 6144 --seed $seed \
  --output_dir /tmp/lt/lab/$name --overwrite_output_dir --save_images_epochs 1000 --logging_steps 500 "$@" > /tmp/lt/lab/$name.log 2>&1
end=$(date +%s)
for w in 1; do
  $R python sample.py /tmp/lt/lab/$name --num_images 300 --batch_size 100 --guidance_scale $w --seed 0 --output /tmp/lt/lab/$name-w$w > /tmp/lt/lab/$name-w$w-sample.log 2>&1
  # sample.py now also writes copies.png (the copy check) into the folder; the scorer would take it as a 301st sample: move it out
  mv /tmp/lt/lab/$name-w$w/copies.png /tmp/lt/lab/$name-w$w-copies.png
  score=$($R python -m bench.labelled score /tmp/lt/lab/set /tmp/lt/lab/$name-w$w --run /tmp/lt/lab/$name --json /tmp/lt/lab/$name-w$w.json --grid /tmp/lt/lab/$name-w$w-grid.png 2>&1 | tail -1)
  end2=$(date +%s)
  echo "$name seed $seed [$*] w=$w train_s=$((end-start)) sample_score_s=$((end2-end)) | $score" >> /tmp/lt/lab/scores.txt
done
