#!/bin/bash
# usage: run_lab.sh CORE NAME SEED BUDGET [train flags...]: the labelled photos with `dit-small` (2026-11-29-cpu-loss-curves'
# labelled-dit protocol: class-conditional, its defaults, batch 16 with EMA, bare budget 1,536 steps on the 10-class crops),
# BUDGET (1 or 4) times the bare budget with a checkpoint every half bare budget, scored at 1/2 and 1 (BUDGET 1) or at
# 1/2, 1, 2, 3 and 4 bare budgets (BUDGET 4): 300 samples at w = 1, class match and photos FD; and the training seconds at
# which each checkpoint was written (its trainer_state.json's time less the run's start).
cd /work/wt-m
export OMP_NUM_THREADS=1
core=$1; name=$2; seed=$3; budget=$4; shift 4
R="nice -n ${NICE:-0} taskset -c $core"
D=/tmp/rl; mkdir -p $D
S=/tmp/imk4/lt/lab/set
bare=1536; half=$((bare / 2))
start=$(date +%s.%N)
$R python train.py --dataset $S/train --class_conditional --model dit-small --image_size 32 --max_train_steps $((budget * bare)) \
  --seed $seed --output_dir $D/$name --overwrite_output_dir --save_images_epochs 1000 --logging_steps 500 \
  --checkpointing_steps $half "$@" > $D/$name.log 2>&1
end=$(date +%s.%N)
echo "$name [--seed $seed $*] train_s=$(python -c "print(round($end - $start))")" >> $D/scores.txt
for k in $([ $budget = 1 ] && echo 1 2 || echo 1 2 4 6 8); do
  steps=$((k * half))
  src=$D/$name/checkpoints/checkpoint-$steps
  at=$(python -c "import os; print(round(os.path.getmtime('$src/trainer_state.json') - $start))")
  out=$D/$name-at$steps
  t0=$(date +%s)
  $R python sample.py $src --num_images 300 --batch_size 100 --seed 0 --no-copies --output $out > $out-sample.log 2>&1
  score=$($R python -m bench.labelled score $S $out --run $D/$name --json $out.json --grid $out-grid.png 2>&1 | tail -1)
  echo "$name steps $steps ($k/2 bare) at_s=$at sample_score_s=$(( $(date +%s) - t0 )) | $score" >> $D/scores.txt
done
