#!/bin/bash
# usage: run.sh NAME [train flags...]: the bare run (12 epochs) with flags, then its shape score with
# the run's own sampler, and for a flow run also with heun.
cd /work/wt-measure
export OMP_NUM_THREADS=1
name=$1; shift
start=$(date +%s)
python train.py --output_dir /tmp/fm2/$name --overwrite_output_dir --save_images_epochs 1000 --logging_steps 500 "$@" > /tmp/fm2/$name.log 2>&1
end=$(date +%s)
score=$(python sample.py /tmp/fm2/$name --fid --num_images 256 --batch_size 64 2>&1 | grep "shape FD")
echo "$name [$*] train_s=$((end-start)) | $score" >> /tmp/fm2/scores.txt
if grep -q '"objective": "flow' /tmp/fm2/$name/train_config.json; then
  score=$(python sample.py /tmp/fm2/$name --fid --num_images 256 --batch_size 64 --sampler heun 2>&1 | grep "shape FD")
  echo "$name+heun [$*] train_s=$((end-start)) | $score" >> /tmp/fm2/scores.txt
fi
