#!/bin/bash
# copies each finished run's printed lines (progress bars left out), resolved flags and sample log into the record
d=$(dirname "$0")
for log in /tmp/gray/*_s[12].log; do
  name=$(basename $log .log)
  [ -e /tmp/gray/$name-gen/grid.png ] || continue
  tr '\r' '\n' < $log | grep -v -E '^\s*$|it/s|s/it' > $d/$name-stdout.txt
  tr '\r' '\n' < /tmp/gray/$name-sample.log | grep -v -E '^\s*$|it/s|s/it' > $d/$name-sample-stdout.txt
  cp /tmp/gray/$name/train_config.json $d/$name-train_config.json
done
cp /tmp/gray/scores.txt $d/scores.txt
cp /tmp/gray/dryrun.txt $d/dryrun.txt
