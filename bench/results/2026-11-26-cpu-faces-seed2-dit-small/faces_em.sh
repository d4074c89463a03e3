#!/bin/bash
# usage: faces_em.sh RUN SAMPLER: a faces run's 400 samples with another sampler (25 steps), scored
cd /work/wt-measure
export OMP_NUM_THREADS=1
run=$1 sampler=$2
python sample.py /tmp/fm2/$run --num_images 400 --batch_size 100 --sampler $sampler --num_inference_steps 25 --output /tmp/fm2/$run-$sampler-gen > /tmp/fm2/$run-$sampler.log 2>&1
score=$(python -m bench.faces score /tmp/fm2/faces /tmp/fm2/$run-$sampler-gen 2>&1 | tail -1)
echo "$run+$sampler 25 | $score" >> /tmp/fm2/scores.txt
