#!/bin/bash
# copy the kept files from /tmp/r2 into this folder: the scores, each run's printed lines without progress bars (the
# 2026-12-01-cpu-token-routing record's filt.sh), its resolved flags, and seed 1's last samples (the first 64 of 400)
D=$(cd $(dirname $0) && pwd)
cd /tmp/r2
cp scores.txt $D/scores.txt
for d in fp2_*_s[12]; do
  [ -f $d/run.json ] || continue
  bash $D/../2026-12-01-cpu-token-routing/filt.sh $d.log > $D/$d-stdout.txt
  cp $d/train_config.json $D/$d-train_config.json
done
for d in fp2_none_s1 fp2_routed_s1; do cp $d-at640/grid.png $D/$d-samples-grid.png; done
