#!/bin/bash
# wait for the w=5,6 sampling lanes, then label_dropout 0.2 (wt-drop) flow runs, one seed per core
while [ "$(grep -c DONE /tmp/ig/q56.done 2>/dev/null)" != 2 ]; do sleep 20; done
taskset -c 0 bash /tmp/lab/run_drop.sh flowdrop20_s1 1 --objective flow &
taskset -c 1 bash /tmp/lab/run_drop.sh flowdrop20_s2 2 --objective flow &
wait
echo DROPDONE >> /tmp/lab/scores.txt
