#!/bin/bash
# The bare run's quality, and the conditional and autoguided runs, on a 2-core CPU (BENCHMARKS.md).
# Each run's stdout, run.json, eval and grid land in bench/results/cpu-quality-DATE/.
#   bash bench/quality_cpu.sh bare        # the bare `python train.py`, scored on 256 samples
#   bash bench/quality_cpu.sh guide       # a guide for autoguidance: the bare run for a quarter of its epochs
#   bash bench/quality_cpu.sh autoguide   # the bare run guided by it, w = 1, 1.5, 2, 3
#   bash bench/quality_cpu.sh conditional # the bare run with --class_conditional, w = 1, 2, 3, 4
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/$(date -u +%F)-cpu-quality
work=${WORK:-/tmp/cpu-quality}
mkdir -p "$out" "$work"
keep() {  # NAME RUN_DIR: the run's printed lines, run.json and last grid beside the results
    cp "$work/$1-stdout.txt" "$out/$1-stdout.txt"
    cp "$2/run.json" "$out/$1-run.json"
    cp "$(ls "$2"/samples/*.png | tail -1)" "$out/$1-grid.png"
}
score() {  # NAME RUN_DIR FLAGS...: sample.py --fid on 256 samples, its lines and JSON kept
    local name=$1 run=$2; shift 2
    python sample.py "$run" --fid --num_images 256 --batch_size 64 --output "$work/$name-samples" "$@" 2>&1 \
        | grep -v "generated" | tee "$out/$name-fid.txt"
    cp "$work/$name-samples/fid.json" "$out/$name-fid.json"
}
case "$1" in
  bare)
    /usr/bin/time -v python train.py --output_dir "$work/bare" --overwrite_output_dir > "$work/bare-stdout.txt" 2>&1
    keep bare "$work/bare"; score bare "$work/bare" ;;
  guide)
    /usr/bin/time -v python train.py --output_dir "$work/guide" --overwrite_output_dir --num_epochs 2 > "$work/guide-stdout.txt" 2>&1
    keep guide "$work/guide"; score guide "$work/guide" ;;
  autoguide)
    score autoguide "$work/bare" --guide "$work/guide" --guidance_scale 1,1.5,2,3 ;;
  conditional)
    /usr/bin/time -v python train.py --output_dir "$work/conditional" --overwrite_output_dir --class_conditional \
        --guidance_scale 2 > "$work/conditional-stdout.txt" 2>&1
    keep conditional "$work/conditional"; score conditional "$work/conditional" --guidance_scale 1,2,3,4 ;;
  *) echo "usage: bash bench/quality_cpu.sh bare|guide|autoguide|conditional" >&2; exit 2 ;;
esac
