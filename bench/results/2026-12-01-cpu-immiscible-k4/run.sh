#!/bin/bash
# usage: run.sh CORE PROTOCOL NAME SEED [train flags...]: one run of an earlier record's protocol, scored once at its end.
# PROTOCOL: faces-dit: the 2026-11-28 faces protocol (its faces_dit_run.sh): `dit-small` at its defaults (batch 16, EMA),
#             640 steps on the 200 LFW crops, 400 samples, faces FD;
#           faces-small: the 2026-11-29 faces-small protocol: `small` at the bare run's settings, 2,560 steps, same score;
#           labelled-small: the 2026-11-28 labelled protocol: `small`, 6,144 steps, class-conditional, 300 samples at
#             w = 1, class match and photos FD;
#           labelled-dit: the same set and scores with `dit-small` at its defaults, 1,536 steps (the labelled protocol's
#             24,576 images); labelled-dit-4x, faces-dit-4x, labelled-small-4x: those at 4x the steps (6,144, 2,560,
#             24,576), scored at the end alone.
# One thread, on core CORE; a run whose claim folder exists is skipped (mkdir: one claim wins).
cd /work/wt-imm
export OMP_NUM_THREADS=1
core=$1; protocol=$2; name=$3; seed=$4; shift 4
R="nice -n 5 taskset -c $core"
D=/tmp/imk4/lm
mkdir $D/$name.claimed 2>/dev/null || exit 0
case $protocol in
  faces-dit) train="--dataset /tmp/imk4/lt/fc/faces --model dit-small --max_train_steps 640"; n=400 ;;
  faces-small) train="--dataset /tmp/imk4/lt/fc/faces --max_train_steps 2560"; n=400 ;;
  labelled-small) train="--dataset /tmp/imk4/lt/lab/set/train --class_conditional --max_train_steps 6144"; n=300 ;;
  labelled-dit) train="--dataset /tmp/imk4/lt/lab/set/train --class_conditional --model dit-small --max_train_steps 1536"; n=300 ;;
  labelled-dit-4x) train="--dataset /tmp/imk4/lt/lab/set/train --class_conditional --model dit-small --max_train_steps 6144"; n=300 ;;
  faces-dit-4x) train="--dataset /tmp/imk4/lt/fc/faces --model dit-small --max_train_steps 2560"; n=400 ;;
  labelled-small-4x) train="--dataset /tmp/imk4/lt/lab/set/train --class_conditional --max_train_steps 24576"; n=300 ;;
esac
echo "$(date -u +%H:%M:%S) start $name on core $core" >> $D/queue.log
start=$(date +%s)
$R python train.py $train --image_size 32 --seed $seed --output_dir $D/$name --overwrite_output_dir --save_images_epochs 1000 \
  --logging_steps 500 "$@" > $D/$name.log 2>&1
end=$(date +%s)
out=$D/$name-gen
$R python sample.py $D/$name --num_images $n --batch_size 100 --seed 0 --output $out > $out-sample.log 2>&1
case $protocol in
  faces-*) score=$($R python -m bench.faces score /tmp/imk4/lt/fc/faces $out 2>&1 | tail -1) ;;
  *) score=$($R python -m bench.labelled score /tmp/imk4/lt/lab/set $out --run $D/$name --json $out.json --grid $out-grid.png 2>&1 | tail -1) ;;
esac
echo "$name [$protocol --seed $seed $*] train_s=$((end-start)) sample_score_s=$(( $(date +%s) - end )) | $score" >> $D/scores.txt
