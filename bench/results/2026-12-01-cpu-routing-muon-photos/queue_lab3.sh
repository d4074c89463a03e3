#!/bin/bash
# usage: queue_lab3.sh CORE NAME SEED PID: once run PID ends, --token_routing 0.5 at the bare budget, seed SEED, as NAME.
# (queue_lab2.sh cut short: the 4x routed run would have ended past the session; both seeds at the bare budget instead,
# one a core, while seed 1's default 4x run is the record's curve of the default at 4x.)
d=$(dirname $0)
while kill -0 $4 2>/dev/null; do sleep 20; done
bash $d/run_lab.sh $1 $2 $3 1 --token_routing 0.5
