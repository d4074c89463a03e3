#!/bin/bash
# usage: queue_faces.sh: run.sh's faces protocol (`small`, 2,560 steps of 4 on the 200 LFW crops, scored at 640, 1,280,
# 1,920 and 2,560 steps), AdamW and Muon at seeds 1 and 2, one queue a core, at d7268a3 (/work/wt-suite). Started
# after the 2026-12-02-cpu-muon-4x runs ended; core 0 first checked that AdamW's bare-budget dit-small faces run still
# gives the 2026-12-01 record's numbers (that record's run_muon.sh, BUDGET=1, in /work/wt-muon at d7268a3; see the
# 2026-12-02-cpu-muon-4x record).
d=$(dirname $0)
(BUDGET=1 bash $d/../2026-12-01-cpu-token-routing/run_muon.sh 0 fc1x_adamw_s1 1
 bash $d/run.sh 0 faces fc_adamw_s1 1; bash $d/run.sh 0 faces fc_muon_s2 2 --optimizer muon) &
(bash $d/run.sh 1 faces fc_muon_s1 1 --optimizer muon; bash $d/run.sh 1 faces fc_adamw_s2 2) &
wait
