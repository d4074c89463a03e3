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
of a step (`step.choose_compile_mode`).
"""

import argparse
import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

import data
import ema as posthoc_ema
import model as models
import sample
import step as steps
from errors import ConfigError

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
PRESET_FALLBACKS = dict(prediction_type="epsilon", timestep_sampling="uniform", P_mean=models.P_MEAN,
                        P_std=models.P_STD, train_batch_size=16, num_epochs=8, use_ema=True)  # fmt: skip
SMALL = models.PRESETS["small"]

# The bare `python train.py` on a CUDA GPU (the built-in shapes, --model auto at 32px):
# `small` at batch 4 would leave an H100 idle (MFU well under 1%). These fill what the
# command line leaves unset instead: Ho et al.'s CIFAR-10 UNet at batch 128 (on an H100,
# 1,500 steps of ddpm32 at batch 128 learned recognisable digits at 62-78 ms a step:
# bench/results/2026-11-23-h100/digits-ddpm32-grid.png), the
# small preset's DDPM settings (v-prediction, EDM's noise levels, no EMA: the CPU quality
# ladder's winners), and 24 epochs of 16,384 generated images, 3,072 steps.
GPU_BARE_RUN = dict(model="ddpm32", train_batch_size=128, num_epochs=24, shapes_num_images=16384,
                    learning_rate=2e-4, use_ema=False, **SMALL["ddpm"])  # fmt: skip
CPU_SHAPES_NUM_IMAGES = 2048

# What a run's train_config.json holds beside its flags: facts of the run (the
# data, the machine, the FLOPs), recomputed by every run, and the --config it was
# read from (files do not include each other). --config skips them.
DERIVED_KEYS = (
    "config", "num_processes", "num_images", "data_path", "global_batch_size", "steps_per_epoch",
    "total_train_steps", "total_epochs", "params", "model_flops_per_step", "hardware_flops_per_step",
    "step_compile_mode", "device", "num_classes", "class_names", "class_counts",
)  # fmt: skip

# What one command asks for once, not what a run is: a file read with --config never
# carries them (a run's train_config.json fed back must not delete its checkpoints
# because that run once started with --overwrite_output_dir).
INVOCATION_KEYS = ("overwrite_output_dir", "resume_from_checkpoint", "dry_run")

# Flags that are gone: old spelling -> the new one, which the old one's error names.
RENAMED = {
    "--profile_operators": "--profile operators",
    "--no-profile_operators": "--profile (its level, kernels, is the default)",
}


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, exit code 2, no usage block: the message says what to change.
    `source` names where the flags came from (a --config file) when it is not the command line."""

    def __init__(self, *args, source="", **kwargs):
        super().__init__(*args, **kwargs)
        self.source = source

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {self.source}{message} (see --help)\n")


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
        if value is not None and not self.inside(value):
            raise ConfigError(f"--{name} must be {self.says} (got {value})")


def at_least(low, kind=int):
    return Range(kind, lambda v: v >= low, f"at least {low}")


positive = Range(float, lambda v: v > 0, "greater than 0")
non_negative = Range(float, lambda v: v >= 0, "at least 0")
unit_interval = Range(float, lambda v: 0 <= v < 1, "in [0, 1)")


class _Renamed(argparse.Action):
    """An old spelling: it parses into a one-line error that names the new one."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {RENAMED[option_string]}")


class _Help(argparse.HelpFormatter):
    """--help gives each flag's allowed range and default after its text."""

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


