#!/usr/bin/env bash
# A (before, 8804e82: the flush inside the save) and B (6e77092: beside training), twice each, ABAB
set -u
ARGS="--model ref128 --image_size 128 --train_batch_size 2 --max_train_steps 8 --checkpointing_steps 2 --compile_mode off --mixed_precision no --save_images_epochs 100 --shapes_num_images 16 --num_inference_steps 2 --eval_batch_size 1 --dataloader_num_workers 0"
for i in 1 2; do
  for v in A B; do
    src=/work/main; [ $v = A ] && src=/tmp/wt-old
    out=/work/ckb-$v-$i; rm -rf $out
    /usr/bin/time -f "%e s wall" python $src/train.py $ARGS --output_dir $out > /tmp/ckb/$v-$i.log 2>&1
    python - $out $v $i <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/run.json"))
b = d["time_breakdown_s"]
print(sys.argv[2], sys.argv[3], f"train {d['train_wall_s']:.1f} s, checkpointing {b['checkpointing']:.1f} s, steps {sum(b[k] for k in ('data','forward','backward','optimizer','ema')):.1f} s", d.get("checkpoint_times_s", ""))
PY
    rm -rf $out
  done
done
