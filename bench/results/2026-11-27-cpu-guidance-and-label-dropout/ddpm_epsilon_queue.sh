#!/bin/bash
# the preset's DDPM (v-prediction) with epsilon prediction instead, one seed per core (wt-lab at c07021f)
taskset -c 0 bash /tmp/lab/run.sh ddpmeps_s1 1 --objective ddpm --prediction_type epsilon &
taskset -c 1 bash /tmp/lab/run.sh ddpmeps_s2 2 --objective ddpm --prediction_type epsilon &
wait
echo EPSDONE >> /tmp/lab/scores.txt
