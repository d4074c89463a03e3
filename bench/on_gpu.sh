#!/usr/bin/env bash
# One part of the GPU evidence, sized for one call of a lent GPU machine (8 minutes on a freshly
# started one, cold compiles included), packed into two files:
#
#   bash bench/on_gpu.sh PART [FOLDER]     PART: tests, graphs, ref128, adm64, fused, dit, cold, terms or routing; FOLDER: $OUT, else bench/results/gpu
#
#   graphs  the launch-bound step captured without compiling (--compile_mode eager-graph, issue 67): its CUDA tests,
#           the speed ladder's eager and eager_graph rows for ddpm32 (batch 128, the GPU bare run's step) and adm64
#           (batch 32), then the GPU bare run with --compile_mode eager-graph to its end, and its shape score
#   tests   the CUDA tests by node id, then the bare `python train.py` and its shape score
#   ref128  128px, batch 64, on 4,096 JPEGs written here: train.py's default cold, the same command
#           warm, diffusers' train_unconditional.py on the same folder (the yardstick), --compile_mode step-graph
#   adm64   64px, batch 32: auto (cold), step-graph, default, diffusers' script with adm64's UNet
#   fused   the speed ladder's train_default and fused_norm rows (fused_norm.py's kernels) for ref128 and adm64
#   dit     DiT-XL/2 on 32x32x4 latents, batch 64: the speed ladder's dit rows on random latents, each repeated
#           block compiled once (regional, cold, and the rows of issue 48: flash and cuDNN attention; fp8, measured
#           once, by --variants regional,fp8),
#           train.py's default (cold, in caches of its own) on 1,024 JPEGs of 256px encoded by a VAE of SD's
#           architecture with random weights (made here: no download; the step does not depend on its weights),
#           a checkpoint at step 60; 12 steps of it, warm, profiled by operator (dit-profile: --profile operators),
#           facebookresearch/DiT's training step (bench/dit_reference.py, on random latents), then max_autotune
#           beside the regional row, each block compiled once, with what time is left (its kernel search takes
#           minutes: for it alone, ON_GPU_RUNS="dit-autotune");
#           eager, compiled (whole) and train_default are the cold part's and the records'
#   cold    the cold start, whole network against regional compilation (each repeated block once), each in a
#           process of its own with empty Inductor and Triton caches: the speed ladder's compiled and regional
#           rows for DiT-XL/2 (batch 64; regional also with Inductor's compile workers started at its first graph,
#           torch's timing, not at the ladder's start) and for ddpm32 at batch 128 in the mode `auto` gives it (the GPU bare
#           run's step): compile seconds (1st call s), the step, peak memory; then the GPU bare run itself
#           (`python train.py`), start to last grid
#   routing issue 76's levers on DiT-XL/2 (batch 64, random 32x32x4 latents), each repeated block compiled once: the
#           speed ladder's regional row against its routed row (--token_routing 0.5) and its muon row (--optimizer
#           muon): ms a step, img/s, MFU (the routed row's against its routed FLOPs), compile seconds, peak memory
#   terms   issue 66's loss terms at GPU scale (docs/loss_terms.md): DiT-B/2 and adm64 on the labelled photos, the default
#           against each of ON_GPU_TERMS (default "deltafm"), seeds 1 and 2, each run then scored (class match and photos
#           FD, bench/labelled.py); sized for a longer loan than one call (below, at the part)
#
# FOLDER receives PART.tar.gz (every run's printed output, run.json, train_config.json and last grid,
# nvidia-smi, versions, this script's log) and PART-summary.txt (one row per run: exit status,
# mode, ms/step, img/s, MFU, compile and first-step seconds, fallbacks). Every run's `timeout` is
# cut from one deadline (DEADLINE_S, 480 s from the start), so a long compile costs the runs after
# it, never the pack. One Inductor cache per call, made fresh here: the first compile is cold.
#
# Before the call, on this machine (diffusers' script is fetched, carried and never committed):
#   bash ../shared/device/fetch-wheels.sh datasets      # .whl/: diffusers, datasets (the GPU image lacks them)
#   python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     -d .whl torchao==0.18.0                           # --mixed_precision fp8 (the dit part's fp8 row)
#   mkdir -p .ext && cp <diffusers>/examples/unconditional_image_generation/train_unconditional.py .ext/
#   mkdir -p .ext/DiT && cp -r <facebookresearch/DiT>/{models.py,train.py,diffusion} .ext/DiT/   # the dit part
#   python -m bench.labelled write .data/labelled         # the terms part: the labelled photos (7.5 MB; carry ".data"),
#   python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     -d .whl scipy==1.17.1                               # and scipy (35 MB), which its scores' FD needs and the image lacks
#   run(command="bash bench/on_gpu.sh ref128", carry=[".whl", ".ext"], timeout_s=600)
#
# ON_GPU_RUNS="NAME ..." runs only the runs named (the others get a "not chosen" row), for a call
# that must leave out what an earlier record already measured.
#
# PYTHON names the interpreter (default python3 from PATH; the tests pass their own, so that a
# venv's interpreter works without activating the venv).
#
# ON_GPU_CPU=1 is the CPU mode (tests/test_on_gpu.py): every run becomes a 2-step tiny run on the
# CPU and the CUDA tests are not run, so that each part's pack is shown to be written before a GPU
# ever sees this script.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
case $part in tests | graphs | ref128 | adm64 | fused | dit | cold | terms | routing) ;; *)
  echo "usage: bash bench/on_gpu.sh tests|graphs|ref128|adm64|fused|dit|cold|terms|routing [FOLDER]" >&2
  exit 2
  ;;
