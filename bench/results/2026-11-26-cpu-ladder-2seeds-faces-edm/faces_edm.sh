#!/bin/bash
# usage: faces_edm.sh SEED: the EDM objective on the same UNet (small) on the faces, the same 2,560 steps
# of the bare run's settings as the DDPM and flow faces runs, then faces FD of 400 samples (EDM's Heun, 18
# steps, churn 20). /tmp/fm2/faces.sh is ../2026-11-26-cpu-faces-seed2-dit-small/faces.sh; the two seeds
# ran at once, beside the quality ladder's two.
seed=$1
bash /tmp/fm2/faces.sh fedm_s$seed --seed $seed --objective edm
