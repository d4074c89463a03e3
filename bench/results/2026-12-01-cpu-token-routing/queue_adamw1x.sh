#!/bin/bash
# usage: queue_adamw1x.sh: the faces protocol at the bare budget with AdamW (the default), the counterparts of
# queue_muon.sh's runs with the same code (run_muon.sh's worktree): seed 2 on core 0 at once, seed 1 on core 1 once
# fc_routed_s2 is done (queue.sh was stopped there: fc_none_s2's scores are the 2026-11-29 record's, see README.md).
d=$(dirname $0)
BUDGET=1 bash $d/run_muon.sh 0 fc1x_adamw_s2 2 &
while pgrep -f "run.sh 1 fc_routed_s2" > /dev/null; do sleep 10; done
BUDGET=1 bash $d/run_muon.sh 1 fc1x_adamw_s1 1
wait
