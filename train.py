"""Train a DDPM (a diffusers UNet2DModel) and report honest FLOPs and utilization.

    python train.py                                   # built-in shapes, CPU-sized model
    python train.py --dataset path/to/images --image_size 64
    python train.py --dataset huggan/smithsonian_butterflies_subset \\
        --image_size 128 --train_batch_size 64 --num_epochs 50 --learning_rate 1e-4
    python train.py --dry_run                         # resolved config, parameters, FLOPs; no training

Resume a run from its newest checkpoint:

    python train.py ...same flags... --resume_from_checkpoint latest

What it writes into --output_dir: samples/NNNN.png (a grid from the EMA
weights, the same noise every time), the trained pipeline
(`DDPMPipeline.from_pretrained(output_dir)`), checkpoints/checkpoint-STEP/,
train_config.json and tensorboard logs under logs/. Every --logging_steps it
prints one line: s/step, images/s, TFLOP/step, TFLOP/s, MFU, HFU and the peak
they are measured against.
"""

import argparse
import copy
import json
import math
import os
import sys
from pathlib import Path

import torch

import checkpoint
import data
import ema as posthoc_ema
import flops
import metrics
import model as models
import profiling
import sample
import step as steps
from errors import ConfigError, RunError

SAMPLERS = sample.SAMPLERS
LR_SCHEDULES = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt",
)  # fmt: skip


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line, exit code 2: no usage block (the message says what to change)."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv=None):
    p = _Parser(prog="train.py", description="Train a DDPM UNet2DModel with accelerate.")
    d = p.add_argument_group("data")
    d.add_argument(
        "--dataset",
        default=data.BUILTIN,
        help="'shapes' (built in, no files), a folder of images, a dataset saved with "
        "datasets' save_to_disk, or a Hugging Face Hub dataset id",
    )
    d.add_argument("--dataset_config", default=None, help="Hub dataset configuration name")
    d.add_argument("--split", default="train", help="dataset split to train on")
    d.add_argument("--image_column", default=None, help="column holding the images (default: found by type)")
    d.add_argument("--shapes_num_images", type=int, default=2048, help="size of the built-in dataset")
    d.add_argument("--image_size", type=int, default=32, help="train on square images of this side")
    d.add_argument(
        "--center_crop",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="crop the centre after resizing (--no-center_crop: a random crop, decoded every epoch)",
    )
    d.add_argument("--random_flip", action=argparse.BooleanOptionalAction, default=True, help="random left-right flips")
    d.add_argument(
        "--preload_data",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode the dataset once and keep it in memory as uint8 (on the GPU when training on one)",
    )
    d.add_argument(
        "--preload_max_gib", type=float, default=8.0, help="stream from disk instead when preloading needs more"
    )
    d.add_argument(
        "--dataloader_num_workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="processes that decode images",
    )

    m = p.add_argument_group("model and noise schedule")
    m.add_argument(
        "--model",
        default="auto",
        help=f"preset: {', '.join(models.PRESETS)}; auto = ref128 at 128px, adm64 at 64px, small otherwise",
    )
    m.add_argument("--num_train_timesteps", type=int, default=1000, help="diffusion steps T")
    m.add_argument(
        "--beta_schedule",
        default="linear",
        choices=("linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid"),
        help="noise schedule",
    )
    m.add_argument(
        "--objective",
        default=None,
        choices=("ddpm", "edm"),
        help="ddpm: Ho et al. (2020), Algorithm 1; edm: Karras et al. (2022)'s preconditioning with EDM2's "
        "learned loss weighting, sampled with EDM's Heun sampler (default: edm for the edm2* presets, else ddpm)",
    )
    m.add_argument(
        "--P_mean",
        type=float,
        default=models.P_MEAN,
        help="EDM: mean of ln(sigma) in training (EDM's CIFAR-10 value, as the EDM2 seed's configs; "
        "EDM2 used -0.8 for ImageNet-64, -0.4 for ImageNet-512 latents)",
    )
    m.add_argument(
        "--P_std", type=float, default=models.P_STD, help="EDM: std of ln(sigma) (EDM2: 1.6 for ImageNet-64, 1.0 for 512)"
    )
    m.add_argument("--sigma_data", type=float, default=models.SIGMA_DATA, help="EDM: std of the data in [-1, 1]")
    m.add_argument(
        "--loss_weighting",
        default="uncertainty",
        choices=models.LOSS_WEIGHTINGS,
        help="EDM: uncertainty = lambda(sigma)/e^u(sigma) with u learned (EDM2 eq. 21); edm = lambda(sigma) alone",
    )
    m.add_argument(
        "--prediction_type",
        default="epsilon",
        choices=("epsilon", "v_prediction", "sample"),
        help="what the network predicts",
    )

    t = p.add_argument_group("training")
    t.add_argument("--train_batch_size", type=int, default=16, help="images per device per micro-batch")
    t.add_argument("--num_epochs", type=int, default=8, help="passes over the dataset")
    t.add_argument("--max_train_steps", type=int, default=None, help="optimizer steps; overrides --num_epochs")
    t.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument(
        "--learning_rate",
        type=float,
        default=None,
        help="peak AdamW learning rate (default: the preset's, 1e-4 for ref128, adm64 and ddpm32, 2e-3 for small)",
    )
    t.add_argument(
        "--lr_scheduler",
        default=None,
        choices=LR_SCHEDULES,
        help="learning-rate schedule after the warm-up (default: the preset's: inverse_sqrt for edm2e and edm2g, "
        "constant_with_warmup for edm2c, cosine for the others); inverse_sqrt is EDM2's lr / sqrt(max(step / "
        "lr_ref_steps, 1))",
    )
    t.add_argument(
        "--lr_ref_steps",
        type=int,
        default=None,
        help="inverse_sqrt: steps before the decay starts (default: the preset's, 400 epochs of 50,000 images for "
        "edm2e/edm2g, in optimizer steps of this run's batch; else 70,000, EDM2's ImageNet-512 value)",
    )
    t.add_argument("--lr_warmup_steps", type=int, default=100, help="linear warm-up steps")
    t.add_argument("--adam_beta1", type=float, default=0.95, help="AdamW beta1")
    t.add_argument("--adam_beta2", type=float, default=0.999, help="AdamW beta2")
    t.add_argument("--weight_decay", type=float, default=1e-6, help="AdamW weight decay")
    t.add_argument("--adam_epsilon", type=float, default=1e-8, help="AdamW epsilon")
    t.add_argument("--max_grad_norm", type=float, default=1.0, help="clip gradients to this norm (0: off)")
    t.add_argument(
        "--use_ema", action=argparse.BooleanOptionalAction, default=True, help="keep an EMA of the weights"
    )
    t.add_argument("--ema_max_decay", type=float, default=0.9999, help="EMA decay after warm-up")
    t.add_argument("--ema_inv_gamma", type=float, default=1.0, help="EMA warm-up: decay = 1 - (1 + step/inv_gamma)^-power")
    t.add_argument("--ema_power", type=float, default=0.75, help="EMA warm-up power")
    t.add_argument(
        "--mixed_precision",
        default=None,
        choices=("no", "fp16", "bf16"),
        help="autocast precision (default: bf16 on a GPU that has it, else no)",
    )
    t.add_argument(
        "--allow_tf32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let fp32 matmuls and convolutions use TF32 on GPUs that have it",
    )
    t.add_argument(
        "--gradient_checkpointing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="recompute activations in the backward pass to save memory",
    )
    t.add_argument("--seed", type=int, default=0, help="seeds the data, the model and the noise")
    t.add_argument(
        "--cpu",
        action="store_true",
        help="train on the CPU even if a GPU is there (needed for several CPU processes: gloo)",
    )

    s = p.add_argument_group("speed (bench.py measures each; unset, the switches are on with a CUDA GPU, off with --cpu or none)")
    s.add_argument(
        "--channels_last",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep weights and activations channels_last (NHWC), the layout tensor-core convolutions read",
    )
    s.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the UNet (the first steps compile; the saved model is the uncompiled one)",
    )
    s.add_argument(
        "--compile_mode",
        default="auto",
        choices=steps.COMPILE_MODES,
        help="auto: reduce-overhead (CUDA graphs) when a step is too small to keep the GPU busy, else default "
        "(the rule and its measurements: step.py); torch.compile's modes; step-graph: the whole step "
        "(forward, backward, optimizer, EMA) in one CUDA graph",
    )
    s.add_argument(
        "--fused_adam",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fused AdamW where torch has it for the device (CUDA and CPU do), else foreach; fused skips a "
        "non-finite step on the device, without a host sync",
    )
    s.add_argument(
        "--cudnn_benchmark",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let cuDNN time its convolution algorithms on the first steps and keep the fastest",
    )
    s.add_argument(
        "--fused_norm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fused NHWC GroupNorm+SiLU Triton kernels for the ResNet blocks and the final norm (fused_norm.py); "
        "unset: off until bench.py's fused_norm row has measured it faster on a GPU; needs a CUDA GPU and "
        "--channels_last",
    )

    o = p.add_argument_group("outputs")
    o.add_argument("--output_dir", default="ddpm-output", help="where samples, checkpoints and the model go")
    o.add_argument("--save_images_epochs", type=int, default=2, help="write a sample grid every N epochs")
    o.add_argument("--eval_batch_size", type=int, default=16, help="images in a sample grid")
    o.add_argument("--sampler", default=sample.DEFAULT_SAMPLER, choices=SAMPLERS, help="sampler for the grids and FID")
    o.add_argument(
        "--num_inference_steps",
        type=int,
        default=None,
        help=f"sampling steps for the grids and FID (default: {sample.DEFAULT_STEPS}; {sample.EDM_STEPS} for EDM's Heun "
        f"sampler, {2 * sample.EDM_STEPS - 1} network evaluations)",
    )
    o.add_argument("--checkpointing_steps", type=int, default=500, help="save a checkpoint every N steps")
    o.add_argument("--checkpoints_total_limit", type=int, default=None, help="keep at most this many checkpoints")
    o.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="continue from the newest checkpoint in --output_dir when there is one (--no-resume: refuse to)",
    )
    o.add_argument(
        "--resume_from_checkpoint", default=None, help="'latest' or a checkpoint folder to continue from"
    )
    o.add_argument(
        "--overwrite_output_dir",
        action="store_true",
        help="start afresh in an --output_dir that holds another run (its checkpoints are deleted)",
    )

    f = p.add_argument_group("faults")
    f.add_argument(
        "--on_nonfinite",
        default="skip",
        choices=("skip", "stop"),
        help="a step whose loss or gradients are NaN/inf: skip its update and count it, or stop the run",
    )
    f.add_argument(
        "--strict_data",
        action="store_true",
        help="stop at an unreadable image instead of skipping it with a warning",
    )

    q = p.add_argument_group("sample quality: power EMA, FID and KID (README: Sampling and evaluation)")
    q.add_argument(
        "--ema",
        default="standard",
        choices=("standard", "power"),
        help="standard: decay with warm-up (--ema_max_decay ...); power: Karras et al. 2024's power-function EMAs "
        "with snapshots for post-hoc reconstruction (ema.py reconstruct)",
    )
    q.add_argument(
        "--ema_stds", default="0.05,0.10", help="power EMA: relative widths tracked; the first gives grids, FID and the pipeline"
    )
    q.add_argument("--ema_snapshot_every", type=int, default=1000, help="power EMA: snapshot every N steps and at the end")
    q.add_argument("--eval_every_epochs", type=int, default=None, help="FID and KID every N epochs and at the end (default: off)")
    q.add_argument("--eval_num_samples", type=int, default=10000, help="images generated for each FID/KID")
    q.add_argument("--fid_batch_size", type=int, default=64, help="images per batch when generating and embedding for FID")
    q.add_argument(
        "--fid_weights", default=None, help="Inception weights file for machines without internet (default: downloaded)"
    )

    r = p.add_argument_group("performance report")
    r.add_argument("--logging_steps", type=int, default=50, help="print and log throughput every N steps")
    r.add_argument("--timing_warmup_steps", type=int, default=5, help="steps left out of the timing")
    r.add_argument(
        "--peak_tflops", type=float, default=None, help="peak TFLOP/s per device for MFU/HFU (default: from flops.py)"
    )
    r.add_argument("--dry_run", action="store_true", help="print the resolved configuration and FLOPs, then exit")
    r.add_argument(
        "--profile",
        action="store_true",
        help="record a few steps with torch.profiler: a trace, a top-operator table and chart in output_dir/profile/",
    )
    r.add_argument("--profile_steps", type=int, default=3, help="steps recorded by --profile (after 1 skipped and 1 warm-up)")
    r.add_argument("--profile_top", type=int, default=15, help="operators in the --profile table")
    r.add_argument("--profile_stack", action="store_true", help="record Python stacks too (slow)")
    r.add_argument(
        "--profile_operators",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="rank the operators that launched the kernels in the --profile table, not the device kernels",
    )
    r.add_argument("--profile_only", action="store_true", help="stop once --profile has recorded its steps")
    return p.parse_args(argv)


