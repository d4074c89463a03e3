#!/bin/bash
# Part B's step 0: the pretrained run (part A's a-n2000-sSEED, 800 steps on the labelled crops) sampled as it is
# and scored against the faces. bash run_b_step0.sh SEED
SEED=$1; OUT=/tmp/sd/runs; LOGS=$(dirname "$0")/logs; export OMP_NUM_THREADS=1
GEN=$OUT/gen-b-fine-s$SEED-0
nice -n 10 python sample.py $OUT/a-n2000-s$SEED --num_images 200 --device cpu --no-copies --output $GEN 2>&1 \
  | tr '\r' '\n' | grep -v '%|' > $LOGS/sample-b-fine-s$SEED-0.txt
echo "fine s$SEED step 0: $(python -m bench.faces score /tmp/sd/faces $GEN 2>&1 | tail -1)" >> $LOGS/faces-fd-s$SEED.txt
