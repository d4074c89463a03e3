#!/bin/bash
# item 3 of issue 46: DDPM trained at flow's noise levels (ln sigma ~ N(0, 1) instead of the preset's N(-1.2, 1.2))
core=$1; seed=$2; pid=$3
while kill -0 $pid 2>/dev/null; do sleep 10; done
taskset -c $core /tmp/lab/run.sh ddpmflowt_s$seed $seed --P_mean_std=0,1