def validate(args):
    """Refuse bad flags before anything is loaded; resolve `--model auto`."""
    at_least = dict(
        image_size=8,
        train_batch_size=1,
        eval_batch_size=1,
        num_epochs=1,
        gradient_accumulation_steps=1,
        shapes_num_images=1,
        num_train_timesteps=1,
        save_images_epochs=1,
        checkpointing_steps=1,
        logging_steps=1,
        profile_steps=1,
        profile_top=1,
        lr_warmup_steps=0,
        timing_warmup_steps=0,
        dataloader_num_workers=0,
    )
    for name, low in at_least.items():
        if getattr(args, name) < low:
            raise ConfigError(f"--{name} must be at least {low} (got {getattr(args, name)})")
    for name in ("max_train_steps", "checkpoints_total_limit"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    for name in ("learning_rate", "preload_max_gib", "adam_epsilon"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise ConfigError(f"--{name} must be greater than 0 (got {getattr(args, name)})")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ConfigError(f"--peak_tflops must be greater than 0 (got {args.peak_tflops})")
    for name in ("adam_beta1", "adam_beta2", "ema_max_decay"):
        if not 0 <= getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be in [0, 1) (got {getattr(args, name)})")
    if args.weight_decay < 0 or args.max_grad_norm < 0:
        raise ConfigError("--weight_decay and --max_grad_norm must not be negative")
    if args.profile_only and not args.profile:
        raise ConfigError("--profile_only needs --profile")
    if args.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("--mixed_precision fp16 needs a CUDA GPU: use bf16 or no")
    args.model = models.resolve_model_name(args.model, args.image_size)
    models.check_image_size(args.model, args.image_size)
    if args.learning_rate is None:
        args.learning_rate = models.PRESETS[args.model]["learning_rate"]
    if args.mixed_precision is None:
        gpu_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        args.mixed_precision = "bf16" if gpu_bf16 else "no"
    # The fast path is the default with a CUDA GPU (bench.py measures each part).
    on_gpu = torch.cuda.is_available() and not args.cpu
    for name in ("channels_last", "compile", "cudnn_benchmark"):
        if getattr(args, name) is None:
            setattr(args, name, on_gpu)
    if args.fused_norm is None:
        args.fused_norm = False  # not measured faster on a GPU yet: off unless asked for
    if args.fused_norm and not (on_gpu and args.channels_last):
        raise ConfigError(
            "--fused_norm needs a CUDA GPU and --channels_last (the kernels run on NHWC CUDA tensors): "
            "drop it or add --channels_last"
        )
    return validate_sample_quality(validate_objective(args))


def validate_objective(args):
    """The objective, its sampler's steps and the learning-rate schedule, by the preset where unset."""
    preset = models.PRESETS[args.model]
    edm2_network = preset.get("network") == "edm2"
    if args.objective is None:
        args.objective = "edm" if edm2_network else "ddpm"
    if edm2_network and args.objective != "edm":
        raise ConfigError(f"--model {args.model} is an EDM2 network, trained with --objective edm: drop --objective ddpm")
    if not args.P_std > 0 or not args.sigma_data > 0:
        raise ConfigError("--P_std and --sigma_data must be greater than 0")
    if args.num_inference_steps is None:
        args.num_inference_steps = sample.EDM_STEPS if args.objective == "edm" else sample.DEFAULT_STEPS
    if args.num_inference_steps < 1:
        raise ConfigError(f"--num_inference_steps must be at least 1 (got {args.num_inference_steps})")
    if args.objective == "ddpm" and args.num_inference_steps > args.num_train_timesteps:
        raise ConfigError(
            f"--num_inference_steps ({args.num_inference_steps}) cannot exceed --num_train_timesteps "
            f"({args.num_train_timesteps})"
        )
    decay = preset.get("lr_decay")
    if args.lr_scheduler is None:
        args.lr_scheduler = decay["schedule"] if decay else "constant_with_warmup" if edm2_network else "cosine"
    if args.lr_ref_steps is not None and args.lr_ref_steps < 1:
        raise ConfigError(f"--lr_ref_steps must be at least 1 (got {args.lr_ref_steps})")
    return args


def validate_sample_quality(args):
    """The power-EMA and FID flags."""
    if args.ema == "power" and not args.use_ema:
        raise ConfigError("--ema power needs an EMA: drop --no-use_ema")
    args.ema_stds = posthoc_ema.parse_stds(args.ema_stds) if isinstance(args.ema_stds, str) else args.ema_stds
    for name, low in dict(ema_snapshot_every=1, eval_num_samples=2, fid_batch_size=1).items():
        if getattr(args, name) < low:
            raise ConfigError(f"--{name} must be at least {low} (got {getattr(args, name)})")
    if args.eval_every_epochs is not None and args.eval_every_epochs < 1:
        raise ConfigError(f"--eval_every_epochs must be at least 1 (got {args.eval_every_epochs})")
    if args.fid_weights is not None and not Path(args.fid_weights).is_file():
        raise ConfigError(f"--fid_weights {args.fid_weights}: no such file")
    return args


def main(args):
    """Train. Errors are one line: exit code 2 for a bad flag, path or dataset,
    1 when training cannot go on (disk full, non-finite loss with --on_nonfinite stop);
    143 after a SIGTERM and 130 after Ctrl-C, once the checkpoint is saved."""
    try:
        return train(validate(args))
    except ConfigError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except RunError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint
        print("train.py: interrupted twice: stopped without saving", file=sys.stderr)
        raise SystemExit(130) from None


# --- pieces of the run -------------------------------------------------------------


def load_images(args, unreadable):
    """The training images: a uint8 tensor (preloaded) or a Dataset to stream."""
    if args.dataset == data.BUILTIN:
        return data.make_shapes(args.shapes_num_images, args.image_size, seed=args.seed)
    dataset = data.open_dataset(
        args.dataset, args.image_size, args.center_crop, args.dataset_config, args.split, args.image_column
    )
    gib = len(dataset) * 3 * args.image_size**2 / 2**30
    if not args.preload_data or not args.center_crop or gib > args.preload_max_gib:
        data.check_readable(dataset, unreadable)
        return dataset
    return data.preload(dataset, args.dataloader_num_workers, progress=unreadable.verbose, unreadable=unreadable)


def ema_unet(accelerator, model, ema):
    """A stand-alone copy of the UNet carrying the EMA weights (or the raw ones without EMA)."""
    unet = copy.deepcopy(accelerator.unwrap_model(model)).eval()
    if ema is not None:
        ema.copy_to(unet.parameters())
    return unet


def save_sample_grid(unet, scheduler, args, path, accelerator):
    """Sample `eval_batch_size` images from fixed noise and write them as one grid PNG."""
    from diffusers import DDPMPipeline
    from torchvision.utils import make_grid, save_image

    pipeline = DDPMPipeline(unet=unet, scheduler=scheduler)
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(args.seed)  # the same noise at every epoch
    with accelerator.autocast():
        images = pipeline(
            batch_size=args.eval_batch_size,
            generator=generator,
            num_inference_steps=args.num_inference_steps,
            output_type="pt",
        ).images
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(make_grid(images.float(), nrow=math.ceil(math.sqrt(len(images)))), path)


def make_ema(args, unet, write):
    """The EMA of the weights that the samples and the saved pipeline use, or None (--no-use_ema).

    --ema power keeps one power-function EMA per --ema_stds and writes snapshots
    to ema_snapshots/ every --ema_snapshot_every steps (when `write`, the main
    process), for `ema.py reconstruct`; --ema standard is diffusers' EMAModel
    with warm-up, updated by foreach ops.
    """
    from diffusers.training_utils import EMAModel

    if not args.use_ema:
        return None
    if args.ema == "power":
        return posthoc_ema.PowerEMA(
            unet.parameters(),
            args.ema_stds,
            names=[name for name, _ in unet.named_parameters()],
            snapshot_dir=Path(args.output_dir) / posthoc_ema.SNAPSHOT_DIR,
            snapshot_every=args.ema_snapshot_every,
            write=write,
        )
    return EMAModel(
        unet.parameters(),
        decay=args.ema_max_decay,
        use_ema_warmup=True,
        inv_gamma=args.ema_inv_gamma,
        power=args.ema_power,
        foreach=True,
    )


# EDM2's t_ref for ImageNet-512 (70k steps of 2048 images), when the preset has none.
DEFAULT_LR_REF_STEPS = 70_000


def lr_ref_steps(args, images_per_step):
    """--lr_ref_steps, else the preset's reference in images over this run's images per step."""
    if args.lr_ref_steps is not None:
        return args.lr_ref_steps
    decay = models.PRESETS[args.model].get("lr_decay")
    return max(1, decay["ref_images"] // images_per_step) if decay else DEFAULT_LR_REF_STEPS


def make_lr_scheduler(args, optimizer, max_train_steps, ref_steps):
    """diffusers' schedules with --lr_warmup_steps, or EDM2's inverse square root:

    lr(t) = lr_ref * min(t / warmup, 1) / sqrt(max(t / t_ref, 1))
    (Karras et al. 2024, Config E; NVlabs/edm2 training_loop.learning_rate_schedule).
    """
    from diffusers.optimization import get_scheduler

    if args.lr_scheduler != "inverse_sqrt":
        return get_scheduler(
            args.lr_scheduler, optimizer, num_warmup_steps=args.lr_warmup_steps, num_training_steps=max_train_steps
        )
    warmup = args.lr_warmup_steps

    def factor(step):
        ramp = min(step / warmup, 1.0) if warmup else 1.0
        return ramp / math.sqrt(max(step / ref_steps, 1.0))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def peak_description(args, device):
    """(peak FLOP/s per device or None, words saying what it is)."""
    precision = flops.matmul_precision(args.mixed_precision, args.allow_tf32 and device.type == "cuda")
    if args.peak_tflops:
        return args.peak_tflops * 1e12, f"peak {args.peak_tflops:g} TFLOP/s (--peak_tflops)"
    if device.type != "cuda":
        return None, f"peak unknown for {device.type} {precision} (pass --peak_tflops)"
    name = torch.cuda.get_device_name(device)
    gpu, peak = flops.lookup_peak(name, precision)
    if peak is None:
        return None, f"peak unknown for {name} {precision} (pass --peak_tflops)"
    return peak, f"peak {name} {precision} {peak / 1e12:g} TFLOP/s"


# --- the run -------------------------------------------------------------------------


def train(args):
    """Build the run, then loop: data, step, log, sample, evaluate, checkpoint, stop."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from tqdm.auto import tqdm

    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.dry_run else "tensorboard",
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs")),
    )
    device, world = accelerator.device, accelerator.num_processes
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.allow_tf32
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    evaluator = None
    if args.eval_every_epochs and accelerator.is_main_process and not args.dry_run:
        # Loads the Inception network now: missing weights stop the run before any training.
        evaluator = metrics.TrainingEvaluator(args, args.output_dir, device, log=accelerator.print)

    # Data: decoded (or generated) before the model is built, so that a bad
    # path or file fails in seconds.
    unreadable = data.Unreadable(strict=args.strict_data, verbose=accelerator.is_main_process)
    images = load_images(args, unreadable)
    images_per_step = args.train_batch_size * world * args.gradient_accumulation_steps
    if len(images) < images_per_step:
        raise ConfigError(
            f"the dataset has {len(images)} images, fewer than one optimizer step takes "
            f"({args.train_batch_size} x {world} processes x {args.gradient_accumulation_steps} accumulation): "
            "lower --train_batch_size or --gradient_accumulation_steps"
        )
    steps_per_epoch = len(images) // images_per_step
    max_train_steps = args.max_train_steps or args.num_epochs * steps_per_epoch
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)

    # FLOPs per optimizer step and process, counted once on the meta device.
    cost = flops.step_flops(args.model, args.image_size, args.train_batch_size, args.gradient_checkpointing)
    model_flops = cost["model_flops"] * args.gradient_accumulation_steps * world  # all processes
    hardware_flops = cost["hardware_flops"] * args.gradient_accumulation_steps * world
    peak_flops, peak_words = peak_description(args, device)
    compile_mode, compile_why = steps.choose_compile_mode(args, device, world, cost["model_flops"])

    config = dict(
        vars(args),
        num_processes=world,
        num_images=len(images),
        data_path="preloaded" if isinstance(images, torch.Tensor) else "streamed",
        global_batch_size=images_per_step,
        steps_per_epoch=steps_per_epoch,
        total_train_steps=max_train_steps,
        total_epochs=num_epochs,
        params=cost["params"],
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hardware_flops,
        step_compile_mode=compile_mode or "eager",
        lr_ref_steps=lr_ref_steps(args, images_per_step) if args.lr_scheduler == "inverse_sqrt" else None,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
    )
    if args.dry_run:
        for key, value in config.items():
            accelerator.print(f"{key:28s} {value}")
        accelerator.print(
            f"model {args.model}: {cost['params']:,} parameters, {model_flops / 1e12:.4g} TFLOP per step "
            f"({model_flops / images_per_step / 1e9:.2f} GFLOP per image, forward+backward); {peak_words}; "
            f"step {compile_why}"
        )
        return config

    start_from = checkpoint.choose_start(
        args.output_dir, config, args.resume, args.resume_from_checkpoint, args.overwrite_output_dir
    )
    accelerator.wait_for_everyone()  # every process has looked before rank 0 writes there
    if evaluator is not None:
        evaluator.prepare_reference(images)
    set_seed(args.seed, device_specific=True)  # each process draws its own noise
    if isinstance(images, torch.Tensor) and device.type == "cuda":
        images = images.to(device)  # small enough to sit on the GPU: preload_max_gib
    batches = data.Batches(
        images,
        args.train_batch_size,
        args.seed,
        device,
        accelerator.process_index,
        world,
        args.dataloader_num_workers,
        unreadable,
    )

    unet = models.build_unet(args.model, args.image_size)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    noise_scheduler = models.make_noise_scheduler(args.num_train_timesteps, args.beta_schedule, args.prediction_type)
    if args.objective == "edm":
        objective = models.EDMObjective(args.P_mean, args.P_std, args.sigma_data, args.loss_weighting).to(device)
    else:
        objective = models.DDPMObjective(noise_scheduler).to(device)

    # Fused AdamW (--fused_adam, the default): one kernel for all parameters, and
    # it can skip a step on the device (see NonFiniteGuard), so a NaN costs no
    # host sync per step. channels_last converts the UNet in place first.
    optimizer = models.prepare_for_training(
        unet,
        args.channels_last,
        args.fused_adam,
        also=objective.parameters(),  # EDM's u(sigma) trains with the network
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.weight_decay,
        eps=args.adam_epsilon,
    )
    if args.fused_norm:  # class swaps in place: the parameters and the state dict stay as they are
        import fused_norm

        fused_norm.keep_channels_last(fused_norm.use_fused_norm(unet))
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, config["lr_ref_steps"])
    model, optimizer = accelerator.prepare(unet, optimizer)
    accelerator.register_for_checkpointing(lr_scheduler)
    if any(True for _ in objective.parameters()):
        accelerator.register_for_checkpointing(objective)
    ema = make_ema(args, accelerator.unwrap_model(model), write=accelerator.is_main_process)
    if ema is not None:
        ema.to(device)
        accelerator.register_for_checkpointing(ema)
    run = Run(args, accelerator, model, ema, noise_scheduler, evaluator, config)

    if start_from is not None:
        accelerator.load_state(str(start_from))
        if ema is not None:
            ema.to(device)
        state = checkpoint.read_state(start_from)
        run.step, run.skipped_before = state["step"], state.get("skipped_nonfinite", 0)
        accelerator.print(f"resumed from {start_from} at step {run.step}")
    if run.step >= max_train_steps:
        if not run.pipeline_saved():  # the end of the run was cut short
            run.on_main_process(run.save_pipeline)
            return config
        accelerator.print(
            f"{args.output_dir} is already trained to step {run.step} of {max_train_steps}: "
            "raise --max_train_steps or --num_epochs to train longer"
        )
        return config

    if accelerator.is_main_process:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        (run.output_dir / "train_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        accelerator.init_trackers("train", config={k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))})

    accelerator.print(
        f"training {args.model} ({cost['params']:,} parameters) on {len(images)} images at {args.image_size}px: "
        f"{max_train_steps} steps of {images_per_step} images, mixed precision {args.mixed_precision}, "
        f"{world} process(es) on {config['device']}; {model_flops / 1e12:.4g} TFLOP per step; {peak_words}; "
        f"step {compile_why}"
    )

    # The step: everything from the uint8 batch to the EMA, in one object (step.py).
    breakdown = profiling.Breakdown(device)
    run.guard = steps.NonFiniteGuard(optimizer, args.on_nonfinite, device)
    train_step = steps.build_step(
        steps.TrainStep(
            steps.compile_network(model, compile_mode),
            model,
            objective,
            optimizer,
            lr_scheduler,
            ema,
            run.guard,
            args.max_grad_norm,
            args.random_flip,
            accelerator=accelerator,
            mark=breakdown.phase_done,
        ),
        compile_mode,
        device,
    )
    compile_cache = run.output_dir / COMPILE_CACHE_FILE
    if compile_mode is not None and steps.load_compile_artifacts(compile_cache):
        accelerator.print(f"loaded compile artifacts from {compile_cache}")

    timer = flops.StepTimer(device, args.timing_warmup_steps)
    losses = steps.LossMeter(device)
    report = Reporter(run, lr_scheduler, losses, max_train_steps, images_per_step, model_flops, hardware_flops,
                      peak_flops, peak_words)  # fmt: skip
    started_at = profiling.now_iso()
    epoch_times = []  # each whole epoch's training time: data loading included; sampling, checkpoints not

    # --profile: torch.profiler on rank 0 over a few steps (1 skipped, 1 warm-up, then recorded).
    profiler, profile_until = None, run.step + 2 + args.profile_steps
    if args.profile and accelerator.is_main_process:
        profiler = profiling.make_profiler(
            run.output_dir / "profile", 1, 1, args.profile_steps, args.profile_top, with_stack=args.profile_stack,
            level="operators" if args.profile_operators else "kernels",
        )  # fmt: skip
        profiler.start()

    first_epoch = run.step // steps_per_epoch
    model.train()
    run.progress = tqdm(total=max_train_steps, initial=run.step, disable=not accelerator.is_local_main_process, desc="steps")
    breakdown.start()
    with checkpoint.StopSignals() as signals, run.progress:  # the bar is closed before any error is printed
        for epoch in range(first_epoch, num_epochs):
            start = (run.step - epoch * steps_per_epoch) * args.gradient_accumulation_steps
            micro_batches = batches.epoch(epoch, start=start)
            breakdown.begin_epoch()
            timer.restart()
            while run.step < min(max_train_steps, (epoch + 1) * steps_per_epoch):
                breakdown.begin_step()
                batch = [next(micro_batches) for _ in range(args.gradient_accumulation_steps)]
                breakdown.phase_done("data")
                if compile_mode is not None and run.compile_s is None:
                    step_losses = run.compile_step(train_step, batch, breakdown, compile_cache)
                else:
                    step_losses = train_step(batch, run.step + 1)
                for loss in step_losses:
                    losses.add(loss)
                run.step += 1
                timer.step_done()
                run.progress.update(1)

                if profiler is not None:
                    profiler.step()
                    if run.step == profile_until:  # the trace and table are written
                        profiler.stop()
                        profiler = None
                if args.profile_only and run.step == profile_until:
                    run.progress.close()
                    accelerator.print(f"stopped after profiling at step {run.step}: see {run.output_dir / 'profile'}")
                    accelerator.end_training()
                    return config
                if run.step % args.logging_steps == 0:
                    report(timer.collect())
                    breakdown.collect()
                if run.step % args.checkpointing_steps == 0 or run.step == max_train_steps:
                    run.save_checkpoint(breakdown)
                    timer.restart()
                if run.stop_requested(signals):
                    run.stop_for_signal(signals, breakdown)

            if start == 0 and run.step == (epoch + 1) * steps_per_epoch:  # a whole epoch in this run
                epoch_s = breakdown.epoch_s()
                epoch_times.append(dict(epoch=epoch, seconds=epoch_s, images_per_s=steps_per_epoch * images_per_step / epoch_s))
                accelerator.log(dict(epoch_time_s=epoch_s), step=run.step)
            last_epoch = run.step >= max_train_steps
            if epoch % args.save_images_epochs == 0 or last_epoch:
                with breakdown.pause("sampling"):
                    run.on_main_process(lambda: run.write_samples(epoch))
                timer.restart()
            if args.eval_every_epochs and ((epoch + 1) % args.eval_every_epochs == 0 or last_epoch):
                with breakdown.pause("evaluation"):
                    run.on_main_process(lambda: run.evaluate(epoch))
                timer.restart()
            if last_epoch:
                break

    if run.step % args.logging_steps:
        report(timer.collect())
    timer.collect()
    report(timer.all_times, final=True)
    skipped = run.skipped_before + run.guard.count()
    if skipped or len(unreadable):
        accelerator.print(
            f"skipped {skipped} step(s) with a non-finite loss or gradient and {len(unreadable)} unreadable image(s)"
        )
    parts, wall_s = breakdown.summary()
    accelerator.print(breakdown.format())
    if args.use_ema and args.ema == "power":
        ema.save_snapshot()  # the end of training, whatever --ema_snapshot_every (main process only)

    def finish():
        """The pipeline, then run.json (the main process)."""
        run.save_pipeline()
        step_time_s = flops.median(timer.all_times) if timer.all_times else None
        perf = report.perf(step_time_s) if step_time_s else {}
        profiling.write_manifest(
            run.output_dir / "run.json",
            config=config,
            git_commit=profiling.git_commit(),
            versions=profiling.library_versions(),
            device=profiling.device_facts(device, world),
            start_time=started_at,
            end_time=profiling.now_iso(),
            steps=run.step,
            skipped_nonfinite_steps=skipped,
            unreadable_images=len(unreadable),
            final_loss=losses.last,
            median_step_time_s=step_time_s,
            images_per_s=images_per_step / step_time_s if step_time_s else None,
            achieved_flops=perf.get("achieved_flops"),
            mfu=perf.get("mfu"),
            hfu=perf.get("hfu"),
            peak=peak_words,
            peak_memory_gib=profiling.peak_memory_gib(device),
            compile_s=run.compile_s,
            train_wall_s=wall_s,
            epoch_times_s=epoch_times,
            time_breakdown_s=parts,
            samples_dir=str(run.output_dir / "samples"),
            checkpoints=[str(p) for p in checkpoint.checkpoint_dirs(run.output_dir)],
            pipeline_dir=str(run.output_dir),
        )

    run.on_main_process(finish)
    accelerator.end_training()  # flushes the tensorboard logs that the plots read
    if accelerator.is_main_process:
        profiling.draw_run_plots(run.output_dir)
    return config


# With several processes, how often they agree on whether a signal asked them to stop.
STOP_CHECK_STEPS = 10

# Compile artifacts (torch.compiler's mega-cache) kept beside the run, so that a
# run resumed on a fresh machine, whose Inductor cache is empty, need not compile again.
COMPILE_CACHE_FILE = "compile_cache.bin"


class Run:
    """What happens between steps: checkpoints, sample grids, evaluation, the pipeline, stopping.

    `step` is the number of optimizer steps taken; `progress` the bar the
    loop sets. Work that only the main process does goes through
    `on_main_process`, so that a failure there stops every process.
    """

    def __init__(self, args, accelerator, model, ema, noise_scheduler, evaluator, config):
        self.args, self.accelerator, self.model, self.ema = args, accelerator, model, ema
        self.noise_scheduler = noise_scheduler
        self.sampling_scheduler = sample.make_sampler(args.objective, args.sampler, noise_scheduler.config, args.sigma_data)
        self.evaluator, self.config = evaluator, config
        self.output_dir = Path(args.output_dir)
        self.device, self.world = accelerator.device, accelerator.num_processes
        self.step, self.skipped_before = 0, 0
        self.guard = self.progress = None
        self.last_saved = (None, None)  # (step, path) of this run's newest checkpoint
        self.compile_s = None  # seconds the first, compiling step took

    def write(self, text):
        if self.accelerator.is_local_main_process:
            self.progress.write(text)

    def compile_step(self, train_step, batch, breakdown, cache_file):
        """The first step, which compiles: timed as its own part of the breakdown, and said."""
        self.write(f"compiling the step ({self.config['step_compile_mode']}) ...")
        clock = steps.FirstStepClock(self.device)
        with breakdown.pause("compile"), clock.measure():
            step_losses = train_step(batch, self.step + 1)
        self.compile_s = clock.seconds
        self.on_main_process(lambda: steps.save_compile_artifacts(cache_file))
        self.write(clock.line)
        return step_losses

    def on_main_process(self, work):
        """`work()` on the main process while the others wait. If it fails, every process
        stops (the main one with its error), rather than the others waiting forever."""
        error = None
        if self.accelerator.is_main_process:
            try:
                work()
            except RunError as e:
                error = e
        failed = torch.tensor(float(error is not None), device=self.device)
        if self.world > 1:
            failed = self.accelerator.reduce(failed, reduction="sum")  # also the barrier
        if error is not None:
            raise error
        if failed.item():
            raise SystemExit(1)  # the main process prints why

    def ema_unet(self):
        return ema_unet(self.accelerator, self.model, self.ema)

    def pipeline_saved(self):
        return (self.output_dir / ("model_index.json" if self.args.objective == "ddpm" else "unet/config.json")).is_file()

    def save_network(self, unet, folder):
        sample.save_network(unet, folder, self.noise_scheduler if self.args.objective == "ddpm" else None)

    def save_pipeline(self):
        """The EMA weights (or the raw ones) in output_dir."""
        try:
            self.save_network(self.ema_unet(), self.output_dir)
        except OSError as e:
            note = f"running again saves it from the checkpoint of step {self.step}"
            raise RunError(checkpoint.cannot_write(f"the pipeline to {self.output_dir}", e, note)) from None
        self.accelerator.print(f"saved the pipeline to {self.output_dir}; sample grids in {self.output_dir / 'samples'}")

    def write_samples(self, epoch):
        path = self.output_dir / "samples" / f"{epoch:04d}.png"
        try:
            if self.args.objective == "ddpm":
                save_sample_grid(self.ema_unet(), self.sampling_scheduler, self.args, path, self.accelerator)
            else:
                seeds = sample.image_seeds(self.args.seed, self.args.eval_batch_size)  # the same noise every time
                images = sample.generate(
                    self.ema_unet(), self.sampling_scheduler, seeds, self.args.num_inference_steps, self.accelerator.autocast
                )
                sample.save_grid(images, path)
        except OSError as e:
            raise RunError(checkpoint.cannot_write(path, e)) from None

    def evaluate(self, epoch):
        """FID/KID of the EMA weights (main process); the best pipeline by FID goes to best/."""
        unet = self.ema_unet()
        save = lambda folder: self.save_network(unet, folder)  # noqa: E731
        args = self.args
        batches = sample.generate_batches(unet, self.sampling_scheduler, args.eval_num_samples, args.fid_batch_size, args.seed,
                                          args.num_inference_steps, self.accelerator.autocast)  # fmt: skip
        sampler = getattr(self.sampling_scheduler, "name", args.sampler)
        result = self.evaluator.evaluate(batches, sampler, args.num_inference_steps, epoch, self.step, save)
        self.accelerator.log({k: result[k] for k in ("fid", "kid_mean", "kid_std")}, step=self.step)
        best = " (best so far: saved to best/)" if result["best"] else ""
        self.write(f"eval epoch {epoch} step {self.step} | {metrics.format_scores(result)}{best}")

    def save_checkpoint(self, breakdown):
        if not weights_finite(self.model):  # never replace a good checkpoint with a broken state
            raise RunError(f"the weights are not finite at step {self.step}: not saving a checkpoint; resume from the last one")
        state = dict(skipped_nonfinite=self.skipped_before + self.guard.count(), run=checkpoint.run_identity(self.config))
        with breakdown.pause("checkpointing"):
            path = checkpoint.save(self.accelerator, self.output_dir, self.step, state, self.args.checkpoints_total_limit)
        self.last_saved = (self.step, path)
        self.write(f"saved {path}")
        return path

    def stop_requested(self, signals):
        """Whether to stop now. Processes must agree, or one would wait in save_state for
        the others forever: with several, they compare notes every STOP_CHECK_STEPS steps."""
        if self.world == 1:
            return signals.requested
        if self.step % STOP_CHECK_STEPS:
            return False
        flag = torch.tensor(float(signals.requested), device=self.device)
        return self.accelerator.reduce(flag, reduction="sum").item() > 0

    def stop_for_signal(self, signals, breakdown):
        """Keep this step in a checkpoint, say how to go on, and exit with the signal's code."""
        self.progress.close()
        saved_step, path = self.last_saved
        if saved_step != self.step:
            path = self.save_checkpoint(breakdown)
        self.accelerator.print(
            f"stopped by {signals.received.name} at step {self.step}: saved {path}; "
            "run the same command again to continue"
        )
        self.accelerator.end_training()
        raise SystemExit(signals.exit_code)


class Reporter:
    """Every --logging_steps: the loss since the last report and the throughput line."""

    def __init__(self, run, lr_scheduler, losses, max_train_steps, images_per_step, model_flops, hardware_flops,
                 peak_flops, peak_words):  # fmt: skip
        self.run, self.lr_scheduler, self.losses = run, lr_scheduler, losses
        self.max_train_steps, self.images_per_step = max_train_steps, images_per_step
        self.model_flops, self.hardware_flops = model_flops, hardware_flops
        self.peak_flops, self.peak_words = peak_flops, peak_words

    def perf(self, step_time_s):
        peak = self.peak_flops and self.peak_flops * self.run.world
        return flops.utilization(self.model_flops, self.hardware_flops, step_time_s, peak)

    def __call__(self, step_times, final=False):
        run, accelerator = self.run, self.run.accelerator
        if self.losses.read():  # the one host sync per log interval
            lr = float(self.lr_scheduler.get_last_lr()[0])
            accelerator.log(dict(loss=self.losses.last, lr=lr), step=run.step)
        last_loss = self.losses.last
        if not step_times:
            line = f"step {run.step}/{self.max_train_steps} | loss {last_loss:.4f} | timing: still warming up"
        else:
            step_time_s = flops.median(step_times)
            perf = self.perf(step_time_s)
            line = flops.format_perf_line(
                run.step, self.max_train_steps, last_loss, step_time_s, self.images_per_step, self.model_flops, perf,
                self.peak_words, run.world, profiling.peak_memory_gib(run.device),
            )  # fmt: skip
            if not final:
                images_per_s = self.images_per_step / step_time_s
                run.progress.set_postfix(loss=f"{last_loss:.4f}", img_s=f"{images_per_s:.1f}")
                logs = dict(step_time_s=step_time_s, images_per_s=images_per_s)
                accelerator.log(logs | {k: v for k, v in perf.items() if v is not None}, step=run.step)
        run.write(("final: " if final else "") + line)


def weights_finite(model):
    norms = torch._foreach_norm([p.detach() for p in model.parameters()])
    return bool(torch.isfinite(torch.stack(norms)).all())


if __name__ == "__main__":
    main(parse_args())
