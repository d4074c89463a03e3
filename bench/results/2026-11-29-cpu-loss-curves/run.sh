#!/bin/bash
# usage: run.sh CORE SET NAME SEED [train flags...]: one 4x-budget run of the 2026-11-28 loss-terms protocols
# (that record's faces_dit_run.sh and labelled_run.sh) with a checkpoint every half bare budget, and the
# set's score at 1/2, 1, 2, 3 and 4 bare budgets. SET is faces (dit-small, bare budget 640 steps, 400 samples,
# faces FD) or labelled (small, class-conditional, bare budget 6,144 steps, 300 samples at w = 1, class match
# and photos FD). One thread, on core CORE; a run whose claim file exists is skipped.
cd /work/wt-curves
export OMP_NUM_THREADS=1
core=$1; set=$2; name=$3; seed=$4; shift 4
R="nice -n 5 taskset -c $core"
D=/tmp/lc
[ -e $D/$name.claimed ] && exit 0; touch $D/$name.claimed
if [ $set = faces ]; then
  bare=640
  train="--dataset /tmp/lt/fc/faces --model dit-small"
  n=400
else
  bare=6144
  train="--dataset /tmp/lt/lab/set/train --class_conditional"
  n=300
fi
half=$((bare / 2))
start=$(date +%s)
$R python train.py $train --image_size 32 --max_train_steps $((4 * bare)) --seed $seed --output_dir $D/$name \
  --overwrite_output_dir --save_images_epochs 1000 --logging_steps 500 --checkpointing_steps $half "$@" > $D/$name.log 2>&1
end=$(date +%s)
echo "$name [$set --seed $seed $*] train_s=$((end-start))" >> $D/scores.txt
for k in ${POINTS:-1 2 4 6 8}; do  # POINTS: the half bare budgets scored (queue_c.sh: the end alone)
  steps=$((k * half))
  src=$D/$name/checkpoints/checkpoint-$steps
  out=$D/$name-at$steps
  t0=$(date +%s)
  $R python sample.py $src --num_images $n --batch_size 100 --seed 0 --no-copies --output $out > $out-sample.log 2>&1
  if [ $set = faces ]; then
    score=$($R python -m bench.faces score /tmp/lt/fc/faces $out 2>&1 | tail -1)
  else
    score=$($R python -m bench.labelled score /tmp/lt/lab/set $out --run $D/$name --json $out.json --grid $out-grid.png 2>&1 | tail -1)
  fi
  echo "$name steps $steps ($k/2 bare) sample_score_s=$(( $(date +%s) - t0 )) | $score" >> $D/scores.txt
done
