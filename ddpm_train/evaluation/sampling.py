"""Sampling a network: guidance, the labels of a grid or an evaluation, images from per-image seeds with an
objective's sampler (objectives.py), gathered across processes, and the grid saved. sample.py is its command line;
train.py draws its grids and evaluations with it."""

import contextlib
import math

import numpy as np
import torch

from ddpm_train.data import captions
from ddpm_train.data import pixels
from ddpm_train.data import autoencoder
from ddpm_train.networks import model as models
from ddpm_train.training import rundir
from ddpm_train.diffusion import objectives
from ddpm_train.diffusion import samplers
from ddpm_train import sizes
from ddpm_train.errors import ConfigError


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
        words = isinstance(labels, captions.Words)  # a captioned run's: the guide (same encoder) reads them too
        if self.guide is not None:
            guide_labels = labels if words or models.num_classes_of(self.guide) else None
            guided = self._call(self.guide, x, t, guide_labels)
            main = guided if w == 0 else self._call(self.net, x, t, labels)
        else:  # the conditional and unconditional outputs in one batch
            null = labels.cat(self.null_label) if words else torch.cat([labels, torch.full_like(labels, self.null_label)])
            both = self._call(self.net, torch.cat([x, x]), torch.cat([t, t]) if torch.is_tensor(t) and t.ndim else t, null)
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


def guided_network(net, labels=None, scale=1.0, guide=None, table=None):
    """`net` as `generate` calls it: itself when there is nothing to guide or condition, else Guided. `table`: a
    captioned run's (captions.Table), whose empty caption is the null label."""
    if labels is None and guide is None:
        return net
    null = table.null(labels.mask.device) if table is not None and labels is not None else models.null_label(models.num_classes_of(net))
    return Guided(net, scale, labels, null, guide)


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
    """A one-line ConfigError unless the run configs `main` and `guide` can be combined: the same objective, image
    size, classes, text encoder (the guide reads the model's caption embeddings) and latent space (VAE and
    normalisation; none for pixel runs), and for DDPM the same noise schedule and prediction, since their outputs
    are combined as they are."""
    keys = ["objective", "image_size", "class_names", "text_encoder", *objectives.of(main.get("objective")).same]
    # the latent space as resume compares it: the encoder's weights and the normalisation, not the --vae text
    space, guide_space = autoencoder.recorded_latent_space(main), autoencoder.recorded_latent_space(guide)
    if space != guide_space:
        raise ConfigError("the guide was trained on another latent space (" + autoencoder.latent_space_change(guide_space, space) +
                          "): guide with a run on the same VAE's latents, normalised the same way")  # fmt: skip
    for key in keys:
        if key == "num_train_timesteps":  # a setting (config.SETTINGS), not a flag
            a, b = (objectives.run_setting(config, key, objectives.NUM_TRAIN_TIMESTEPS) for config in (main, guide))
        else:
            a, b = main.get(key), guide.get(key)
        if key == "objective":
            a, b = objectives.recorded(a), objectives.recorded(b)
        if a != b:
            raise ConfigError(f"the guide was trained with {key} {b!r}, the model with {a!r}: "
                              f"guide with a run of the same {key.replace('_', ' ')}")  # fmt: skip


def load_guide(path, main_config, device, main=None):
    """The guiding network of --guide on `device`, checked against the run config `main_config` of the model
    it guides (sampling.check_guide); where either config is missing (a pipeline outside its run), against `main`,
    the model's (RunDir, network), by what the folders still say (check_guide_network)."""
    guide = rundir.RunDir(path)
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
    kind = pixels.Pixels(bits=bits)
    return ((images.float().clamp(-1, 1) + 1) * (kind.top / 2)).round().to(kind.dtype).cpu()


@torch.no_grad()
def generate(net, scheduler, seeds, num_inference_steps, autocast=contextlib.nullcontext, labels=None,
             guidance_scale=1.0, guide=None, decode=None, bits=8):  # fmt: skip
    """uint8 images (len(seeds), C, S, S), uint16 with `bits` 16; image i starts from noise drawn with seed seeds[i].

    `scheduler` is one of samplers.make_scheduler's, or an samplers.EDMHeunSampler for a network
    trained with the EDM objective (`objectives.make_sampler` picks by the run's objective).
    `labels`: image i's class (a conditional network); `guidance_scale` and
    `guide`: classifier-free guidance or autoguidance (Guided). `decode`: a latent
    run's latents -> images in [-1, 1] (RunDir.decoder: through its VAE).
    """
    device = samplers.network_device(net)
    table = getattr(net, "captions", None)  # a captioned run's: its labels are caption ids, looked up here
    kind = objectives.sampled_by(scheduler)  # each network called with its family's time input
    net = kind.timed(net, models.family_of(net).time_input)
    guide = None if guide is None else kind.timed(guide, models.family_of(guide).time_input)
    labels = None if labels is None else table.rows(labels, device) if table is not None else torch.as_tensor(labels).to(device)
    net = guided_network(net, labels, guidance_scale, guide, table)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    x = samplers.image_noise(generators, image_shape(net), device)
    if isinstance(scheduler, samplers.EDMHeunSampler):
        x = scheduler.sample(net, x, num_inference_steps, autocast, generators)
    else:
        scheduler.set_timesteps(num_inference_steps, device=device)  # also resets a multistep solver's history
        x = x * getattr(scheduler, "init_noise_sigma", 1.0)  # a flow scheduler starts at σ = 1 and has none
        scale = getattr(scheduler, "scale_model_input", lambda x, t: x)
        for t in scheduler.timesteps:
            with autocast():
                model_output = net(scale(x, t), t, return_dict=False)[0]
            # the DDPM sampler's fresh noise comes from the same per-image generators
            x = scheduler.step(model_output.float(), t, x, generator=generators).prev_sample
    return to_pixels(x if decode is None else decode(x), bits)


def generate_batches(net, scheduler, num_images, batch_size, seed, num_inference_steps, autocast=contextlib.nullcontext,
                     labels=None, guidance_scale=1.0, guide=None, decode=None, shard=(0, 1), bits=8):  # fmt: skip
    """Yield uint8 (with `bits` 16, uint16) batches of `num_images` images in all; image i depends only on (seed, i) (and its label).
    `shard` (rank, world): batches rank, rank + world, ... of them alone (one process's of several)."""
    seeds = image_seeds(seed, num_images)
    rank, world = shard
    for start in range(rank * batch_size, num_images, world * batch_size):
        part = None if labels is None else labels[start : start + batch_size]
        yield generate(net, scheduler, seeds[start : start + batch_size], num_inference_steps, autocast, part,
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

    images = pixels.eight_bit(images)
    grid = make_grid(images, nrow=grid_columns(len(images), *images.shape[2:]))[: images.shape[1]]  # make_grid makes one channel 3
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(grid, path)


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
