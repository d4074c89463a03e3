#!/bin/bash
# copy each finished run's kept files from /tmp/lc into this folder
D=$(cd $(dirname $0) && pwd)
cd /tmp/lc
cp scores.txt $D/scores.txt; [ -f scores1x.txt ] && cp scores1x.txt $D/scores1x.txt
for d in fc_*_s[12] lab_*_s[12] fs_*_s[12] ld_*_s[12]; do
  [ -f $d/run.json ] || continue
  bash $D/filt.sh $d.log > $D/$d-stdout.txt
  cp $d/train_config.json $D/$d-train_config.json
  for j in $d-at*.json $d-gen.json; do [ -f $j ] && cp $j $D/$j; done
done
# the grids of seed 1 at the end of each run: faces samples (grid.png), the labelled photos' class grids
for d in fc_none_s1 fc_deltafm_s1 fc_dispersive_s1 fc_layersync_s1 fs_none_s1 fs_deltafm_s1; do
  g=$(ls -d $d-at2560/grid.png $d-gen/grid.png 2>/dev/null | head -1); [ -n "$g" ] && cp $g $D/$d-samples-grid.png
done
for d in lab_none_s1 lab_deltafm_s1; do [ -f $d-at24576-grid.png ] && cp $d-at24576-grid.png $D/$d-grid.png; done
for d in lab_deltafm-dispersive_s1 ld_none_s1 ld_deltafm_s1; do [ -f $d-gen-grid.png ] && cp $d-gen-grid.png $D/$d-grid.png; done
