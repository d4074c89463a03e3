#!/bin/bash
# usage: queue_lab2.sh CORE A|B PID: what queue_lab.sh's queue A or B runs once run PID ends (queue_lab.sh was cut short:
# seed 2's AdamW at the bare budget is the 2026-11-29-cpu-loss-curves record's ld_none_s2, the protocol deterministic:
# seed 1 reproduced it to the digit; and token routing's seed 2 is measured at the bare budget, seed 1 at 4x).
# A: Muon's seed 2 at the bare budget, then --token_routing 0.5 at the bare budget, seeds 1 and 2.
# B: --token_routing 0.5 at 4x, seed 1.
d=$(dirname $0); c=$1
while kill -0 $3 2>/dev/null; do sleep 20; done
if [ $2 = A ]; then
  bash $d/run_lab.sh $c lb1x_muon_s2 2 1 --optimizer muon
  bash $d/run_lab.sh $c lb1x_routed_s1 1 1 --token_routing 0.5
  bash $d/run_lab.sh $c lb1x_routed_s2 2 1 --token_routing 0.5
else
  bash $d/run_lab.sh $c lb_routed_s1 1 4 --token_routing 0.5
fi
