#!/bin/bash
for w in dit-s2 dit-b2; do for v in eager compiled regional; do /tmp/cc/run.sh $w $v 8 5; done; done
for v in eager compiled regional; do /tmp/cc/run.sh small $v 32 5; done
for v in eager compiled regional; do /tmp/cc/run.sh ref128 $v 2 2; done
echo ALLDONE >> /tmp/cc/summary.txt
