#!/bin/bash
# after queue.sh: (1) the two faces runs that were scored before faces_dit_run.sh moved copies.png out of the samples
# folder (their score counted it as a 401st image) are scored again on their 400 samples; (2) set C: the two faces
# terms with the lowest mean FD over the two seeds (deltafm 15.70, layersync 16.68; dispersive 18.19, immiscible 30.90)
# together, two seeds, unless past the deadline.
D=/work/wt-lt/bench/results/2026-11-28-cpu-loss-terms
while kill -0 $(cat /tmp/lt/queue.pid) 2>/dev/null; do sleep 10; done
cd /work/wt-lt
for name in dit_none_s1 dit_dispersive_s1; do
  [ -f /tmp/lt/fc/$name-gen/copies.png ] && mv /tmp/lt/fc/$name-gen/copies.png /tmp/lt/fc/$name-copies.png
  score=$(OMP_NUM_THREADS=1 nice -n 5 taskset -c 1 python -m bench.faces score /tmp/lt/fc/faces /tmp/lt/fc/$name-gen 2>&1 | tail -1)
  echo "$name rescored without copies.png | $score" >> /tmp/lt/fc/scores.txt
done
for s in 1 2; do
  [ $(date +%s) -gt $(cat /tmp/lt/deadline_fc) ] && { echo "skipped fc deltafm-layersync s$s (deadline)" >> /tmp/lt/queue.log; continue; }
  echo "$(date -u +%H:%M:%S) start fc deltafm-layersync_s$s" >> /tmp/lt/queue.log
  bash $D/faces_dit_run.sh dit_deltafm-layersync_s$s $s --loss_terms deltafm,layersync
done
echo "$(date -u +%H:%M:%S) queue_c done" >> /tmp/lt/queue.log
