#!/bin/bash
# step time alone (one run at a time, RGB and L alternating twice), after the eight runs: short runs, their final median s/step
cd /work/wt-gray
export OMP_NUM_THREADS=1
for rep in 1 2; do
  for cfg in "small 200" "dit-small 100"; do set -- $cfg
    for data in rgb gray; do
      line=$(nice -n 10 python train.py --dataset /tmp/gray/$data --image_size 32 --model $1 --max_train_steps $2 --seed 1 \
        --output_dir /tmp/gray/st --overwrite_output_dir --save_images_epochs 1000 --logging_steps 1000 --checkpointing_steps 100000 2>&1 \
        | tr '\r' '\n' | grep '^final:')
      echo "$1 $data rep$rep: $line"
    done
  done
done
