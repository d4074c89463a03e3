#!/bin/bash
# phase 3, after q46b_0.sh: the UNet's residual branches and output conv started at zero (Ho et al., ADM); wt-zero at be149ca
until grep -q Q0BDONE /tmp/lab/scores2.txt 2>/dev/null; do sleep 20; done
EXP_UNET_ZERO=1 TREE=/work/wt-zero taskset -c 0 bash /tmp/lab/run3.sh unetzero_s1 1
echo Q0CDONE >> /tmp/lab/scores2.txt
