"""The speed ladder: one training step, timed with one more speed-up per row.

    python -m bench                                    # GPU: the ref128 and adm64 ladders; CPU: the tiny preset
    python -m bench --workload ref128 --batch_sizes 32,64,128,256 --variants train_default
    python -m bench --workload tiny --steps 3 --warmup 1   # seconds on a CPU
    python -m bench --workload dit                     # DiT-XL/2 on 32x32x4 latents: eager, compiled, regional, fp8,
                                                       # the attention kernels, max-autotune, train.py's
    python -m bench --sweep batch_size                 # whole train.py runs, one setting varied: see bench/sweep.py
    python -m bench --quality                          # whole train.py runs, scored offline: see bench/quality.py

Every row runs the same training step as train.py (uint8 images to [-1, 1]
with random flips, noise and timesteps drawn on the device, the DDPM loss,
backward, gradient clipping, AdamW, EMA update), with every setting outside
the ladder taken from train.py's defaults. The first row, diffusers_example,
is a yardstick outside the ladder: the step as diffusers' train_unconditional.py
takes it. Then the ladder: the project this grows from as it shipped, and each
row below it switches one more thing on (force_layout starts again from
no_syncs, leaving CUDA graphs out; fused_norm too, as train.py's step runs
with it: --compile_mode auto, no force_layout); the last is what `python
train.py` runs by default on this device. The settings train.py has no flag
for (channels_last, cudnn_benchmark, fused AdamW, TF32, fused_norm: config.SETTINGS)
are the ladder's own flags too: they change that last row, train.py's step with them. The speedup column is over the
first row that ran (diffusers_example when it is among --variants). Rows that
need CUDA are skipped on a CPU, with the reason in the table.

Before a row is timed, its loss and gradients are checked against the plain
fp32 eager step (no TF32 anywhere) on the same inputs and weights, within its
precision's tolerance. Compilation happens in that check, so it is reported
separately ("1st call s") and never timed. Then --warmup steps run untimed and
--steps are timed, each step's end a CUDA event (no host sync for timing);
the table gives the median and the 10th to 90th percentile. Every row's timed
steps draw the same noise from the same weights (seeded by --seed), so "mean loss
vs 1st" is what the row's change does to the loss over them. FLOPs are counted
once on the eager model on the meta device (flops.step_flops). MFU is quoted
against the GPU's dense bf16 peak in every row, the denominator of the
project's target, so it stays proportional to speed down the table.

It prints the device and library versions, then one table per workload and
batch size, and writes every number (.json, rewritten after every row, so a
run cut short keeps what it measured), the printed tables (.txt) and a bar
chart (.png, at the end; `--redraw FILE.json` draws it again) into --output,
named by the device, workload and batch sizes.
"""

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ddpm_train.training import checkpoint
from ddpm_train.perf import compiling
from ddpm_train import config
from ddpm_train.data import data
from ddpm_train.data import batches
from ddpm_train.perf import flops
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.perf import profiling
from ddpm_train.training import step as steps
from ddpm_train.training import builder
from bench import quality, sweep
from ddpm_train.errors import ConfigError, error_line, first_line, one_line_errors

# name -> preset, image side and the batch the targets are stated for.
WORKLOADS = {
    "ref128": dict(model="ref128", image_size=128, batch_size=64),
    "adm64": dict(model="adm64", image_size=64, batch_size=32),
    "small": dict(model="small", image_size=32, batch_size=32),  # the preset of a bare `python train.py`
    "ddpm32": dict(model="ddpm32", image_size=32, batch_size=128),  # the GPU bare run's (config.GPU_BARE_RUN)
    "tiny": dict(model="tiny", image_size=16, batch_size=8),  # for tests
    # EDM2 against DDPM (--sweep model only: the ladder times the DDPM step): the seed's
    # CIFAR-10 batch, and a test size.
    "edm2g": dict(model="edm2g", image_size=32, batch_size=512),
    "edm2tiny": dict(model="edm2tiny", image_size=16, batch_size=8),
    # DiT-XL/2 (issue 39) on SD's VAE's 32x32x4 latents of 256px images, at the batch of the issue's
    # target: a --vae run's step after its latent cache (the VAE is not in it), on random latents.
    "dit": dict(model="dit-xl2", image_size=32, batch_size=64, channels=4),
    "dit-small": dict(model="dit-small", image_size=32, batch_size=32),  # the CPU's DiT, on the built-in 32px images
    # DiT-S/2 and B/2 on 32x32x4 latents at a CPU's batch: regional against whole compilation on a CPU
    "dit-s2": dict(model="dit-s2", image_size=32, batch_size=8, channels=4),
    "dit-b2": dict(model="dit-b2", image_size=32, batch_size=8, channels=4),
    "dit-tiny": dict(model="dit-tiny", image_size=8, batch_size=4, channels=4),  # for tests: the latent path
}
WORKLOAD_GROUPS = {"all": ("ref128", "adm64")}
# The rows a workload runs without --variants (the others: every row but a DiT's). A DiT has no GroupNorm for the
# UNet's rungs: it gets train.py's step eager, compiled, and as train.py picks (--compile_mode auto), and DIT_ROWS.
WORKLOAD_VARIANTS = {name: ("eager", "compiled", "regional", "fp8", "flash_attention", "cudnn_attention",
                            "max_autotune", "routed", "muon", "train_default")
                     for name in ("dit", "dit-small", "dit-tiny", "dit-s2", "dit-b2")}  # fmt: skip


def channels_of(workload):
    """The network's input channels: a latent workload's latent channels, else 3 (RGB)."""
    return workload.get("channels", 3)


def input_words(workload):
    """'128px', or '32x32x4 latents': a workload's input, or a row's (which has channels only for latents)."""
    side = workload["image_size"]
    return f"{side}x{side}x{workload['channels']} latents" if workload.get("channels") else f"{side}px"

# Everything the ladder does not vary comes from train.py's defaults (config.py): each
# step takes them resolved for its model (train_defaults: the learning rate is
# the preset's); these unresolved ones give the loss-reading interval and the
# number of timesteps, and are recorded in the JSON.
TRAIN_DEFAULTS = config.parse_args([])


def takes_ddpm(model):
    """Whether DDPM gives preset `model`'s family the time input it takes (EDM2's networks train EDM)."""
    return models.family(model)[0].time_input in objectives.OBJECTIVES["ddpm"].time_inputs


def train_defaults(workload, *flags):
    """train.py's defaults, resolved by config.py for a workload's model (its learning rate is the preset's),
    with `flags` (config.py's refusals apply). A latent workload's network takes its latents' side and channels,
    as a --vae run's does (latent_size, latent_channels: config._fill_latents)."""
    # a UNet's or DiT's DDPM step, whatever the preset's default objective: the check compares DDPM's loss (flow's
    # step is the same network's forward and backward, its noise drawn another way); EDM2's networks train EDM
    ddpm = ["--objective", "ddpm"] if takes_ddpm(workload["model"]) else []
    args = config.resolve(config.parse_args(["--model", workload["model"], "--image_size", str(workload["image_size"]), *ddpm, *flags]))
    if workload.get("channels"):
        args.latent_size, args.latent_channels = workload["image_size"], workload["channels"]
    return args


