#!/bin/bash
/tmp/lab/run.sh ddpm_s1 1
/tmp/lab/run.sh flow_s1 1 --objective flow
/tmp/lab/run.sh ddpm_s2 2
/tmp/lab/run.sh flow_s2 2 --objective flow
echo ALLDONE >> /tmp/lab/scores.txt
