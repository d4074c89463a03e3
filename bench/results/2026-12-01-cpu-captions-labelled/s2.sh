cd /work/main
export OMP_NUM_THREADS=1
D=/tmp/capl; S=$D/set; name=cap_s2
for w in 1 3; do
  out=$D/$name-w$w; rm -rf $out $out-flat
  taskset -c 1 python sample.py $D/$name --prompt_file $D/prompts.txt --num_images 300 --batch_size 100 --seed 0 --no-copies --guidance_scale $w --output $out-flat > $out-sample.log 2>&1
  python -c "
import shutil, sys; sys.path.insert(0, '.'); from pathlib import Path; from bench import labelled
names = sorted(labelled.PHOTOS)
for i in range(300):
    (Path('$out') / names[i % 10]).mkdir(parents=True, exist_ok=True)
    shutil.copy(Path('$out-flat') / f'{i:06d}.png', Path('$out') / names[i % 10] / f'{i:06d}.png')
"
  score=$(taskset -c 1 python -m bench.labelled score $S $out --json $out.json --grid $out-grid.png 2>&1 | head -1)
  echo "$name w=$w | $score" >> $D/scores.txt
done