# Relative error of the loss and of the whole gradient vector against the
# fp32 eager step, by the precision convolutions and matmuls run in. TF32 and
# bf16 keep 10 and 7 mantissa bits (relative rounding 5e-4 and 4e-3 per
# operation), which compound through the network; fp32 only reorders sums.
# The learning-rate schedule's length for a row: long, so that the timed steps sit in its warm-up as a run's first do.
TIMED_RUN_STEPS = 10**6

# fp8 (--mixed_precision fp8): e4m3's 3 mantissa bits forward, e5m2's 2 for the gradients, in the converted layers;
# its check on a CPU for dit-tiny (8x8x4 latents, batch 4) passes well inside this bound (BENCHMARKS.md, Not measured
# on a GPU: the fp8 row and its record).
TOLERANCE = {"fp32": 1e-5, "tf32": 1e-2, "bf16": 3e-2, "fp8": 0.1}

# The plain step the check compares against: fp32 everywhere, eager.
STRICT_FP32 = dict(
    precision="fp32",
    matmul_tf32=False,
    conv_tf32=False,
    cudnn_benchmark=False,
    channels_last=False,
    fused_adam=False,
    adam_foreach=True,  # without fused_adam: foreach AdamW; None: torch's default, as diffusers' example builds it
    nonfinite_guard=False,
    ema_foreach=False,
    compile_mode=None,
    force_layout=False,  # Inductor's force_layout_optimization (compiling.inductor_settings)
    fused_norm=False,  # fused_norm.py's GroupNorm+SiLU kernels in the UNet
    sdpa_backend=None,  # attention's kernel as torch picks it; else SDPA's backend by name (torch.nn.attention.SDPBackend)
    sync_every=0,
)


# Not a rung of the ladder but the yardstick above it: the step as diffusers'
# examples/unconditional_image_generation/train_unconditional.py takes it. Its
# DataLoader (flips and scaling on the CPU) is not part of a ladder row.
DIFFUSERS_EXAMPLE = dict(
    name="diffusers_example",
    changed="the step of diffusers' train_unconditional.py (not a rung: a yardstick, each row's speedup is "
    "over it when it runs): eager, bf16 autocast, NCHW, AdamW as torch builds it by default (foreach on CUDA), "
    "gradient clipping, its EMAModel without foreach, loss.item() every step; the whole script took "
    "~222 ms/step for ref128 on an H100 (BENCHMARKS.md)",
    settings=dict(
        STRICT_FP32,
        precision="bf16",
        conv_tf32=True,  # PyTorch's defaults, which the script leaves alone
        adam_foreach=None,
        sync_every=1,  # its progress bar shows loss.detach().item() every step
    ),
    predicted_ms=dict(ref128=None, adm64=None),
    cuda_only=None,
)


def _ladder():
    """The rows, each the row above plus one change (or, with `base`, the named row plus the changes given).

    predicted_ms: what an H100 SXM should take at the workload's batch size,
    written down before measuring (the reasoning is in BENCHMARKS.md).
    """
    settings = dict(
        STRICT_FP32,
        compile_scope="whole",  # the ladder's compiled rows compile the whole network, as they were measured
        conv_tf32=True,  # PyTorch's default: cuDNN convolutions in TF32, matmuls in fp32
        sync_every=1,  # loss.item() every step, as the reference logged it
    )
    rows = []

    def add(name, changed, predicted_ms, cuda_only=None, base=None, **change):
        if base is not None:  # start again from an earlier row rather than the one above
            settings.clear()
            settings.update(next(row["settings"] for row in rows if row["name"] == base))
        settings.update(change)
        rows.append(dict(name=name, changed=changed, settings=dict(settings), predicted_ms=predicted_ms, cuda_only=cuda_only))

    add(
        "reference",
        "the reference as shipped: fp32, eager, NCHW, foreach AdamW, EMA one parameter at a time, "
        "loss.item() every step; PyTorch's default TF32 (convolutions yes, matmuls no)",
        dict(ref128=115, adm64=28),
    )
    add(
        "tf32",
        "TF32 for matmuls too (attention, linear layers)",
        dict(ref128=114, adm64=28),
        cuda_only="TF32 is a CUDA tensor-core format",
        matmul_tf32=True,
    )
    add(
        "bf16",
        "bf16 autocast: convolutions and matmuls in bf16, norms and the loss in fp32",
        dict(ref128=90, adm64=31),
        precision="bf16",
    )
    add(
        "channels_last",
        "channels_last (NHWC) weights and activations",
        dict(ref128=88, adm64=33),
        channels_last=True,
    )
    add(
        "cudnn_benchmark",
        "cudnn.benchmark: cuDNN times its algorithms once per shape and keeps the fastest",
        dict(ref128=86, adm64=33),
        cuda_only="cuDNN is CUDA's convolution library",
        cudnn_benchmark=True,
    )
    add(
        "fused_adamw",
        "fused AdamW (one kernel per step; train.py's non-finite guard skips a bad step inside it, "
        "without a host sync) and the EMA as foreach ops",
        dict(ref128=81, adm64=24),
        fused_adam=True,
        nonfinite_guard=True,
        ema_foreach=True,
    )
    add(
        "compile",
        "torch.compile, mode 'default' (Inductor fuses norms, activations and casts)",
        dict(ref128=60, adm64=6),
        compile_mode="default",
    )
    add(
        "no_syncs",
        "no host syncs in the step: the loss is read every 50 steps, as train.py logs it",
        dict(ref128=59.5, adm64=5.8),
        sync_every=TRAIN_DEFAULTS.logging_steps,
    )
    add(
        "cuda_graphs",
        "CUDA graphs: torch.compile mode 'reduce-overhead'",
        dict(ref128=59.5, adm64=5.3),
        cuda_only="CUDA graphs need a CUDA device",
        compile_mode="reduce-overhead",
    )
    add(
        "step_graph",
        "the whole step (forward, backward, clipping, AdamW, EMA) in one CUDA graph around the compiled network",
        dict(ref128=None, adm64=None),
        cuda_only="CUDA graphs need a CUDA device",
        compile_mode="step-graph",
    )
    add(
        "force_layout",
        "no_syncs (compile mode 'default' again, no CUDA graphs) with Inductor's layout optimisation forced: "
        "it otherwise turns channels_last off for the whole graph, because conv_out (128 -> 3) has "
        "out_channels * 2 <= in_channels",
        dict(ref128=None, adm64=None),
        cuda_only="on a CPU with mkldnn Inductor always keeps channels_last: nothing to force",
        base="no_syncs",
        force_layout=True,
    )
    add(
        "fused_norm",
        "train.py's step with fused_norm (python -m bench --fused_norm; it turns channels_last on): no_syncs with "
        "--compile_mode auto as train.py picks it and Inductor's layout left alone (no force_layout), plus fused_norm.py's NHWC "
        "GroupNorm+SiLU Triton kernels in the ResNet blocks and the final norm, and Upsample2D without its NCHW copy",
        dict(ref128=None, adm64=None),
        cuda_only="the kernels run on NHWC CUDA tensors",
        base="no_syncs",
        compile_mode="auto",
        compile_scope="auto",  # as train.py compiles
        fused_norm=True,
    )
    return rows


