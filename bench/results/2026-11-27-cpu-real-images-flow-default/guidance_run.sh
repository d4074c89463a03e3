#!/bin/bash
# usage: run.sh RUN W MODE: 300 samples of /tmp/lab/RUN at guidance W, MODE interval (guidance for flow sigma in
# (0.219, 0.844], EDM2's ImageNet-512 interval) or plain; scored by python -m bench.labelled score
cd /work/wt-lab
export OMP_NUM_THREADS=1
run=$1; w=$2; mode=$3; out=/tmp/ig/$run-$mode-w$w
common="--num_images 300 --batch_size 100 --guidance_scale $w --seed 0 --output $out"
if [ $mode = interval ]; then python /tmp/ig/interval_sample.py 0.219 0.844 /tmp/lab/$run $common > $out.log 2>&1
else python sample.py /tmp/lab/$run $common > $out.log 2>&1; fi
python -m bench.labelled score /tmp/lab/set $out --run /tmp/lab/$run --json $out.json --grid $out-grid.png > $out-score.txt 2>&1
