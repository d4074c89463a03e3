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
from checkpoint import RunError
from model import ConfigError

SAMPLERS = sample.SAMPLERS
LR_SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")


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
    t.add_argument("--lr_scheduler", default="cosine", choices=LR_SCHEDULES, help="learning-rate schedule")
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
        default="default",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        help="torch.compile mode; reduce-overhead adds CUDA graphs",
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

    o = p.add_argument_group("outputs")
    o.add_argument("--output_dir", default="ddpm-output", help="where samples, checkpoints and the model go")
    o.add_argument("--save_images_epochs", type=int, default=2, help="write a sample grid every N epochs")
    o.add_argument("--eval_batch_size", type=int, default=16, help="images in a sample grid")
    o.add_argument("--sampler", default=sample.DEFAULT_SAMPLER, choices=SAMPLERS, help="sampler for the grids and FID")
    o.add_argument(
        "--num_inference_steps", type=int, default=sample.DEFAULT_STEPS, help="sampling steps for the grids and FID"
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
        num_inference_steps=1,
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
    if args.num_inference_steps > args.num_train_timesteps:
        raise ConfigError(
            f"--num_inference_steps ({args.num_inference_steps}) cannot exceed --num_train_timesteps "
            f"({args.num_train_timesteps})"
        )
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
    return validate_sample_quality(args)


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


def make_sampling_scheduler(name, training_scheduler):
    return sample.make_scheduler(name, training_scheduler.config)


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
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from diffusers import DDPMPipeline
    from diffusers.optimization import get_scheduler
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
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
    )
    if args.dry_run:
        for key, value in config.items():
            accelerator.print(f"{key:28s} {value}")
        accelerator.print(
            f"model {args.model}: {cost['params']:,} parameters, {model_flops / 1e12:.4g} TFLOP per step "
            f"({model_flops / images_per_step / 1e9:.2f} GFLOP per image, forward+backward); {peak_words}"
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
    sampling_scheduler = make_sampling_scheduler(args.sampler, noise_scheduler)
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(device)

    # Fused AdamW (--fused_adam, the default): one kernel for all parameters, and
    # it can skip a step on the device (see NonFiniteGuard), so a NaN costs no
    # host sync per step. channels_last converts the UNet in place first.
    optimizer = models.prepare_for_training(
        unet,
        args.channels_last,
        args.fused_adam,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.weight_decay,
        eps=args.adam_epsilon,
    )
    lr_scheduler = get_scheduler(
        args.lr_scheduler, optimizer, num_warmup_steps=args.lr_warmup_steps, num_training_steps=max_train_steps
    )
    model, optimizer = accelerator.prepare(unet, optimizer)
    step_model = models.compile_for_training(model, args.compile_mode if args.compile else None)
    accelerator.register_for_checkpointing(lr_scheduler)
    ema = make_ema(args, accelerator.unwrap_model(model), write=accelerator.is_main_process)
    if ema is not None:
        ema.to(device)
        accelerator.register_for_checkpointing(ema)

    output_dir = Path(args.output_dir)

    def on_main_process(work):
        """`work()` on the main process while the others wait. If it fails, every process
        stops (the main one with its error), rather than the others waiting forever."""
        error = None
        if accelerator.is_main_process:
            try:
                work()
            except RunError as e:
                error = e
        failed = torch.tensor(float(error is not None), device=device)
        if world > 1:
            failed = accelerator.reduce(failed, reduction="sum")  # also the barrier
        if error is not None:
            raise error
        if failed.item():
            raise SystemExit(1)  # the main process prints why

    def save_pipeline():
        """The EMA weights (or the raw ones) as a DDPMPipeline in output_dir."""
        try:
            DDPMPipeline(unet=ema_unet(accelerator, model, ema), scheduler=noise_scheduler).save_pretrained(str(output_dir))
        except OSError as e:
            note = f"running again saves it from the checkpoint of step {global_step}"
            raise RunError(checkpoint.cannot_write(f"the pipeline to {output_dir}", e, note)) from None
        accelerator.print(f"saved the pipeline to {output_dir}; sample grids in {output_dir / 'samples'}")

    global_step, skipped_before = 0, 0
    if start_from is not None:
        accelerator.load_state(str(start_from))
        if ema is not None:
            ema.to(device)
        state = checkpoint.read_state(start_from)
        global_step, skipped_before = state["step"], state.get("skipped_nonfinite", 0)
        accelerator.print(f"resumed from {start_from} at step {global_step}")
    if global_step >= max_train_steps:
        if not (output_dir / "model_index.json").is_file():  # the end of the run was cut short
            on_main_process(save_pipeline)
            return config
        accelerator.print(
            f"{args.output_dir} is already trained to step {global_step} of {max_train_steps}: "
            "raise --max_train_steps or --num_epochs to train longer"
        )
        return config

    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "train_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        accelerator.init_trackers("train", config={k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))})

    accelerator.print(
        f"training {args.model} ({cost['params']:,} parameters) on {len(images)} images at {args.image_size}px: "
        f"{max_train_steps} steps of {images_per_step} images, mixed precision {args.mixed_precision}, "
        f"{world} process(es) on {config['device']}; {model_flops / 1e12:.4g} TFLOP per step; {peak_words}"
    )

    def write_samples(epoch):
        path = output_dir / "samples" / f"{epoch:04d}.png"
        try:
            save_sample_grid(ema_unet(accelerator, model, ema), sampling_scheduler, args, path, accelerator)
        except OSError as e:
            raise RunError(checkpoint.cannot_write(path, e)) from None

    guard = NonFiniteGuard(optimizer, args.on_nonfinite, device)

    last_saved = [None, None]  # (step, path) of this run's newest checkpoint

    def save_checkpoint():
        if not weights_finite(model):  # never replace a good checkpoint with a broken state
            raise RunError(f"the weights are not finite at step {global_step}: not saving a checkpoint; resume from the last one")
        state = dict(skipped_nonfinite=skipped_before + guard.count(), run=checkpoint.run_identity(config))
        with breakdown.pause("checkpointing"):
            path = checkpoint.save(accelerator, output_dir, global_step, state, args.checkpoints_total_limit)
        last_saved[:] = [global_step, path]
        if accelerator.is_local_main_process:
            progress.write(f"saved {path}")
        timer.restart()
        return path

    def evaluate(epoch):
        """FID/KID of the EMA weights (main process); the best pipeline by FID goes to best/."""
        unet = ema_unet(accelerator, model, ema)
        save = DDPMPipeline(unet=unet, scheduler=noise_scheduler).save_pretrained
        result = evaluator.evaluate(unet, sampling_scheduler, epoch, global_step, save, accelerator.autocast)
        accelerator.log({k: result[k] for k in ("fid", "kid_mean", "kid_std")}, step=global_step)
        best = " (best so far: saved to best/)" if result["best"] else ""
        progress.write(f"eval epoch {epoch} step {global_step} | {metrics.format_scores(result)}{best}")

    timer = flops.StepTimer(device, args.timing_warmup_steps)
    breakdown = profiling.Breakdown(device)
    losses = LossMeter(device)
    started_at = profiling.now_iso()
    epoch_times = []  # each whole epoch's training time: data loading included; sampling, checkpoints not

    def report(step_times, final=False):
        """Log the loss since the last report and print the throughput line."""
        if losses.read():  # the one host sync per log interval
            accelerator.log(dict(loss=losses.last, lr=lr_scheduler.get_last_lr()[0]), step=global_step)
        last_loss = losses.last
        if not step_times:
            line = f"step {global_step}/{max_train_steps} | loss {last_loss:.4f} | timing: still warming up"
        else:
            step_time_s = flops.median(step_times)
            perf = flops.utilization(model_flops, hardware_flops, step_time_s, peak_flops and peak_flops * world)
            line = flops.format_perf_line(
                global_step, max_train_steps, last_loss, step_time_s, images_per_step, model_flops, perf, peak_words,
                world, profiling.peak_memory_gib(device),
            )  # fmt: skip
            if not final:
                progress.set_postfix(loss=f"{last_loss:.4f}", img_s=f"{images_per_step / step_time_s:.1f}")
                logs = dict(step_time_s=step_time_s, images_per_s=images_per_step / step_time_s)
                accelerator.log(logs | {k: v for k, v in perf.items() if v is not None}, step=global_step)
        if accelerator.is_local_main_process:
            progress.write(("final: " if final else "") + line)

    def stop_requested(signals):
        """Whether to stop now. Processes must agree, or one would wait in save_state for
        the others forever: with several, they compare notes every STOP_CHECK_STEPS steps."""
        if world == 1:
            return signals.requested
        if global_step % STOP_CHECK_STEPS:
            return False
        flag = torch.tensor(float(signals.requested), device=device)
        return accelerator.reduce(flag, reduction="sum").item() > 0

    def stop_for_signal(signals):
        """Keep this step in a checkpoint, say how to go on, and exit with the signal's code."""
        progress.close()
        path = last_saved[1] if last_saved[0] == global_step else save_checkpoint()
        accelerator.print(
            f"stopped by {signals.received.name} at step {global_step}: saved {path}; "
            "run the same command again to continue"
        )
        accelerator.end_training()
        raise SystemExit(signals.exit_code)

    # --profile: torch.profiler on rank 0 over a few steps (1 skipped, 1 warm-up, then recorded).
    profiler, profile_until = None, global_step + 2 + args.profile_steps
    if args.profile and accelerator.is_main_process:
        profiler = profiling.make_profiler(
            output_dir / "profile", 1, 1, args.profile_steps, args.profile_top, with_stack=args.profile_stack,
            level="operators" if args.profile_operators else "kernels",
        )  # fmt: skip
        profiler.start()

    first_epoch = global_step // steps_per_epoch
    model.train()
    progress = tqdm(
        total=max_train_steps, initial=global_step, disable=not accelerator.is_local_main_process, desc="steps"
    )
    breakdown.start()
    with checkpoint.StopSignals() as signals, progress:  # the bar is closed before any error is printed
        for epoch in range(first_epoch, num_epochs):
            start = (global_step - epoch * steps_per_epoch) * args.gradient_accumulation_steps
            micro_batches = batches.epoch(epoch, start=start)
            breakdown.begin_epoch()
            timer.restart()
            while global_step < min(max_train_steps, (epoch + 1) * steps_per_epoch):
                breakdown.begin_step()
                for _ in range(args.gradient_accumulation_steps):
                    clean = data.to_model_input(next(micro_batches), args.random_flip)
                    noise = torch.randn_like(clean)
                    timesteps = torch.randint(0, args.num_train_timesteps, (clean.shape[0],), device=device)
                    breakdown.phase_done("data")
                    with accelerator.accumulate(model):
                        loss = models.ddpm_loss(step_model, clean, noise, timesteps, alphas_cumprod, args.prediction_type)
                        breakdown.phase_done("forward")
                        accelerator.backward(loss)
                        breakdown.phase_done("backward")
                        if accelerator.sync_gradients:
                            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
                            guard.check(loss, grad_norm, global_step + 1)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                    losses.add(loss)
                    breakdown.phase_done("optimizer")
                lr_scheduler.step()
                if ema is not None:
                    ema.step(model.parameters())
                breakdown.phase_done("ema")
                global_step += 1
                timer.step_done()
                progress.update(1)

                if profiler is not None:
                    profiler.step()
                    if global_step == profile_until:  # the trace and table are written
                        profiler.stop()
                        profiler = None
                if args.profile_only and global_step == profile_until:
                    progress.close()
                    accelerator.print(f"stopped after profiling at step {global_step}: see {output_dir / 'profile'}")
                    accelerator.end_training()
                    return config
                if global_step % args.logging_steps == 0:
                    report(timer.collect())
                    breakdown.collect()
                if global_step % args.checkpointing_steps == 0 or global_step == max_train_steps:
                    save_checkpoint()
                if stop_requested(signals):
                    stop_for_signal(signals)

            if start == 0 and global_step == (epoch + 1) * steps_per_epoch:  # a whole epoch in this run
                epoch_s = breakdown.epoch_s()
                epoch_times.append(dict(epoch=epoch, seconds=epoch_s, images_per_s=steps_per_epoch * images_per_step / epoch_s))
                accelerator.log(dict(epoch_time_s=epoch_s), step=global_step)
            last_epoch = global_step >= max_train_steps
            if epoch % args.save_images_epochs == 0 or last_epoch:
                with breakdown.pause("sampling"):
                    on_main_process(lambda: write_samples(epoch))
                timer.restart()
            if args.eval_every_epochs and ((epoch + 1) % args.eval_every_epochs == 0 or last_epoch):
                with breakdown.pause("evaluation"):
                    on_main_process(lambda: evaluate(epoch))
                timer.restart()
            if last_epoch:
                break

    if global_step % args.logging_steps:
        report(timer.collect())
    timer.collect()
    report(timer.all_times, final=True)
    skipped = skipped_before + guard.count()
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
        save_pipeline()
        step_time_s = flops.median(timer.all_times) if timer.all_times else None
        perf = flops.utilization(model_flops, hardware_flops, step_time_s, peak_flops and peak_flops * world) if step_time_s else {}
        profiling.write_manifest(
            output_dir / "run.json",
            config=config,
            git_commit=profiling.git_commit(),
            versions=profiling.library_versions(),
            device=profiling.device_facts(device, world),
            start_time=started_at,
            end_time=profiling.now_iso(),
            steps=global_step,
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
            train_wall_s=wall_s,
            epoch_times_s=epoch_times,
            time_breakdown_s=parts,
            samples_dir=str(output_dir / "samples"),
            checkpoints=[str(p) for p in checkpoint.checkpoint_dirs(output_dir)],
            pipeline_dir=str(output_dir),
        )

    on_main_process(finish)
    accelerator.end_training()  # flushes the tensorboard logs that the plots read
    if accelerator.is_main_process:
        profiling.draw_run_plots(output_dir)
    return config


# With several processes, how often they agree on whether a signal asked them to stop.
STOP_CHECK_STEPS = 10


class LossMeter:
    """The mean loss over a log interval, kept on the device so that adding costs no host sync.

    A non-finite loss (a step NonFiniteGuard skips) is left out of the mean.
    """

    def __init__(self, device):
        self.sum, self.count = torch.zeros((), device=device), torch.zeros((), device=device)
        self.last = float("nan")  # the mean of the last interval that had a finite loss

    def add(self, loss):
        finite = torch.isfinite(loss.detach())
        self.sum += torch.where(finite, loss.detach(), 0.0)
        self.count += finite

    def read(self):
        """Sets `last` to the interval's mean and starts a new interval; False if it had no finite loss."""
        count = self.count.item()
        if count:
            self.last = (self.sum / count).item()
            self.sum.zero_()
            self.count.zero_()
        return bool(count)


class NonFiniteGuard:
    """Keeps a step whose loss or gradients are NaN/inf from changing the weights.

    A fused AdamW takes the decision on the device: given `found_inf` (the
    hook torch's GradScaler uses) it leaves weights, moments and step count
    as they were, so 'skip' costs no host sync. Otherwise, and for 'stop',
    the flag is read on the host every step.
    """

    def __init__(self, optimizer, mode, device):
        self.inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
        self.mode = mode
        self.on_device = mode == "skip" and bool(self.inner.defaults.get("fused"))
        self.skipped = torch.zeros((), device=device)

    def check(self, loss, grad_norm, step):
        bad = ~(torch.isfinite(grad_norm) & torch.isfinite(loss.detach()))
        self.skipped += bad
        if self.on_device:
            self.inner.found_inf = bad.float()
            return
        if bad.item():
            if self.mode == "stop":
                raise RunError(
                    f"non-finite loss or gradient at step {step} (--on_nonfinite stop): lower --learning_rate "
                    "or use --on_nonfinite skip; the last checkpoint holds the state before it"
                )
            for group in self.inner.param_groups:  # without a fused optimizer, drop the gradients
                for p in group["params"]:
                    p.grad = None

    def count(self):
        return int(self.skipped.item())


def weights_finite(model):
    norms = torch._foreach_norm([p.detach() for p in model.parameters()])
    return bool(torch.isfinite(torch.stack(norms)).all())


if __name__ == "__main__":
    main(parse_args())
