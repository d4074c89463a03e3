#!/bin/bash
# copy the kept files from /tmp/ms into this folder: the scores (with each labelled checkpoint's JSON), each run's
# printed lines without progress bars (the 2026-12-01-cpu-token-routing record's filt.sh), its resolved flags, and the
# seed-1 runs' last grids (labelled: a row a class; faces: the first 64 of 400)
D=$(cd $(dirname $0) && pwd)
cd /tmp/ms
# the labelled session's /tmp/ms held the lab_* lines; the faces runs ran in a later session on a fresh machine,
# whose /tmp/ms/scores.txt was appended to this folder's (`cat /tmp/ms/scores.txt >> scores.txt`)
ls lab_*-at*.json > /dev/null 2>&1 && cp scores.txt lab_*-at*.json $D/
for d in lab_*_s[12] fc_*_s[12]; do
  [ -f $d/run.json ] || continue
  bash $D/../2026-12-01-cpu-token-routing/filt.sh $d.log > $D/$d-stdout.txt
  cp $d/train_config.json $D/$d-train_config.json
done
for d in lab_adamw_s1 lab_muon_s1; do [ -f $d-at6144-grid.png ] && cp $d-at6144-grid.png $D/$d-grid.png; done
for d in fc_adamw_s1 fc_muon_s1; do [ -f $d-at2560/grid.png ] && cp $d-at2560/grid.png $D/$d-grid.png; done
exit 0
