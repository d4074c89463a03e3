cd /work/main
export OMP_NUM_THREADS=1
for r in /tmp/fm/flow5_s1 /tmp/fm/flow5_s2 /tmp/fm2/flow03_s1; do
  for s in "euler_maruyama 25" "euler 50"; do
    set -- $s
    score=$(python sample.py $r --fid --num_images 256 --batch_size 64 --sampler $1 --num_inference_steps $2 2>&1 | grep "shape FD")
    echo "$(basename $r) $1 $2 | $score" >> /tmp/fm2/em_scores.txt
  done
done
