#!/bin/bash
# Euler-Maruyama at 10 and 50 steps on the shapes flow models (earlier record) and the faces flow models (this record)
cd /work/wt-measure
export OMP_NUM_THREADS=1
for r in /tmp/fm/flow5_s1 /tmp/fm/flow5_s2; do
  for n in 10 50; do
    score=$(python sample.py $r --fid --num_images 256 --batch_size 64 --sampler euler_maruyama --num_inference_steps $n 2>&1 | grep "shape FD")
    echo "$(basename $r) euler_maruyama $n | $score" >> /tmp/fm2/em_steps.txt
  done
done
for r in fflow_s1 fflow_s2; do
  for n in 10 50; do
    python sample.py /tmp/fm2/$r --num_images 400 --batch_size 100 --sampler euler_maruyama --num_inference_steps $n --output /tmp/fm2/$r-em$n-gen > /dev/null 2>&1
    score=$(python -m bench.faces score /tmp/fm2/faces /tmp/fm2/$r-em$n-gen 2>&1 | tail -1)
    echo "$r euler_maruyama $n | $score" >> /tmp/fm2/em_steps.txt
  done
done
