#!/bin/bash
# usage: run.sh CORE NAME SEED STEPS [train flags]: one captioned run of the labelled protocol from captions (each crop's
# class name in 4 templates, `python -m bench.labelled captions`; a random 2-layer CLIP of 77 positions, DIR/clip), then
# 300 samples at w = 1 and w = 3 from "a photo of a NAME" (image i asks for class i mod 10; prompts.txt written before
# any run starts; TRAIN=FOLDER trains on another captioning of the same crops, PROMPTS=FILE asks its own prompts), sorted into a folder a class and scored by `python -m bench.labelled score`.
cd /work/wt-m
export OMP_NUM_THREADS=1
core=$1; name=$2; seed=$3; steps=$4; shift 4
R="taskset -c $core"
D=/tmp/cap2; S=$D/set
start=$(date +%s)
$R python train.py --dataset ${TRAIN:-$S/train} --text_encoder $S/clip --image_size 32 --max_train_steps $steps --seed $seed \
  --output_dir $D/$name --overwrite_output_dir --save_images_epochs 1000 --logging_steps 1000 "$@" > $D/$name.log 2>&1
echo "$name train_s=$(( $(date +%s) - start ))" >> $D/scores.txt
for w in 1 3; do
  out=$D/$name-w$w; rm -rf $out $out-flat
  $R python sample.py $D/$name --prompt_file ${PROMPTS:-$D/prompts.txt} --num_images 300 --batch_size 100 --seed 0 --no-copies \
    --guidance_scale $w --output $out-flat > $out-sample.log 2>&1
  python -c "
import shutil, sys; sys.path.insert(0, '.'); from pathlib import Path; from bench import labelled
names = sorted(labelled.PHOTOS)
for i in range(300):
    (Path('$out') / names[i % 10]).mkdir(parents=True, exist_ok=True)
    shutil.copy(Path('$out-flat') / f'{i:06d}.png', Path('$out') / names[i % 10] / f'{i:06d}.png')
"
  $R python -m bench.labelled score $S $out --json $out.json --grid $out-grid.png > $out-score.txt 2>&1; score=$(head -1 $out-score.txt)
  echo "$name w=$w | $score" >> $D/scores.txt
done