esac
dest=${2:-${OUT:-bench/results/gpu}}
cpu=${ON_GPU_CPU:-0}
deadline_s=${DEADLINE_S:-480}
python=${PYTHON:-python3}
chosen=${ON_GPU_RUNS:-}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
work=$(mktemp -d /tmp/on_gpu.XXXXXX)
pack=$work/pack
mkdir -p "$pack" "$work/runs"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TORCHINDUCTOR_CACHE_DIR=$work/inductor # one cache per call: the first compile of each graph is cold
export MPLBACKEND=Agg

finish() {  # the pack, whatever happened before
  "$python" bench/pack_summary.py "$work" "$part" > "$pack/summary.txt" 2>&1
  cp "$pack/summary.txt" "$dest/$part-summary.txt"
  tar czf "$dest/$part.tar.gz" -C "$pack" .
  cat "$pack/summary.txt"
  rm -rf "$work"
}
trap finish EXIT
exec > >(tee "$pack/on_gpu.log") 2>&1

echo "== on_gpu.sh $part at $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), deadline ${deadline_s}s"
if ((!cpu)) && compgen -G ".whl/*.whl" > /dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" .whl/*.whl \
    && export PYTHONPATH=$work/site
fi
(nvidia-smi || echo "no nvidia-smi") > "$pack/nvidia-smi.txt" 2>&1
# The libraries' versions from their installed metadata (run.json's way, profiling.library_versions), not by
# importing them: seconds saved on every call (the runs import what they use, and fail on what is broken).
"$python" - > "$pack/versions.txt" 2>&1 << 'EOF'
import sys, torch
from importlib.metadata import PackageNotFoundError, version
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
for name in ("triton", "diffusers", "accelerate", "datasets", "torchao"):
    try:
        print(name, version(name))
    except PackageNotFoundError as e:
        print(name, "missing:", type(e).__name__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
EOF
cat "$pack/versions.txt"

left() { echo $((deadline_s - SECONDS)); }

unrun_row() { printf '%s\t%s\t0\t0\t0\n' "$1" "$2" >> "$work/runs.tsv"; }  # unrun_row NAME WHY: a run's row that did not run

is_chosen() { [[ -z $chosen || " $chosen " == *" $1 "* ]]; }  # is_chosen NAME: ON_GPU_RUNS names it, or is unset

run_within() {  # run_within NAME BUDGET_S command...: output to pack/NAME.log, a row in runs.tsv
  local name=$1 budget=$2 code start
  shift 2
  if ! is_chosen "$name"; then
    echo "== not chosen (ON_GPU_RUNS): $name"
    unrun_row "$name" "not chosen"
    return 0
  fi
  local limit
  limit=$(left)
  ((limit < budget)) && budget=$limit
  if ((budget < 20)); then
    echo "== skipped (deadline, $(left)s left): $name"
    unrun_row "$name" "skipped"
    return 0
  fi
  echo "== at ${SECONDS}s, budget ${budget}s: $name"
  start=$(date +%s.%N)
  timeout --signal=INT --kill-after=20 "$budget" "$@" > "$pack/$name.log" 2>&1
  code=$?
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$code" "$start" "$(date +%s.%N)" "$budget" >> "$work/runs.tsv"
  echo "== exit $code$( ((code == 124)) && echo ' (budget used up)') at ${SECONDS}s: $name"
}

train_run() {  # train_run NAME BUDGET_S train.py flags...: the run's printed lines, run.json, config and last grid packed
  local name=$1 budget=$2 dir=$work/runs/$1
  shift 2
  run_within "$name" "$budget" "$python" train.py --output_dir "$dir" "$@"
  [[ -f $dir/run.json ]] && cp "$dir/run.json" "$pack/$name.run.json"
  [[ -f $dir/train_config.json ]] && cp "$dir/train_config.json" "$pack/$name.train_config.json"
  local grid
  grid=$(ls "$dir"/samples/*.png 2> /dev/null | sort | tail -1)
  [[ -n $grid ]] && cp "$grid" "$pack/$name.grid.png"
  return 0
}

bench_run() {  # bench_run NAME BUDGET_S python -m bench flags...: the ladder's table and JSON packed
  local name=$1 budget=$2 dir=$work/runs/$1
  shift 2
  run_within "$name" "$budget" "$python" -m bench --output "$dir" --tag "$name" "$@"
  [[ -f $dir/$name.json ]] && cp "$dir/$name.json" "$pack/$name.bench.json"
  return 0
}

diffusers_run() {  # diffusers_run NAME BUDGET_S DATA RESOLUTION BATCH [UNET_PRESET]: diffusers' example script
  local name=$1 budget=$2 data=$3 resolution=$4 batch=$5 preset=${6:-} config=()
  if [[ ! -f .ext/train_unconditional.py ]]; then
    echo "== skipped (.ext/train_unconditional.py not carried): $name"
    unrun_row "$name" "not carried"
    return 0
  fi
  if [[ -n $preset ]] && is_chosen "$name" && (($(left) >= 20)); then  # the preset's UNet as a config file the script reads
    "$python" -c "import sys; from ddpm_train.networks import model; model.build_network(sys.argv[1], int(sys.argv[2])).save_config(sys.argv[3])" \
      "$preset" "$resolution" "$work/unet-$preset"
    config=(--model_config_name_or_path "$work/unet-$preset")
  fi
  local precision=bf16 epochs=3 workers=8
  ((cpu)) && precision=no epochs=1 workers=0
  # The yardstick as its users run it: bf16, EMA, DataLoader workers; sampling cut to 10 steps
  # (it samples after the last epoch) and no checkpoints, so that the time is the training's.
  run_within "$name" "$budget" "$python" .ext/train_unconditional.py --train_data_dir "$data" --resolution "$resolution" \
    --train_batch_size "$batch" --num_epochs $epochs --mixed_precision $precision --use_ema \
    --dataloader_num_workers $workers --save_images_epochs 1000 --save_model_epochs 1000 \
    --ddpm_num_inference_steps 10 --checkpointing_steps 100000 --logger tensorboard \
    --output_dir "$work/runs/$name" "${config[@]}"
  printf '%s\t%s\n' "$name" "$batch" >> "$work/batches.tsv"
}

reference_run() {  # reference_run NAME BUDGET_S dit_reference.py flags...: facebookresearch/DiT's step, from .ext/DiT
  local name=$1 budget=$2
  shift 2
  if [[ ! -f .ext/DiT/models.py ]]; then
    echo "== skipped (.ext/DiT not carried): $name"
    unrun_row "$name" "not carried"
    return 0
  fi
  run_within "$name" "$budget" "$python" bench/dit_reference.py --json "$pack/$name.run.json" "$@"
}

make_vae() {  # make_vae DIR CONFIG_JSON: an AutoencoderKL of that architecture with random weights, saved (no download)
  (($(left) < 20)) && return 0
  "$python" -c "import json, sys, torch; from diffusers import AutoencoderKL; torch.manual_seed(0); \
AutoencoderKL(**json.loads(sys.argv[2])).save_pretrained(sys.argv[1])" "$@"
}

make_folder() {  # make_folder DIR N SIDE: N JPEGs of the built-in shapes, SIDE px, as a user's folder would hold
  (($(left) < 20)) && return 0  # no run will have the time to read it
  "$python" - "$@" << 'EOF'
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from ddpm_train.data import shapes
from PIL import Image

folder, n, side = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
folder.mkdir(parents=True, exist_ok=True)
small = min(side, 64)  # drawn at 64px at most, then resized: quick even for 4,096 images

def write(lo):
    images = shapes.make_shapes(min(256, n - lo), small, seed=lo, supersample=2)
    for i, image in enumerate(images.permute(0, 2, 3, 1).numpy()):
        Image.fromarray(image).resize((side, side), Image.BICUBIC).save(folder / f"{lo + i:05d}.jpg", quality=90)

with ProcessPoolExecutor() as pool:
    list(pool.map(write, range(0, n, 256)))
print(f"wrote {n} JPEGs of {side}px to {folder}")
EOF
}

score_run() {  # score_run NAME: 300 samples of run NAME at w = 1 (sample.py, its copy check too), class match and photos FD
  [[ -f $work/runs/$1/run.json ]] || return 0  # it finished (a DiT run saves no model_index.json)
  run_within "$1-score" 120 bash -c '"$1" sample.py "$2" --num_images "$3" --batch_size 100 --seed 0 --output "$2-gen" &&
    "$1" -m bench.labelled score "$4" "$2-gen" --run "$2" --grid "$2-gen/classes.png"' _ \
    "$python" "$work/runs/$1" $((cpu ? 8 : 300)) "$labelled"
  [[ -f $work/runs/$1-gen/classes.png ]] && cp "$work/runs/$1-gen/classes.png" "$pack/$1.classes.png"
  return 0
}

shape_fd() {  # shape_fd NAME: the shape score of run NAME's saved model (the built-in shapes), where it saved one
  if [[ -f $work/runs/$1/model_index.json ]]; then
    run_within "$1-shape-fd" 50 "$python" sample.py "$work/runs/$1" --fid --num_images $((cpu ? 8 : 256)) --batch_size 64
  fi
}

# What each workload's runs share; the CPU mode swaps every one for a 2-step tiny run. The benchmark
# runs log nowhere and save no checkpoint but the last; the bare run is the bare command.
timing=(--logger none --checkpointing_steps 100000)
if ((cpu)); then
  images=16
  tiny=(--cpu --model tiny --image_size 16 --train_batch_size 4 --max_train_steps 2 --num_inference_steps 2 --eval_batch_size 4)
  ref128=("${timing[@]}" "${tiny[@]}" --logging_steps 1)
  adm64=("${ref128[@]}")
  bare=("${tiny[@]}" --shapes_num_images 16)
  eager_graph=() # CUDA graphs need a CUDA GPU: the CPU mode's bare run stays eager
  graph_ladder=(--variants eager,eager_graph --steps 2 --warmup 1)
  graph_workloads=(tiny tiny)
  fused=(--steps 2 --warmup 1)
  fused_workloads=(tiny tiny)
  sides=(16 16)
  dit=("${timing[@]}" "${tiny[@]}" --model dit-tiny --logging_steps 1)
  dit_images=16
  dit_checkpoints=(--checkpointing_steps 1)
  dit_vae='{"down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"], "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"], "block_out_channels": [8, 16], "layers_per_block": 1, "latent_channels": 4, "norm_num_groups": 8, "sample_size": 16}'
  dit_reference=(--tiny --cpu --batch 4 --num_classes 10 --steps 2 --warmup 1)
  dit_ladder=(--workload dit-tiny --variants eager,train_default --steps 2 --warmup 1)
  dit_autotune=(--workload dit-tiny --variants eager --steps 1 --warmup 0)
  cold_dit=(--workload dit-tiny --steps 2 --warmup 1)
  cold_bare=(--workload tiny --steps 2 --warmup 1)
  routing_ladder=(--workload dit-tiny --variants eager,routed,muon --steps 2 --warmup 1)
  terms_dit=(--model dit-tiny --image_size 16 --max_train_steps 2)
  terms_adm=(--model tiny --image_size 16 --max_train_steps 2)
  terms_run=(--cpu --train_batch_size 4 --num_inference_steps 2 --eval_batch_size 4)
else
  images=4096
  # The timing runs name their compile mode: --compile_mode auto now trains runs this short eager (they would
  # not repay a cold compile), and these measure the compiled step. adm64's is the mode auto picked for it.
  ref128=("${timing[@]}" --image_size 128 --train_batch_size 64 --max_train_steps 200 --logging_steps 50 --compile_mode default)
  adm64=("${timing[@]}" --image_size 64 --train_batch_size 32 --max_train_steps 400 --logging_steps 100 --compile_mode reduce-overhead)
  bare=()
  eager_graph=(--compile_mode eager-graph)
  graph_ladder=(--variants eager,eager_graph --steps 50 --warmup 5)
  graph_workloads=(ddpm32 adm64)
  fused=(--steps 30 --warmup 5)
  fused_workloads=(ref128 adm64)
  sides=(256 64)
  # 1,024 images: 16 steps an epoch; 120 steps leave 115 timed after train.py's 5 warm-up steps
  dit=("${timing[@]}" --model dit-xl2 --image_size 256 --train_batch_size 64 --max_train_steps 120 --logging_steps 40 --compile_mode default)
  dit_images=1024
  dit_checkpoints=(--checkpointing_steps 60) # one mid-run (its flush beside the next 60 steps), one at the end
  # Stable Diffusion's VAE (stabilityai/sd-vae-ft-mse's config.json): 8x, 4 channels, 83.7M parameters
  dit_vae='{"down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"], "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"], "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 4, "sample_size": 256}'
  dit_reference=(--steps 30 --warmup 5)
  # each repeated block compiled once: fp8's whole network did not finish compiling within a call's budget
  # (record 2026-11-27-h100-regional-memory); fp8 is left out since it was measured (BENCHMARKS.md)
  dit_ladder=(--workload dit --steps 20 --warmup 3 --compile_scope regional --variants regional,flash_attention,cudnn_attention)
  # beside the regional row it is timed against, each block compiled once (the whole network's compile alone took
  # 86-91 s before any kernel search); without CUDA graphs, which per block cost ddpm32's step 52% (BENCHMARKS.md)
  dit_autotune=(--workload dit --steps 20 --warmup 3 --compile_scope regional --variants regional,max_autotune)
  cold_dit=(--workload dit --steps 20 --warmup 3)
  cold_bare=(--workload ddpm32 --steps 50 --warmup 5)
  routing_ladder=(--workload dit --steps 20 --warmup 3 --compile_scope regional --variants regional,routed,muon)
  # 30 minutes a run at the step each is expected to take (the part's comment): DiT's batch, adm64's (seed 004's)
  terms_dit=(--model dit-b2 --image_size 32 --train_batch_size 256 --max_train_steps "${TERMS_DIT_STEPS:-18000}")
  terms_adm=(--model adm64 --image_size 64 --train_batch_size 32 --max_train_steps "${TERMS_ADM_STEPS:-90000}")
  terms_run=(--logging_steps 500 --save_images_epochs 100000 --checkpointing_steps 100000)
fi

cold_run() {  # cold_run NAME BUDGET_S python -m bench flags...: a ladder run in a process with its own empty compile caches
  local name=$1
  shift
  TORCHINDUCTOR_CACHE_DIR=$work/inductor-$name TRITON_CACHE_DIR=$work/triton-$name bench_run "$name" "$@"
}

case $part in
tests)
  if ((cpu)); then
    echo "== CPU mode: the CUDA tests are not run" | tee "$pack/cuda-tests.log"
    unrun_row cuda-tests "CPU mode"
  else
    # Every test that skips without a CUDA GPU (their skip reasons name CUDA), by node id.
    # -p no:logging: pytest's log capture switched on torch's DEBUG structured trace, and the
    # first GPU run was several times slower with it (the first GPU run, BENCHMARKS.md).
    run_within cuda-tests 420 "$python" -m pytest -p no:cacheprovider -p no:logging -q -rA --tb=short \
      tests/test_gpu.py \
      tests/test_step.py::test_the_captured_step_trains_as_the_eager_step_on_a_gpu \
      tests/test_fused_norm.py::test_cuda_bf16_matches_fp32_reference \
      tests/test_fused_norm.py::test_cuda_compiled_unet_keeps_channels_last \
      tests/test_memory.py::test_on_a_gpu_decoding_a_grid_allocates_its_activations_not_a_benchmark_workspace
  fi
  train_run bare 240 "${bare[@]}"
  shape_fd bare
  ;;
graphs)
  # The captured eager step's CUDA tests first (a wrong capture would make the timings meaningless), then the ladder's
  # eager and eager_graph rows (the GPU bare run's step eager was never measured on a GPU), then the bare run.
  if ((cpu)); then
    echo "== CPU mode: the CUDA tests are not run" | tee "$pack/graphs-tests.log"
    unrun_row graphs-tests "CPU mode"
  else
    run_within graphs-tests 90 "$python" -m pytest -p no:cacheprovider -p no:logging -n 0 -q -rA --tb=short \
      "tests/test_gpu.py::test_the_captured_bf16_step_compiled_or_not_trains_as_the_eager_one[eager-graph]" \
      "tests/test_gpu.py::test_a_term_on_a_blocks_output_trains_alike_under_a_cuda_graph" \
      tests/test_step.py::test_the_captured_step_trains_as_the_eager_step_on_a_gpu
  fi
  bench_run ddpm32-graph-ladder 90 "${graph_ladder[@]}" --workload "${graph_workloads[0]}"
  bench_run adm64-graph-ladder 60 "${graph_ladder[@]}" --workload "${graph_workloads[1]}"
  train_run bare-eager-graph 220 "${bare[@]}" "${eager_graph[@]}"
  shape_fd bare-eager-graph
  ;;
ref128)
  make_folder "$work/data128" $images "${sides[0]}"
  train_run ref128-default-cold 200 --dataset "$work/data128" "${ref128[@]}"
  train_run ref128-default-warm 70 --dataset "$work/data128" "${ref128[@]}"
  diffusers_run ref128-diffusers 130 "$work/data128" "$(((cpu)) && echo 16 || echo 128)" "$(((cpu)) && echo 4 || echo 64)" \
    "$(((cpu)) && echo tiny || echo ref128)"
  train_run ref128-step-graph 90 --dataset "$work/data128" "${ref128[@]}" --compile_mode step-graph
  ;;
adm64)
  make_folder "$work/data64" $images "${sides[1]}"
  train_run adm64-auto-cold 170 --dataset "$work/data64" "${adm64[@]}"
  train_run adm64-step-graph 150 --dataset "$work/data64" "${adm64[@]}" --compile_mode step-graph
  train_run adm64-default 60 --dataset "$work/data64" "${adm64[@]}" --compile_mode default
  diffusers_run adm64-diffusers 90 "$work/data64" "$(((cpu)) && echo 16 || echo 64)" "$(((cpu)) && echo 4 || echo 32)" \
    "$(((cpu)) && echo tiny || echo adm64)"
  ;;
fused)
  # The ladder's rows: train.py's default step, and the same with fused_norm (it brings channels_last);
  # each checked against the fp32 eager step first. Not a train.py flag: bench/speed.py sets it.
  bench_run ref128-fused 220 "${fused[@]}" --workload "${fused_workloads[0]}" --variants train_default,fused_norm
  bench_run adm64-fused 220 "${fused[@]}" --workload "${fused_workloads[1]}" --variants train_default,fused_norm
  ;;
dit)
  # train.py's default step on latents first (issue 67 ranks its cold start above the ladder's rows): --vae, each image
  # encoded once, the latents normalised by the data's own mean and std, as a VAE of random weights has no scaling
  # factor worth the name; in caches of its own, so that its compile (the scope auto picks) is cold. Then the ladder's
  # rows (issue 48's), each checked against the fp32 eager step and each compiling each repeated block once: regional
  # (the first compile in the call's cache: cold), then each attention kernel (traced anew, and keyed apart in the
  # compile caches): the whole network's compiles filled the ladder's budget twice before fp8 finished (record
  # 2026-11-27-h100-regional-memory).
  export DDPM_TRAIN_LATENT_CACHE=$work/latents # the call's own latent cache (latents.cache_root), encoded cold
  make_folder "$work/data256" $dit_images "$(((cpu)) && echo 16 || echo 256)"
  make_vae "$work/vae" "$dit_vae"
  TORCHINDUCTOR_CACHE_DIR=$work/inductor-default TRITON_CACHE_DIR=$work/triton-default \
    train_run dit-default-cold 200 --dataset "$work/data256" --vae "$work/vae,dataset" "${dit[@]}" "${dit_checkpoints[@]}"
  # Where the default step's time goes, by operator (the optimizer's, the EMA's, the clipping's share beside the
  # matmuls' and attention's: what is left for issue 48's 40%), in the same warm caches: --profile prints the top 15
  TORCHINDUCTOR_CACHE_DIR=$work/inductor-default TRITON_CACHE_DIR=$work/triton-default \
    train_run dit-profile 90 --dataset "$work/data256" --vae "$work/vae,dataset" "${dit[@]}" --max_train_steps 12 \
    --profile operators
  bench_run dit-ladder 300 "${dit_ladder[@]}"
  reference_run dit-reference 60 "${dit_reference[@]}"
  bench_run dit-autotune 200 "${dit_autotune[@]}"
  ;;
cold)
  # Regional first: it is what train.py now does. The same with Inductor's compile workers started when its first
  # graph reaches it (torch's timing), not at the ladder's start (train.py starts them once its step is planned:
  # step.start_compile_workers): what starting them before the first compile saves. Then ddpm32's two scopes; DiT's
  # whole network last, as the dit part measured it twice (record 2026-11-27-h100-regional-memory): a comparison
  # within this call where time is left.
  cold_run dit-regional 150 "${cold_dit[@]}" --variants regional
  cold_run dit-regional-inductor 150 "${cold_dit[@]}" --variants regional --compile_workers inductor
  cold_run ddpm32-regional 90 "${cold_bare[@]}" --variants train_default --compile_scope regional
  cold_run ddpm32-whole 110 "${cold_bare[@]}" --variants train_default --compile_scope whole
  cold_run dit-whole 160 "${cold_dit[@]}" --variants compiled
  TORCHINDUCTOR_CACHE_DIR=$work/inductor-bare TRITON_CACHE_DIR=$work/triton-bare train_run bare-cold 200 "${bare[@]}"
  ;;
routing)
  bench_run dit-routing 420 "${routing_ladder[@]}"
  ;;
terms)
  # Issue 66, item 4: do the loss terms win at GPU scale, where their papers measured them? The labelled photos
  # (bench/labelled.py: 2,000 32px crops of ten photos, ten classes; the CPU records' set), class-conditional, each run
  # scored as those records are: 300 samples at w = 1, class match and photos FD (their sampling error about ±0.1,
  # record 2026-11-28-cpu-loss-terms), and sample.py's copy check. DiT-B/2 on the photos' pixels at 32px: 256
  # tokens, the sequence it sees on a 256px image's latents (a trained VAE cannot reach this machine: no download,
  # and sd-vae-ft-mse is 335 MB, over what a call carries); adm64 at 64px (train.py scales the crops up; the score
  # scales samples back to 32px). The default (no term) and each of ON_GPU_TERMS (default "deltafm", the CPU records'
  # one candidate; e.g. ON_GPU_TERMS="deltafm dispersive layersync"), seeds 1 and 2; run names FAMILY-TERM-sSEED.
  # Expected: a step of 35.3 TFLOP (flops.py) at DiT-XL/2's 35.9% MFU: about 100 ms on an H100 or H200 (more if DiT-B/2's
  # narrower matmuls reach less), so 18,000 steps (TERMS_DIT_STEPS) are 30 minutes; adm64 about 20 ms at batch 32 (the ladder's CUDA graphs: 21.6 ms), 90,000
  # steps (TERMS_ADM_STEPS) 30 minutes; each term's extra step time ≤ 5% (deltafm ≈ 0; dispersive and layersync one
  # B x B or token-wise product on one block's output). A term wins as docs/loss_terms.md's rule says: on both seeds,
  # by more than the sampling error. The CPU's figures (`small`, 6,144 steps): class match 80.3 / 81.0%, FD 4.12 / 4.97.
  # Sized past one call: 8 runs of 30 minutes want DEADLINE_S=16000 and a loan that long. Within a 15-minute loan, the
  # step cost of each term at scale and an early score, about 2 minutes a run: DEADLINE_S=500 TERMS_DIT_STEPS=600
  # ON_GPU_TERMS="deltafm dispersive layersync" with ON_GPU_RUNS naming DiT-B/2's four runs of seed 1 and their scores
  # (dit-b2-none-s1 dit-b2-none-s1-score ...). layersync applies to DiTs alone: adm64's runs of it stop in one line.
  # The set: carried in .data/labelled (`python -m bench.labelled write .data/labelled`: 7.5 MB), else written here
  # where scikit-image is installed (the CPU mode's), else the runs are "not carried".
  labelled=$PWD/.data/labelled
  if [[ ! -d $labelled/train ]] && (($(left) >= 20)); then
    labelled=$work/labelled
    "$python" -m bench.labelled write "$labelled" || echo "== no labelled set: carry .data/labelled"
  fi
  for family in dit adm; do
    for seed in 1 2; do
      for term in none ${ON_GPU_TERMS:-deltafm}; do
        name=$([[ $family == dit ]] && echo dit-b2 || echo adm64)-$term-s$seed
        if [[ ! -d $labelled/train ]]; then
          unrun_row "$name" "not carried"
          continue
        fi
        flags=terms_$family[@]
        train_run "$name" 2400 --dataset "$labelled/train" --class_conditional --seed "$seed" --loss_terms "$term" \
          "${!flags}" "${terms_run[@]}"
        score_run "$name"
      done
    done
  done
  ;;
esac
echo "== done at ${SECONDS}s"
