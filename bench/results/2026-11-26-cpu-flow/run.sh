#!/bin/bash
# usage: run.sh NAME [train flags...]: the bare run (12 epochs) with flags, then its shape score with
# the run's own sampler, and for a flow run also with heun.
cd ${REPO:-/work/wt-measure}
name=$1; shift
start=$(date +%s)
python train.py --output_dir /tmp/fm/$name --overwrite_output_dir --save_images_epochs 1000 --logging_steps 500 "$@" > /tmp/fm/$name.log 2>&1
end=$(date +%s)
score=$(python sample.py /tmp/fm/$name --fid --num_images 256 --batch_size 64 2>&1 | grep "shape FD")
echo "$name [$*] train_s=$((end-start)) | $score" >> /tmp/fm/scores.txt
if grep -q '"objective": "flow' /tmp/fm/$name/train_config.json; then
  score=$(python sample.py /tmp/fm/$name --fid --num_images 256 --batch_size 64 --sampler heun 2>&1 | grep "shape FD")
  echo "$name+heun [$*] train_s=$((end-start)) | $score" >> /tmp/fm/scores.txt
fi
