"""Generate images from a trained run, and measure its FID and KID.

    python sample.py ddpm-output --num_images 64 --output samples/
    python sample.py ddpm-output --num_images 16 --sampler ddpm --num_inference_steps 1000 --output slow/
    python sample.py ddpm-output --fid --num_images 10000                  # against the run's training set
    python sample.py ddpm-output/best --fid --dataset path/to/images --fid_weights weights-inception.pth

RUN_DIR is a training run's --output_dir (its saved pipeline, or its newest
checkpoint while it has none), a pipeline folder (`best/`, a reconstructed
EMA from `ema.py reconstruct`) or one checkpoint folder. A checkpoint gives
the EMA weights unless --no-ema; a pipeline holds the EMA weights only.

Into --output it writes 000000.png, 000001.png, ... and grid.png (the first
64 images). Image i starts from noise drawn from its own generator, seeded by
(--seed, i): the same seed gives the same files, whatever --batch_size.

The samplers are diffusers schedulers built from the training schedule
(`make_scheduler`); train.py uses the same ones for its grids and FID.
"""

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

import model as models
from checkpoint import checkpoint_dirs
from model import ConfigError

SAMPLERS = ("ddpm", "ddim", "dpmsolver")
# DPM-Solver++ with 25 steps: on the bare `python train.py` model (1024 steps)
# it gave the data's coloured backgrounds like 1000-step DDPM, where DDIM-50
# turned every background grey; and it costs half of DDIM-50. README: Samplers.
DEFAULT_SAMPLER = "dpmsolver"
DEFAULT_STEPS = 25
GRID_IMAGES = 64


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        """One line, exit code 2: no usage block (the message says what to change)."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# --- samplers ------------------------------------------------------------------------


def make_scheduler(name, training_config):
    """The sampler `name` for a model trained with the DDPMScheduler config `training_config`.

    Every sampler clips its estimate of the clean image to [-1, 1] at each
    step. Without that, the estimate x0 = (x_t - sqrt(1 - abar) eps) / sqrt(abar)
    of a model early in training is far outside the data range at high noise
    (sqrt(abar) is 0.006 at t = 999), and the solver carries it into the
    image: on a tiny model after 150 steps, 92% of DPM-Solver++'s pixels and
    94% of DDIM's were saturated without clipping, 14% and 0.5% with it.
    DDPM and DDIM call this clip_sample; DPM-Solver++ calls it thresholding,
    which with sample_max_value=1 is plain clipping (diffusers recommends it
    for pixel-space models).

    Timesteps are "trailing" (Lin et al. 2024, "Common Diffusion Noise
    Schedules and Sample Steps are Flawed"): the first step is t = T-1, the
    noise level x_T ~ N(0, I) actually has. Set explicitly because
    `from_config` would otherwise carry DDPMScheduler's "leading" over.
    (diffusers' DDIM steps from t to t - T // steps; when the step count does
    not divide T that is up to one timestep off the trailing schedule, which
    is harmless.)
    """
    from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler

    if name == "ddpm":
        # Ancestral sampling, Algorithm 2 of Ho et al. (2020): 1000 steps to be exact.
        return DDPMScheduler.from_config(training_config, clip_sample=True, clip_sample_range=1.0)
    if name == "ddim":
        # eta = 0: deterministic, so a grid from the same noise changes only as the model does.
        return DDIMScheduler.from_config(
            training_config, clip_sample=True, clip_sample_range=1.0, set_alpha_to_one=True, timestep_spacing="trailing"
        )
    if name == "dpmsolver":
        return DPMSolverMultistepScheduler.from_config(
            training_config,
            algorithm_type="dpmsolver++",
            solver_order=2,
            thresholding=True,
            sample_max_value=1.0,
            timestep_spacing="trailing",
            lower_order_final=True,  # first order for the last steps when there are < 15: more stable
            final_sigmas_type="zero",  # the last step lands on the clean image
        )
    raise ConfigError(f"unknown --sampler '{name}': choose one of {', '.join(SAMPLERS)}")


def image_seeds(seed, count):
    """One 64-bit seed per image from (seed, image index): independent streams, whatever the batch."""
    return [int(np.random.SeedSequence([seed % 2**64, i]).generate_state(1, np.uint64)[0]) for i in range(count)]


def to_uint8(images):
    """[-1, 1] floats -> uint8 [0, 255] on the CPU, as a PNG stores them."""
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()


@torch.no_grad()
def generate(unet, scheduler, seeds, num_inference_steps, autocast=contextlib.nullcontext):
    """uint8 images (len(seeds), C, S, S); image i starts from noise drawn with seed seeds[i]."""
    device = unet.device
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    shape = (unet.config.in_channels, unet.config.sample_size, unet.config.sample_size)
    x = torch.stack([torch.randn(shape, generator=g) for g in generators]).to(device)
    scheduler.set_timesteps(num_inference_steps, device=device)  # also resets a multistep solver's history
    x = x * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        with autocast():
            model_output = unet(scheduler.scale_model_input(x, t), t).sample
        # the DDPM sampler's fresh noise comes from the same per-image generators
        x = scheduler.step(model_output.float(), t, x, generator=generators).prev_sample
    return to_uint8(x)


def generate_batches(unet, scheduler, num_images, batch_size, seed, num_inference_steps, autocast=contextlib.nullcontext):
    """Yield uint8 batches of `num_images` images in all; image i depends only on (seed, i)."""
    seeds = image_seeds(seed, num_images)
    for start in range(0, num_images, batch_size):
        yield generate(unet, scheduler, seeds[start : start + batch_size], num_inference_steps, autocast)


def save_grid(images, path):
    """uint8 images (N, 3, S, S) as one PNG, in a square-ish grid."""
    from torchvision.utils import make_grid, save_image

    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(make_grid(images.float() / 255, nrow=math.ceil(math.sqrt(len(images)))), path)


# --- loading a run -------------------------------------------------------------------


def find_run_folder(path):
    """The training run folder that `path` (a run, pipeline or checkpoint folder) belongs to, or None."""
    candidates = [path, *path.parents][:3]  # run/, run/best/, run/checkpoints/checkpoint-N/
    return next((folder for folder in candidates if (folder / "train_config.json").is_file()), None)


def find_run_config(path):
    """The train_config.json of the run that `path` belongs to, or None."""
    folder = find_run_folder(path)
    return json.loads((folder / "train_config.json").read_text()) if folder else None


def newest_checkpoint(run_dir):
    found = checkpoint_dirs(run_dir)  # complete ones only
    return found[-1] if found else None


def resolve_source(path):
    """('pipeline' or 'checkpoint', folder) for what RUN_DIR names."""
    if (path / "model_index.json").is_file():
        return "pipeline", path
    if (path / "trainer_state.json").is_file():
        return "checkpoint", path
    checkpoint = newest_checkpoint(path) if path.is_dir() else None
    if checkpoint is not None:
        return "checkpoint", checkpoint
    raise ConfigError(
        f"{path}: no saved pipeline (model_index.json), checkpoint or checkpoints/ folder: "
        "pass a training run's --output_dir, a pipeline folder or a checkpoint folder"
    )


def ema_weights_from_checkpoint(checkpoint):
    """The EMA weights (a list of tensors in parameter order) in a checkpoint, or None.

    accelerate saves registered objects as custom_checkpoint_N.pkl, N in
    registration order; the EMA's is the one that holds shadow parameters:
    diffusers' EMAModel ("shadow_params") or ema.PowerEMA ("shadows", one list
    per tracked std; the first one is the run's EMA).
    """
    for path in sorted(checkpoint.glob("custom_checkpoint_*.pkl")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        if isinstance(state, dict) and "shadow_params" in state:
            return state["shadow_params"]
        if isinstance(state, dict) and "shadows" in state:
            return state["shadows"][0]
    return None


@contextlib.contextmanager
def quiet_loading():
    """No "Loading pipeline components" bar: an error after it should be the only line on stderr."""
    from diffusers.utils import logging as diffusers_logging

    was_enabled = diffusers_logging.is_progress_bar_enabled()
    diffusers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            diffusers_logging.enable_progress_bar()


def load_model(path, ema=True):
    """(UNet2DModel in eval mode, training-scheduler config) from a pipeline or checkpoint folder."""
    from diffusers import DDPMPipeline
    from safetensors.torch import load_file

    kind, folder = resolve_source(Path(path))
    if kind == "pipeline":
        if not ema:
            raise ConfigError(
                f"{folder} is a saved pipeline, which holds the EMA weights only: "
                "for the raw weights pass a checkpoint folder (RUN_DIR/checkpoints/checkpoint-STEP) with --no-ema"
            )
        with quiet_loading():
            pipeline = DDPMPipeline.from_pretrained(str(folder))
        return pipeline.unet.eval(), pipeline.scheduler.config

    config = find_run_config(folder)
    if config is None:
        raise ConfigError(f"{folder}: no train_config.json in the run folder above it, so the model is unknown")
    unet = models.build_unet(config["model"], config["image_size"])
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{folder}: no model.safetensors in the checkpoint")
    unet.load_state_dict(load_file(str(weights)))
    if ema:
        shadow = ema_weights_from_checkpoint(folder)
        if shadow is None:
            raise ConfigError(f"{folder}: the checkpoint has no EMA weights (trained with --no-use_ema): add --no-ema")
        with torch.no_grad():
            for parameter, value in zip(unet.parameters(), shadow, strict=True):
                parameter.copy_(value)
    scheduler = models.make_noise_scheduler(config["num_train_timesteps"], config["beta_schedule"], config["prediction_type"])
    return unet.eval(), scheduler.config


# --- the command ---------------------------------------------------------------------


def parse_args(argv=None):
    p = OneLineParser(prog="sample.py", description="Generate images from a trained run; measure FID and KID.")
    p.add_argument("run_dir", help="a run's --output_dir, a pipeline folder or a checkpoint folder")
    p.add_argument("--num_images", type=int, default=16, help="images to generate")
    p.add_argument("--output", default=None, help="folder for the PNGs and grid.png (optional with --fid)")
    p.add_argument("--batch_size", type=int, default=16, help="images generated at once")
    p.add_argument("--seed", type=int, default=0, help="image i's noise is seeded by (seed, i)")
    p.add_argument("--sampler", default=DEFAULT_SAMPLER, choices=SAMPLERS, help="diffusers scheduler that samples")
    p.add_argument("--num_inference_steps", type=int, default=DEFAULT_STEPS, help="sampling steps")
    p.add_argument(
        "--ema", action=argparse.BooleanOptionalAction, default=True, help="EMA weights (--no-ema: raw, checkpoints only)"
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")

    f = p.add_argument_group("FID and KID")
    f.add_argument("--fid", action=argparse.BooleanOptionalAction, default=False, help="measure FID and KID")
    f.add_argument(
        "--dataset", default=None, help="reference images, as train.py's --dataset (default: the run's training set)"
    )
    f.add_argument("--dataset_config", default=None, help="Hub dataset configuration name")
    f.add_argument("--split", default=None, help="dataset split (default: the run's, else train)")
    f.add_argument("--image_column", default=None, help="column holding the images")
    f.add_argument("--fid_weights", default=None, help="Inception weights file, for machines without internet")
    return p.parse_args(argv)


def validate(args):
    for name in ("num_images", "batch_size", "num_inference_steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.output is None and not args.fid:
        raise ConfigError("say where the images go with --output DIR (or measure them with --fid)")
    if args.fid and args.num_images < 2:
        raise ConfigError(f"--fid needs --num_images of at least 2 (got {args.num_images})")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if not Path(args.run_dir).exists():
        raise ConfigError(f"{args.run_dir}: no such folder")
    return args


def main(args):
    try:
        return run(validate(args))
    except ConfigError as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def run(args):
    import metrics

    run_dir = Path(args.run_dir)
    unet, training_config = load_model(run_dir, ema=args.ema)
    unet.to(args.device)
    if training_config["num_train_timesteps"] < args.num_inference_steps:
        raise ConfigError(
            f"--num_inference_steps ({args.num_inference_steps}) cannot exceed the model's "
            f"{training_config['num_train_timesteps']} training timesteps"
        )
    scheduler = make_scheduler(args.sampler, training_config)
    # The Inception weights and the reference statistics before any sampling: a missing file fails now.
    evaluation = metrics.SampleEvaluation(run_dir, args, unet.config.sample_size) if args.fid else None
    output = Path(args.output) if args.output else None
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)

    grid, done = [], 0
    batches = generate_batches(unet, scheduler, args.num_images, args.batch_size, args.seed, args.num_inference_steps)
    for images in batches:
        if evaluation is not None:
            evaluation.add(images)
        if output is not None:
            for i, image in enumerate(images):
                save_png(image, output / f"{done + i:06d}.png")
            grid.extend(images[: max(0, GRID_IMAGES - len(grid))])
        done += len(images)
        print(f"generated {done}/{args.num_images}", end="\r", file=sys.stderr)
    print(file=sys.stderr)

    result = dict(
        run=str(run_dir), num_images=args.num_images, seed=args.seed, sampler=args.sampler,
        num_inference_steps=args.num_inference_steps, ema=args.ema,
    )  # fmt: skip
    if output is not None:
        save_grid(torch.stack(grid), output / "grid.png")
        print(f"wrote {args.num_images} images and grid.png to {output}")
    if evaluation is not None:
        result |= evaluation.result()
        print(metrics.format_scores(result))
        if output is not None:
            (output / "fid.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def save_png(image, path):
    from PIL import Image

    Image.fromarray(image.permute(1, 2, 0).numpy()).save(path)


if __name__ == "__main__":
    main(parse_args())
