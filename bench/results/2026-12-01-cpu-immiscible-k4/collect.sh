#!/bin/bash
# copy each finished run's kept files from /tmp/lm into this folder
D=$(cd $(dirname $0) && pwd)
cd /tmp/imk4/lm
cp scores.txt queue.log $D/
for d in *_s[12]; do
  [ -f $d/run.json ] || continue
  bash $D/filt.sh $d.log > $D/$d-stdout.txt
  cp $d/train_config.json $D/$d-train_config.json
  [ -f $d-gen.json ] && cp $d-gen.json $D/$d-gen.json
done
# seed 1's grids: faces samples (grid.png), the labelled photos' class grids
for d in *_s1; do
  [ -f $d/run.json ] || continue
  case $d in f*) [ -f $d-gen/grid.png ] && cp $d-gen/grid.png $D/$d-samples-grid.png ;;
             *) [ -f $d-gen-grid.png ] && cp $d-gen-grid.png $D/$d-grid.png ;; esac
done
