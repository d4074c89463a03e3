"""train.py's configuration: every flag declared once, the presets that fill what is unset, config files.

    args = config.parse_args(["--config", "configs/cifar10-edm2-E.yaml", "--train_batch_size", "256"])
    args = config.resolve(args)  # every value set and checked: nothing is left None for a later step

Each flag is one declaration in `build_parser`, grouped by concern: its
default, its help and its allowed range (the `type=`: `at_least(1)`,
`positive`, `unit_interval`, ...). `--config FILE` (YAML or JSON, a run's own
train_config.json included) sets flags as if typed before the command line,
so a flag on the command line wins. `resolve` then, before any data loads,
checks every range, fills what is unset from the model preset (`model.PRESETS`)
and the machine, and checks the combinations; it is idempotent. Only
`--compile_mode auto` is left for train.py: it needs the device and the FLOPs
of a step (`compiling.choose_compile_mode`).

A resolved configuration also holds settings that are not flags (`SETTINGS`:
what train.py always does; `python -m bench` sets the speed ones on the
configurations it builds); a run's train_config.json records them apart from
its flags, under "settings" (`recorded`). The code reads today's flags only
(what --augment says of flips: `data.random_flips`). A flag that was removed
(`REMOVED`) is a one-line error naming what replaced it, on the command line
and in a file alike (a run's train_config.json of an earlier version).
"""

import argparse
import functools
import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

import torch

from ddpm_train.data import captions
from ddpm_train.training import checkpoint
from ddpm_train.perf import compiling
from ddpm_train.data import data
from ddpm_train.data import sources
from ddpm_train.data import pixels
from ddpm_train.data import shapes
from ddpm_train.networks import dit
from ddpm_train.training import ema as posthoc_ema
from ddpm_train.networks import fp8
from ddpm_train.networks import init_from
from ddpm_train.data import autoencoder
from ddpm_train.data import latents
from ddpm_train.diffusion import loss_terms
from ddpm_train.evaluation import metrics
from ddpm_train.networks import model as models
from ddpm_train.training import optimizer as optimizers
from ddpm_train.diffusion import objectives
from ddpm_train.diffusion import samplers
from ddpm_train.evaluation import sampling
from ddpm_train import sizes
from ddpm_train.errors import ConfigError, OneLineParser

LR_SCHEDULES = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt",
)  # fmt: skip
LOGGERS = ("tensorboard", "wandb", "none")
PROFILE_LEVELS = ("kernels", "operators")

# EDM2's t_ref for ImageNet-512 (70k steps of 2048 images), when the preset has none.
DEFAULT_LR_REF_STEPS = 70_000

# What config.resolve fills where neither the command line nor the preset sets it
# (a preset's `ddpm` and `flags` in model.PRESETS come first): Ho et al.'s DDPM,
# EDM's noise levels for --timestep_sampling lognormal, diffusers' example's batch.
PRESET_FALLBACKS = dict(prediction_type="epsilon", timestep_sampling="uniform", P_mean_std=[objectives.P_MEAN, objectives.P_STD],
                        train_batch_size=16, num_epochs=8, ema="standard")  # fmt: skip
# ... but a class-conditional or captioned DDPM run predicts v: with epsilon it learns its labels late (at high noise
# epsilon is nearly the noisy input itself, whatever the class; docs/conditional.md). Measured on the
# labelled photos for `small` and `dit-small` at two seeds (BENCHMARKS.md, Quality: the conditional
# defaults, and their record).
CONDITIONAL_FALLBACKS = dict(prediction_type="v_prediction")
SMALL = models.PRESETS["small"]

# The bare `python train.py` on a CUDA GPU (the built-in shapes, --model auto at 32px):
# `small` at batch 4 would leave an H100 idle (MFU well under 1%). These fill what the
# command line leaves unset instead: Ho et al.'s CIFAR-10 UNet at batch 128 (on an H100
# it learned recognisable shapes: BENCHMARKS.md, Speed on a GPU), the
# small preset's DDPM settings (v-prediction, EDM's noise levels, no EMA: the CPU quality
# ladder's winners), and 24 epochs of 16,384 generated images, 3,072 steps.
GPU_BARE_RUN = dict(model="ddpm32", train_batch_size=128, num_epochs=24, shapes_num_images=16384,
                    learning_rate=2e-4, ema="none", **SMALL.ddpm)  # fmt: skip
CPU_SHAPES_NUM_IMAGES = 2048
DEFAULT_IMAGE_SIZE = 32

def default_objective(model_name, dataset):
    """The objective a run of preset `model_name` on `dataset` trains without --objective: its family's
    (model.Family.default_objective), except that on the built-in shapes a UNet trains DDPM: there DDPM
    scored better at two seeds and its grid shows clean one-coloured shapes where flow's shows blobs in
    gradients of colour (the bare run's grid). A resumed run keeps the objective it recorded
    (resume.keep_recorded_objective)."""
    family = models.family_name(model_name)
    return "ddpm" if family == "unet" and dataset == shapes.BUILTIN else models.FAMILIES[family].default_objective

# What a run's train_config.json holds beside its flags: facts of the run (the
# data, the machine, the FLOPs), recomputed by every run, and the --config it was
# read from (files do not include each other). --config skips them.
DERIVED_KEYS = (
    "config", "num_processes", "num_images", "data_path", "global_batch_size", "steps_per_epoch",
    "total_train_steps", "total_epochs", "params", "model_flops_per_step", "hardware_flops_per_step",
    "step_compile_mode", "step_compile_scope", "device", "num_classes", "class_names", "class_counts",
    "latent_size", "latent_channels", "latent_normalization", "latents", "latent_space", "flow_sigmas",
    "image_channels", "image_bits", "data_survey", "init_source", "text_dim", "text_length", "num_captions",
)  # fmt: skip

# What one command asks for once, not what a run is: a file read with --config never
# carries them (a run's train_config.json fed back must not delete its checkpoints
# because that run once started with --overwrite_output_dir, nor resume from the
# checkpoint that run once resumed from).
INVOCATION_KEYS = ("overwrite_output_dir", "resume", "resume_from_checkpoint", "dry_run")

# What a --config file may say that no flag does: a captioned run's grid prompts (a list of captions, which no flag's
# single value holds; the grids take the training set's first captions without it).
FILE_KEYS = ("grid_prompts",)

