#!/bin/bash
# usage: queue2.sh CORE: the bare-budget runs, after queue.sh's on the same core; seed 1's before seed 2's.
d=$(dirname $0)
for seed in 1 2; do
  bash $d/run1x.sh $1 labelled-small lab_deltafm-dispersive_s$seed $seed --loss_terms deltafm,dispersive
  bash $d/run1x.sh $1 faces-small fs_none_s$seed $seed
  bash $d/run1x.sh $1 faces-small fs_deltafm_s$seed $seed --loss_terms deltafm
  bash $d/run1x.sh $1 labelled-dit ld_none_s$seed $seed
  bash $d/run1x.sh $1 labelled-dit ld_deltafm_s$seed $seed --loss_terms deltafm
done
