#!/bin/bash
# after queue_c.sh: the photos FD's sampling error at 300 images. The seed-1 default and deltafm runs sampled again
# at w = 1 with sample.py --seed 1 and --seed 2 (the runs above: --seed 0), scored the same way. One process at a time.
cd /work/wt-lt
export OMP_NUM_THREADS=1
R="nice -n 5 taskset -c 1"
while kill -0 $(cat /tmp/lt/queue_c.pid) 2>/dev/null; do sleep 5; done
for name in lab_none_s1 lab_deltafm_s1; do
  for ss in 1 2; do
    o=/tmp/lt/lab/$name-w1-seed$ss
    $R python sample.py /tmp/lt/lab/$name --num_images 300 --batch_size 100 --guidance_scale 1 --seed $ss --no-copies --output $o > $o-sample.log 2>&1
    $R python -m bench.labelled score /tmp/lt/lab/set $o --run /tmp/lt/lab/$name --json $o.json > /dev/null 2>&1
    echo "$name sample.py --seed $ss w=1 | $(python -c "import json; d=json.load(open('$o.json')); print('match %.1f%% (se %.1f) | photos FD %.2f' % (100*d['match'], 100*d['se'], d['fd']))")" >> /tmp/lt/lab/noise.txt
  done
done
echo done >> /tmp/lt/lab/noise.txt
