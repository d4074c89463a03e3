#!/bin/bash
# phase 2, one seed per core, after q46_0.sh: DiT's own initialization (wt-init at 5cc2d75, branch init-exp) and the UNet's
# class embedding at N(0, 0.02^2)
until grep -q Q0DONE /tmp/lab/scores2.txt 2>/dev/null; do sleep 20; done
export TREE=/work/wt-init
taskset -c 0 bash /tmp/lab/run3.sh ditinit_s1 1 --model dit-small --max_train_steps 1536
taskset -c 0 bash /tmp/fc/run3.sh dit_flowinit_s1 1
EXP_CLASS_EMBED_STD=0.02 taskset -c 0 bash /tmp/lab/run3.sh embinit_s1 1
echo Q0BDONE >> /tmp/lab/scores2.txt
