#!/bin/bash
# copy each finished run's kept files into the record folder
D=/work/wt-lt/bench/results/2026-11-28-cpu-loss-terms
cd /tmp/lt/fc
for d in dit_*_s[12]; do
  [ -f $d/run.json ] || continue
  [ -d $d-gen ] || continue
  n=faces_$d
  { /tmp/lt/filt.sh $d.log; echo "---- sample.py ----"; /tmp/lt/filt.sh $d-sample.log; } > $D/$n-stdout.txt
  cp $d/train_config.json $D/$n-train_config.json
  case $d in *_s1) [ -f $d-gen/grid.png ] && cp $d-gen/grid.png $D/$n-samples-grid.png;; esac
done
cd /tmp/lt/lab
for d in lab_*_s[12]; do
  [ -f $d/run.json ] || continue
  [ -f $d-w1.json ] || continue
  n=labelled_${d#lab_}
  { /tmp/lt/filt.sh $d.log; echo "---- sample.py (w = 1) ----"; /tmp/lt/filt.sh $d-w1-sample.log; } > $D/$n-stdout.txt
  cp $d/train_config.json $D/$n-train_config.json
  cp $d-w1.json $D/$n-w1.json
  case $d in *_s1) cp $d-w1-grid.png $D/$n-w1-grid.png;; esac
done
