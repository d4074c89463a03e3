#!/bin/bash
# copy the kept files from /tmp/ms into this folder: the scores (with each labelled checkpoint's JSON), each run's
# printed lines without progress bars (the 2026-12-01-cpu-token-routing record's filt.sh), its resolved flags, and the
# seed-1 labelled runs' last grids (a row a class)
D=$(cd $(dirname $0) && pwd)
cd /tmp/ms
cp scores.txt lab_*-at*.json $D/
for d in lab_*_s[12] fc_*_s[12]; do
  [ -f $d/run.json ] || continue
  bash $D/../2026-12-01-cpu-token-routing/filt.sh $d.log > $D/$d-stdout.txt
  cp $d/train_config.json $D/$d-train_config.json
done
for d in lab_adamw_s1 lab_muon_s1; do [ -f $d-at6144-grid.png ] && cp $d-at6144-grid.png $D/$d-grid.png; done
exit 0
