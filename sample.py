"""Generate images from a trained run, and measure its FID and KID.

    python sample.py ddpm-output --num_images 64 --output samples/
    python sample.py ddpm-output --num_images 16 --sampler ddpm --num_inference_steps 1000 --output slow/
    python sample.py ddpm-output --fid --num_images 10000                  # against the run's training set
    python sample.py ddpm-output/best --fid --dataset path/to/images --fid_weights weights-inception.pth
    python sample.py ddpm-output --class_labels circle,square --guidance_scale 2 --output cfg/     # a conditional run
    python sample.py ddpm-output --guide small-run --guidance_scale 2 --output auto/            # autoguidance
    python sample.py ddpm-output --fid --num_images 1024 --guidance_scale 1,1.5,2,3             # one score per w

RUN_DIR is a training run's --output_dir (its saved pipeline, or its newest
checkpoint while it has none), a pipeline folder (`best/`, a reconstructed
EMA from `ema.py reconstruct`) or one checkpoint folder. A checkpoint gives
the EMA weights unless --no-ema; a pipeline holds the EMA weights only. A run
trained without an EMA (--ema none) has its raw weights only: its pipeline
holds them, and both give them.

Into --output it writes 000000.png, 000001.png, ... and grid.png (the first
64 images). Image i starts from noise drawn from its own generator, seeded by
(--seed, i): the same seed gives the same files, whatever --batch_size.

The copy check runs on every run whose train_config.json names training images
this machine can open (--no-copies: not): the share of the samples that copy a
training image by Gu et al.'s criterion, printed (and in fid.json), and
copies.png in --output, the most copy-like samples each beside its nearest
training image (copies.py, docs/copies.md).

The samplers are diffusers schedulers built from the training schedule
(`objectives.make_scheduler`); train.py uses the same ones for its grids and FID. A run
whose train_config.json says "objective": "edm" samples with EDM's
Heun sampler instead (`objectives.edm_heun_sample`, 18 steps by default), stochastic
(`--churn`, EDM's S_churn; 0 for the deterministic one). A flow run samples with
Euler (its default), Heun or SiT's Euler-Maruyama SDE sampler (`objectives.make_flow_sampler`).
Every sampler takes classifier-free guidance and autoguidance through
`Guided`, which combines the network's outputs (docs/conditional.md).
"""

import errors  # noqa: I001 (first: the standard library only)

if __name__ == "__main__":  # a Ctrl-C while torch and diffusers import: one line, not their traceback
    errors.quit_on_ctrl_c("sample.py")

import argparse
import contextlib
import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

import checkpoint
import copies
import data
import latents
import metrics
import model as models
import objectives
import sizes
from errors import ConfigError, OneLineParser, one_line_errors
from rundir import RunDir

if __name__ == "__main__":
    errors.ctrl_c_raises()  # imported: main's own handling from here

GRID_IMAGES = 64


# --- guidance -----------------------------------------------------------------------------


