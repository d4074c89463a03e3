#!/bin/bash
# usage: queue.sh: the 8 runs, one at a time on core 1 (core 0 was another engineer's), in the brief's order of
# priority: the faces (both families, both seeds), then the photos with `small`, then the photos with `dit-small`.
d=$(dirname $(readlink -f $0))
r() { bash $d/run.sh 1 "$@"; }
for s in 1 2; do r faces-dit fd_immiscible4_s$s $s --loss_terms immiscible:4; done
for s in 1 2; do r faces-small fs_immiscible4_s$s $s --loss_terms immiscible:4; done
for s in 1 2; do r labelled-small lab_immiscible4_s$s $s --loss_terms immiscible:4; done
for s in 1 2; do r labelled-dit ld_immiscible4_s$s $s --loss_terms immiscible:4; done
echo "$(date -u +%H:%M:%S) done" >> /tmp/imk4/lm/queue.log
