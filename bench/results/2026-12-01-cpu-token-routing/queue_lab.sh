#!/bin/bash
# usage: queue_lab.sh CORE A|B: the labelled photos' runs (run_lab.sh), two queues, one a core.
# A: Muon against AdamW at the bare budget, seeds 1 and 2, then token routing's seed-2 pair at 4x.
# B: token routing's seed-1 pair at 4x (the default DiT, then --token_routing 0.5).
d=$(dirname $0); c=$1
if [ $2 = A ]; then
  bash $d/run_lab.sh $c lb1x_adamw_s1 1 1
  bash $d/run_lab.sh $c lb1x_muon_s1 1 1 --optimizer muon
  bash $d/run_lab.sh $c lb1x_adamw_s2 2 1
  bash $d/run_lab.sh $c lb1x_muon_s2 2 1 --optimizer muon
  bash $d/run_lab.sh $c lb_routed_s2 2 4 --token_routing 0.5
else
  bash $d/run_lab.sh $c lb_none_s1 1 4
  bash $d/run_lab.sh $c lb_routed_s1 1 4 --token_routing 0.5
  bash $d/run_lab.sh $c lb_none_s2 2 4
fi