class Guided(torch.nn.Module):
    """A network as the samplers call one, net(x, t, return_dict=False), its output guided.

    Classifier-free guidance (Ho & Salimans 2022), `guide` None: the network
    evaluated with the images' labels and with the null label,
        out = out(null) + w (out(labels) - out(null)).
    Autoguidance (Karras et al. 2024), `guide` a second network (a smaller or
    less-trained one of the same data):
        out = guide(labels) + w (out(labels) - guide(labels)),
    with labels for conditional networks and none for unconditional ones. w = 1
    is the network alone, w = 0 the unconditional model or the guide.

    The combination is linear in what the network outputs: for DDPM the
    eps/v/x0 prediction the sampler reads; for EDM, F of D = c_skip x + c_out F,
    whose coefficients both networks share, so it is the same combination of
    the denoisers D. Each network takes t as the sampler gives it: `generate` hands
    it each network with its own time input (Objective.timed).
    """

    def __init__(self, net, scale=1.0, labels=None, null_label=None, guide=None):
        super().__init__()
        self.net, self.guide, self.scale = net, guide, float(scale)
        self.labels, self.null_label = labels, null_label
        self.config = net.config

    def _call(self, net, x, t, labels):
        kwargs = {} if labels is None else dict(class_labels=labels)
        return net(x, t, return_dict=False, **kwargs)[0].float()

    def forward(self, x, t, return_dict=False):
        w, labels = self.scale, self.labels
        if w == 1 or (self.guide is None and labels is None):  # nothing to guide by
            return (self._call(self.net, x, t, labels),)
        if self.guide is not None:
            guide_labels = labels if models.num_classes_of(self.guide) else None
            guided = self._call(self.guide, x, t, guide_labels)
            main = guided if w == 0 else self._call(self.net, x, t, labels)
        else:  # the conditional and unconditional outputs in one batch
            both = self._call(self.net, torch.cat([x, x]), torch.cat([t, t]) if torch.is_tensor(t) and t.ndim else t,
                              torch.cat([labels, torch.full_like(labels, self.null_label)]))  # fmt: skip
            main, guided = both.chunk(2)
        return (guided + w * (main - guided),)


def parse_scales(text, flag):
    """'1,1.5,2' (or a list, from a run's train_config.json) -> [1.0, 1.5, 2.0]: guidance scales, each at least 0."""
    words = text if isinstance(text, (list, tuple)) else str(text).split(",")
    try:
        scales = [float(w) for w in words if str(w).strip()]
    except ValueError:
        scales = None
    if not scales or min(scales) < 0:
        raise ConfigError(f"{flag} takes numbers of at least 0, comma-separated (got {text!r})")
    return scales


def guided_network(net, labels=None, scale=1.0, guide=None):
    """`net` as `generate` calls it: itself when there is nothing to guide or condition, else Guided."""
    if labels is None and guide is None:
        return net
    num_classes = models.num_classes_of(net)
    return Guided(net, scale, labels, models.null_label(num_classes), guide)