# What train.py always does where a flag once chose: settings, not flags, that
# `resolve` puts on every configuration for the code that reads them, and that a run's
# train_config.json records under "settings" (`recorded`). The speed ones are `python -m bench`'s
# to vary: it sets them on the configurations it builds (its rows, its own flags) before resolving
# them; train.py runs fused AdamW with TF32, NCHW without fused_norm.py's kernels, and
# cudnn.benchmark on a CUDA GPU.
SPEED_SETTINGS = ("channels_last", "fused_norm", "fused_adam", "allow_tf32", "cudnn_benchmark")
SETTINGS = dict(
    fused_norm=False, fused_adam=True, allow_tf32=True,  # channels_last: with fused_norm; cudnn_benchmark: with a GPU
    num_train_timesteps=objectives.NUM_TRAIN_TIMESTEPS,  # DDPM's T (Ho et al. 2020, and every config here)
    sigma_data=objectives.SIGMA_DATA,  # EDM's std of the data in [-1, 1]
    loss_weighting="uncertainty",  # EDM: EDM2's learned weighting (eq. 21)
    label_dropout=0.1,  # a conditional run's labels dropped for classifier-free guidance (Ho & Salimans 2022)
    adam_epsilon=1e-8,
    ema_inv_gamma=1.0,  # the EMA's warm-up, decay = 1 - (1 + step / inv_gamma)^-ema_power: --ema_power shapes it
    timing_warmup_steps=5,  # steps left out of the timing
    # Recomputing activations in the backward pass (torch.utils.checkpoint) to fit memory: off. What fits
    # a GPU instead: a smaller --train_batch_size with --gradient_accumulation_steps (as EDM2's batch_gpu),
    # or latents (--vae), 48x fewer values per image at 8x. flops.py counts its cost (HFU).
    gradient_checkpointing=False,
    profile_steps=3, profile_top=15, profile_stack=False,  # --profile: steps recorded, rows of its table, no stacks
    # What a compiled step compiles: "auto", by the run's length (compiling.choose_compile_scope); "regional",
    # each repeated block once; "whole", the network as one graph. `python -m bench --compile_scope` sets it.
    compile_scope="auto",
)  # fmt: skip
# Every setting `resolve` puts on a configuration: SETTINGS, and channels_last (with fused_norm) and
# cudnn_benchmark (with a CUDA GPU), which it derives where a configuration does not set them.
SETTING_NAMES = (*SETTINGS, *(name for name in SPEED_SETTINGS if name not in SETTINGS))
ADAM_BETAS = (0.95, 0.999)


# Flags train.py no longer has that a user could still type (from diffusers' examples or this
# project's earlier versions): each is a one-line error naming what to use instead, on the command
# line and in a --config file. A run's train_config.json of such a version is refused the same way.
_BENCH = "the rows of python -m bench and its --{0} set it on the step they time"
REMOVED = {
    "compile": "use --compile_mode off, auto or a mode",
    "use_ema": "use --ema none, standard or power",
    "preload_max_gib": "use --preload_data MAX_GIB",
    "resume_from_checkpoint": "use --resume CHECKPOINT (or --resume: the newest)",
    "label_column": "use --class_conditional LABEL_COLUMN",
    "adam_beta1": "use --adam_betas BETA1,BETA2",
    "adam_beta2": "use --adam_betas BETA1,BETA2",
    "adam_epsilon": "AdamW's epsilon is 1e-8",
    "ema_inv_gamma": "the EMA's warm-up has inv_gamma 1 (--ema_power shapes it)",
    "P_mean": "use --P_mean_std MEAN,STD",
    "P_std": "use --P_mean_std MEAN,STD",
    "eval_guidance_scales": "use --guidance_scale W1,W2,...: the grids take the first, evaluation each",
    "on_nonfinite": "use --on_fault skip or stop (it decides for non-finite steps and unreadable images alike)",
    "strict_data": "use --on_fault skip or stop (it decides for non-finite steps and unreadable images alike)",
    "center_crop": "use --augment crop for random crops (flip,crop for both; none)",
    "random_flip": "use --augment none for no flips (flip,crop adds random crops)",
    "channels_last": "train.py runs NCHW; " + _BENCH.format("channels_last"),
    "fused_norm": "train.py runs without it; " + _BENCH.format("fused_norm"),
    "fused_adam": "train.py always runs fused AdamW; " + _BENCH.format("no-fused_adam"),
    "allow_tf32": "train.py always allows TF32; " + _BENCH.format("no-allow_tf32"),
    "cudnn_benchmark": "train.py turns it on with a CUDA GPU; " + _BENCH.format("cudnn_benchmark"),
    "gradient_checkpointing": "to fit memory, lower --train_batch_size and raise --gradient_accumulation_steps, "
                              "or train on latents (--vae)",
    "compile_scope": "train.py compiles each repeated block once for a short run, the whole network for a long "
                     "one (compiling.choose_compile_scope); " + _BENCH.format("compile_scope whole"),
    "profile_only": "use --profile with --max_train_steps",
}  # fmt: skip


