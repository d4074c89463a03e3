#!/bin/bash
# usage: faces.sh NAME [train flags...]: 2,560 steps of the bare run's settings on the 200 LFW crops, then faces FD of 400 samples
cd /work/wt-measure
export OMP_NUM_THREADS=1
name=$1; shift
start=$(date +%s)
python train.py --dataset /tmp/fm2/faces --image_size 32 --max_train_steps 2560 --output_dir /tmp/fm2/$name --overwrite_output_dir --save_images_epochs 1000 --logging_steps 500 "$@" > /tmp/fm2/$name.log 2>&1
end=$(date +%s)
python sample.py /tmp/fm2/$name --num_images 400 --batch_size 100 --output /tmp/fm2/$name-gen > /tmp/fm2/$name-sample.log 2>&1
score=$(python -m bench.faces score /tmp/fm2/faces /tmp/fm2/$name-gen 2>&1 | tail -1)
echo "$name [$*] train_s=$((end-start)) | $score" >> /tmp/fm2/scores.txt
