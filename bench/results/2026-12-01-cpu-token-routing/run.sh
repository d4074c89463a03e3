#!/bin/bash
# usage: run.sh CORE NAME SEED [train flags...]: one 4x-budget run of the faces protocol (2026-11-29-cpu-loss-curves'
# run.sh, faces: dit-small at its defaults, batch 16 with EMA, bare budget 640 steps on the 200 LFW crops) with a
# checkpoint every half bare budget, each scored at 1/2, 1, 2, 3 and 4 bare budgets (400 samples, faces FD), and the
# training seconds at which each checkpoint was written (its trainer_state.json's time less the run's start).
cd /work/wt-route
export OMP_NUM_THREADS=1
core=$1; name=$2; seed=$3; shift 3
R="nice -n 5 taskset -c $core"
D=/tmp/rt
bare=640; half=$((bare / 2))
start=$(date +%s.%N)
$R python train.py --dataset /tmp/imk4/lt/fc/faces --model dit-small --image_size 32 --max_train_steps $((4 * bare)) \
  --seed $seed --output_dir $D/$name --overwrite_output_dir --save_images_epochs 1000 --logging_steps 500 \
  --checkpointing_steps $half "$@" > $D/$name.log 2>&1
end=$(date +%s.%N)
echo "$name [--seed $seed $*] train_s=$(python -c "print(round($end - $start))")" >> $D/scores.txt
for k in 1 2 4 6 8; do
  steps=$((k * half))
  src=$D/$name/checkpoints/checkpoint-$steps
  at=$(python -c "import os; print(round(os.path.getmtime('$src/trainer_state.json') - $start))")
  out=$D/$name-at$steps
  t0=$(date +%s)
  $R python sample.py $src --num_images 400 --batch_size 100 --seed 0 --no-copies --output $out > $out-sample.log 2>&1
  score=$($R python -m bench.faces score /tmp/imk4/lt/fc/faces $out 2>&1 | tail -1)
  echo "$name steps $steps ($k/2 bare) at_s=$at sample_score_s=$(( $(date +%s) - t0 )) | $score" >> $D/scores.txt
done
