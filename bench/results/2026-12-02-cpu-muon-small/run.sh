#!/bin/bash
# usage: run.sh CORE PROTOCOL NAME SEED [train flags...]: one bare-budget run of `small` at its defaults (batch 4, no EMA)
# with 4 checkpoints, each scored, and the training second each was written at (its trainer_state.json's time less the
# run's start). PROTOCOL (the 2026-11-29-cpu-loss-curves record's run1x.sh):
#   labelled: class-conditional, 6,144 steps on the 10-class crops at 32px, a checkpoint every 1,536; 300 samples at
#             w = 1, class match and photos FD;
#   faces:    2,560 steps on the 200 LFW crops at 32px, a checkpoint every 640; 400 samples, faces FD.
cd /work/wt-suite
export OMP_NUM_THREADS=1
core=$1; protocol=$2; name=$3; seed=$4; shift 4
R="nice -n 5 taskset -c $core"
D=/tmp/ms; mkdir -p $D
S=/tmp/imk4/lt/lab/set; F=/tmp/imk4/lt/fc/faces
case $protocol in
  labelled) train="--dataset $S/train --class_conditional --max_train_steps 6144"; every=1536; n=300 ;;
  faces) train="--dataset $F --max_train_steps 2560"; every=640; n=400 ;;
esac
start=$(date +%s.%N)
$R python train.py $train --image_size 32 --seed $seed --output_dir $D/$name --overwrite_output_dir \
  --save_images_epochs 1000 --logging_steps 500 --checkpointing_steps $every "$@" > $D/$name.log 2>&1
end=$(date +%s.%N)
echo "$name [$protocol --seed $seed $*] train_s=$(python -c "print(round($end - $start))")" >> $D/scores.txt
for k in 1 2 3 4; do
  steps=$((k * every))
  src=$D/$name/checkpoints/checkpoint-$steps
  at=$(python -c "import os; print(round(os.path.getmtime('$src/trainer_state.json') - $start))")
  out=$D/$name-at$steps
  t0=$(date +%s)
  $R python sample.py $src --num_images $n --batch_size 100 --seed 0 --no-copies --output $out > $out-sample.log 2>&1
  if [ $protocol = faces ]; then
    score=$($R python -m bench.faces score $F $out 2>&1 | tail -1)
  else
    score=$($R python -m bench.labelled score $S $out --run $D/$name --json $out.json --grid $out-grid.png 2>&1 | tail -1)
  fi
  echo "$name steps $steps at_s=$at sample_score_s=$(( $(date +%s) - t0 )) | $score" >> $D/scores.txt
done
