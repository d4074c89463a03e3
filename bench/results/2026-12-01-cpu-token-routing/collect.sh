#!/bin/bash
# copy each finished run's kept files from /tmp/rt into this folder: printed lines without progress bars, resolved
# flags, run.json, and seed 1's last grid (the first 64 of 400 samples)
D=$(cd $(dirname $0) && pwd)
cd /tmp/rt
cp scores.txt $D/scores.txt
for d in fc_*_s[12] fc1x_*_s[12]; do
  [ -f $d/run.json ] || continue
  bash $D/filt.sh $d.log > $D/$d-stdout.txt
  cp $d/train_config.json $D/$d-train_config.json
done
for d in fc_routed_s1 fc_none_s1; do [ -f $d-at2560/grid.png ] && cp $d-at2560/grid.png $D/$d-samples-grid.png; done
for d in fc1x_muon_s1 fc1x_adamw_s1; do [ -f $d-at640/grid.png ] && cp $d-at640/grid.png $D/$d-samples-grid.png; done
exit 0
