#!/bin/bash
# usage: run.sh CORE NAME SEED [train flags...]: one bare-budget run of the faces protocol (the 2026-12-01-cpu-token-routing
# record's run.sh: dit-small at its defaults, batch 16 with EMA, 640 steps on the 200 LFW crops) on dit-small at patch 2
# (256 tokens an image; patch2.diff on the tree), a checkpoint every 160 steps, each sampled (400 images) and scored
# (faces FD), with the training second each checkpoint was written at (its trainer_state.json's time less the run's start).
cd /work/wt-m
export OMP_NUM_THREADS=1
core=$1; name=$2; seed=$3; shift 3
R="nice -n 5 taskset -c $core"
D=/tmp/r2
start=$(date +%s.%N)
$R python train.py --dataset /tmp/imk4/lt/fc/faces --model dit-small --image_size 32 --max_train_steps 640 \
  --seed $seed --output_dir $D/$name --overwrite_output_dir --save_images_epochs 1000 --logging_steps 160 \
  --checkpointing_steps 160 "$@" > $D/$name.log 2>&1
end=$(date +%s.%N)
echo "$name [--seed $seed $*] train_s=$(python -c "print(round($end - $start))")" >> $D/scores.txt
for steps in 160 320 480 640; do
  src=$D/$name/checkpoints/checkpoint-$steps
  at=$(python -c "import os; print(round(os.path.getmtime('$src/trainer_state.json') - $start))")
  out=$D/$name-at$steps
  t0=$(date +%s)
  $R python sample.py $src --num_images 400 --batch_size 100 --seed 0 --no-copies --output $out > $out-sample.log 2>&1
  score=$($R python -m bench.faces score /tmp/imk4/lt/fc/faces $out 2>&1 | tail -1)
  echo "$name steps $steps at_s=$at sample_score_s=$(( $(date +%s) - t0 )) | $score" >> $D/scores.txt
done
