#!/bin/bash
# usage: queue.sh: Muon at 4x the faces budget, seed 1 on core 0 and seed 2 on core 1, side by side, nothing else running.
d=$(dirname $0)
bash $d/run.sh 0 fc4x_muon_s1 1 --optimizer muon &
bash $d/run.sh 1 fc4x_muon_s2 2 --optimizer muon &
wait
