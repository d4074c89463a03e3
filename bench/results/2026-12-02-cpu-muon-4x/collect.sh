#!/bin/bash
# copy the kept files from /tmp/m4 into this folder: the scores, each run's printed lines without progress bars (the
# 2026-12-01-cpu-token-routing record's filt.sh), its resolved flags, and seed 1's last grids (the first 64 of 400)
D=$(cd $(dirname $0) && pwd)
cd /tmp/m4
cp scores.txt $D/
for d in fc4x_*_s[12]; do
  [ -f $d/run.json ] || continue
  bash $D/../2026-12-01-cpu-token-routing/filt.sh $d.log > $D/$d-stdout.txt
  cp $d/train_config.json $D/$d-train_config.json
done
for d in fc4x_adamw_s1 fc4x_muon_s1 fc4x_muon_s2; do cp $d-at2560/grid.png $D/$d-grid.png; done