LADDER = _ladder()


def train_settings(*argv, **settings):
    """A row's settings for what `python train.py *argv` runs on this machine's device (config.py resolves them),
    with `settings` (config.SPEED_SETTINGS: channels_last=True, ...) set on its configuration."""
    args = config.parse_args(list(argv))
    for name, value in settings.items():
        setattr(args, name, value)
    args = config.resolve(args)
    return dict(
        precision=args.mixed_precision if args.mixed_precision in ("bf16", "fp8") else "fp32",
        matmul_tf32=args.allow_tf32,
        conv_tf32=args.allow_tf32,
        cudnn_benchmark=args.cudnn_benchmark,
        channels_last=args.channels_last,
        fused_adam=args.fused_adam,
        nonfinite_guard=True,  # train.py always checks each step for NaN/inf
        adam_foreach=True,
        ema_foreach=True,  # train.py builds its EMAModel with foreach=True
        compile_mode=None if args.compile_mode == "off" else args.compile_mode,  # auto: per workload (resolve_settings)
        compile_scope=args.compile_scope,  # auto: as train.py picks it for the workload (resolve_settings)
        force_layout=False,  # compiling.inductor_settings: no train.py flag sets it
        fused_norm=args.fused_norm,
        sdpa_backend=None,  # train.py leaves the choice to torch
        sync_every=args.logging_steps,
    )


def train_default_variant(**given):
    """The row for what `python train.py` runs by default on this machine's device, with `given`
    (the ladder's --channels_last, ...) set on its configuration."""
    settings = train_settings(**given)
    # --compile_mode auto is 'default' for ref128 and CUDA graphs for adm64 (resolve_settings): compare with 'default'.
    fixed = dict(settings, compile_mode="default") if settings["compile_mode"] == "auto" else dict(settings)
    fixed.pop("compile_scope", None)  # the ladder's rows compile the whole network
    nearest = min(LADDER, key=lambda row: sum(row["settings"][k] != v for k, v in fixed.items()))
    where = " where --compile_mode auto picks 'default'" if settings["compile_mode"] == "auto" else ""
    but = ", ".join(f"{k}={v}" for k, v in fixed.items() if nearest["settings"][k] != v)
    head = f"train.py's step with {', '.join(f'{k}={v}' for k, v in given.items())}" if given else (
        "what `python train.py` runs by default here")  # fmt: skip
    changed = f"{head} (the settings of {nearest['name']}{where}{' but ' + but if but else ''})"
    return dict(name="train_default", changed=changed, settings=settings, predicted_ms=dict(ref128=59.5, adm64=5.8), cuda_only=None)


# What an H100 SXM should take for DiT-XL/2 at batch 64 (the `dit` workload), written down before measuring:
# 45.6 TFLOP a step, ~75 ms of bf16 matmuls at ~600 TFLOP/s; eager adds ~45 ms of norm, modulation, GELU and
# residual passes over 64x256x1152 activations (~10 a block forward, twice that backward, 28 blocks) and
# ~12 ms of fused AdamW, EMA and clipping over 675M fp32 weights; compiling fuses about half the passes.
DIT_PREDICTED_MS = dict(eager=140, compiled=115, train_default=115)
# Regional compilation leaves the patch embedding, the final layer and the glue between blocks eager:
# predicted within 3% of the whole network compiled (the `compiled` row's H100 step, BENCHMARKS.md), written down
# before measuring.
DIT_PREDICTED_MS["regional"] = 131
# The eager step replayed as one CUDA graph: a DiT's eager step is bound by its kernels, not their launches, so no
# faster than eager (the H100's eager row, 187 ms); ddpm32's at batch 128 as the UNet's eager MFU predicted it
# (4.78 TFLOP at 11.6% of an H100's bf16 peak), written down before measuring.
EAGER_GRAPH_PREDICTED_MS = dict(dit=187, ddpm32=42)


def train_compile_variants(**given):
    """train.py's step (train_default's settings) eager, compiled whole and compiled regionally (each repeated
    block once): --compile_mode off, and default with each compile_scope; and captured whole around the eager
    network (--compile_mode eager-graph)."""
    rows = []
    for name, mode, scope in (("eager", "off", None), ("compiled", "default", "whole"), ("regional", "default", "regional"),
                              ("eager_graph", "eager-graph", None)):  # fmt: skip
        also = "".join(f", {k}={v}" for k, v in given.items())
        how = f"--compile_mode {mode}" + (f", compile_scope {scope}" if scope else "")
        changed = f"train.py's step {name} ({how}{also}; not a rung: train_default's settings but the compile)"
        settings = train_settings("--compile_mode", mode, **given)
        settings["compile_scope"] = scope or settings["compile_scope"]
        predicted = EAGER_GRAPH_PREDICTED_MS if name == "eager_graph" else dict(dit=DIT_PREDICTED_MS[name])
        rows.append(dict(name=name, changed=changed, settings=settings, predicted_ms=predicted,
                         cuda_only="CUDA graphs need a CUDA device" if mode == "eager-graph" else None))  # fmt: skip
    return rows


# The bf16 step past 40% MFU and the FP8 step (issue 48), each the `compiled` row (the whole network, mode default)
# with one change; predicted for DiT-XL/2 at batch 64 on an H100 SXM before measuring (ms): attention is ~4% of
# the step's FLOPs at 256 tokens, so its kernel moves the step by a few ms either way; max-autotune times Inductor's
# matmul templates against cuBLAS (~5%); fp8 halves the ~75 ms of block matmuls' time at best, less the casts
# and amax reductions it adds (~10 ms).
# fp8 first: the row with the most at stake runs before a deadline can cut the call short.
DIT_ROWS = (
    ("fp8", "--mixed_precision fp8: the blocks' attention and MLP linear layers in FP8 through torchao "
     "(fp8.py), the rest bf16", 100, None, dict(precision="fp8")),
    ("flash_attention", "SDPA's flash attention kernel only (torch.nn.attention.sdpa_kernel)", 128,
     "flash attention is a CUDA kernel", dict(sdpa_backend="FLASH_ATTENTION")),
    ("cudnn_attention", "SDPA's cuDNN attention kernel only (torch.nn.attention.sdpa_kernel)", 126,
     "cuDNN attention is a CUDA kernel", dict(sdpa_backend="CUDNN_ATTENTION")),
    ("max_autotune", "torch.compile mode 'max-autotune-no-cudagraphs': Inductor times its matmul templates "
     "against cuBLAS and keeps the fastest", 122, "its search is for a GPU's kernels (minutes of compile)",
     dict(compile_mode="max-autotune-no-cudagraphs")),
    # TREAD's routing (issue 76): 62% of the step's FLOPs at DiT-XL/2 (blocks 6-26 of 28 on half the tokens); its
    # gathers and scatters cost a little. Another function of the weights: its check is not against the fp32 step's.
    ("routed", "--token_routing 0.5: half of each image's tokens skip TREAD's middle blocks (dit.py)", 75, None,
     dict(token_routing="0.5")),
    # Muon (issue 76): Newton-Schulz on every block matrix, 20.5 TFLOP in bf16 a step (docs/muon.md), one matrix at
    # a time: about 40 ms at half the bf16 peak, and some 4,000 small kernels more.
    ("muon", "--optimizer muon: torch.optim.Muon for the blocks' matrices, AdamW for the rest (optimizer.py)", 165, None,
     dict(optimizer="muon")),
)  # fmt: skip


