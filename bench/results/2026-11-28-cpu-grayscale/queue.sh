#!/bin/bash
# the runs, two at a time: the RGB and the grayscale run of one seed side by side (the same contention)
d=$(dirname "$0")
DIT="--model dit-small --max_train_steps 640"    # its own defaults: batch 16, EMA, flow (10,240 images)
UNET="--model small --max_train_steps 2560"      # its own defaults: batch 4, no EMA, flow (the same 10,240 images)
for seed in 1 2; do
  bash $d/run.sh dit_rgb_s$seed rgb $seed $DIT & bash $d/run.sh dit_gray_s$seed gray $seed $DIT & wait
done
for seed in 1 2; do
  bash $d/run.sh unet_rgb_s$seed rgb $seed $UNET & bash $d/run.sh unet_gray_s$seed gray $seed $UNET & wait
done