def spread_labels(num_classes, count):
    """Labels for `count` images in contiguous runs over the classes: a grid's rows by class."""
    return torch.tensor([i * num_classes // count for i in range(count)]) if num_classes else None


def grid_columns(count, height, width):
    """How many images of height x width save_grid puts in a row: a square-ish grid of `count`."""
    return math.ceil(math.sqrt(count * height / width))


def grid_labels(num_classes, count, image_size=1):
    """A conditional run's grid of `count` images of `image_size` (sizes): row r shows class r (mod the classes),
    or with more classes than rows, classes spread over the rows."""
    if not num_classes:
        return None
    columns = grid_columns(count, *sizes.height_width(image_size))
    row = [i // columns for i in range(count)]
    num_rows = row[-1] + 1
    return torch.tensor([r % num_classes if num_classes <= num_rows else r * num_classes // num_rows for r in row])


def labels_as_in_data(class_counts, count, seed):
    """`count` labels drawn with the data's class frequencies (for FID), seeded by `seed`."""
    weights = torch.tensor(class_counts, dtype=torch.float)
    return torch.multinomial(weights, count, replacement=True, generator=torch.Generator().manual_seed(seed))


def check_guide(main, guide):
    """A one-line ConfigError unless the run configs `main` and `guide` can be combined:
    the same objective, image size, classes and latent space (VAE and normalisation; none for
    pixel runs), and for DDPM the same noise schedule and prediction, since their outputs are
    combined as they are."""
    keys = ["objective", "image_size", "class_names", *objectives.of(main.get("objective")).same]
    # the latent space as resume compares it: the encoder's weights and the normalisation, not the --vae text
    space, guide_space = latents.recorded_latent_space(main), latents.recorded_latent_space(guide)
    if space != guide_space:
        raise ConfigError("the guide was trained on another latent space (" + latents.latent_space_change(guide_space, space) +
                          "): guide with a run on the same VAE's latents, normalised the same way")  # fmt: skip
    for key in keys:
        if key == "num_train_timesteps":  # a setting (config.SETTINGS), not a flag
            a, b = (objectives.run_setting(config, key, objectives.NUM_TRAIN_TIMESTEPS) for config in (main, guide))
        else:
            a, b = main.get(key), guide.get(key)
        if key == "objective":
            a, b = a or "ddpm", b or "ddpm"
        if a != b:
            raise ConfigError(f"the guide was trained with {key} {b!r}, the model with {a!r}: "
                              f"guide with a run of the same {key.replace('_', ' ')}")  # fmt: skip


def image_shape(net):
    """(C, H, W) of one image: UNet2DModel's config names (sample_size: a side or [height, width]), else
    EDM2-style img_channels/img_resolution."""
    config = net.config
    channels = config.get("in_channels", config.get("img_channels"))
    return (channels, *sizes.height_width(config.get("sample_size", config.get("img_resolution"))))


def image_seeds(seed, count):
    """One 64-bit seed per image from (seed, image index): independent streams, whatever the batch."""
    return [int(np.random.SeedSequence([seed % 2**64, i]).generate_state(1, np.uint64)[0]) for i in range(count)]


def to_pixels(images, bits=8):
    """[-1, 1] floats -> uint8 [0, 255] (or with `bits` 16, uint16 [0, 65,535]) on the CPU, as a PNG stores them."""
    pixels = data.Pixels(bits=bits)
    return ((images.float().clamp(-1, 1) + 1) * (pixels.top / 2)).round().to(pixels.dtype).cpu()


@torch.no_grad()
def generate(unet, scheduler, seeds, num_inference_steps, autocast=contextlib.nullcontext, labels=None,
             guidance_scale=1.0, guide=None, decode=None, bits=8):  # fmt: skip
    """uint8 images (len(seeds), C, S, S), uint16 with `bits` 16; image i starts from noise drawn with seed seeds[i].

    `scheduler` is one of objectives.make_scheduler's, or an objectives.EDMHeunSampler for a network
    trained with the EDM objective (`objectives.make_sampler` picks by the run's objective).
    `labels`: image i's class (a conditional network); `guidance_scale` and
    `guide`: classifier-free guidance or autoguidance (Guided). `decode`: a latent
    run's latents -> images in [-1, 1] (RunDir.decoder: through its VAE).
    """
    device = objectives.network_device(unet)
    kind = objectives.sampled_by(scheduler)  # each network called with its family's time input
    unet = kind.timed(unet, models.family_of(unet).time_input)
    guide = None if guide is None else kind.timed(guide, models.family_of(guide).time_input)
    labels = None if labels is None else torch.as_tensor(labels).to(device)
    unet = guided_network(unet, labels, guidance_scale, guide)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    x = objectives.image_noise(generators, image_shape(unet), device)
    if isinstance(scheduler, objectives.EDMHeunSampler):
        x = scheduler.sample(unet, x, num_inference_steps, autocast, generators)
    else:
        scheduler.set_timesteps(num_inference_steps, device=device)  # also resets a multistep solver's history
        x = x * getattr(scheduler, "init_noise_sigma", 1.0)  # a flow scheduler starts at σ = 1 and has none
        scale = getattr(scheduler, "scale_model_input", lambda x, t: x)
        for t in scheduler.timesteps:
            with autocast():
                model_output = unet(scale(x, t), t, return_dict=False)[0]
            # the DDPM sampler's fresh noise comes from the same per-image generators
            x = scheduler.step(model_output.float(), t, x, generator=generators).prev_sample
    return to_pixels(x if decode is None else decode(x), bits)


def generate_batches(unet, scheduler, num_images, batch_size, seed, num_inference_steps, autocast=contextlib.nullcontext,
                     labels=None, guidance_scale=1.0, guide=None, decode=None, shard=(0, 1), bits=8):  # fmt: skip
    """Yield uint8 (with `bits` 16, uint16) batches of `num_images` images in all; image i depends only on (seed, i) (and its label).
    `shard` (rank, world): batches rank, rank + world, ... of them alone (one process's of several)."""
    seeds = image_seeds(seed, num_images)
    rank, world = shard
    for start in range(rank * batch_size, num_images, world * batch_size):
        part = None if labels is None else labels[start : start + batch_size]
        yield generate(unet, scheduler, seeds[start : start + batch_size], num_inference_steps, autocast, part,
                       guidance_scale, guide, decode, bits)  # fmt: skip


def gathered(mine, num_images, batch_size, image_shape, rank=0, world=1, group=None, before_round=None):
    """The main process's view of every process's uint8 batches of `num_images` images of `image_shape` (C, H, W),
    in image order: each process's
    `mine` (batches rank, rank + world, ... of `batch_size`: generate_batches' shard) gathered to rank 0 round by
    round through `group` (gloo: CPU tensors; the last batch may be short, a process may have none in the last
    round); the others' view: nothing (their part is to send). `before_round()`, on every process before each round:
    where the processes agree on a stop."""
    batches, mine = -(-num_images // batch_size), iter(mine)
    for first in range(0, batches, world):  # a round: batches first .. first + world - 1
        if before_round is not None:
            before_round()
        batch = next(mine) if first + rank < batches else None
        if world == 1:
            yield batch
            continue
        padded = torch.zeros(batch_size, *image_shape, dtype=torch.uint8)
        if batch is not None:
            padded[: len(batch)] = batch
        parts = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
        torch.distributed.gather(padded, parts, dst=0, group=group)
        for k in range(world if rank == 0 else 0):
            if first + k < batches:
                yield parts[k][: min(batch_size, num_images - (first + k) * batch_size)]


def save_grid(images, path):
    """Images (N, C, H, W) as one 8-bit PNG in a square-ish grid (a wide image's has fewer columns): grayscale,
    RGB, or RGBA with its transparency."""
    from torchvision.utils import make_grid

    images = data.eight_bit(images)
    grid = make_grid(images, nrow=grid_columns(len(images), *images.shape[2:]))[: images.shape[1]]  # make_grid makes one channel 3
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(grid, path)


# --- the command ---------------------------------------------------------------------


# What sampling writes into --output: the first image, the grid and the scores (their presence: samples already there).
WRITTEN = ("000000.png", "000000.tif", "grid.png", "fid.json")


def parse_args(argv=None):
    p = OneLineParser(prog="sample.py", description="Generate images from a trained run; measure FID and KID.")
    p.add_argument("run_dir", help="a run's --output_dir, a pipeline folder or a checkpoint folder")
    p.add_argument("--num_images", type=int, default=16, help="images to generate")
    p.add_argument("--output", default=None, help="folder for the PNGs and grid.png (optional with --fid)")
    p.add_argument("--batch_size", type=int, default=16, help="images generated at once")
    p.add_argument("--seed", type=int, default=0, help="image i's noise is seeded by (seed, i)")
    p.add_argument(
        "--sampler", default=None, choices=objectives.SAMPLERS + objectives.FLOW_SAMPLERS,
        help=f"diffusers scheduler that samples a DDPM run (default: {objectives.DEFAULT_SAMPLER}) or a flow run (default: "
             f"{objectives.DEFAULT_FLOW_SAMPLER}; {objectives.flow_sampler_names()}); an EDM run always samples with EDM's Heun sampler",
    )  # fmt: skip
    p.add_argument("--churn", type=float, default=objectives.EDM_CHURN, help=objectives.CHURN_HELP)
    p.add_argument(
        "--num_inference_steps", type=int, default=None,
        help=f"sampling steps (default: {objectives.DEFAULT_STEPS}; an EDM run {objectives.EDM_STEPS} Heun steps, {2 * objectives.EDM_STEPS - 1} evaluations)",
    )  # fmt: skip
    p.add_argument(
        "--ema", action=argparse.BooleanOptionalAction, default=None,
        help="EMA weights (--no-ema: raw, checkpoints only; default: the EMA where the run kept one)",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")

    g = p.add_argument_group("classes and guidance")
    g.add_argument("--class_labels", default=None,
                   help="a conditional run: comma-separated class names or numbers, taken in turn by image i "
                        "(default: spread over the classes in runs; with --fid, drawn as in the data)")  # fmt: skip
    g.add_argument("--guidance_scale", default="1",
                   help="w: classifier-free guidance of a conditional run, or autoguidance with --guide (1: none); "
                        "with --fid a comma-separated list, scored in turn")  # fmt: skip
    g.add_argument("--guide", default=None,
                   help="autoguidance: a run (pipeline or checkpoint folder) of the same data, objective and classes, "
                        "smaller or trained less, that guides this one (Karras et al. 2024)")  # fmt: skip

    p.add_argument("--copies", action=argparse.BooleanOptionalAction, default=True,
                   help=f"the copy check (docs/copies.md): the share of the first {copies.MAX_SAMPLES} samples that copy a "
                        f"training image of the run (Gu et al. 2023), and {copies.PICTURE} of the nearest pairs in --output; "
                        "--no-copies: none (it reads the whole training set: minutes for a large one)")  # fmt: skip

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
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.churn < 0:
        raise ConfigError(f"--churn must be at least 0 (got {args.churn:g})")
    if args.output is None and not args.fid:
        raise ConfigError("say where the images go with --output DIR (or measure them with --fid)")
    if args.output is not None:
        checkpoint.check_writable(args.output, "--output")
        written = [name for name in WRITTEN if (Path(args.output) / name).exists()]
        if written:  # an earlier sampling's images, written over one by one
            raise ConfigError(f"--output {args.output} already holds samples ({written[0]}): give another folder, "
                              "or move them away first")  # fmt: skip
    if args.fid and args.num_images < 2:
        raise ConfigError(f"--fid needs --num_images of at least 2 (got {args.num_images})")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ConfigError(f"--device {args.device}: not a device torch knows: use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: this machine has no CUDA GPU torch can use: use --device cpu")
    if not Path(args.run_dir).exists():
        raise ConfigError(f"{args.run_dir}: no such folder")
    if args.guide is not None and not Path(args.guide).exists():
        raise ConfigError(f"--guide {args.guide}: no such folder")
    args.guidance_scales = parse_scales(args.guidance_scale, "--guidance_scale")
    if len(args.guidance_scales) > 1 and not args.fid:
        raise ConfigError("several --guidance_scale values are for --fid: give one to write images")
    return args


def class_labels_for(spec, config, num_classes, count, seed, as_in_data):
    """Image i's label for a run with `num_classes` classes (None for an unconditional one).

    `spec`: --class_labels, names (the run's class_names) or numbers, taken in
    turn; None: spread over the classes, or with `as_in_data` drawn with the
    data's class frequencies (what FID compares with).
    """
    if not num_classes:
        if spec is not None:
            raise ConfigError("--class_labels is for a class-conditional run: this one was trained without labels")
        return None
    names = (config or {}).get("class_names") or [str(i) for i in range(num_classes)]
    if spec is None:
        counts = (config or {}).get("class_counts")
        return labels_as_in_data(counts, count, seed) if as_in_data and counts else spread_labels(num_classes, count)
    wanted = []
    items = [w.strip() for w in spec.split(",")]
    if any(not w for w in items) and any(items):
        raise ConfigError(f"--class_labels {spec!r} has an empty entry: give names or numbers separated by single commas")
    for item in (w for w in items if w):
        if item in names:
            wanted.append(names.index(item))
        elif item.isdigit() and int(item) < num_classes:
            wanted.append(int(item))
        else:
            raise ConfigError(f"--class_labels: no class {item!r} (the classes: {', '.join(names)}, or 0..{num_classes - 1})")
    if not wanted:
        raise ConfigError("--class_labels is empty: name at least one class")
    return torch.tensor([wanted[i % len(wanted)] for i in range(count)])


def load_guide(path, main_config, device, main=None):
    """The guiding network of --guide on `device`, checked against the run config `main_config` of the model
    it guides (check_guide); where either config is missing (a pipeline outside its run), against `main`,
    the model's (RunDir, network), by what the folders still say (check_guide_network)."""
    guide = RunDir(path)
    if main_config is not None and guide.config is not None:
        check_guide(main_config, guide.config)
    net, _ = guide.load()
    if main is not None and (main_config is None or guide.config is None):
        check_guide_network(guide, net, *main)
    return net.to(device)


def check_guide_network(guide, guide_net, source, net):
    """The objective (a flow pipeline's scheduler says flow) and the images' shape must be the model's."""
    if guide.objective != source.objective or image_shape(guide_net) != image_shape(net):
        raise ConfigError(f"the guide {guide.path} ({guide.objective}, images {image_shape(guide_net)}) does not match "
                          f"the model ({source.objective}, images {image_shape(net)}): guide with a run of the same kind")  # fmt: skip


def main(args):
    with one_line_errors("sample.py", interrupted="stopped before the end; the images written so far stay"):
        return run(validate(args))


# How long a process of a launch by torchrun or accelerate launch waits for the others (its slowest batch, rank 0's
# reference statistics): hours at FID-50k's scale, and it fires only when a process hangs (one that dies ends it).
PROCESS_WAIT = timedelta(hours=12)


def processes(args):
    """(rank, world, group) of a launch by torchrun or `accelerate launch` (WORLD_SIZE > 1): a gloo process group
    that carries the images to rank 0, each process on its own GPU (cuda:LOCAL_RANK); (0, 1, None) otherwise.
    Every process has validated its flags before any joins (--output is looked at before rank 0 writes to it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=PROCESS_WAIT)
    args.device = device_of_process(args.device, int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), world, dist.group.WORLD


def device_of_process(device, local_rank):
    """A launched process's device: its own GPU, cuda:LOCAL_RANK, for `cuda` (the default on a GPU machine); a
    device named in full, or the CPU, as given."""
    return f"cuda:{local_rank}" if device == "cuda" else device


def run(args):
    rank, world, group = processes(args)
    try:
        return _run(args, rank, world, group)
    finally:
        if group is not None:
            torch.distributed.destroy_process_group()


def _run(args, rank, world, group):
    run_dir = Path(args.run_dir)
    source = RunDir(run_dir)
    config = source.config
    ema = source.kept_ema if args.ema is None else args.ema  # which weights sample, as recorded below
    unet, training_config = source.load(ema=ema)
    unet.to(args.device)
    decode = source.decoder(args.device)  # a latent run's VAE, as its train_config.json records it; else None
    # a network of pixels takes the channels its run recorded (1, 3 or 4); one of no run, grayscale or RGB
    recorded = (config or {}).get("image_channels")
    if decode is None and image_shape(unet)[0] not in ([recorded] if recorded else [1, 3]):
        raise ConfigError(
            f"{run_dir} holds a network of {image_shape(unet)[0]}-channel latents, in no run folder whose "
            "train_config.json names their VAE: sample it from its run's --output_dir (or a folder inside it)"
        )
    kind = objectives.of(source.objective)
    steps, sampler_name = args.num_inference_steps or kind.default_steps, args.sampler or kind.default_sampler
    if sampler_name not in kind.samplers:
        owner = next(o for o in objectives.OBJECTIVES.values() if sampler_name in o.samplers)  # the flag's choices
        raise ConfigError(f"--sampler {sampler_name} samples {owner.run_words}; {run_dir} is {kind.run_words}: "
                          f"choose one of {', '.join(kind.samplers)}")  # fmt: skip
    if training_config is None and config is not None:  # a run that saves no pipeline (a DiT's, EDM's)
        training_config = objectives.run_noise_scheduler(config).config
    kind.check_steps(steps, training_config)
    scheduler = kind.sampler(source.objective, sampler_name, training_config, source.setting("sigma_data", objectives.SIGMA_DATA),
                             args.churn, decode is None)  # fmt: skip
    sampler_name = getattr(scheduler, "name", sampler_name)  # EDM's: its Heun sampler, with its churn
    labels = class_labels_for(args.class_labels, config, models.num_classes_of(unet), args.num_images, args.seed, args.fid)
    guide = load_guide(args.guide, config, args.device, main=(source, unet)) if args.guide else None
    if labels is None and guide is None and any(w != 1 for w in args.guidance_scales):
        raise ConfigError(f"--guidance_scale guides a class-conditional run, or autoguides with --guide: {run_dir} has "
                          "no classes, so give --guide RUN (a weaker run or checkpoint) or drop --guidance_scale")  # fmt: skip
    # The Inception weights and the reference statistics before any sampling: rank 0 loads the network (a missing
    # file fails now) and looks for them; found nowhere, every process makes its share (make_reference).
    evaluation, failed = None, [None, False]  # rank 0's error, whether the statistics are to be made
    image_size = source.get("image_size") if decode is not None else sizes.of(*image_shape(unet)[1:])
    channels = image_shape(unet)[0] if decode is None else 3
    bits = data.pixels_of(config or {}).bits if decode is None else 8  # a 16-bit run's PNGs are 16-bit
    if args.fid and rank == 0:
        try:
            evaluation = metrics.SampleEvaluation(run_dir, source.folder, config, args, image_size)
            failed[1] = evaluation.reference is None
        except ConfigError as e:
            failed[0] = str(e)
            if group is None:
                raise
    if group is not None:
        torch.distributed.broadcast_object_list(failed, src=0, group=group)
        if failed[0] is not None:  # said by rank 0
            raise ConfigError(failed[0]) if rank == 0 else SystemExit(2)
    if failed[1]:
        make_reference(evaluation, metrics.reference_options(run_dir, source.folder, config, args), args, image_size,
                       rank, world, group)  # fmt: skip
    training = copy_training_images(source, image_size) if args.copies and rank == 0 else None
    output = Path(args.output) if args.output else None
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
    quiet = rank != 0  # rank 0 says what all did

    base = dict(
        run=str(run_dir), num_images=args.num_images, seed=args.seed, sampler=sampler_name,
        num_inference_steps=steps, ema=ema, guide=args.guide,
    )  # fmt: skip
    results, writes = [], output is not None and len(args.guidance_scales) == 1

    def written(batches):  # this process's batches (every world-th), each image saved as it comes, then at 8 bits
        for k, images in enumerate(batches):
            start = (rank + k * world) * args.batch_size
            for i, image in enumerate(images if writes else ()):
                save_image(image, output / f"{start + i:06d}.png")
            yield data.eight_bit(images)

    for w in args.guidance_scales:
        grid, measured, done = [], [], 0  # measured: the copy check's samples
        mine = generate_batches(unet, scheduler, args.num_images, args.batch_size, args.seed, steps,
                                labels=labels, guidance_scale=w, guide=guide, decode=decode, shard=(rank, world),
                                bits=bits)  # fmt: skip
        shape = (channels, *sizes.height_width(image_size))
        for images in gathered(written(mine), args.num_images, args.batch_size, shape, rank, world, group):
            if evaluation is not None:
                evaluation.add(images, None if labels is None else labels[done : done + len(images)])
            if writes:
                grid.extend(images[: max(0, GRID_IMAGES - len(grid))])
            if training is not None:
                measured.extend(images[: max(0, copies.MAX_SAMPLES - len(measured))])
            done += len(images)
            print(f"generated {done}/{args.num_images}", end="\r", file=sys.stderr)
        if quiet:
            continue
        print(file=sys.stderr)
        result = dict(base, guidance_scale=w)
        if grid:
            save_grid(torch.stack(grid), output / "grid.png")
            print(f"wrote {args.num_images} images and grid.png to {output}" + (f" ({world} processes)" if world > 1 else ""))
        guided = len(args.guidance_scales) > 1 or w != 1 or guide is not None
        if evaluation is not None:
            result |= evaluation.result()
            print(f"guidance scale {w:g}: " * guided + metrics.format_scores(result))
        if training is not None:
            flips, picture = copies.trained_with_flips(config), output / copies.PICTURE if writes else None
            result |= copies.measure(torch.stack(measured), training, flips, args.device, picture)
            print(f"guidance scale {w:g}: " * guided + copies.format_line(result, flips, picture))
        results.append(result)
    if quiet:
        return None
    if evaluation is None:
        return results[0]
    best = metrics.lowest_fid(results)
    summary = dict(best, scales=results) if len(results) > 1 else best
    if len(results) > 1:
        print(f"best guidance scale: {best['guidance_scale']:g}")
    if output is not None:
        (output / "fid.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def copy_training_images(source, image_size):
    """The training images of the run `source` (a RunDir) for the copy check (copies.run_training_images), or
    None, said in a line, where there are none to compare with: a folder outside any run, or a training set
    that cannot be opened here (moved, or on the Hub and this machine offline)."""
    if source.config is None:
        print(f"no copy check: {source.path} is in no run folder whose train_config.json names its training images",
              file=sys.stderr)  # fmt: skip
        return None
    try:
        return copies.run_training_images(source.config, image_size)
    except ConfigError as e:
        print(f"no copy check: the run's training images cannot be opened ({e})", file=sys.stderr)
        return None


def make_reference(evaluation, options, args, image_size, rank, world, group):
    """The reference statistics that rank 0's `evaluation` found nowhere, made: every process embeds its share of
    the images (`options`' at `image_size`; on the built-in shapes the shape scorer's, rank 0's alone), summed
    to rank 0, which keeps them. A process's error stops every process (together)."""
    if metrics.uses_shape_score(options, args.fid_weights):
        world, group = 1, None
        if rank != 0:
            return

    def ready():
        if rank == 0:
            images = evaluation.images  # opened for the statistics' key
            return metrics.reference_images(options, image_size) if images is None else images, evaluation.extractor
        return metrics.reference_images(options, image_size), metrics.extractor_for(options, image_size, args.fid_weights)[0]

    try:
        images, extractor = together(ready, world, group)
        if rank == 0:
            print(metrics.computing_line(len(images), evaluation.key, world))
        statistics = metrics.statistics_of_share(images, extractor, args.device, args.batch_size, 0, rank, world, group)
        together(lambda: rank == 0 and evaluation.keep_reference(statistics), world, group)
    finally:
        if rank == 0:
            evaluation.release()  # made and kept, or failed: another run may make them


def together(work, world, group):
    """work() on every process of `group`; where it fails on any, every process stops: that one with its error,
    the others with exit code 2 and nothing said."""
    error, result = None, None
    try:
        result = work()
    except ConfigError as e:
        error = e
    if world > 1:
        errors = [None] * world
        torch.distributed.all_gather_object(errors, None if error is None else str(error), group=group)
        if error is None and any(errors):
            raise SystemExit(2)
    if error is not None:
        raise error
    return result


def save_image(image, path):
    """A uint8 or uint16 image (C, H, W) as a PNG of its own mode: grayscale (8 or 16 bits), RGB or RGBA; 16-bit
    colour, which PIL cannot write, as a TIFF of the same name (.tif) by tifffile. Returns the path written."""
    from PIL import Image

    array = image.permute(1, 2, 0).numpy()
    if image.dtype == torch.uint16 and len(image) > 1:
        import tifffile

        tifffile.imwrite(path.with_suffix(".tif"), array, photometric="rgb")
        return path.with_suffix(".tif")
    Image.fromarray(array[..., 0] if len(image) == 1 else array).save(path)  # L or I;16, RGB, RGBA: by its shape and type
    return path


if __name__ == "__main__":
    main(parse_args())