DIT_ROWS_BY_NAME = {row[0]: row for row in DIT_ROWS}


def dit_variants(**given):
    """DIT_ROWS as rows: train.py's step compiled whole (the `compiled` row's settings), one change each; with
    --compile_scope regional, each repeated block compiled once (the `regional` row's): a compile short enough
    for a lent GPU's call, which fp8's whole network of DiT-XL/2 was not (BENCHMARKS.md, Speed on a GPU)."""
    base = train_settings("--compile_mode", "default", **given)
    base["compile_scope"] = given.get("compile_scope") or "whole"
    how = "compiled" if base["compile_scope"] == "whole" else "regional"
    return [dict(name=name, changed=f"{how}, and {changed}", settings=dict(base, **change),
                 predicted_ms=dict(dit=predicted), cuda_only=cuda_only)
            for name, changed, predicted, cuda_only, change in DIT_ROWS]  # fmt: skip


def all_variants(settings=None):
    """Every row; `settings` (the ladder's own flags) set on the configuration of the last ones (train.py's step
    eager, compiled, as train.py picks it, and a DiT's rows)."""
    default = train_default_variant(**(settings or {}))
    default["predicted_ms"] = dict(default["predicted_ms"], dit=DIT_PREDICTED_MS["train_default"])
    given = settings or {}
    return [DIFFUSERS_EXAMPLE] + LADDER + train_compile_variants(**given) + dit_variants(**given) + [default]


def matmul_precision(settings, device):
    """The precision convolutions and matmuls run in: picks the tolerance and the row's own peak (fp8's: the FP8
    peak, for the converted layers' matmuls; the table's MFU is against bf16's in every row)."""
    if settings["precision"] in ("bf16", "fp8"):
        return settings["precision"]
    if device.type == "cuda" and (settings["matmul_tf32"] or settings["conv_tf32"]):
        return "tf32"
    return "fp32"


def set_backend_flags(settings):
    """TF32 and cuDNN autotuning are process-wide switches: each row sets all of them."""
    torch.backends.cuda.matmul.allow_tf32 = settings["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = settings["conv_tf32"]
    torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- one variant's training step ---------------------------------------------------


class TrainingStep:
    """A variant's training step on fixed starting weights: train.py's step.TrainStep, built as train.py builds it.

    Calling it runs one step; `loss_and_backward` runs the part the
    correctness check compares (the loss and the gradients it leaves).
    """

    def __init__(self, settings, workload, init_state, images, device):
        # fp8: builder.build swaps a DiT's block linear layers for FP8 ones; config.py refuses a UNet's, or a GPU's
        # without FP8 tensor cores
        t = self.train_args = train_defaults(workload, *(["--mixed_precision", "fp8"] if settings["precision"] == "fp8" else []),
                                             "--token_routing", settings.get("token_routing", "0"),
                                             "--optimizer", settings.get("optimizer", "adamw"))  # fmt: skip
        set_backend_flags(settings)
        self.device, self.images = device, images
        t.channels_last, t.fused_adam, t.fused_norm = settings["channels_last"], settings["fused_adam"], settings["fused_norm"]
        # train.py's pieces (builder.build), from the same starting weights; the EMA's update foreach or not,
        # AdamW foreach or (diffusers' example: adam_foreach None) as torch picks
        pieces = builder.build(t, TIMED_RUN_STEPS, device, init_state=init_state, write_ema=False,
                                ema_foreach=settings["ema_foreach"], adam_foreach=settings["adam_foreach"])  # fmt: skip
        self.unet, self.objective, self.ema = pieces.network, pieces.objective, pieces.ema
        self.optimizer, self.lr_scheduler = pieces.optimizer, pieces.lr_scheduler
        self.unet.train()
        self.model = compiling.compile_network(self.unet, settings["compile_mode"], force_layout=settings["force_layout"],
                                           scope=settings.get("compile_scope") or "whole")  # the ladder's rows: whole
        # train.py's guard: with a fused AdamW it skips a NaN/inf step on the device.
        self.guard = steps.NonFiniteGuard(self.optimizer, t.on_fault, device) if settings["nonfinite_guard"] else None
        # train.py's accelerator autocasts the model's forward; the loss is fp32 either way.
        self.autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=settings["precision"] in ("bf16", "fp8"))
        # the attention kernel a row pins (its name in torch.nn.attention.SDPBackend), around every call: a compiled
        # graph takes the kernel that is allowed when it is traced
        backend = settings.get("sdpa_backend")
        self.attention = (lambda: sdpa_kernel(getattr(SDPBackend, backend))) if backend else contextlib.nullcontext
        self.step = compiling.build_step(
            steps.TrainStep(self.model, self.unet, self.objective, self.optimizer, self.lr_scheduler, self.ema,
                            self.guard, t.max_grad_norm, data.random_flips(t),
                            autocast=lambda: torch.autocast(**self.autocast)),
            settings["compile_mode"],
            device,
        )  # fmt: skip

    def loss_and_backward(self, clean, noise, timesteps):
        with torch.autocast(**self.autocast), self.attention():
            loss = self.objective.loss_at(self.model, clean, timesteps, noise)  # train.py's objective, its inputs given
        loss.backward()
        return loss.detach()

    def __call__(self):
        with self.attention():
            return self.step([self.images])[0]["loss"]


def flat_gradients(unet):
    """Every parameter's gradient as one fp32 vector on the CPU (whatever the memory format)."""
    return torch.cat([p.grad.float().reshape(-1) for p in unet.parameters()]).cpu()


def check_inputs(images, seed, device):
    """Fixed model inputs for the check: clean images (no flip), noise and timesteps."""
    g = torch.Generator().manual_seed(seed + 1)
    clean = batches.to_model_input(images, random_flip=False)
    noise = torch.randn(clean.shape, generator=g).to(device)
    timesteps = torch.randint(0, config.SETTINGS["num_train_timesteps"], (clean.shape[0],), generator=g).to(device)
    return clean, noise, timesteps


