#!/bin/bash
# usage: run.sh CORE SEED: one captioned run of the labelled protocol (the 2026-11-28 record's labelled_run.sh with
# `small`: 6,144 steps at its defaults, 32px) from captions instead of class labels (`python -m bench.labelled captions`:
# each crop's class name in 4 templates; a random 2-layer CLIP, DIR/clip), then 300 samples at w = 1 and at w = 3 from
# the prompts "a photo of a NAME" (image i asks for class i mod 10), sorted into a folder a class and scored.
cd /work/main
export OMP_NUM_THREADS=1
core=$1; seed=$2
R="taskset -c $core"
D=/tmp/capl; S=$D/set; name=cap_s$seed
start=$(date +%s)
$R python train.py --dataset $S/train --text_encoder $S/clip --image_size 32 --max_train_steps 6144 --seed $seed \
  --output_dir $D/$name --overwrite_output_dir --save_images_epochs 1000 --logging_steps 1000 > $D/$name.log 2>&1
echo "$name train_s=$(( $(date +%s) - start ))" >> $D/scores.txt
python -c "import sys; sys.path.insert(0, '.'); from bench import labelled; print('\n'.join(f'a photo of a {n}' for n in sorted(labelled.PHOTOS)))" > $D/prompts.txt
for w in 1 3; do
  out=$D/$name-w$w
  $R python sample.py $D/$name --prompt_file $D/prompts.txt --num_images 300 --batch_size 100 --seed 0 --no-copies \
    --guidance_scale $w --output $out-flat > $out-sample.log 2>&1
  python -c "
import shutil, sys; sys.path.insert(0, '.'); from pathlib import Path; from bench import labelled
names = sorted(labelled.PHOTOS)
for i in range(300):
    (Path('$out') / names[i % 10]).mkdir(parents=True, exist_ok=True)
    shutil.copy(Path('$out-flat') / f'{i:06d}.png', Path('$out') / names[i % 10] / f'{i:06d}.png')
"
  score=$($R python -m bench.labelled score $S $out --json $out.json --grid $out-grid.png 2>&1 | head -1)
  echo "$name w=$w | $score" >> $D/scores.txt
done
