#!/bin/bash
# usage: n1000.sh RUN...: 1,000 samples of each /tmp/lab/RUN at w = 3 (sample.py seed 0), scored by bench.labelled
cd /work/wt-lab
export OMP_NUM_THREADS=1
for run in "$@"; do
  out=/tmp/ig/$run-w3-n1000
  python sample.py /tmp/lab/$run --num_images 1000 --batch_size 100 --guidance_scale 3 --seed 0 --output $out > $out.log 2>&1
  python -m bench.labelled score /tmp/lab/set $out --run /tmp/lab/$run --json $out.json --grid $out-grid.png > $out-score.txt 2>&1
done
echo "LANE $* DONE" >> /tmp/ig/n1000.done
