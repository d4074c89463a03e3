#!/bin/bash
# usage: queue_muon.sh CORE: the faces protocol at the bare budget (640 steps) with --optimizer muon, seeds 1 and 2,
# on the core the test suite shared (NICE=0: an equal share); scored at 320 and 640 steps.
d=$(dirname $0)
BUDGET=1 NICE=0 bash $d/run_muon.sh $1 fc1x_muon_s1 1 --optimizer muon
BUDGET=1 NICE=0 bash $d/run_muon.sh $1 fc1x_muon_s2 2 --optimizer muon
