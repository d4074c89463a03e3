#!/usr/bin/env bash
# A (bench/checkpoint_copy.py wait: the steps wait while accelerate's save_state writes the files, train.py's
# default) and B (bench/checkpoint_copy.py copy: the state copied into host memory, the files written from it by
# the checkpoint's thread beside training), twice each, A B A B, from the same commit.
# THREADS=1: torch on one thread, the other core free for the checkpoint's thread (as a GPU's host has cores to spare);
# LOGS: the folder for the logs (default /tmp/ckh)
set -u
logs=${LOGS:-/tmp/ckh}; mkdir -p $logs
[ -n "${THREADS:-}" ] && export OMP_NUM_THREADS=$THREADS
ARGS="--model ref128 --image_size 128 --train_batch_size 2 --max_train_steps 8 --checkpointing_steps 2 --compile_mode off --mixed_precision no --save_images_epochs 100 --shapes_num_images 16 --num_inference_steps 2 --eval_batch_size 1 --dataloader_num_workers 0"
for i in 1 2; do
  for v in A B; do
    script="/work/main/bench/checkpoint_copy.py copy"; [ $v = A ] && script="/work/main/bench/checkpoint_copy.py wait"
    out=/work/ckh-$v-$i; rm -rf $out
    /usr/bin/time -f "%e s wall" python $script $ARGS --output_dir $out > $logs/$v-$i.log 2>&1
    python - $out $v $i <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/run.json"))
b = d["time_breakdown_s"]
steps = sum(b[k] for k in ('data', 'forward', 'backward', 'optimizer', 'ema'))
times = [(t["step"], round(t["waited"], 2), round(t["beside"], 2)) for t in d["checkpoint_times_s"]]
print(sys.argv[2], sys.argv[3], f"train {d['train_wall_s']:.1f} s, checkpointing {b['checkpointing']:.1f} s, steps {steps:.1f} s "
      f"(forward {b['forward']:.1f}, backward {b['backward']:.1f}), median step {d['median_step_time_s']:.2f} s, "
      f"final loss {d.get('final_loss')}; checkpoints (step, waited s, beside s): {times}")
PY
    rm -rf $out
  done
done