def reference_step(workload, init_state, images, inputs, device):
    """(loss, gradients) of the plain fp32 eager step: what every variant must reproduce."""
    step = TrainingStep(STRICT_FP32, workload, init_state, images, device)
    loss = step.loss_and_backward(*inputs).item()
    gradients = flat_gradients(step.unet)
    del step
    return loss, gradients


def check_variant(step, settings, inputs, reference, device):
    """The variant's loss and gradients on `inputs` against the fp32 eager step's.

    Returns the relative errors, the tolerance and, as first_call_s, the wall
    time of the first forward+backward (which compiles a compiled model).
    Under CUDA graphs the first calls warm up and record, so it compares the
    third call, a graph replay.
    """
    calls = 3 if settings["compile_mode"] in ("reduce-overhead", "max-autotune") else 1
    before = compiling.compile_phase_totals()
    start = time.perf_counter()
    for call in range(calls):
        step.optimizer.zero_grad(set_to_none=True)
        loss = step.loss_and_backward(*inputs)
        if call == 0:
            synchronize(device)
            first_call_s = time.perf_counter() - start
            phases = compiling.compile_phases(before, compiling.compile_phase_totals())
    loss = loss.item()
    gradients = flat_gradients(step.unet)
    step.optimizer.zero_grad(set_to_none=True)
    precision = matmul_precision(settings, device)
    result = dict(precision=precision, tolerance=TOLERANCE[precision], first_call_s=first_call_s, compile_phases_s=phases)
    if reference is None or settings.get("token_routing"):  # routed: another function of the weights than the step's
        return result | dict(passed=None, loss_rel_err=None, grad_rel_err=None)
    ref_loss, ref_gradients = reference
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    grad_err = ((gradients - ref_gradients).norm() / ref_gradients.norm()).item()
    # NaN compares False, so a step that produced NaN fails.
    passed = loss_err <= TOLERANCE[precision] and grad_err <= TOLERANCE[precision]
    return result | dict(passed=passed, loss_rel_err=loss_err, grad_rel_err=grad_err)


def time_steps(step, steps, warmup, sync_every, device):
    """Seconds per step of `steps` steps after `warmup` untimed ones, and the mean loss."""
    timer = flops.StepTimer(device, warmup)
    loss_sum = torch.zeros((), device=device)
    timer.restart()
    for i in range(1, warmup + steps + 1):
        loss_sum += step()
        if sync_every and i % sync_every == 0:
            loss_sum.item()  # what reading the loss costs: the host waits for the device
        timer.step_done()
    return timer.collect(), loss_sum.item() / (warmup + steps)


