#!/bin/bash
# the four dit-small runs, two at a time (run as two chains here: seed 1 and seed 2)
for s in 1 2; do
  bash dit_run.sh dit_ddpm_s$s --seed $s --timestep_sampling lognormal --prediction_type v_prediction
  bash dit_run.sh dit_flow_s$s --seed $s --objective flow
done
