#!/bin/bash
# usage: queue_adamw.sh: AdamW (the default) at 4x the faces budget, seed 1 on core 0 and seed 2 on core 1, side by
# side as the Muon runs were: the baseline's seconds on this machine and code (the 2026-12-01 record's ran beside
# the test suite, at an earlier commit). Started once the 2026-12-02-cpu-muon-small faces queue had ended.
d=$(dirname $0)
bash $d/run.sh 0 fc4x_adamw_s1 1 &
bash $d/run.sh 1 fc4x_adamw_s2 2 &
wait