def run_variant(variant, workload, batch_size, init_state, images, reference, args, device):
    """Build, check and time one variant; returns its row of results (status ok)."""
    settings = resolve_settings(variant["settings"], workload, batch_size, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = TrainingStep(settings, workload, init_state, images, device)
    check = check_variant(step, settings, check_inputs(images, args.seed, device), reference, device)
    # every row's timed steps draw the same noise, timesteps and flips from the same weights: their mean losses
    # differ by what the row changes (fp8's target: within 2% of bf16's), not by the draw
    torch.manual_seed(args.seed)
    times, mean_loss = time_steps(step, args.steps, args.warmup, settings["sync_every"], device)
    deciles = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
    return dict(
        status="ok",
        compile_mode=settings["compile_mode"],
        optimizer=optimizer_kind(step.optimizer, device),
        check=check,
        first_call_s=check.pop("first_call_s"),
        compile_phases_s=check.pop("compile_phases_s"),
        step_times_s=times,
        step_time_s_median=statistics.median(times),
        step_time_s_p10=deciles[0],
        step_time_s_p90=deciles[-1],
        mean_loss=mean_loss,
        peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    )


def optimizer_kind(optimizer, device):
    """'fused', 'foreach' or 'per-parameter': the AdamW implementation that runs (foreach=None is torch's pick)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    if optimizer.defaults.get("fused"):
        return "fused"
    foreach = optimizer.defaults.get("foreach")
    if foreach is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        foreach = _default_to_fused_or_foreach(params, differentiable=False)[1]
    return "foreach" if foreach else "per-parameter"


def uses_cuda_graphs(settings):
    return settings["compile_mode"] in compiling.CUDA_GRAPH_MODES


def resolve_settings(settings, workload, batch_size, device):
    """The row's settings with --compile_mode auto, and an unset compile_scope, replaced by what train.py
    would pick here (the compile's scope by the workload's network; for auto, the mode as a run of any length)."""
    args = train_defaults(workload)
    if settings.get("compile_scope", "whole") in (None, "auto"):
        settings = dict(settings, compile_scope=compiling.choose_compile_scope(args)[0])
    if settings["compile_mode"] != "auto":
        return settings
    per_image = flops.step_flops(workload["model"], workload["image_size"], 1, channels=channels_of(workload))["model_flops"]
    mode, _ = compiling.choose_compile_mode(args, device, 1, per_image * batch_size)
    return dict(settings, compile_mode=mode)


def release_memory(device, forget_compiled=False):
    """Free what a finished row held; `forget_compiled` also drops compiled graphs and CUDA-graph pools.

    Compiled graphs are otherwise kept, so that the next row with the same
    compile settings reuses them rather than compiling again.
    """
    gc.collect()
    if forget_compiled:
        torch.compiler.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def pinned_kernel_cache_key(backend):
    """Compile caches keyed by the attention kernel a row pins (`backend`, SDPBackend's name; None: no key
    added). AOTAutograd's cache keys a graph by what Dynamo traced, which is the same whatever SDPA kernel is
    allowed (the kernel is chosen below it): without this a pinned row loads the graph an earlier row
    compiled, with that row's kernel, and times it again (an H100's flash and cuDNN rows did:
    BENCHMARKS.md, Speed on a GPU)."""
    tag = torch.compiler.config.cache_key_tag
    if backend:
        torch.compiler.config.cache_key_tag = f"{tag}|sdpa={backend}"
    try:
        yield
    finally:
        torch.compiler.config.cache_key_tag = tag


def add_rates(row, flops_per_step, batch_size, peak_bf16, peak_row):
    """img/s, achieved TFLOP/s and MFU from the median step time."""
    step_time_s = row["step_time_s_median"]
    row["images_per_s"] = batch_size / step_time_s
    perf = flops.utilization(flops_per_step, flops_per_step, step_time_s, peak_bf16)
    row["achieved_tflops"] = perf["achieved_flops"] / 1e12
    row["mfu"] = perf["mfu"]
    row["mfu_row_precision"] = flops_per_step / step_time_s / peak_row if peak_row else None


def run_workload(name, args, device, peaks, print_line, save):
    """Every variant at every batch size for one workload, smallest batch first; yields each batch's rows.

    `save(rows)` is called with the batch's rows so far after every row.
    """
    workload = WORKLOADS[name]
    torch.manual_seed(args.seed)
    init_state = models.build_network(workload["model"], workload["image_size"], channels=channels_of(workload)).state_dict()
    variants = [v for v in all_variants(args.train_settings) if v["name"] in args.variants]
    # FLOPs are linear in the batch (tests/test_flops.py checks it): count one image, scale.
    per_image = flops.step_flops(workload["model"], workload["image_size"], 1, channels=channels_of(workload))
    out_of_memory_at = {}  # variant -> the batch size it first ran out of memory at
    for batch_size in args.batch_sizes or [workload["batch_size"]]:
        release_memory(device, forget_compiled=True)  # a new shape compiles anew: drop the last one's graphs
        flops_per_step = per_image["model_flops"] * batch_size
        g = torch.Generator().manual_seed(args.seed)
        side = workload["image_size"]
        if workload.get("channels"):  # a latent run's batch: floats, drawn already (batches.to_model_input takes them as they are)
            images = torch.randn(batch_size, workload["channels"], side, side, generator=g).to(device)
        else:
            images = torch.randint(0, 256, (batch_size, 3, side, side), generator=g, dtype=torch.uint8).to(device)
        set_backend_flags(STRICT_FP32)
        reference, reference_note = None, None
        try:
            reference = reference_step(workload, init_state, images, check_inputs(images, args.seed, device), device)
        except torch.OutOfMemoryError:
            reference_note = f"not checked: the fp32 reference step does not fit at batch {batch_size}"
        release_memory(device)

        group = []
        traced_with = None  # the attention kernel the kept compiled graphs were traced with (a row's sdpa_backend)
        for variant in variants:
            row = dict(
                workload=name,
                model=workload["model"],
                image_size=workload["image_size"],
                **({"channels": workload["channels"]} if workload.get("channels") else {}),  # a latent workload's
                batch_size=batch_size,
                params=per_image["params"],
                flops_per_step=flops_per_step,
                variant=variant["name"],
                changed=variant["changed"],
                settings=variant["settings"],
                predicted_ms_h100=variant["predicted_ms"].get(name) if batch_size == workload["batch_size"] else None,
            )
            if variant["cuda_only"] and device.type != "cuda":
                row |= dict(status="skipped", reason=f"{variant['cuda_only']}: not on {device.type}")
            elif variant["name"] in out_of_memory_at:
                row |= dict(status="skipped", reason=f"out of memory at batch {out_of_memory_at[variant['name']]}")
            else:
                print_line(f"  {name} batch {batch_size}: {variant['name']} ...", progress=True)
                if variant["settings"].get("sdpa_backend") != traced_with:  # Dynamo does not guard on sdpa_kernel: a kept
                    release_memory(device, forget_compiled=True)  # graph would run the kernel it was traced with
                    traced_with = variant["settings"].get("sdpa_backend")
                try:
                    with pinned_kernel_cache_key(variant["settings"].get("sdpa_backend")):
                        row |= run_variant(variant, workload, batch_size, init_state, images, reference, args, device)
                    if reference_note:
                        row["check"]["note"] = reference_note
                except torch.OutOfMemoryError as e:
                    out_of_memory_at[variant["name"]] = batch_size
                    row |= dict(status="oom", reason=f"out of memory at batch {batch_size}: {first_line(e, None)}")
                except Exception as e:  # one broken row must not lose the others' numbers
                    row |= dict(status="error", reason=error_line(e))
                # A failed row may leave half-built graphs and CUDA-graph pools behind: drop them too.
                release_memory(device, forget_compiled=row["status"] != "ok" or uses_cuda_graphs(row))
                if row["status"] == "ok":
                    precision = matmul_precision(variant["settings"], device)
                    if variant["settings"].get("token_routing"):  # the routed step's FLOPs, as executed
                        row["flops_per_step"] = batch_size * flops.step_flops(
                            workload["model"], workload["image_size"], 1, channels=channels_of(workload),
                            routing=variant["settings"]["token_routing"])["model_flops"]  # fmt: skip
                    add_rates(row, row["flops_per_step"], batch_size, peaks["bf16"], peaks[precision])
            group.append(row)
            save(group)
        timed = [r for r in group if r["status"] == "ok"]
        for r in timed:
            r["speedup_over"] = timed[0]["variant"]
            r["speedup"] = timed[0]["step_time_s_median"] / r["step_time_s_median"]
            r["loss_vs_first"] = r["mean_loss"] / timed[0]["mean_loss"] - 1
        yield group


# --- output --------------------------------------------------------------------------


def _fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def _check_words(check):
    if check.get("passed") is None:
        return check.get("note", "not checked")
    err = max(check["loss_rel_err"], check["grad_rel_err"])
    return f"{'ok' if check['passed'] else 'FAIL'} {err:.1e} {'<=' if check['passed'] else '>'} {check['tolerance']:.0e}"


def format_group(rows, peak_words):
    """One workload at one batch size as a text table; a row that did not run says why."""
    first = rows[0]
    over = next((r["speedup_over"] for r in rows if "speedup_over" in r), None)
    lines = [
        f"{first['workload']}: {first['model']} ({first['params']:,} parameters) at {input_words(first)}, "
        f"batch {first['batch_size']}: {first['flops_per_step'] / 1e12:.4g} TFLOP/step; MFU against {peak_words}"
        + (f"; speedup over {over}" if over else ""),
    ]
    show_prediction = any(r["predicted_ms_h100"] for r in rows)
    header = ["#", "variant", "ms/step", "p10-p90 ms", "img/s", "TFLOP/s", "MFU %", "peak GiB", "speedup",
              "mean loss vs 1st", "1st call s", "check (max rel err)"] + ["H100 predicted ms"] * show_prediction  # fmt: skip
    table = [header + ["what changed"]]
    for i, r in enumerate(rows, 1):
        if r["status"] != "ok":
            table.append([str(i), r["variant"], f"{r['status']}: {r['reason']}", r["changed"]])
            continue
        cells = [
            str(i),
            r["variant"],
            f"{1e3 * r['step_time_s_median']:.4g}",
            f"{1e3 * r['step_time_s_p10']:.4g}-{1e3 * r['step_time_s_p90']:.4g}",
            f"{r['images_per_s']:.1f}",
            f"{r['achieved_tflops']:.4g}",
            _fmt(r["mfu"] and 100 * r["mfu"], ".1f", "n/a"),
            _fmt(r["peak_memory_gib"], ".2f", "n/a"),
            f"{r['speedup']:.2f}x",
            f"{100 * r['loss_vs_first']:+.2f}%",
            f"{r['first_call_s']:.2f}",
            _check_words(r["check"]),
        ]
        table.append(cells + [_fmt(r["predicted_ms_h100"], "g")] * show_prediction + [r["changed"]])
    full = [row for row in table if len(row) == len(header) + 1]
    widths = [max(len(row[c]) for row in full) for c in range(len(header))]
    for row in table:
        if len(row) == len(header) + 1:
            lines.append("  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)) + "  " + row[-1])
        else:  # the reason spans the number columns
            lines.append(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}  ({row[3]})")
    for r in rows:  # where a row's 1st call went, by torch's compile timers (nested; all of them in the JSON)
        phases = r.get("compile_phases_s") or {}
        shown = ", ".join(f"{name} {phases[name]:g}" for name in compiling.COMPILE_PHASES_SHOWN if name in phases)
        if shown:
            lines.append(f"{r['variant']}'s 1st call, compile timers (s): {shown}")
    return lines


def draw_chart(rows, env, path):
    """Bars of img/s per variant, one panel per workload, one bar per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(len(workloads), 1, figsize=(10, 0.45 * len(all_variants()) * len(workloads) + 1.5), squeeze=False)
    for ax, name in zip(axes[:, 0], workloads):
        mine = [r for r in rows if r["workload"] == name]
        variants = list(dict.fromkeys(r["variant"] for r in mine))
        batches = list(dict.fromkeys(r["batch_size"] for r in mine))
        height = 0.8 / len(batches)
        for j, batch in enumerate(batches):
            for i, variant in enumerate(variants):
                r = next(r for r in mine if r["variant"] == variant and r["batch_size"] == batch)
                y = i + (j - (len(batches) - 1) / 2) * height
                if r["status"] != "ok":
                    ax.text(0, y, f" {r['status']}", va="center", fontsize=7, color="grey")
                    continue
                ax.barh(y, r["images_per_s"], height=height, color=f"C{j}", label=f"batch {batch}" if i == 0 else None)
                ax.text(r["images_per_s"], y, f" {r['speedup']:.2f}x", va="center", fontsize=7)
                if env["device_type"] == "cuda" and r["predicted_ms_h100"]:
                    ax.plot(batch / (r["predicted_ms_h100"] / 1e3), y, "k|", markersize=10)
        ax.set_yticks(range(len(variants)), variants)
        ax.invert_yaxis()
        ax.set_xlabel("images/s (| = H100 prediction)" if env["device_type"] == "cuda" else "images/s")
        ax.set_title(f"{name}: {mine[0]['model']} at {input_words(mine[0])}", fontsize=10)
        if any(r["status"] == "ok" for r in mine):
            ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{env['device']}, torch {env['torch']}, {env['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- CLI -----------------------------------------------------------------------------


def _batch_sizes(text):
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch_sizes takes integers separated by commas (got '{text}')") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--batch_sizes must be integers of at least 1 (got '{text}')")
    return sorted(set(sizes))


# the ladder's flags for config.SPEED_SETTINGS, the settings its rows vary and train.py does not.
SETTING_FLAGS = dict(
    channels_last="channels_last (NHWC) weights and activations (train.py: off, on with fused_norm)",
    cudnn_benchmark="cudnn.benchmark (train.py: on with a CUDA GPU)",
    fused_adam="fused AdamW (train.py: on; its non-finite skip happens inside it)",
    allow_tf32="TF32 for fp32 matmuls and convolutions on a CUDA GPU (train.py: on)",
    fused_norm="fused_norm.py's NHWC GroupNorm+SiLU kernels; needs a CUDA GPU and channels_last (train.py: off)",
)
assert set(SETTING_FLAGS) == set(config.SPEED_SETTINGS)
# The ladder's own flags (with SETTING_FLAGS): --sweep and --quality do not read them.
LADDER_FLAGS = ("batch_sizes", "variants", "steps", "warmup", "compile_workers", "compile_scope")


def parse_args(argv=None):
    p = config.Parser(prog="bench", description="Time the training step's speed-ups, one row at a time.")
    p.add_argument(
        "--workload",
        default=None,
        choices=(*WORKLOADS, *WORKLOAD_GROUPS),
        help="model and image size: ref128 (128px, batch 64), adm64 (64px, batch 32), small, tiny, dit (DiT-XL/2 on "
        "32x32x4 latents, batch 64), dit-small (32px, batch 32), or all (ref128 and adm64); default: all on a GPU, "
        "tiny on a CPU (bf16 on a CPU without bf16 instructions is emulated: small's bf16 rows take ~20 s a step "
        "on 2 AVX2 cores)",
    )
    p.add_argument(
        "--batch_sizes",
        type=_batch_sizes,
        default=None,
        help="comma-separated batch sizes to sweep, smallest first; a variant that runs out of memory "
        "is not tried at larger ones (default: the workload's batch)",
    )
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated rows to run (default: all; a dit workload's: {', '.join(WORKLOAD_VARIANTS['dit'])}): "
        f"{', '.join(v['name'] for v in all_variants())}",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per row before timing")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the inputs")
    p.add_argument("--output", default="bench/results/latest", help="folder for the .json, .txt and .png")
    p.add_argument("--tag", default=None, help="file name for the outputs (default: from the device, workload and batches)")
    p.add_argument(
        "--redraw", default=None, metavar="JSON", help="only draw the chart of an earlier run's JSON, next to it, and exit"
    )
    p.add_argument("--compile_workers", default="early", choices=("early", "inductor"),
                   help="when Inductor's compile workers start on a GPU: early, at the ladder's start (train.py starts them "
                        "once it has planned a compiled step: compiling.start_compile_workers), or when Inductor's first graph "
                        "reaches it, torch's own timing")  # fmt: skip
    s = p.add_argument_group("train.py's step settings that train.py has no flag for (config.SETTINGS): set on the "
                             "train_default row's configuration (default: what train.py runs)")  # fmt: skip
    for name, says in SETTING_FLAGS.items():
        s.add_argument(f"--{name}", default=None, action=argparse.BooleanOptionalAction, help=says)
    s.add_argument("--compile_scope", default=None, choices=("whole", "regional"),
                   help="what a compiled step compiles: the network as one graph, or each repeated block once "
                        "(train.py: by the run's length, compiling.choose_compile_scope); a DiT's rows (fp8, the "
                        "attention kernels, max_autotune) take it too, else compile the whole network")  # fmt: skip
    groups = {"--sweep": sweep.add_arguments(p), "--quality": quality.add_arguments(p)}
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    # the flags typed (abbreviated too): argparse gives a default only to a name the namespace lacks
    unset = object()
    typed = vars(p.parse_args(argv, argparse.Namespace(**{a.dest: unset for a in p._actions})))
    # which commands read each flag (the others: every command), so that one typed for another is refused, not
    # left unread; the sweep says itself that --batch_sizes and --variants are the ladder's
    readers = {f"--{a.dest}": ("the ladder",) for a in p._actions if a.dest in (*LADDER_FLAGS, *SETTING_FLAGS)}
    readers |= {f"--{a.dest}": (command,) for command, group in groups.items() for a in group._group_actions
                if f"--{a.dest}" != command}  # fmt: skip
    readers |= {"--workload": ("the ladder", "--sweep"), "--train_args": ("--sweep", "--quality")}
    args.running = "--sweep" if args.sweep else "--quality" if args.quality else "the ladder"
    args.unread = {flag: commands for flag, commands in readers.items() if typed[flag[2:]] is not unset
                   and args.running not in commands
                   and not (args.running == "--sweep" and flag in ("--batch_sizes", "--variants"))}  # fmt: skip
    args.train_settings = {name: getattr(args, name) for name in (*SETTING_FLAGS, "compile_scope") if getattr(args, name) is not None}
    return args


def validate(args):
    if args.redraw:
        try:
            result = json.loads(Path(args.redraw).read_text())
        except (OSError, ValueError):
            result = None
        kinds = ({"environment", "results"}, {"environment", "sweep", "points"}, {"environment", "rows", "images"})  # the ladder's, a sweep's, the quality ladder's
        if not isinstance(result, dict) or not any(kind <= set(result) for kind in kinds):
            raise ConfigError(f"--redraw {args.redraw}: not the JSON of a python -m bench run")
        args.redraw_result = result
        return args
    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1 (got {args.steps})")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be at least 0 (got {args.warmup})")
    names = [v["name"] for v in all_variants(args.train_settings)]  # and the ladder's settings checked (config.resolve)
    if args.workload is None:
        args.workload = "all" if torch.cuda.is_available() else "tiny"
    if args.variants is None:
        args.variants = list(WORKLOAD_VARIANTS.get(args.workload, [n for n in names if n not in DIT_ROWS_BY_NAME]))
    else:
        args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in args.variants if v not in names]
        if unknown or not args.variants:
            raise ConfigError(f"unknown --variants '{','.join(unknown)}': choose from {', '.join(names)}")
    if not takes_ddpm(WORKLOADS.get(args.workload, WORKLOADS["tiny"])["model"]):
        raise ConfigError(f"--workload {args.workload}: the ladder times the DDPM step; compare EDM2 with --sweep model")
    try:
        Path(args.output).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write to --output {args.output} ({e.strerror})") from None
    checkpoint.check_writable(args.output, "--output")  # a read-only folder: before the timing, not after it
    return args


