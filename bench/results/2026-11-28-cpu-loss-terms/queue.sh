#!/bin/bash
# the runs, one at a time, in the brief's order: A (faces, both seeds), then B (labelled, seed 1 of all four before seed 2).
# A run is not started after the deadline in /tmp/lt/deadline_fc or /tmp/lt/deadline_lab (epoch seconds: 01:38 and 01:33 UTC,
# the last moments a faces or a labelled run may start; none was reached).
D=/work/wt-lt/bench/results/2026-11-28-cpu-loss-terms
for s in 1 2; do
  for t in none dispersive layersync deltafm immiscible; do
    f=""; [ $t != none ] && f="--loss_terms $t"
    [ $(date +%s) -gt $(cat /tmp/lt/deadline_fc) ] && { echo "skipped fc $t s$s (deadline)" >> /tmp/lt/queue.log; continue; }
    echo "$(date -u +%H:%M:%S) start fc ${t}_s$s" >> /tmp/lt/queue.log
    bash $D/faces_dit_run.sh dit_${t}_s$s $s $f
  done
done
for s in 1 2; do
  for t in none dispersive deltafm immiscible; do
    f=""; [ $t != none ] && f="--loss_terms $t"
    [ $(date +%s) -gt $(cat /tmp/lt/deadline_lab) ] && { echo "skipped lab $t s$s (deadline)" >> /tmp/lt/queue.log; continue; }
    echo "$(date -u +%H:%M:%S) start lab ${t}_s$s" >> /tmp/lt/queue.log
    bash $D/labelled_run.sh lab_${t}_s$s $s $f
  done
done
echo "$(date -u +%H:%M:%S) queue done" >> /tmp/lt/queue.log