def build_parser(prog="train.py", source=""):
    p = Parser(prog=prog, description="Train a diffusion model (DDPM or EDM2) with accelerate.", formatter_class=_Help,
               source=source)  # fmt: skip
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="a YAML or JSON file of flags (a run's train_config.json too); flags on the command line override it",
    )
    for old in RENAMED:
        p.add_argument(old, action=_Renamed)

    d = p.add_argument_group("data")
    flag(d, "dataset", "'shapes' (built in, no files), a folder of images, a dataset saved with datasets' "
         "save_to_disk, or a Hugging Face Hub dataset id", data.BUILTIN)  # fmt: skip
    flag(d, "dataset_config", "Hub dataset configuration name")
    flag(d, "split", "dataset split to train on", "train")
    flag(d, "image_column", "column holding the images (default: found by type)")
    flag(d, "shapes_num_images", f"size of the built-in dataset (default: {CPU_SHAPES_NUM_IMAGES}; "
         f"{GPU_BARE_RUN['shapes_num_images']} for the bare run on a GPU)", type=at_least(1))  # fmt: skip
    switch(d, "class_conditional", "train with the data's class labels (folders with one subfolder per class, a "
           "datasets ClassLabel column or --label_column, or the built-in shapes: one shape per image, labelled by "
           "its kind), for classifier-free guidance (--guidance_scale)")  # fmt: skip
    flag(d, "label_column", "column holding the class labels (default: the ClassLabel column)")
    flag(d, "label_dropout", "conditional: probability that a training label is replaced by the null label "
         "(classifier-free guidance learns the unconditional model from these)", 0.1, type=unit_interval)  # fmt: skip
    flag(d, "image_size", "train on square images of this side", 32, type=at_least(8))
    switch(d, "center_crop", "crop the centre after resizing (--no-center_crop: a random crop, decoded every epoch)", True)
    switch(d, "random_flip", "random left-right flips", True)
    switch(d, "preload_data", "decode the dataset once and keep it in memory as uint8 (on the GPU when training "
           "on one)", True)  # fmt: skip
    flag(d, "preload_max_gib", "stream from disk instead when preloading needs more", 8.0, type=positive)
    flag(d, "dataloader_num_workers", "processes that decode images (default: 4, or fewer CPU cores)",
         min(4, os.cpu_count() or 1), type=at_least(0))  # fmt: skip

    m = p.add_argument_group("model and noise schedule")
    flag(m, "model", f"preset: {', '.join(models.PRESETS)}; auto: "
         f"{', '.join(f'{name} at {size}px' for size, name in models.AUTO_MODEL.items())}, small otherwise "
         f"({GPU_BARE_RUN['model']} for the built-in shapes at 32px on a GPU)", "auto")  # fmt: skip
    flag(m, "num_train_timesteps", "diffusion steps T", 1000, type=at_least(1))
    flag(m, "beta_schedule", "noise schedule", "linear", choices=("linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid"))
    flag(m, "objective", "ddpm: Ho et al. (2020), Algorithm 1; edm: Karras et al. (2022)'s preconditioning with "
         "EDM2's learned loss weighting, sampled with EDM's Heun sampler (default: edm for the EDM2 presets, "
         "else ddpm)", choices=("ddpm", "edm"))  # fmt: skip
    flag(m, "timestep_sampling", "DDPM: how training draws t: uniform (Ho et al. 2020), or lognormal: t such that "
         "ln(sigma_t) ~ N(P_mean, P_std^2), EDM's noise levels on DDPM's timesteps (default: the preset's; "
         f"{SMALL['ddpm']['timestep_sampling']} for small, else {PRESET_FALLBACKS['timestep_sampling']})",
         choices=models.TIMESTEP_SAMPLINGS)  # fmt: skip
    flag(m, "P_mean", "EDM, and DDPM's --timestep_sampling lognormal: mean of ln(sigma) in training (default: "
         f"the preset's, else {models.P_MEAN}: EDM's CIFAR-10 value, as the EDM2 seed's configs; EDM2 used -0.8 for "
         "ImageNet-64, -0.4 for ImageNet-512 latents)", type=float)  # fmt: skip
    flag(m, "P_std", "EDM, and --timestep_sampling lognormal: std of ln(sigma) (default: the preset's, else "
         f"{models.P_STD}; EDM2: 1.6 for ImageNet-64, 1.0 for 512)", type=positive)  # fmt: skip
    flag(m, "sigma_data", "EDM: std of the data in [-1, 1]", models.SIGMA_DATA, type=positive)
    flag(m, "loss_weighting", "EDM: uncertainty = lambda(sigma)/e^u(sigma) with u learned (EDM2 eq. 21); "
         "edm = lambda(sigma) alone", "uncertainty", choices=models.LOSS_WEIGHTINGS)  # fmt: skip
    flag(m, "prediction_type", "DDPM: what the network predicts (default: the preset's; "
         f"{SMALL['ddpm']['prediction_type']} for small, else {PRESET_FALLBACKS['prediction_type']})",
         choices=("epsilon", "v_prediction", "sample"))  # fmt: skip
    flag(m, "snr_gamma", "DDPM: min-SNR-gamma loss weighting (Hang et al. 2023; 5 in their paper; default: off)",
         type=positive)  # fmt: skip
    switch(m, "zero_terminal_snr", "DDPM: rescale the betas to zero SNR at t = T (Lin et al. 2024); needs "
           "--prediction_type v_prediction")  # fmt: skip

    t = p.add_argument_group("training")
    flag(t, "train_batch_size", "images per device per micro-batch (default: the preset's; "
         f"{SMALL['flags']['train_batch_size']} for small, else {PRESET_FALLBACKS['train_batch_size']})",
         type=at_least(1))  # fmt: skip
    flag(t, "num_epochs", f"passes over the dataset (default: the preset's; {SMALL['flags']['num_epochs']} for "
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
    flag(t, "adam_beta1", "AdamW beta1", 0.95, type=unit_interval)
    flag(t, "adam_beta2", "AdamW beta2", 0.999, type=unit_interval)
    flag(t, "weight_decay", "AdamW weight decay", 1e-6, type=non_negative)
    flag(t, "adam_epsilon", "AdamW epsilon", 1e-8, type=positive)
    flag(t, "max_grad_norm", "clip gradients to this norm (0: off)", 1.0, type=non_negative)
    switch(t, "use_ema", "keep an EMA of the weights; it samples, is saved and is scored (default: the preset's; "
           f"{'on' if SMALL['flags'].get('use_ema', True) else 'off'} for small, else "
           f"{'on' if PRESET_FALLBACKS['use_ema'] else 'off'}; on with --ema power)", None)  # fmt: skip
    flag(t, "ema_max_decay", "EMA decay after warm-up", 0.9999, type=unit_interval)
    flag(t, "ema_inv_gamma", "EMA warm-up: decay = 1 - (1 + step/inv_gamma)^-power", 1.0, type=positive)
    flag(t, "ema_power", "EMA warm-up power", 0.75, type=non_negative)
    flag(t, "mixed_precision", "autocast precision (default: bf16 on a GPU that has it, else no)",
         choices=("no", "fp16", "bf16"))  # fmt: skip
    switch(t, "allow_tf32", "let fp32 matmuls and convolutions use TF32 on GPUs that have it", True)
    switch(t, "gradient_checkpointing", "recompute activations in the backward pass to save memory")
    flag(t, "seed", "seeds the data, the model and the noise", 0, type=at_least(0))
    switch(t, "cpu", "train on the CPU even if a GPU is there (needed for several CPU processes: gloo)")

    s = p.add_argument_group("speed (bench.py measures each; unset, compile and cudnn_benchmark are on with a CUDA GPU, "
                             "off with --cpu or none)")
    flag(s, "channels_last", "keep weights and activations channels_last (NHWC), the layout tensor-core convolutions "
         "read (default: off, on with --fused_norm: compiled ref128 was slower with it on an H100, BENCHMARKS.md)", action=argparse.BooleanOptionalAction)  # fmt: skip
    flag(s, "compile", "torch.compile the UNet (the first steps compile; the saved model is the uncompiled one)",
         action=argparse.BooleanOptionalAction)  # fmt: skip
    flag(s, "compile_mode", "auto: reduce-overhead (CUDA graphs) when a step is too small to keep the GPU busy, "
         "else default (the rule and its measurements: step.py); torch.compile's modes; step-graph: the whole "
         "step (forward, backward, optimizer, EMA) in one CUDA graph", "auto", choices=steps.COMPILE_MODES)  # fmt: skip
    switch(s, "fused_adam", "fused AdamW where torch has it for the device (CUDA and CPU do), else foreach; fused "
           "skips a non-finite step on the device, without a host sync", True)  # fmt: skip
    flag(s, "cudnn_benchmark", "let cuDNN time its convolution algorithms on the first steps and keep the fastest",
         action=argparse.BooleanOptionalAction)  # fmt: skip
    flag(s, "fused_norm", "fused NHWC GroupNorm+SiLU Triton kernels for the ResNet blocks and the final norm "
         "(fused_norm.py); needs a CUDA GPU and --channels_last (default: off, until bench.py's fused_norm row "
         "measures it faster)", action=argparse.BooleanOptionalAction)  # fmt: skip

    o = p.add_argument_group("outputs")
    flag(o, "output_dir", "where samples, checkpoints and the model go", "ddpm-output")
    flag(o, "logger", "where the logged scalars go, through accelerate's trackers: tensorboard (logs/, drawn "
         "into plots/ at the end), wandb (Weights & Biases; WANDB_MODE=offline keeps it on disk) or none",
         "tensorboard", choices=LOGGERS)  # fmt: skip
    flag(o, "save_images_epochs", "write a sample grid every N epochs", 2, type=at_least(1))
    flag(o, "eval_batch_size", "images in a sample grid", 16, type=at_least(1))
    flag(o, "sampler", "sampler for the grids and FID", sample.DEFAULT_SAMPLER, choices=sample.SAMPLERS)
    flag(o, "churn", sample.CHURN_HELP, sample.EDM_CHURN, type=non_negative)
    flag(o, "num_inference_steps", f"sampling steps for the grids and FID (default: {sample.DEFAULT_STEPS}; "
         f"{sample.EDM_STEPS} for EDM's Heun sampler, {2 * sample.EDM_STEPS - 1} network evaluations)",
         type=at_least(1))  # fmt: skip
    flag(o, "guidance_scale", "grids and evaluation: w in D = D_uncond + w (D_cond - D_uncond) for a conditional "
         "run (classifier-free guidance), or D = D_guide + w (D - D_guide) with --guide; 1: no guidance", 1.0,
         type=non_negative)  # fmt: skip
    flag(o, "guide", "grids and evaluation: guide the model with another run's (autoguidance, Karras et al. 2024): "
         "its --output_dir, pipeline or checkpoint folder")  # fmt: skip
    flag(o, "checkpointing_steps", "save a checkpoint every N steps", 500, type=at_least(1))
    flag(o, "checkpoints_total_limit", "keep at most this many checkpoints (default: all)", type=at_least(1))
    switch(o, "resume", "continue from the newest checkpoint in --output_dir when there is one (--no-resume: "
           "refuse to)", True)  # fmt: skip
    flag(o, "resume_from_checkpoint", "'latest' or a checkpoint folder to continue from")
    switch(o, "overwrite_output_dir", "start afresh in an --output_dir that holds another run (its checkpoints are deleted)")

    f = p.add_argument_group("faults")
    flag(f, "on_nonfinite", "a step whose loss or gradients are NaN/inf: skip its update and count it, or stop "
         "the run", "skip", choices=("skip", "stop"))  # fmt: skip
    switch(f, "strict_data", "stop at an unreadable image instead of skipping it with a warning")

    q = p.add_argument_group("sample quality: power EMA, FID and KID (docs/sampling.md)")
    flag(q, "ema", "standard: decay with warm-up (--ema_max_decay ...); power: Karras et al. 2024's power-function "
         "EMAs with snapshots for post-hoc reconstruction (ema.py reconstruct)", "standard",
         choices=("standard", "power"))  # fmt: skip
    flag(q, "ema_stds", "power EMA: relative widths tracked; the first gives grids, FID and the pipeline", "0.05,0.10")
    flag(q, "ema_snapshot_every", "power EMA: snapshot every N steps and at the end", 1000, type=at_least(1))
    flag(q, "eval_every_epochs", "FID and KID every N epochs and at the end (default: off)", type=at_least(1))
    flag(q, "eval_guidance_scales", "guidance scales to evaluate, comma-separated: one score each, and the best "
         "one's picks best/ (default: --guidance_scale)")  # fmt: skip
    flag(q, "eval_num_samples", "images generated for each FID/KID", 10000, type=at_least(2))
    flag(q, "fid_batch_size", "images per batch when generating and embedding for FID", 64, type=at_least(1))
    flag(q, "fid_weights", "Inception weights file for machines without internet (default: downloaded)")

    r = p.add_argument_group("performance report")
    flag(r, "logging_steps", "print and log throughput every N steps", 50, type=at_least(1))
    flag(r, "timing_warmup_steps", "steps left out of the timing", 5, type=at_least(0))
    flag(r, "peak_tflops", "peak TFLOP/s per device for MFU/HFU (default: from flops.py)", type=positive)
    switch(r, "dry_run", "print the resolved configuration and FLOPs, then exit (opens no dataset but the built-in one)")
    flag(r, "profile", "record a few steps with torch.profiler: a trace, a table and chart of the top kernels "
         "(or of the operators that launched them) in output_dir/profile/", nargs="?", const="kernels",
         choices=PROFILE_LEVELS)  # fmt: skip
    flag(r, "profile_steps", "steps recorded by --profile (after the step's compile or capture calls and 1 warm-up)", 3, type=at_least(1))
    flag(r, "profile_top", "rows of the --profile table", 15, type=at_least(1))
    switch(r, "profile_stack", "record Python stacks too (slow)")
    switch(r, "profile_only", "profile (--profile, kernels unless given), then stop")
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
        from_file = file_flags(args.config, parser)
    except ConfigError as e:
        parser.error(str(e))
    build_parser(source=f"--config {args.config}: ").parse_args(from_file)  # its bad values, named as the file's
    return parser.parse_args(from_file + argv)


def read_file(path):
    """{key: value} of a YAML file, or of JSON (a .json name)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
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


def file_flags(path, parser):
    """The command-line words that say what the file at `path` says, to be parsed before the real ones."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    words = []
    for key, value in read_file(path).items():
        if key in DERIVED_KEYS or key in INVOCATION_KEYS or (value is False and f"--{key}" in RENAMED):  # a removed switch, off: says nothing
            continue
        if f"--{key}" in RENAMED:
            raise ConfigError(f"--config {path}: {key} is now {RENAMED[f'--{key}']}")
        if key not in actions:
            raise ConfigError(f"--config {path}: '{key}' is not a flag of train.py")
        words += _words(actions[key], key, value, path)
    return words


def _words(action, key, value, path):
    """`key: value` as command-line words: --key=value, --key or --no-key; none for null (the default)."""
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigError(f"--config {path}: {key} takes true or false (got {value!r})")
        return [f"--{key}" if value else f"--no-{key}"]
    if action.nargs == "?" and isinstance(value, bool):  # --profile: true is its level by default, false is off
        return [f"--{key}"] if value else []
    if isinstance(value, (bool, dict)):
        raise ConfigError(f"--config {path}: {key} takes one value, not {value!r}")
    if isinstance(value, list):
        value = ",".join(map(str, value))  # --ema_stds
    return [f"--{key}={value}"]


def resolve(args):
    """Check every range, fill every value left unset, check the combinations; returns `args`.

    Filled: --model auto; the preset's objective, DDPM settings (prediction type, timestep
    sampling and its P_mean/P_std), batch size, epochs, learning rate, lr_scheduler and
    (inverse_sqrt) lr_ref_steps; num_inference_steps by the objective's sampler;
    mixed_precision and the speed switches (channels_last, compile, cudnn_benchmark,
    fused_norm) by the machine; --profile by --profile_only; ema_stds as numbers.
    Idempotent: a resolved Namespace comes back the same.
    """
    for name, kind in _ranges().items():
        kind.check(name, getattr(args, name))
    _fill_gpu_bare_run(args)
    _fill_from_preset(args)
    _fill_from_machine(args)
    if args.objective == "ddpm" and args.num_inference_steps > args.num_train_timesteps:
        raise ConfigError(
            f"--num_inference_steps ({args.num_inference_steps}) cannot exceed --num_train_timesteps "
            f"({args.num_train_timesteps})"
        )
    if args.zero_terminal_snr and args.prediction_type != "v_prediction":
        raise ConfigError("--zero_terminal_snr needs --prediction_type v_prediction (at zero SNR eps says nothing of the image)")
    if args.objective == "edm" and (args.snr_gamma is not None or args.zero_terminal_snr):
        raise ConfigError("--snr_gamma and --zero_terminal_snr are DDPM's: EDM weights its loss by --loss_weighting")
    if args.profile_only and args.profile is None:
        args.profile = "kernels"
    if args.logger == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--logger wandb needs the wandb package: pip install wandb (or use --logger tensorboard)")
    if args.ema == "power" and not args.use_ema:
        raise ConfigError("--ema power needs an EMA: drop --no-use_ema")
    if isinstance(args.ema_stds, str):
        args.ema_stds = posthoc_ema.parse_stds(args.ema_stds)
    if args.guide is not None and not Path(args.guide).exists():
        raise ConfigError(f"--guide {args.guide}: no such folder; point it at a run of the same data (its --output_dir)")
    if args.eval_guidance_scales is None:
        args.eval_guidance_scales = [args.guidance_scale]
    args.eval_guidance_scales = sample.parse_scales(args.eval_guidance_scales, "--eval_guidance_scales")
    if any(w != 1 for w in [args.guidance_scale, *args.eval_guidance_scales]) and not (args.class_conditional or args.guide):
        raise ConfigError("--guidance_scale and --eval_guidance_scales guide a --class_conditional run (or one with "
                          "--guide): add one of them, or leave them at 1")  # fmt: skip
    if args.fid_weights is not None and not Path(args.fid_weights).is_file():
        raise ConfigError(f"--fid_weights {args.fid_weights}: no such file")
    return args


def on_gpu(args):
    """Whether this run trains on a CUDA GPU."""
    return torch.cuda.is_available() and not args.cpu


def _fill_gpu_bare_run(args):
    """GPU_BARE_RUN's values where unset, for the built-in shapes at 32px with --model auto on a GPU;
    elsewhere only the built-in dataset's size."""
    if args.dataset == data.BUILTIN and args.model == "auto" and args.image_size == 32 and on_gpu(args):
        for name, value in GPU_BARE_RUN.items():
            if name in SMALL["ddpm"] and args.objective == "edm":
                continue  # DDPM's settings; --objective edm draws its own noise levels
            if name == "model" or getattr(args, name) is None:
                setattr(args, name, value)
    if args.shapes_num_images is None:
        args.shapes_num_images = CPU_SHAPES_NUM_IMAGES


def _fill_from_preset(args):
    """The model, and what its preset decides: objective, learning rate and schedule, sampling steps."""
    args.model = models.resolve_model_name(args.model, args.image_size)
    models.check_image_size(args.model, args.image_size)
    preset = models.PRESETS[args.model]
    edm2_network = preset.get("network") == "edm2"
    if args.objective is None:
        args.objective = "edm" if edm2_network else "ddpm"
    if edm2_network and args.objective != "edm":
        raise ConfigError(f"--model {args.model} is an EDM2 network, trained with --objective edm: drop --objective ddpm")
    if args.objective == "edm" and args.timestep_sampling not in (None, "uniform"):
        raise ConfigError("--timestep_sampling is DDPM's: EDM draws its noise levels by --P_mean and --P_std")
    # The preset's DDPM settings (for a DDPM run) and other defaults, else the fallbacks
    ddpm = preset.get("ddpm", {}) if args.objective == "ddpm" else {}
    if args.use_ema is None and args.ema == "power":
        args.use_ema = True  # asking for the power EMA asks for an EMA
    for name, value in (PRESET_FALLBACKS | ddpm | preset.get("flags", {})).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.learning_rate is None:
        args.learning_rate = preset["learning_rate"]
    decay = preset.get("lr_decay")
    if args.lr_scheduler is None:
        args.lr_scheduler = decay["schedule"] if decay else "constant_with_warmup" if edm2_network else "cosine"
    if args.lr_scheduler == "inverse_sqrt" and args.lr_ref_steps is None:
        images_per_step = args.train_batch_size * num_processes() * args.gradient_accumulation_steps
        args.lr_ref_steps = lr_ref_steps(args.model, images_per_step)
    if args.num_inference_steps is None:
        args.num_inference_steps = sample.EDM_STEPS if args.objective == "edm" else sample.DEFAULT_STEPS


def _fill_from_machine(args):
    """Precision and the speed switches: the fast path with a CUDA GPU (bench.py measures each part)."""
    gpu = on_gpu(args)
    if args.mixed_precision == "fp16" and not gpu:
        raise ConfigError("--mixed_precision fp16 needs a CUDA GPU: use bf16 or no (or drop --cpu)")
    if args.mixed_precision is None:  # --cpu on a GPU machine trains in fp32, as on any CPU
        args.mixed_precision = "bf16" if gpu and torch.cuda.is_bf16_supported() else "no"
    for name in ("compile", "cudnn_benchmark"):
        if getattr(args, name) is None:
            setattr(args, name, gpu)
    if args.fused_norm is None:
        args.fused_norm = False  # not measured faster on a GPU yet: off unless asked for
    if args.channels_last is None:  # measured slower on an H100 (BENCHMARKS.md); the fused kernels need it
        args.channels_last = args.fused_norm
    if args.fused_norm and not (gpu and args.channels_last):
        raise ConfigError(
            "--fused_norm needs a CUDA GPU and --channels_last (the kernels run on NHWC CUDA tensors): "
            "drop it or add --channels_last"
        )


def num_processes():
    """The processes of this run, as `accelerate launch` (or torchrun) tells them: 1 without a launcher."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def lr_ref_steps(model, images_per_step):
    """inverse_sqrt's t_ref in optimizer steps: the preset's reference in images over the images per step."""
    decay = models.PRESETS[model].get("lr_decay")
    return max(1, decay["ref_images"] // images_per_step) if decay else DEFAULT_LR_REF_STEPS


def cli_markdown():
    """docs/cli.md: train.py's --help, at a fixed width so that it reads the same everywhere."""
    parser = build_parser()
    parser.formatter_class = lambda prog: _Help(prog, width=100)
    return (
        "# `python train.py --help`\n\n"
        "Generated by `python config.py docs/cli.md`; `tests/test_config.py` fails when it drifts from the flags.\n\n"
        f"```text\n{parser.format_help()}```\n"
    )


if __name__ == "__main__":  # python config.py docs/cli.md
    Path(sys.argv[1]).write_text(cli_markdown())
