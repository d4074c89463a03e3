#!/bin/bash
# usage: run.sh NAME EPOCHS [train flags...]
cd ${REPO:-/work/main}
name=$1; ep=$2; shift 2
start=$(date +%s)
python train.py --num_epochs $ep --output_dir /tmp/x/$name --overwrite_output_dir --save_images_epochs 1000 --logging_steps 500 "$@" > /tmp/x/$name.log 2>&1
end=$(date +%s)
score=$(python sample.py /tmp/x/$name --fid --num_images 256 --batch_size 64 2>&1 | grep "shape FD")
echo "$name ep=$ep [$*] train_s=$((end-start)) | $score" >> /tmp/x/scores.txt
