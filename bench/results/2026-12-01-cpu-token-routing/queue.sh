#!/bin/bash
# usage: queue.sh CORE: the four faces runs, routed and plain alternating (A B A B), seed 1's before seed 2's.
d=$(dirname $0)
bash $d/run.sh $1 fc_routed_s1 1 --token_routing 0.5
bash $d/run.sh $1 fc_none_s1 1
bash $d/run.sh $1 fc_routed_s2 2 --token_routing 0.5
bash $d/run.sh $1 fc_none_s2 2
