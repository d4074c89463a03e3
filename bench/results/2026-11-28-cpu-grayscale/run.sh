#!/bin/bash
# usage: run.sh NAME DATA SEED [train flags...]: one faces run (the 2026-11-27 faces record's recipe) on
# /tmp/gray/DATA, `rgb` (`python -m bench.faces write /tmp/gray/rgb`: RGB files of grey content, trains 3 channels)
# or `gray` (`... write /tmp/gray/gray --gray`: 'L' files, trains 1 channel); then sample.py 400 images, batch 100,
# and the faces FD against the RGB folder (the score reads both in grey). One thread, nice 10, two runs at a time.
cd /work/wt-gray
export OMP_NUM_THREADS=1
name=$1; data=$2; seed=$3; shift 3
start=$(date +%s)
nice -n 10 python train.py --dataset /tmp/gray/$data --image_size 32 --seed $seed --output_dir /tmp/gray/$name \
  --overwrite_output_dir --save_images_epochs 1000 --logging_steps 500 "$@" > /tmp/gray/$name.log 2>&1
end=$(date +%s)
nice -n 10 python sample.py /tmp/gray/$name --num_images 400 --batch_size 100 --output /tmp/gray/$name-gen > /tmp/gray/$name-sample.log 2>&1
score=$(nice -n 10 python -m bench.faces score /tmp/gray/rgb /tmp/gray/$name-gen 2>&1 | tail -1)
echo "$name [$data --seed $seed $*] train_s=$((end-start)) | $score" >> /tmp/gray/scores.txt
