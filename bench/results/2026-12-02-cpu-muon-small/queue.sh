#!/bin/bash
# usage: queue.sh: the labelled runs in two queues, one a core, each seed's AdamW and Muon runs side by side (the cores
# swapped for seed 2). Started once the 2026-12-02-cpu-routing-256 runs had ended. The faces runs that followed them
# (`run.sh CORE faces fc_adamw_sN N` and `fc_muon_sN N --optimizer muon`) were stopped before they started: they would
# have ended past the session.
d=$(dirname $0)
(bash $d/run.sh 0 labelled lab_adamw_s1 1; bash $d/run.sh 0 labelled lab_muon_s2 2 --optimizer muon) &
(bash $d/run.sh 1 labelled lab_muon_s1 1 --optimizer muon; bash $d/run.sh 1 labelled lab_adamw_s2 2) &
wait
