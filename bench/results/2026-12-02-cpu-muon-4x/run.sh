#!/bin/bash
# usage: run.sh CORE NAME SEED [train flags...]: one 4x-budget run of the faces protocol (the 2026-12-01-cpu-token-routing
# record's run_muon.sh at its default BUDGET=4: dit-small at its defaults, batch 16 with EMA, 2,560 steps on the 200 LFW
# crops at 32px) with a checkpoint every 320 steps, each at 1/2, 1, 2, 3 and 4 bare budgets sampled (400 images) and
# scored (faces FD), and the training second each checkpoint was written at (its trainer_state.json's time less the
# run's start). The code: d7268a3, checked out in /work/wt-m.
cd /work/wt-m
export OMP_NUM_THREADS=1
core=$1; name=$2; seed=$3; shift 3
R="nice -n 5 taskset -c $core"
D=/tmp/m4; mkdir -p $D
F=/tmp/imk4/lt/fc/faces
bare=640; half=$((bare / 2))
start=$(date +%s.%N)
$R python train.py --dataset $F --model dit-small --image_size 32 --max_train_steps $((4 * bare)) \
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
  score=$($R python -m bench.faces score $F $out 2>&1 | tail -1)
  echo "$name steps $steps ($k/2 bare) at_s=$at sample_score_s=$(( $(date +%s) - t0 )) | $score" >> $D/scores.txt
done