def refuse_unread(args):
    """One command at a time (the ladder, --sweep, --quality or --redraw), and no flag of another's, which it
    would not read."""
    given = [flag for flag in ("--sweep", "--quality", "--redraw") if getattr(args, flag[2:])]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} are two commands: give one")
    for flag, commands in args.unread.items():
        owner = " and ".join(f"{c}'s" for c in commands)
        if args.running != "the ladder":
            raise ConfigError(f"{flag} is {owner}, and {args.running} does not read it: leave it out")
        add = " or ".join(f"--sweep NAME ({', '.join(sweep.SWEEPS)})" if c == "--sweep" else c for c in commands)
        raise ConfigError(f"{flag} is {owner}, and the ladder does not read it: add {add}, or leave it out")


def main(args):
    """Run the ladder; 0 when every row that ran passed its check, 1 otherwise; a bad flag exits 2 with one line."""
    with one_line_errors("bench"):
        refuse_unread(args)
    if args.sweep:  # whole train.py runs on the built-in images: the pixel workloads
        return sweep.main(args, {k: w for k, w in WORKLOADS.items() if not w.get("channels")}, draw_chart_if_possible)
    if args.quality:
        return quality.main(args)
    with one_line_errors("bench"):
        args = validate(args)
    if args.redraw:
        print(draw_chart_if_possible(args.redraw_result, Path(args.redraw).with_suffix(".png")))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.compile_workers == "early":
        compiling.start_compile_workers(device, "default")
    env = profiling.environment(device, ["python -m bench", *args.argv])
    lines = []

    def print_line(text="", progress=False):
        print(text, flush=True)
        if not progress:
            lines.append(text)

    for line in profiling.environment_lines(env):
        print_line(line)

    # An unknown GPU, or a CPU, has no known peak: MFU is then n/a, never a guess.
    gpu_name = env["device"] if device.type == "cuda" else None
    peaks = {precision: flops.lookup_peak(gpu_name, precision)[1] for precision in ("fp32", "tf32", "bf16", "fp8")}
    gpu = flops.lookup_peak(gpu_name, "bf16")[0]
    peak_words = f"the {gpu} dense bf16 peak, {peaks['bf16'] / 1e12:g} TFLOP/s" if gpu else f"no known peak ({env['device']})"

    tag = args.tag or _default_tag(env, args)
    rows = []

    def save(unfinished=()):
        """Written after every row, so that a run cut short keeps what it measured."""
        return write_outputs(rows + list(unfinished), env, args, lines, tag)

    for name in WORKLOAD_GROUPS.get(args.workload, (args.workload,)):
        for group in run_workload(name, args, device, peaks, print_line, save):
            print_line()
            for line in format_group(group, peak_words):
                print_line(line)
            rows.extend(group)
            result = save()
    chart = draw_chart_if_possible(result, Path(args.output) / f"{tag}.png")
    print(f"\nwrote {Path(args.output) / tag}.json and .txt; {chart}")

    failed = [f"{r['workload']} batch {r['batch_size']} {r['variant']}" for r in rows if r["status"] == "error" or (r["status"] == "ok" and r["check"]["passed"] is False)]
    if failed:
        print(f"bench: {len(failed)} row(s) failed or did not match the fp32 step: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def write_outputs(rows, env, args, lines, tag):
    """The results as JSON and the printed tables as text; returns the JSON's content."""
    out = Path(args.output)
    settings = dict(steps=args.steps, warmup=args.warmup, seed=args.seed, tolerance=TOLERANCE, train_defaults=vars(TRAIN_DEFAULTS))
    result = dict(environment=env, settings=settings, results=rows)
    (out / f"{tag}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / f"{tag}.txt").write_text("\n".join(lines) + "\n")
    return result


def draw_chart_if_possible(result, path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the GPU machine's image may lack it: draw later with --redraw
        return f"no chart: matplotlib is not installed (python -m bench --redraw {path.with_suffix('.json')})"
    if "sweep" in result:
        sweep.draw(result, path)
    elif "rows" in result:  # the quality ladder, stopped before its end: its table too
        quality.draw(result, path)
        path.with_suffix(".txt").write_text("\n".join([*profiling.environment_lines(result["environment"]), "",
                                                        *quality.format_table(result)]) + "\n")  # fmt: skip
    else:
        draw_chart(result["results"], result["environment"], path)
    return f"chart {path}"


def _default_tag(env, args):
    batches = "-".join(map(str, args.batch_sizes)) if args.batch_sizes else "default"
    return f"{profiling.device_tag(env)}_{args.workload}_b{batches}"


def command():
    """`python -m bench`: main's exit code; Ctrl-C exits 130 (the JSON holds every row measured before it)."""
    with one_line_errors("bench", interrupted="the rows measured so far are in the .json in --output"):
        return main(parse_args())
