#!/usr/bin/env bash
# The GPU evidence, what users need first measured first; each part fits one call of the device tool
# (its budgets sum under 540 s, the tool's limit being 600):
#
#   bash ../shared/device/fetch-wheels.sh          # here first: puts the diffusers wheel in .whl/
#   run(command="bash bench/run_gpu.sh", carry=[".whl"], kind="nvidia-h100-x1")   # sections 1-3
#   run(command="bash bench/run_gpu.sh new_rows", carry=[".whl"])      # force_layout, fused_norm in full
#   run(command="bash bench/run_gpu.sh startup", carry=[".whl"])       # section 4
#   run(command="bash bench/run_gpu.sh sweep", carry=[".whl"])         # section 5
#   run(command="bash bench/run_gpu.sh train_sweeps", carry=[".whl"])  # whole train.py runs (sweep.py)
#
#   1. train.py's default step: ref128 with diffusers' example step beside it, and adm64 with
#      the two CUDA-graph rows (auto picks CUDA graphs there)             170 s + 190 s
#   2. the other compiled ref128 rows, force_layout and fused_norm last   110 s
#   3. the eager rows of both workloads (no compile: quick)               50 s    (1-3: 520 s)
#   4. (startup) train.py's start, cold then warm: two 30-step ref128 runs sharing a fresh
#      Inductor cache, each in a fresh --output_dir, so that the second is served by Inductor's
#      on-disk cache alone, not by compile_cache.bin; their "compiled the step in" lines
#                                                                         300 s + 120 s
#   5. (sweep) the batch sweeps: each new batch size compiles anew        280 s + 200 s
#
# A cold compile took 114-127 s for ref128 and 91-127 s for adm64 on an H100 (BENCHMARKS.md),
# so section 2 measures the rows that reuse ref128's graph (compile, no_syncs) and is cut
# before force_layout and fused_norm, which compile afresh (~2 min each): `new_rows` measures
# them beside no_syncs. A compile that runs long costs the sections after it, never the results
# before it: each section runs under `timeout` within an overall deadline (DEADLINE_S, 540 by
# default), bench.py rewrites its .json after every row, and a section with under 30 s left
# is skipped (printed as such). Each section prints its budget when it starts and again with
# its exit status.
#
# Rows that share a compiled graph reuse it: every bench.py section shares one Inductor cache
# (TORCHINDUCTOR_CACHE_DIR), so section 2's compile and no_syncs rows load the graph section 1
# compiled for ref128's train_default (the same settings, compile mode 'default'), and adm64's
# cuda_graphs row the one of its train_default (auto picks reduce-overhead: the same settings).
#
# Everything lands in $OUT (bench/results/gpu without one): per bench.py run a .json, a .txt and
# a .png (where matplotlib is installed; else `python bench.py --redraw FILE.json`), plus
# nvidia-smi.txt, versions.txt, train-cold.log, train-warm.log and run_gpu.log.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
exec > >(tee "$OUT/run_gpu.log") 2>&1

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, diffusers, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version()); print('diffusers', diffusers.__version__); print(torch.cuda.get_device_name())" | tee "$OUT/versions.txt"

# One Inductor cache for every bench.py section: later rows and sweeps reuse earlier kernels.
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
deadline_s=${DEADLINE_S:-540}

run_within() {  # run_within BUDGET_S NAME LOG command...: under the budget left, output to LOG (- : this log)
  local budget=$1 name=$2 log=$3; shift 3
  local left=$((deadline_s - SECONDS))
  (( left < budget )) && budget=$left
  if (( budget < 30 )); then echo "== skipped (deadline, ${left}s left): $name"; return 1; fi
  echo "== at ${SECONDS}s, budget ${budget}s: $name"
  local code
  if [[ $log == - ]]; then
    timeout --signal=INT --kill-after=15 "$budget" "$@"; code=$?
  else
    timeout --signal=INT --kill-after=15 "$budget" "$@" > "$log" 2>&1; code=$?
  fi
  local why=""; (( code == 124 )) && why=" (budget used up)"
  echo "== exit ${code}${why} after ${SECONDS}s, budget ${budget}s: $name"
  return $code
}

section() {  # section BUDGET_S bench.py flags...
  local budget=$1; shift
  run_within "$budget" "python3 bench.py $*" - python3 bench.py --output "$OUT" "$@"
}

ref128_run=(--model ref128 --image_size 128 --train_batch_size 64 --max_train_steps 30 --logging_steps 10
            --checkpointing_steps 1000)

if [[ $part == all || $part == ladder ]]; then
  echo "=== 1. train.py's default step"
  section 170 --workload ref128 --variants train_default,diffusers_example
  section 190 --workload adm64 --variants train_default,cuda_graphs,step_graph
  echo "=== 2. the other compiled ref128 rows"
  section 110 --workload ref128 --variants compile,no_syncs,cuda_graphs,step_graph,force_layout,fused_norm
  echo "=== 3. the eager rows"
  section 50 --workload all --variants reference,tf32,bf16,channels_last,cudnn_benchmark,fused_adamw
fi
if [[ $part == new_rows ]]; then
  echo "=== the rows new since the last GPU run, beside the row they change"
  section 400 --workload ref128 --variants no_syncs,force_layout,fused_norm
fi
if [[ $part == startup ]]; then
  echo "=== 4. train.py's start, cold then warm (a fresh Inductor cache, shared by the two runs)"
  rm -rf /tmp/inductor-startup /tmp/r128-cold /tmp/r128-warm
  cache=(env TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-startup)
  run_within 300 "train.py ref128, cold" "$OUT/train-cold.log" "${cache[@]}" python3 train.py "${ref128_run[@]}" --output_dir /tmp/r128-cold \
    && run_within 120 "train.py ref128, warm" "$OUT/train-warm.log" "${cache[@]}" python3 train.py "${ref128_run[@]}" --output_dir /tmp/r128-warm
  for run in cold warm; do
    echo "$run: $(grep -a -o "compiled the step in .*" "$OUT/train-$run.log" 2>/dev/null || echo "no 'compiled the step in' line")"
  done
fi
if [[ $part == sweep ]]; then
  echo "=== 5. the batch sweeps of train.py's default step"
  section 280 --workload ref128 --batch_sizes 32,64,128,256 --variants train_default
  section 200 --workload adm64 --batch_sizes 32,64,128,256,512 --variants train_default
fi
if [[ $part == train_sweeps ]]; then  # whole train.py runs (bench.py --sweep); not part of "all"
  section 150 --sweep model --workload edm2g --num_images 4096  # issue 13: ddpm32 against edm2g, 32px, batch 512
  section 150 --sweep batch_size --workload ref128 --values 32,64,128
  section 130 --sweep dataloader_num_workers --workload ref128 --values 0,4,8 --num_images 1024
  section 100 --sweep mixed_precision --workload ref128 --values no,bf16
  section 100 --sweep compile --workload ref128
  if (( $(nvidia-smi -L | wc -l) > 1 )); then section 120 --sweep num_processes --workload ref128; fi
fi
ls -la "$OUT"
