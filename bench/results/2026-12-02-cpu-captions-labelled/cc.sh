#!/bin/bash
# usage: cc.sh CORE NAME SEED STEPS [train flags]: the class-conditional run on the same crops (the labelled protocol, as
# the 2026-11-28 and 2026-12-01 records), then 300 samples at w = 1 and w = 3 (classes spread over the images as sample.py
# does) scored by `python -m bench.labelled score --run`: the comparison for run.sh's captioned runs at both scales.
cd /work/main
export OMP_NUM_THREADS=1
core=$1; name=$2; seed=$3; steps=$4; shift 4
R="taskset -c $core"
D=/tmp/cap2; S=/tmp/imk4/lt/lab/set
start=$(date +%s)
$R python train.py --dataset $S/train --class_conditional --image_size 32 --max_train_steps $steps --seed $seed \
  --output_dir $D/$name --overwrite_output_dir --save_images_epochs 1000 --logging_steps 1000 "$@" > $D/$name.log 2>&1
echo "$name train_s=$(( $(date +%s) - start ))" >> $D/scores.txt
for w in 1 3; do
  out=$D/$name-w$w; rm -rf $out
  $R python sample.py $D/$name --num_images 300 --batch_size 100 --seed 0 --no-copies --guidance_scale $w --output $out > $out-sample.log 2>&1
  score=$($R python -m bench.labelled score $S $out --run $D/$name --json $out.json --grid $out-grid.png 2>&1 | tail -1)
  echo "$name w=$w | $score" >> $D/scores.txt
done
