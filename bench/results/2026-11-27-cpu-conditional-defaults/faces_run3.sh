#!/bin/bash
# usage: run.sh NAME SEED [train flags...]: dit-small, 640 steps of its own defaults (batch 16, EMA: 10,240 images, the faces record's) on
# scikit-image's 200 LFW crops (the faces record's budget), then faces FD of 400 samples (the run's own sampler)
cd ${TREE:-/work/wt-lab}
export OMP_NUM_THREADS=1
name=$1; seed=$2; shift 2
[ -e /tmp/fc/$name.claimed ] && exit 0; touch /tmp/fc/$name.claimed
start=$(date +%s)
python train.py --dataset /tmp/fc/faces --model dit-small --image_size 32 --max_train_steps 640 --seed $seed --output_dir /tmp/fc/$name \
  --overwrite_output_dir --save_images_epochs 1000 --logging_steps 500 "$@" > /tmp/fc/$name.log 2>&1
end=$(date +%s)
python sample.py /tmp/fc/$name --num_images 400 --batch_size 100 --output /tmp/fc/$name-gen > /tmp/fc/$name-sample.log 2>&1
score=$(python -m bench.faces score /tmp/fc/faces /tmp/fc/$name-gen 2>&1 | tail -1)
echo "$name [--seed $seed $*] train_s=$((end-start)) | $score" >> /tmp/fc/scores.txt
