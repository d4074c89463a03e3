#!/bin/bash
# faces seed 2: DDPM then flow (default sampler now EM), then flow seed 2 with Euler 25
cd /work/wt-measure
export OMP_NUM_THREADS=1
bash /tmp/fm2/faces.sh fddpm_s2 --seed 2
bash /tmp/fm2/faces.sh fflow_s2 --seed 2 --objective flow
python sample.py /tmp/fm2/fflow_s2 --num_images 400 --batch_size 100 --sampler euler --num_inference_steps 25 --output /tmp/fm2/fflow_s2-euler-gen > /tmp/fm2/fflow_s2-euler.log 2>&1
score=$(python -m bench.faces score /tmp/fm2/faces /tmp/fm2/fflow_s2-euler-gen 2>&1 | tail -1)
echo "fflow_s2+euler25 [--seed 2 --objective flow] | $score" >> /tmp/fm2/scores.txt
echo queue5 done >> /tmp/fm2/scores.txt