class Parser(OneLineParser):
    """errors.OneLineParser (one line, exit code 2; `source` names a --config file) that reads a
    negative number as a value, not a flag: -0.5, and numbers after a comma (--P_mean_std -1.2,1.2)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\d*\.?\d+(e-?\d+)?(,-?\d*\.?\d+(e-?\d+)?)*$")


def objective_flag(text):
    """--objective's type: ddpm, edm, flow or flow:SHIFT, spelled one way (model.canonical_objective)."""
    try:
        return objectives.canonical_objective(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--objective {text}: ")) from None


# Flags of DDPM's noise process: a flow run has none of them.
DDPM_ONLY = ("prediction_type", "beta_schedule", "snr_gamma", "zero_terminal_snr")


class Range:
    """A flag's `type=`: reads the number from the command line; `check` holds it to its range.

    The range is checked by `resolve`, not while parsing, so that a value from a
    --config file gets the same one-line error as a typed one.
    """

    def __init__(self, kind, inside, says):
        self.kind, self.inside, self.says = kind, inside, says
        self.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"

    def __call__(self, text):
        return self.kind(text)

    def check(self, name, value):
        if value is not None and not isinstance(value, bool) and not self.inside(value):
            raise ConfigError(f"--{name} must be {self.says} (got {value})")


def at_least(low, kind=int):
    return Range(kind, lambda v: v >= low, f"at least {low}")


positive = Range(float, lambda v: 0 < v < math.inf, "a finite number greater than 0")
non_negative = Range(float, lambda v: 0 <= v < math.inf, "a finite number, at least 0")
SEEDS = Range(int, lambda v: 0 <= v < 2**32, f"in [0, {2**32 - 1}] (numpy's seeds)")
unit_interval = Range(float, lambda v: 0 <= v < 1, "in [0, 1)")


def numbers(count, name):
    """A `type=` for `count` comma-separated numbers (a list, from a file, too)."""

    def parse(text):
        values = [float(v) for v in (text if isinstance(text, (list, tuple)) else str(text).split(","))]
        if len(values) != count:
            raise ValueError(text)
        return values

    parse.__name__ = name
    return parse


def augmentations(text):
    """--augment's value: 'flip', 'crop', 'flip,crop' or 'none' (in any order)."""
    words = {w.strip() for w in str(text).split(",") if w.strip()}
    if not words or not words <= {"flip", "crop"} and words != {"none"}:
        raise argparse.ArgumentTypeError(f"choose flip, crop, flip,crop or none (got '{text}')")
    return ",".join(w for w in ("flip", "crop") if w in words) or "none"


class _Removed(argparse.Action):
    """A flag that is gone (REMOVED): it parses into a one-line error that says what to use instead."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        key = option_string.removeprefix("--").removeprefix("no-")
        parser.error(f"{option_string} was removed: {REMOVED[key]}")


class _SwitchOrValue(argparse.Action):
    """--name (on), --name VALUE (on, with that value) or --no-name (off)."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.update(nargs="?", const=True)
        super().__init__([*option_strings, *(f"--no-{s[2:]}" for s in option_strings)], dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        off = option_string.startswith("--no-")
        if off and values is not True:
            parser.error(f"{option_string} takes no value (got '{values}')")
        setattr(namespace, self.dest, False if off else values)


class _Help(argparse.HelpFormatter):
    """--help gives each flag's allowed range and default after its text."""

    def _format_action_invocation(self, action):
        if isinstance(action, _SwitchOrValue):
            on, off = action.option_strings
            return f"{on} [{action.metavar}], {off}"
        return super()._format_action_invocation(action)

    def _get_help_string(self, action):
        text, notes = action.help or "", []
        if isinstance(action.type, Range):
            notes.append(action.type.says)
        if "(default: " in text:  # a default in words: the range goes in front of it
            return text.replace("(default: ", f"({notes[0]}; default: ", 1) if notes else text
        if action.option_strings and action.default not in (None, argparse.SUPPRESS):
            notes.append("default: %(default)s")
        return f"{text} ({'; '.join(notes)})" if notes else text


def flag(group, name, help, default=None, **kwargs):
    """One declaration: --name, its default, its help and (in `type=`) its range."""
    group.add_argument(f"--{name}", default=default, help=help, **kwargs)


def switch(group, name, help, default=False):
    """A boolean flag: --name and --no-name (so that the command line can undo a --config file)."""
    flag(group, name, help, default, action=argparse.BooleanOptionalAction)


def switch_or_value(group, name, help, default, metavar, **kwargs):
    """--name, --name VALUE or --no-name (see _SwitchOrValue)."""
    flag(group, name, help, default, action=_SwitchOrValue, metavar=metavar, **kwargs)


def build_parser(prog="train.py", source=""):
    p = Parser(prog=prog, description="Train a diffusion model (flow matching, DDPM or EDM; a UNet, EDM2's network or a "
               "DiT) with accelerate.", formatter_class=_Help, source=source)  # fmt: skip
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="a YAML or JSON file of flags (a run's train_config.json too); flags on the command line override it",
    )
    for key in REMOVED:
        p.add_argument(f"--{key}", f"--no-{key}", action=_Removed)

    d = p.add_argument_group("data")
    flag(d, "dataset", "'shapes' (built in, no files), a folder of images, a dataset saved with datasets' "
         "save_to_disk, or a Hub dataset id", shapes.BUILTIN)  # fmt: skip
    flag(d, "dataset_config", "Hub dataset configuration name")
    flag(d, "split", "dataset split to train on", "train")
    flag(d, "image_column", "column holding the images (default: found by type)")
    flag(d, "shapes_num_images", f"size of the built-in dataset (default: {CPU_SHAPES_NUM_IMAGES}; "
         f"{GPU_BARE_RUN['shapes_num_images']} for the bare run on a GPU)", type=at_least(1))  # fmt: skip
    switch_or_value(d, "class_conditional", "train with the data's class labels, for classifier-free guidance "
                    "(--guidance_scale): the subfolders of a folder, a datasets ClassLabel column (or the column "
                    "LABEL_COLUMN), or the built-in shapes' kinds; a tenth of the labels are dropped in training",
                    False, "LABEL_COLUMN")  # fmt: skip
    flag(d, "text_encoder", "train from captions (a metadata.jsonl or a .txt beside each image, or a dataset's "
         "text/caption/prompt column): a transformers CLIP or T5 text encoder (a folder, a pipeline folder with "
         "text_encoder/ and tokenizer/, or a Hub id), each caption encoded once and cached beside the latents; a UNet "
         "or DiT preset attends to the embeddings; a tenth of the captions are dropped in training (docs/text.md)",
         metavar="ID_OR_PATH")  # fmt: skip
    flag(d, "caption_column", "the captions' column of a datasets dataset (default: text, caption or prompt)")
    flag(d, "image_size", "train at this size: a side (64) or width x height (96x64); each image is resized to "
         f"cover it and cropped (default: {DEFAULT_IMAGE_SIZE}, or the --init_from source's)")  # fmt: skip
    flag(d, "augment", "random left-right flips (flip), random crops after resizing instead of the centre, "
         "decoded every epoch (crop), both (flip,crop) or none", "flip", type=augmentations)  # fmt: skip
    switch_or_value(d, "preload_data", "decode the dataset once and keep it in memory as uint8 (on the GPU when "
                    f"training on one), unless it needs more than MAX_GIB (default: {data.PRELOAD_MAX_GIB:g}): then stream "
                    "it from disk; --no-preload_data: always stream", True, "MAX_GIB", type=positive)  # fmt: skip
    flag(d, "dataloader_num_workers", "processes that decode images (default: 4, or the fewer CPU cores this "
         "process may use)", min(4, usable_cores()), type=at_least(0))  # fmt: skip
    flag(d, "vae", "train on the latents of this VAE (a diffusers AutoencoderKL or AutoencoderTiny: a folder, a "
         "pipeline folder with vae/, or a Hub id): the data is encoded once and cached (in $DDPM_TRAIN_LATENT_CACHE, "
         "else ~/.cache/ddpm-train/latents), the network takes the VAE's channels at --image_size over its factor, "
         "and grids, sample.py and FID decode through it. NORM: vae (its scaling_factor and shift_factor; the "
         "default when its config sets a scaling_factor) or dataset (each channel's mean and std over the data) "
         "(docs/latents.md)", metavar="ID_OR_PATH[,NORM]")  # fmt: skip

    m = p.add_argument_group("model and noise schedule")
    flag(m, "model", f"preset: {', '.join(models.PRESETS)}; auto: "
         f"{', '.join(f'{name} at {size}px' for size, name in models.AUTO_MODEL.items())}, small otherwise "
         f"({GPU_BARE_RUN['model']} for the built-in shapes at 32px on a GPU)", "auto")  # fmt: skip
    flag(m, "init_from", "start from trained weights at step 0 with a fresh optimizer: a diffusers pipeline or model "
         "folder (UNet2DModel, DiT), a Hub id (google/ddpm-cifar10-32, facebook/DiT-XL-2-256) or a run or checkpoint "
         "folder of this project. Its config gives --model and, unless set, --image_size, --objective, "
         "--prediction_type and --beta_schedule; a new label table, another size and DiT's learned variance are "
         "adapted (docs/init_from.md)", metavar="SOURCE")  # fmt: skip
    flag(m, "beta_schedule", "DDPM's noise schedule over its 1000 timesteps (default: linear)",
         choices=("linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid"))  # fmt: skip
    flag(m, "objective", "ddpm: Ho et al. (2020), Algorithm 1; edm: Karras et al. (2022)'s preconditioning with "
         "EDM2's learned loss weighting, sampled with EDM's Heun sampler; flow: flow matching (SiT, SD3: "
         "x = (1-sigma) x0 + sigma noise, the network predicts noise - x0), flow:SHIFT with SD3's timestep shift "
         "(docs/training.md) (default: edm for the EDM2 presets, ddpm for a UNet on the built-in shapes, else flow)", type=objective_flag)  # fmt: skip
    flag(m, "timestep_sampling", "DDPM and flow: how training draws the noise level: uniform (Ho et al. 2020; "
         "SiT), or lognormal: DDPM's t such that ln(sigma_t) ~ N(P_mean, P_std^2), EDM's noise levels on DDPM's "
         "timesteps; flow's sigma logit-normal, SD3's (default: flow lognormal; else the preset's, "
         f"{SMALL.ddpm['timestep_sampling']} for small, else {PRESET_FALLBACKS['timestep_sampling']})",
         choices=objectives.TIMESTEP_SAMPLINGS)  # fmt: skip
    flag(m, "P_mean_std", "EDM, and DDPM's --timestep_sampling lognormal: ln(sigma) ~ N(P_mean, P_std^2) in "
         f"training (default: the preset's, else {objectives.P_MEAN},{objectives.P_STD}: EDM's CIFAR-10 values, as the "
         "EDM2 seed's configs; EDM2 used -0.8,1.6 for ImageNet-64, -0.4,1.0 for ImageNet-512 latents); flow: "
         f"logit(sigma) ~ N(P_mean, P_std^2) (default: SD3's {objectives.FLOW_P_MEAN:g},{objectives.FLOW_P_STD:g})",
         metavar="P_MEAN,P_STD", type=Range(numbers(2, "pair"), lambda v: v[1] > 0, "two numbers, P_std greater than 0"))  # fmt: skip
    flag(m, "prediction_type", "DDPM: what the network predicts (default: the preset's; "
         f"{SMALL.ddpm['prediction_type']} for small, else {PRESET_FALLBACKS['prediction_type']}; "
         f"{CONDITIONAL_FALLBACKS['prediction_type']} when --class_conditional or --text_encoder)",
         choices=("epsilon", "v_prediction", "sample"))  # fmt: skip
    flag(m, "snr_gamma", "DDPM: min-SNR-gamma loss weighting (Hang et al. 2023; 5 in their paper; default: off)",
         type=positive)  # fmt: skip
    flag(m, "loss_terms", "more terms of the loss, NAME or NAME:VALUE comma-separated (a name alone: its paper's "
         "value): dispersive:WEIGHT (Wang & He 2025, on the middle block; 0.25), layersync:WEIGHT (DiTs; 0.2), "
         "deltafm:WEIGHT (contrastive flow matching, --objective flow; 0.05), immiscible:K (each image's noise the "
         "nearest of K draws; 4 on pixels, 64 on latents); a resumed run keeps its own (docs/loss_terms.md) (default: none)",
         metavar="NAME[:VALUE],...")  # fmt: skip
    flag(m, "token_routing", "DiT: the share of tokens that skip from an early block to a late one while training and "
         "rejoin unchanged (TREAD, Krause et al. 2025), SHARE or SHARE:FIRST-LAST (blocks counted from 1; default: "
         "TREAD's blocks 3 to 11 of 12, scaled to the depth); every token at sampling (docs/token_routing.md)", 0.0,
         metavar="SHARE[:FIRST-LAST]", type=dit.routing_flag)  # fmt: skip
    switch(m, "zero_terminal_snr", "DDPM: rescale the betas to zero SNR at t = T (Lin et al. 2024); needs "
           "--prediction_type v_prediction")  # fmt: skip

    t = p.add_argument_group("training")
    flag(t, "train_batch_size", "images per device per micro-batch (default: the preset's; "
         f"{SMALL.flags['train_batch_size']} for small, else {PRESET_FALLBACKS['train_batch_size']})",
         type=at_least(1))  # fmt: skip
    flag(t, "num_epochs", f"passes over the dataset (default: the preset's; {SMALL.flags['num_epochs']} for "
         f"small, else {PRESET_FALLBACKS['num_epochs']})", type=at_least(1))  # fmt: skip
    flag(t, "max_train_steps", "optimizer steps; overrides --num_epochs", type=at_least(1))
    flag(t, "gradient_accumulation_steps", "micro-batches per optimizer step", 1, type=at_least(1))
    flag(t, "learning_rate", "peak AdamW learning rate (default: the preset's)", type=positive)
    flag(t, "lr_scheduler", "learning-rate schedule after the warm-up (default: the preset's); inverse_sqrt is "
         "EDM2's lr / sqrt(max(step / lr_ref_steps, 1))", choices=LR_SCHEDULES)  # fmt: skip
    flag(t, "lr_ref_steps", "inverse_sqrt: steps before the decay starts (default: the preset's reference in "
         f"images over this run's images per step; {DEFAULT_LR_REF_STEPS:,} for a preset without one)",
         type=at_least(1))  # fmt: skip
    flag(t, "lr_warmup_steps", "linear warm-up steps", 100, type=at_least(0))
    flag(t, "adam_betas", "AdamW's beta1,beta2", ",".join(map(str, ADAM_BETAS)), metavar="BETA1,BETA2",
         type=Range(numbers(2, "pair"), lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)"))  # fmt: skip
    flag(t, "weight_decay", "AdamW weight decay", 1e-6, type=non_negative)
    flag(t, "optimizer", "adamw; muon: torch.optim.Muon for the blocks' 2-D weights (a fused adaLN matrix split "
         "per modulation), AdamW for the rest, at one --learning_rate (docs/muon.md)", "adamw", choices=tuple(optimizers.OPTIMIZERS))  # fmt: skip
    flag(t, "max_grad_norm", "clip gradients to this norm (0: off)", 1.0, type=non_negative)
    flag(t, "ema", "the average of the weights that samples, is saved and is scored: none (the raw weights), "
         "standard (decay with warm-up: --ema_max_decay, --ema_power) or power (Karras et al. 2024's power-function "
         "EMAs, snapshots for post-hoc reconstruction: --ema_stds, ema.py reconstruct) (default: the preset's; "
         f"{SMALL.flags['ema']} for small, else {PRESET_FALLBACKS['ema']})",
         choices=("none", "standard", "power"))  # fmt: skip
    flag(t, "ema_max_decay", "standard EMA: decay after warm-up", 0.9999, type=unit_interval)
    flag(t, "ema_power", "standard EMA: warm-up power, decay = 1 - (1 + step)^-power", 0.75, type=non_negative)
    flag(t, "mixed_precision", "autocast precision (default: bf16 on a GPU that has it, else no); fp8: a DiT's "
         "block linear layers in FP8 through torchao, the rest bf16 (docs/fp8.md)", choices=("no", "fp16", "bf16", "fp8"))  # fmt: skip
    flag(t, "seed", "seeds the data, the model and the noise", 0, type=SEEDS)
    switch(t, "cpu", "train on the CPU even if a GPU is there (needed for several CPU processes: gloo)")
    flag(t, "compile_mode", "off: eager; auto: torch.compile, reduce-overhead (CUDA graphs) when a step is too small "
         "to keep the GPU busy, else default, unless eager or eager-graph (on a CUDA GPU that can capture the step) "
         "would end a run of known length sooner, compile or capture included (the rule and its measurements: "
         "compiling.plan_compile); torch.compile's modes; "
         "step-graph: the whole step (forward, backward, optimizer, EMA) in one CUDA graph; eager-graph: the same "
         "around the eager network, nothing compiled (default: auto on a CUDA "
         "GPU, else off; python -m bench measures the other speed settings)", choices=("off", *compiling.COMPILE_MODES))  # fmt: skip

    o = p.add_argument_group("outputs")
    flag(o, "output_dir", "where samples, checkpoints and the model go", "ddpm-output")
    flag(o, "logger", "where the logged scalars go, through accelerate's trackers: tensorboard (logs/, drawn "
         "into plots/ at the end), wandb (Weights & Biases; WANDB_MODE=offline keeps it on disk) or none",
         "tensorboard", choices=LOGGERS)  # fmt: skip
    flag(o, "save_images_epochs", "write a sample grid every N epochs", 2, type=at_least(1))
    flag(o, "eval_batch_size", f"images in a sample grid (FID samples max({metrics.FID_BATCH_SIZE}, this) at a time)", 16,
         type=at_least(1))  # fmt: skip
    ddpm, flow = objectives.DDPMObjective, objectives.FlowObjective
    flag(o, "sampler", f"sampler for the grids and FID: DDPM's {', '.join(ddpm.samplers)} (default: "
         f"{ddpm.default_sampler}); flow's {', '.join(flow.samplers)} (default: {flow.default_sampler})",
         choices=ddpm.samplers + flow.samplers)  # fmt: skip
    flag(o, "churn", samplers.CHURN_HELP, samplers.EDM_CHURN, type=non_negative)
    flag(o, "num_inference_steps", f"sampling steps for the grids and FID (default: {ddpm.default_steps}; "
         f"{objectives.EDMObjective.default_steps} for EDM's Heun sampler, {2 * objectives.EDMObjective.default_steps - 1} "
         "network evaluations)",
         type=at_least(1))  # fmt: skip
    flag(o, "guidance_scale", "w in D = D_uncond + w (D_cond - D_uncond) for a conditional run (classifier-free "
         "guidance), or D = D_guide + w (D - D_guide) with --guide; 1: no guidance. Comma-separated: the grids take "
         "the first, evaluation scores each and the best one's picks go to best/", "1")  # fmt: skip
    flag(o, "guide", "grids and evaluation: guide the model with another run's (autoguidance, Karras et al. 2024): "
         "its --output_dir, pipeline or checkpoint folder")  # fmt: skip
    flag(o, "checkpointing_steps", "save a checkpoint every N steps", 500, type=at_least(1))
    flag(o, "checkpoints_total_limit", "keep at most this many checkpoints (default: all)", type=at_least(1))
    switch_or_value(o, "resume", "continue from CHECKPOINT (a checkpoint folder), or without one from the newest "
                    "checkpoint in --output_dir when there is one (the default); --no-resume: refuse to", True,
                    "CHECKPOINT")  # fmt: skip
    switch(o, "overwrite_output_dir", "start afresh in an --output_dir that holds another run (its checkpoints are "
           "deleted) or other files")

    f = p.add_argument_group("faults")
    flag(f, "on_fault", "a step whose loss or gradients are NaN/inf, or an unreadable image: skip it (the step's "
         "update, counted; the image, with a warning) or stop the run", "skip", choices=("skip", "stop"))  # fmt: skip

    q = p.add_argument_group("sample quality: power EMA, FID and KID (docs/sampling.md)")
    flag(q, "ema_stds", "power EMA: relative widths tracked; the first gives grids, FID and the pipeline", "0.05,0.10")
    flag(q, "ema_snapshot_every", "power EMA: snapshot every N steps and at the end", 1000, type=at_least(1))
    flag(q, "eval_every_epochs", "FID and KID every N epochs and at the end (default: off)", type=at_least(1))
    flag(q, "eval_num_samples", "images generated for each FID/KID", 10000, type=at_least(2))
    flag(q, "fid_weights", "Inception weights file for machines without internet (default: downloaded)")

    r = p.add_argument_group("performance report")
    flag(r, "logging_steps", "print and log throughput every N steps", 50, type=at_least(1))
    switch(r, "dry_run", "print the resolved configuration and FLOPs, then exit (opens no dataset but the built-in one)")
    flag(r, "profile", f"record {SETTINGS['profile_steps']} steps with torch.profiler (after the step's compile or "
         f"capture calls and 1 warm-up): a trace, a table and chart of the top {SETTINGS['profile_top']} kernels (or "
         "of the operators that launched them) in output_dir/profile/", nargs="?", const="kernels",
         choices=PROFILE_LEVELS)  # fmt: skip
    p.set_defaults(grid_prompts=None)  # FILE_KEYS: a --config file's alone
    return p


@functools.cache
def _ranges():
    """{dest: Range} of every flag that declares one."""
    return {a.dest: a.type for a in build_parser()._actions if isinstance(a.type, Range)}


def parse_args(argv=None):
    """The flags, with a --config file's under them: a flag on the command line wins, even at its default.

    Not resolved: `resolve` fills what is unset and checks everything.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config is None:
        return args
    try:
        raw = read_file(args.config)
        from_file = file_flags(raw, args.config, parser)
        prompts = grid_prompts(raw.get("grid_prompts"), args.config)
    except ConfigError as e:
        parser.error(str(e))
    build_parser(source=f"--config {args.config}: ").parse_args(from_file)  # its bad values, named as the file's
    args = parser.parse_args(from_file + argv)
    args.grid_prompts = prompts
    return args


def grid_prompts(value, path):
    """A --config file's `grid_prompts`: a list of captions (None: the grids take the training set's first)."""
    if value is not None and (not isinstance(value, list) or not value or not all(isinstance(p, str) and p.strip() for p in value)):
        raise ConfigError(f"--config {path}: grid_prompts takes a list of captions, such as [\"a red car\", \"a cat\"]")
    return value


def read_file(path):
    """{key: value} of a YAML file, or of JSON (a .json name)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not a text file; give a YAML or JSON file") from None
    try:
        values = json.loads(text) if Path(path).suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: not valid {'JSON' if Path(path).suffix == '.json' else 'YAML'} "
                          f"({' '.join(str(e).split())})") from None  # fmt: skip
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: holds a {type(values).__name__}, not 'flag: value' lines")
    return values


