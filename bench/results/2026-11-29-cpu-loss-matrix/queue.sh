#!/bin/bash
# usage: queue.sh CORE: takes the next unclaimed run of the list below, in its order (both cores run this list).
# The 4x runs are not started after the epoch seconds in /tmp/lm/deadline_4x.
d=$(dirname $0)
r() { bash $d/run.sh $CORE "$@"; }
CORE=$1
for s in 1 2; do r labelled-dit ld_layersync_s$s $s --loss_terms layersync; done
for s in 1 2; do
  r faces-dit fd_ddpm_s$s $s --objective ddpm
  r faces-dit fd_ddpm-snr5_s$s $s --objective ddpm --snr_gamma 5
  r labelled-small lab_ddpm_s$s $s --objective ddpm
  r labelled-small lab_ddpm-snr5_s$s $s --objective ddpm --snr_gamma 5
done
for t in dispersive immiscible; do for s in 1 2; do r labelled-dit ld_${t}_s$s $s --loss_terms $t; done; done
for t in dispersive immiscible; do for s in 1 2; do r faces-small fs_${t}_s$s $s --loss_terms $t; done; done
for s in 1 2; do for t in none layersync; do
  [ $(date +%s) -gt $(cat /tmp/lm/deadline_4x) ] && { echo "skipped ld4_${t}_s$s (deadline)" >> /tmp/lm/queue.log; continue; }
  f=""; [ $t != none ] && f="--loss_terms $t"
  r labelled-dit-4x ld4_${t}_s$s $s $f
done; done
echo "$(date -u +%H:%M:%S) core $CORE done" >> /tmp/lm/queue.log
