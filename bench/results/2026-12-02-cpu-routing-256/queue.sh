#!/bin/bash
# usage: queue.sh: the four runs, two queues, one a core; each seed's pair runs side by side (plain on one core,
# routed on the other), then the cores swap for seed 2.
d=$(dirname $0)
(bash $d/run.sh 0 fp2_none_s1 1; bash $d/run.sh 0 fp2_routed_s2 2 --token_routing 0.5) &
(bash $d/run.sh 1 fp2_routed_s1 1 --token_routing 0.5; bash $d/run.sh 1 fp2_none_s2 2) &
wait
