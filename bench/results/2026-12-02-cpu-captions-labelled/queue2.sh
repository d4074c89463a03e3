#!/bin/bash
# usage: queue2.sh: after the dit-small captioned runs, core 0 trains the class-conditional `small` at seed 1 (w = 1 and
# w = 3 with today's code), core 1 `small` from the class names alone as captions (one caption a class), seed 1.
cd /tmp/cap2
while pgrep -f "run.sh 0 dit_s1" > /dev/null; do sleep 20; done
./cc.sh 0 ccsmall_s1 1 6144 &
while pgrep -f "run.sh 1 dit_s2" > /dev/null; do sleep 20; done
TRAIN=/tmp/cap2/names/train PROMPTS=/tmp/cap2/names/prompts.txt ./run.sh 1 names_s1 1 6144
wait
