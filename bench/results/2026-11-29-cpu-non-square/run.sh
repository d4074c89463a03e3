#!/bin/bash
# usage: run.sh SEED: the bare run's settings (`small`, its CPU defaults) on the 3:2 crops at width 48, height 32 for
# 6,144 steps (the bare run's 24,576 images), then 300 samples and their photos FD against the crops (bench/faces.py's
# score: grey, each image resized to 32x32, so the crops and the samples alike)
cd /work/main
export OMP_NUM_THREADS=1
seed=$1; out=/tmp/ns/run_s$seed
python train.py --dataset /tmp/ns/crops --image_size 48x32 --max_train_steps 6144 --seed $seed --output_dir $out \
  --overwrite_output_dir --save_images_epochs 1000 --logging_steps 1000 > /tmp/ns/s$seed-stdout.txt 2>&1
python sample.py $out --num_images 300 --batch_size 100 --seed 0 --output /tmp/ns/gen_s$seed > /tmp/ns/s$seed-sample.txt 2>&1
mv /tmp/ns/gen_s$seed/copies.png /tmp/ns/copies_s$seed.png  # the copy check's picture is not a sample (added after the
# recorded runs, which were scored again with it moved out: README.md)
echo "seed $seed | $(python -m bench.faces score /tmp/ns/crops /tmp/ns/gen_s$seed 2>&1 | tail -1)" >> /tmp/ns/scores.txt
