#!/bin/bash
# phase 4, after q46c_0.sh: dit-small's DDPM with v-prediction (the class-conditional fallback since 087127a), wt-lab at 94db57c
until grep -q Q0BDONE /tmp/lab/scores2.txt 2>/dev/null; do sleep 20; done
taskset -c 0 bash /tmp/lab/run2.sh ditddpmv_s1 1 --model dit-small --max_train_steps 1536 --objective ddpm --prediction_type v_prediction
echo Q0DDONE >> /tmp/lab/scores2.txt
