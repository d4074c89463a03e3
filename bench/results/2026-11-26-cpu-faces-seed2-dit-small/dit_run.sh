#!/bin/bash
# usage: run.sh NAME [train flags...]: dit-small at batch 4 without EMA (small's settings), 3,200 steps
# (small's 2,560 of the 5-epoch runs x its step time over dit-small's, 0.369/0.294 s), then its shape score
cd /work/wt-measure
export OMP_NUM_THREADS=1
name=$1; shift
start=$(date +%s)
python train.py --model dit-small --train_batch_size 4 --ema none --max_train_steps 3200 --num_epochs 7 --output_dir /tmp/dit/$name --overwrite_output_dir --save_images_epochs 1000 --logging_steps 500 "$@" > /tmp/dit/$name.log 2>&1
end=$(date +%s)
score=$(python sample.py /tmp/dit/$name --fid --num_images 256 --batch_size 64 2>&1 | grep "shape FD")
echo "$name [$*] train_s=$((end-start)) | $score" >> /tmp/dit/scores.txt
