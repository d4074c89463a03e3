#!/bin/bash
# after ditx's w=3 scoring: core 0 the captioned DiT (dit.py's, cross-attention not zeroed) from the class names alone,
# seed 1; core 1 the same DiT with PixArt-α's zeroed cross-attention output, from the templates, seed 1
cd /tmp/cap2
while pgrep -f "runm.sh . ditx_s" > /dev/null; do sleep 10; done
TRAIN=/tmp/cap2/names/train PROMPTS=/tmp/cap2/names/prompts.txt ./runm.sh 0 ditnames_s1 1 1536 --model dit-small &
./runz.sh 1 ditz_s1 1 1536 --model dit-small &
wait
