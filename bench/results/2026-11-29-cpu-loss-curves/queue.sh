#!/bin/bash
# usage: queue.sh CORE: takes the next unclaimed run of the list, in order (seed 1's four runs before seed 2's).
d=$(dirname $0)
bash $d/run.sh $1 labelled lab_none_s1 1
bash $d/run.sh $1 faces fc_none_s1 1
bash $d/run.sh $1 labelled lab_deltafm_s1 1 --loss_terms deltafm
bash $d/run.sh $1 faces fc_deltafm_s1 1 --loss_terms deltafm
bash $d/run.sh $1 labelled lab_none_s2 2
bash $d/run.sh $1 faces fc_none_s2 2
bash $d/run.sh $1 labelled lab_deltafm_s2 2 --loss_terms deltafm
bash $d/run.sh $1 faces fc_deltafm_s2 2 --loss_terms deltafm
