#!/bin/bash
# lane A: seed 1, lane B: seed 2
s=$1
for w in 5 6; do for m in plain interval; do bash /tmp/ig/run.sh flow_s$s $w $m; done; done
echo LANE$s DONE >> /tmp/ig/q56.done
