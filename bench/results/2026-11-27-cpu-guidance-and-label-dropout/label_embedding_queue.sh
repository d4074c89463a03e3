#!/bin/bash
# after CI: the class embedding at 10x the learning rate (wt-drop), flow, one seed per core
while ! grep -q "^RC" /tmp/ci.log 2>/dev/null; do sleep 20; done
taskset -c 0 bash /tmp/lab/run_embed.sh flowembed10_s1 1 --objective flow &
taskset -c 1 bash /tmp/lab/run_embed.sh flowembed10_s2 2 --objective flow &
wait
echo EMBEDDONE >> /tmp/lab/scores.txt
