#!/usr/bin/env bash
# The GPU evidence for issue 3 in one call of the device tool: both ladders, then both batch sweeps.
#
#   bash ../shared/device/fetch-wheels.sh          # here first: puts the diffusers wheel in .whl/
#   run(command="bash bench/run_gpu.sh", carry=[".whl"], kind="nvidia-h100-x1")
#   bash bench/run_gpu.sh ladder | sweep            # one half only, if a call is cut short
#   run(command="bash bench/run_gpu.sh train_sweeps", carry=[".whl"])   # a second call: issue 5's sweeps
#
# Everything lands in $OUT (bench/results/gpu without one): per bench.py run a .json (rewritten
# after every row), a .txt (after every table) and a .png (at the end, where matplotlib is
# installed; else draw it later with `python bench.py --redraw FILE.json`), plus nvidia-smi.txt,
# versions.txt and run_gpu.log. Each section has a time budget inside an overall deadline
# (DEADLINE_S, 540 by default, under the tool's 600 s), so a slow compile costs the sections
# after it, not the results before it.
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

# One Inductor cache for every section: the sweeps reuse the ladders' kernels.
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
deadline_s=${DEADLINE_S:-540}

section() {  # section BUDGET_S bench.py flags...
  local budget=$1; shift
  local left=$((deadline_s - SECONDS))
  (( left < budget )) && budget=$left
  if (( budget < 30 )); then echo "== skipped (deadline): bench.py $*"; return; fi
  echo "== at ${SECONDS}s, up to ${budget}s: python3 bench.py $*"
  timeout --signal=INT --kill-after=15 "$budget" python3 bench.py --output "$OUT" "$@"
  echo "== exit $? after ${SECONDS}s"
}

if [[ $part == all || $part == ladder ]]; then
  section 220 --workload ref128
  section 150 --workload adm64
fi
if [[ $part == all || $part == sweep ]]; then
  section 100 --workload ref128 --batch_sizes 32,64,128,256 --variants train_default
  section 70 --workload adm64 --batch_sizes 32,64,128,256,512 --variants train_default
fi
if [[ $part == train_sweeps ]]; then  # whole train.py runs (bench.py --sweep); not part of "all"
  section 150 --sweep batch_size --workload ref128 --values 32,64,128
  section 130 --sweep dataloader_num_workers --workload ref128 --values 0,4,8 --num_images 1024
  section 100 --sweep mixed_precision --workload ref128 --values no,bf16
  section 100 --sweep compile --workload ref128
  if (( $(nvidia-smi -L | wc -l) > 1 )); then section 120 --sweep num_processes --workload ref128; fi
fi
ls -la "$OUT"
