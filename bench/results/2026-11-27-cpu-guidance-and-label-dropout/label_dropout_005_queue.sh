#!/bin/bash
# after the embedding runs: label_dropout 0.05 (wt-drop05, at c07021f as the 0.1 and 0.2 runs), flow, one seed per core
while ! grep -q EMBEDDONE /tmp/lab/scores.txt 2>/dev/null; do sleep 20; done
taskset -c 0 bash /tmp/lab/run_drop05.sh flowdrop05_s1 1 --objective flow &
taskset -c 1 bash /tmp/lab/run_drop05.sh flowdrop05_s2 2 --objective flow &
wait
echo DROP05DONE >> /tmp/lab/scores.txt
