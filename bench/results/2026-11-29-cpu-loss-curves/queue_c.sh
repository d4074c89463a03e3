#!/bin/bash
# C: dispersive and layersync at 4x on the faces (dit-small), scored at the end alone; one run per core, seed 1 first.
d=$(dirname $0)
export POINTS=8
(bash $d/run.sh 0 faces fc_dispersive_s1 1 --loss_terms dispersive; bash $d/run.sh 0 faces fc_dispersive_s2 2 --loss_terms dispersive) &
(bash $d/run.sh 1 faces fc_layersync_s1 1 --loss_terms layersync; bash $d/run.sh 1 faces fc_layersync_s2 2 --loss_terms layersync) &
wait
