#!/bin/bash
# usage: queue2.sh CORE: after queue.sh on the same core: the 4x runs of the terms the 2026-11-29 loss-curves record did
# not run at 4x (immiscible on the faces, dispersive on the photos), each not started after the epoch seconds in
# /tmp/lm/deadline_q2_fc or /tmp/lm/deadline_q2_lab.
d=$(dirname $0)
CORE=$1
late() { [ $(date +%s) -gt $(cat /tmp/lm/deadline_q2_$1) ] && { echo "skipped $2 (deadline)" >> /tmp/lm/queue.log; }; }
for s in 1 2; do late fc fc4_immiscible_s$s || bash $d/run.sh $CORE faces-dit-4x fc4_immiscible_s$s $s --loss_terms immiscible; done
for s in 1 2; do late lab lab4_dispersive_s$s || bash $d/run.sh $CORE labelled-small-4x lab4_dispersive_s$s $s --loss_terms dispersive; done
echo "$(date -u +%H:%M:%S) core $CORE queue2 done" >> /tmp/lm/queue.log