def file_flags(raw, path, parser):
    """The command-line words that say what `raw` (read_file's, of the file at `path`) says, to be parsed before the
    real ones."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    if not any(key in raw for key in DERIVED_KEYS):  # a file of yours, not a run's record: what it asks, it means
        typed_only = [key for key in INVOCATION_KEYS if key in actions and raw.get(key) not in (None, False)]
        if typed_only:
            raise ConfigError(f"--config {path}: '{typed_only[0]}' acts only when typed: pass --{typed_only[0]} on "
                              "the command line")  # fmt: skip
    values = {k: v for k, v in raw.items() if k not in (*DERIVED_KEYS, *INVOCATION_KEYS, *FILE_KEYS)}
    values.pop("settings", None)  # a run's (`recorded`): what its train.py did, as today's does
    for key in values:
        if key in REMOVED:  # a file of yours, or a run's train_config.json of an earlier version
            raise ConfigError(f"--config {path}: '{key}' was removed: {REMOVED[key]}")
        if key not in actions:
            raise ConfigError(f"--config {path}: '{key}' is not a flag of train.py")
    return [word for key, value in values.items() for word in _words(actions[key], key, value, path)]


def _words(action, key, value, path):
    """`key: value` as command-line words: --key=value, --key or --no-key; none for null (the default)."""
    if value is None:
        return []
    if isinstance(action, _SwitchOrValue):
        return [f"--{key}" if value is True else f"--no-{key}" if value is False else f"--{key}={value}"]
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigError(f"--config {path}: {key} takes true or false (got {value!r})")
        return [f"--{key}" if value else f"--no-{key}"]
    if action.nargs == "?" and isinstance(value, bool):  # --profile: true is its level by default, false is off
        return [f"--{key}"] if value else []
    if isinstance(value, (bool, dict)):
        raise ConfigError(f"--config {path}: {key} takes one value, not {value!r}")
    if isinstance(value, list):
        value = ",".join(map(str, value))  # --ema_stds, --adam_betas, --P_mean_std, --guidance_scale
    return [f"--{key}={value}"]


def resolve(args):
    """Check every range, fill every value left unset, check the combinations; returns `args`.

    Filled: a --vae run's latent size, channels and normalisation (its config.json: autoencoder.vae_settings);
    --model auto (by the size the network takes); the preset's objective, DDPM settings (prediction type, timestep
    sampling and its P_mean/P_std), batch size, epochs, EMA, learning rate, lr_scheduler and
    (inverse_sqrt) lr_ref_steps; num_inference_steps by the objective's sampler;
    mixed_precision, --compile_mode and cudnn_benchmark by the machine; the SETTINGS that a
    configuration built by `python -m bench` does not set; ema_stds and guidance_scale as numbers.
    Idempotent: a resolved Namespace comes back the same.
    """
    for name, kind in _ranges().items():
        kind.check(name, getattr(args, name))
    args.image_size = None if args.image_size is None else sizes.parse(args.image_size)
    _check_captions(args)
    _fill_from_source(args)
    _fill_gpu_bare_run(args)
    _fill_pixels(args)
    _fill_latents(args)
    args.text_dim, args.text_length = captions.encoder_settings(args.text_encoder) if args.text_encoder else (None, None)
    _take_from_source(args)
    _fill_from_preset(args)
    _fill_from_machine(args)
    _fill_settings(args)
    if args.zero_terminal_snr and args.prediction_type != "v_prediction":
        raise ConfigError("--zero_terminal_snr needs --prediction_type v_prediction (at zero SNR eps says nothing of the image)")
    objectives.of(args.objective).check(args)
    args.loss_terms = loss_terms.spell(loss_terms.parse(args.loss_terms, latents=bool(args.vae)))
    if args.token_routing:
        kind, settings = models.family(args.model)
        if not kind.transformer:
            raise ConfigError(f"--token_routing routes a DiT's tokens past its middle blocks, not {kind.called}'s: "
                              f"drop it for --model {args.model}")  # fmt: skip
        dit.routing(args.token_routing, settings["num_layers"])  # its blocks are the network's
    if args.text_encoder and not models.family(args.model)[0].text_build:
        raise ConfigError(f"--text_encoder: {models.family(args.model)[0].called} cannot attend to captions yet; train a "
                          "UNet or DiT preset (--model small, dit-b2, ...) from captions (docs/text.md)")  # fmt: skip
    loss_terms.check(loss_terms.parse(args.loss_terms), objectives.of(args.objective),
                     models.family_name(args.model), args.train_batch_size, bool(args.token_routing))  # fmt: skip
    if args.logger == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--logger wandb needs the wandb package: pip install wandb (or use --logger tensorboard)")
    if isinstance(args.ema_stds, str):
        args.ema_stds = posthoc_ema.parse_stds(args.ema_stds)
    if args.guide is not None and not Path(args.guide).exists():
        raise ConfigError(f"--guide {args.guide}: no such folder; point it at a run of the same data (its --output_dir)")
    args.guidance_scale = sampling.parse_scales(args.guidance_scale, "--guidance_scale")
    if any(w != 1 for w in args.guidance_scale) and not (args.class_conditional or args.text_encoder or args.guide):
        raise ConfigError("--guidance_scale guides a --class_conditional or --text_encoder run (or one with --guide): add "
                          "one of them, or leave it at 1")  # fmt: skip
    if args.fid_weights is not None and not Path(args.fid_weights).is_file():
        raise ConfigError(f"--fid_weights {args.fid_weights}: no such file")
    checkpoint.check_writable(args.output_dir, "--output_dir")
    return args


def _check_captions(args):
    """A captioned run (--text_encoder) trains on a folder or dataset's captions, not on class labels:
    checked before the images are looked at."""
    if not args.text_encoder:
        if args.caption_column:
            raise ConfigError("--caption_column names the captions a --text_encoder run trains from: add --text_encoder")
        if args.grid_prompts:
            raise ConfigError("grid_prompts are a captioned run's grid rows: add --text_encoder, or leave them out")
        return
    if args.class_conditional:
        raise ConfigError("--text_encoder conditions on captions, --class_conditional on class labels: pick one")
    if args.dataset == shapes.BUILTIN:
        raise ConfigError("--text_encoder trains from captions, and the built-in shapes have none: point --dataset "
                          "at captioned images (docs/text.md)")  # fmt: skip


def _fill_settings(args):
    """The SETTINGS a configuration does not set already (`python -m bench` sets the speed ones on
    the configurations it builds), channels_last and cudnn_benchmark among them."""
    for name, value in SETTINGS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if getattr(args, "channels_last", None) is None:  # fused_norm's kernels need it; measured slower alone (BENCHMARKS.md)
        args.channels_last = args.fused_norm
    if getattr(args, "cudnn_benchmark", None) is None:
        args.cudnn_benchmark = on_gpu(args)
    if args.fused_norm and not (on_gpu(args) and args.channels_last):
        raise ConfigError(
            "--fused_norm needs a CUDA GPU and --channels_last (the kernels run on NHWC CUDA tensors): "
            "drop it or add --channels_last"
        )


def recorded(args):
    """What a run's train_config.json records of the resolved configuration `args`: its flags and what
    `resolve` found (a latent run's size, channels, normalisation and VAE: DERIVED_KEYS), with its
    settings (SETTING_NAMES) apart under "settings", which `file_flags` leaves: today's train.py does them."""
    flags = {name: value for name, value in vars(args).items() if name not in SETTING_NAMES}
    return dict(flags, settings={name: getattr(args, name) for name in SETTING_NAMES})


def usable_cores():
    """The CPU cores this process may run on: a SLURM job's or `taskset`'s share, not the machine's (os.cpu_count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def on_gpu(args):
    """Whether this run trains on a CUDA GPU."""
    return torch.cuda.is_available() and not args.cpu


def _fill_gpu_bare_run(args):
    """GPU_BARE_RUN's values where unset, for the built-in shapes at 32px with --model auto on a GPU;
    elsewhere only the built-in dataset's size."""
    if args.dataset == shapes.BUILTIN and args.model == "auto" and args.image_size == 32 and not args.vae and on_gpu(args):
        for name, value in GPU_BARE_RUN.items():
            if name in SMALL.ddpm and not objectives.of(args.objective).discrete:
                continue  # DDPM's settings; --objective edm or flow draws its own noise levels
            if name == "model" or getattr(args, name) is None:
                setattr(args, name, value)
    if args.shapes_num_images is None:
        args.shapes_num_images = CPU_SHAPES_NUM_IMAGES


# What a dry run assumes of a VAE whose config.json cannot be had offline (a Hub id not in the local Hub
# cache): Stable Diffusion's KL-f8, 8x smaller latents of 4 channels. It says so; a run loads the VAE.
ASSUMED_VAE = dict(cls="AutoencoderKL", subfolder=None, factor=8, channels=4, in_channels=3, scaling_factor=None)


def _fill_pixels(args):
    """What the images are (data.survey: their headers, none decoded) and what the run makes of them: the channels
    and bits of args.image_channels and image_bits, and the survey for the line train.py prints before training
    (args.data_survey). The built-in shapes are RGB at 8 bits, and a dry run does not open a Hub dataset."""
    if getattr(args, "image_channels", None) is not None:  # resolved already
        return
    local = Path(args.dataset).expanduser().exists()
    hub = not local and not sources.looks_like_path(args.dataset) and not args.dry_run
    # a missing folder is refused where the data loads (data.load_images), with the other checks of the data
    height, width = sizes.height_width(args.image_size)
    found = data.survey(data.open_run_dataset(args), (height, width)) if args.dataset != shapes.BUILTIN and (local or hub) else None
    args.image_channels, args.image_bits = found.pixels if found else pixels.Pixels()
    args.data_survey = found._asdict() if found else None


def _fill_latents(args):
    """A --vae run: what its VAE's config.json says, before any weights load (autoencoder.vae_settings): the
    size and channels of the latents the network takes, and the normalisation (autoencoder.normalization_kind).
    `args.latents` holds the VAE's settings (train.py adds the normalisation and the cache). All None for
    a run on pixels."""
    args.latent_size = args.latent_channels = args.latent_normalization = args.latents = None
    if not args.vae:
        return
    if "crop" in args.augment.split(","):
        raise ConfigError(
            "--augment crop draws a new random crop of each image every epoch, and --vae encodes each image once: "
            "use --augment flip or none with --vae"
        )
    # a file in the cache's place; a read-only cache may be complete already, and is read (latents.cached_latents)
    checkpoint.check_writable(latents.cache_root(), f"${latents.CACHE_ENV}", writable=False)
    source, wanted = autoencoder.parse_vae_flag(args.vae)
    try:
        found = autoencoder.vae_settings(source)
    except autoencoder.DownloadNeeded as e:
        if not args.dry_run:
            raise
        found = dict(ASSUMED_VAE, source=source, assumed=str(e))
    if found["in_channels"] != 3:
        raise ConfigError(f"--vae {source} encodes {found['in_channels']}-channel images, and a run gives its VAE RGB "
                          "images: use a VAE of RGB images, or train on pixels (leave out --vae)")  # fmt: skip
    if args.image_channels == 4:
        raise ConfigError(f"--vae {source} encodes RGB images, and these have an alpha channel: train on pixels "
                          "(leave out --vae) to keep it, or save the images as RGB")  # fmt: skip
    # a VAE encodes 8-bit RGB: grayscale repeated in three channels, 16 bits rounded to 8 (docs/images.md)
    args.image_channels, args.image_bits = 3, 8
    args.latent_size = autoencoder.latent_size(args.image_size, found["factor"])
    args.latent_channels = found["channels"]
    args.latent_normalization = wanted if "assumed" in found else autoencoder.normalization_kind(found, wanted)
    args.latents = found


def _fill_from_source(args):
    """--init_from: its record (init_from.read_source, `args.init_source`; None without it), the preset its
    config gives (a --model that names another is refused) and, where unset, --image_size: its size (times a
    --vae's factor). Without it --image_size is DEFAULT_IMAGE_SIZE where unset."""
    found = getattr(args, "init_source", None)
    if not args.init_from:
        args.init_source = None
        args.image_size = DEFAULT_IMAGE_SIZE if args.image_size is None else args.image_size
        return
    record = found if found and found["source"] == args.init_from else init_from.read_source(args.init_from)
    if args.model not in ("auto", record["model"]):
        raise ConfigError(f"--model {args.model} disagrees with --init_from {args.init_from}, whose network is "
                          f"--model {record['model']}: drop --model")  # fmt: skip
    args.model, args.init_source = record["model"], record
    if args.image_size is None:
        factor = autoencoder.vae_settings(autoencoder.parse_vae_flag(args.vae)[0])["factor"] if args.vae else 1
        size = record["sample_size"] or models.PRESETS[args.model].image_size
        args.image_size = sizes.times(size, factor)


def _take_from_source(args):
    """--init_from: what the run takes from its source's training, where the command line leaves it unset (the
    objective; a DDPM source's prediction type, noise schedule and zero terminal SNR), and its checks that need
    the run's inputs: its channels must be the source's; what differs and can be adapted is said in the record."""
    record = args.init_source
    if record is None:
        return
    init_from.check_fits(record, models.network_channels(vars(args)), bool(args.vae))
    patch = models.PRESETS[args.model].settings.get("patch_size")  # a DiT's
    record["adapted"] = init_from.adaptations(record, network_size(args), patch)
    trained = record["trained"]
    if args.objective is None:
        if not trained:
            raise ConfigError(
                f"--init_from {args.init_from}: no scheduler config beside it says how it was trained (a model folder "
                "outside its pipeline): add --objective (with --prediction_type and --beta_schedule) as it was trained"
            )
        if trained.get("refused"):
            raise ConfigError(f"{trained['refused']}: add --objective to say what to train it with")
        args.objective = objectives.recorded(trained["objective"])
    kind = objectives.of(args.objective)
    if trained and trained["objective"] and objectives.of(trained["objective"]) is kind and kind.discrete:
        for name in ("prediction_type", "beta_schedule"):
            if getattr(args, name) is None:
                setattr(args, name, trained[name])
        args.zero_terminal_snr = args.zero_terminal_snr or bool(trained.get("zero_terminal_snr"))


def network_size(args):
    """The size of what the network takes (sizes: a side or "WxH"): a latent run's latents, else the images."""
    return args.latent_size or args.image_size


def _fill_from_preset(args):
    """The model, and what its preset decides: objective, learning rate and schedule, sampling steps."""
    args.model = models.resolve_model_name(args.model, network_size(args))
    models.check_image_size(args.model, args.image_size, args.latents["factor"] if args.latents else 1)
    preset = models.PRESETS[args.model]
    defaulted = args.objective is None
    if defaulted:
        args.objective = default_objective(args.model, args.dataset)
    kind, family = objectives.of(args.objective), models.family(args.model)[0]
    time_input = family.time_input
    if time_input not in kind.time_inputs:
        givers = [name for name, other in objectives.OBJECTIVES.items() if time_input in other.time_inputs]
        raise ConfigError(f"--model {args.model} is trained with --objective {' or '.join(givers)}: "
                          f"drop --objective {kind.name}")  # fmt: skip
    _fill_sampling(args, defaulted)
    # The preset's DDPM settings (for a DDPM run) and other defaults, else the fallbacks
    ddpm = dict(preset.ddpm) if kind.discrete else {}
    conditional = args.class_conditional or args.text_encoder  # captions are conditioning as labels are
    fallbacks = PRESET_FALLBACKS | (CONDITIONAL_FALLBACKS if conditional and kind.discrete else {})
    for name, value in (fallbacks | ddpm | dict(preset.flags)).items():
        if not kind.ddpm_schedule and name in DDPM_ONLY:
            continue  # none for a flow run: its train_config.json must not read back as DDPM's flags
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.learning_rate is None:
        args.learning_rate = preset.learning_rate
    decay = preset.lr_decay
    if args.lr_scheduler is None:
        args.lr_scheduler = decay["schedule"] if decay else family.lr_schedule
    if args.lr_scheduler == "inverse_sqrt" and args.lr_ref_steps is None:
        images_per_step = args.train_batch_size * num_processes() * args.gradient_accumulation_steps
        args.lr_ref_steps = lr_ref_steps(args.model, images_per_step)
    if args.beta_schedule is None and kind.ddpm_schedule:
        args.beta_schedule = "linear"
    if args.num_inference_steps is None:
        args.num_inference_steps = kind.default_steps


def _fill_sampling(args, defaulted=False):
    """The objective's sampler where unset, and its refusals of other objectives' samplers and of DDPM's
    schedule flags where it has no DDPM schedule (`defaulted`: the preset chose the objective, so the refusal
    says how to ask for DDPM); then its own defaults where unset (flow's σ draw, SD3's logit-normal(0, 1))."""
    kind = objectives.of(args.objective)
    if args.sampler is None:
        args.sampler = kind.default_sampler
    ask = f"; {args.model} trains {kind.called} unless told: add --objective ddpm, or drop it" if defaulted else ""
    given = [name for name in DDPM_ONLY if getattr(args, name) not in (None, False)]
    if given and not kind.ddpm_schedule:
        raise ConfigError(f"--{given[0]} is DDPM's" + (ask or f": --objective {kind.name} has no DDPM schedule; drop it"))
    if args.sampler not in kind.samplers:
        owner = next(o for o in objectives.OBJECTIVES.values() if args.sampler in o.samplers)  # the flag's choices
        raise ConfigError(f"--sampler {args.sampler} is {owner.sampler_words}" + (ask or f": {kind.run_words} samples "
                          f"with {', '.join(kind.samplers)}"))  # fmt: skip
    for name, value in kind.defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _fill_from_machine(args):
    """Precision and compilation: the fast path with a CUDA GPU (`python -m bench` measures each part)."""
    gpu = on_gpu(args)
    if args.mixed_precision == "fp16" and not gpu:
        raise ConfigError("--mixed_precision fp16 needs a CUDA GPU: use bf16 or no (or drop --cpu)")
    if args.mixed_precision is None:  # --cpu on a GPU machine trains in fp32, as on any CPU
        args.mixed_precision = "bf16" if gpu and torch.cuda.is_bf16_supported() else "no"
    if args.mixed_precision == "fp8":
        why = fp8.refusal(args, torch.device("cuda" if gpu else "cpu"))
        if why:
            raise ConfigError(why)
    if args.compile_mode is None:
        args.compile_mode = "auto" if gpu else "off"


def num_processes():
    """The processes of this run, as `accelerate launch` (or torchrun) tells them: 1 without a launcher."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def lr_ref_steps(model, images_per_step):
    """inverse_sqrt's t_ref in optimizer steps: the preset's reference in images over the images per step."""
    decay = models.PRESETS[model].lr_decay
    return max(1, decay["ref_images"] // images_per_step) if decay else DEFAULT_LR_REF_STEPS


def cli_markdown():
    """docs/cli.md: train.py's --help, at a fixed width so that it reads the same everywhere."""
    parser = build_parser()
    parser.formatter_class = lambda prog: _Help(prog, width=100)
    return (
        "# `python train.py --help`\n\n"
        "Generated by `python -m ddpm_train.config docs/cli.md`; `tests/test_config.py` fails when it drifts from the flags.\n\n"
        f"```text\n{parser.format_help()}```\n"
    )


if __name__ == "__main__":  # python -m ddpm_train.config docs/cli.md
    Path(sys.argv[1]).write_text(cli_markdown())
