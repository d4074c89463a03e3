#!/bin/bash
# copy each finished run's kept files from /tmp/rl into this folder: the score lines and each scored checkpoint's
# scores (JSON), printed lines without progress bars (../2026-12-01-cpu-token-routing/filt.sh), resolved flags, and
# each run's last grid (8 samples a class, one row a class)
D=$(cd $(dirname $0) && pwd)
cd /tmp/rl
cp scores.txt $D/scores.txt
cp lb*-at*.json $D/
for d in lb_*_s[12] lb1x_*_s[12]; do
  [ -f $d/run.json ] || continue
  bash $D/../2026-12-01-cpu-token-routing/filt.sh $d.log > $D/$d-stdout.txt
  cp $d/train_config.json $D/$d-train_config.json
done
for d in lb1x_*_s[12]; do [ -f $d-at1536-grid.png ] && cp $d-at1536-grid.png $D/$d-grid.png; done
[ -f lb_none_s1-at6144-grid.png ] && cp lb_none_s1-at6144-grid.png $D/lb_none_s1-grid.png
exit 0
