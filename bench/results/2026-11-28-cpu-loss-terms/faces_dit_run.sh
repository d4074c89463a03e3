#!/bin/bash
# usage: faces_dit_run.sh NAME SEED [train flags...]: the 2026-11-27 faces protocol (its faces_dit_run.sh) with paths moved:
# dit-small, 640 steps of its own defaults (batch 16, EMA; objective flow, the default now) on scikit-image's 200 LFW crops,
# then faces FD of 400 samples (the run's own sampler). One process at a time, one thread, on core 1.
cd /work/wt-lt
export OMP_NUM_THREADS=1
R="nice -n 5 taskset -c 1"
name=$1; seed=$2; shift 2
[ -e /tmp/lt/fc/$name.claimed ] && exit 0; touch /tmp/lt/fc/$name.claimed
start=$(date +%s)
$R python train.py --dataset /tmp/lt/fc/faces --model dit-small --image_size 32 --max_train_steps 640 --seed $seed --output_dir /tmp/lt/fc/$name \
  --overwrite_output_dir --save_images_epochs 1000 --logging_steps 500 "$@" > /tmp/lt/fc/$name.log 2>&1
end=$(date +%s)
$R python sample.py /tmp/lt/fc/$name --num_images 400 --batch_size 100 --output /tmp/lt/fc/$name-gen > /tmp/lt/fc/$name-sample.log 2>&1
# sample.py now also writes copies.png (the copy check) into the folder, and the scorer would count it as a 401st sample: move it out
mv /tmp/lt/fc/$name-gen/copies.png /tmp/lt/fc/$name-copies.png
score=$($R python -m bench.faces score /tmp/lt/fc/faces /tmp/lt/fc/$name-gen 2>&1 | tail -1)
end2=$(date +%s)
echo "$name [--seed $seed $*] train_s=$((end-start)) sample_score_s=$((end2-end)) | $score" >> /tmp/lt/fc/scores.txt
