#!/bin/bash
# one seed per core: issue 46's session-4 experiments (wt-lab at 94db57c)
R="taskset -c 0 bash /tmp/lab/run2.sh"
$R ddpmepsu_s1 1 --objective ddpm --prediction_type epsilon --timestep_sampling uniform
$R ddpmvu_s1 1 --objective ddpm --prediction_type v_prediction --timestep_sampling uniform
$R ditddpm_s1 1 --model dit-small --max_train_steps 1536 --objective ddpm
$R ditflow_s1 1 --model dit-small --max_train_steps 1536
WS="1 2 3 5 6" $R edm2_s1 1 --model edm2small --max_train_steps 1536
WS="5 6" $R ddpm_s1 1
echo Q0DONE >> /tmp/lab/scores2.txt
