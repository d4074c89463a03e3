"""The copy check: how many generated images are copies of a training image (Gu et al. 2023), and their picture.

A sample counts as a copy when its ℓ2 distance to the nearest training image is under a third of its
distance to the second nearest (Gu et al. 2023, "On Memorization in Diffusion Models", after Yoon et al.
2023), both measured in pixel space at the run's resolution: each image's values scaled to [0, 1] and
flattened (docs/copies.md says why). A run trained with random flips saw each image both ways round, so
a training image is as near as the nearer of it and its mirror image.

The search is a matmul, ||a||² + ||b||² - 2 a·b, run on one device over chunks of the training set and
blocks of the samples (memory stays bounded), keeping each sample's two nearest; the two found in a chunk
are measured again directly, (a - b)², so that an exact copy is at distance 0, not at float32's rounding
of the difference of two large sums.
"""

import math
from pathlib import Path
from typing import NamedTuple

import torch


from ddpm_train.data import decoding
from ddpm_train.data import sources
from ddpm_train.data import pixels
from ddpm_train.evaluation import metrics
from ddpm_train import sizes
from ddpm_train.errors import ConfigError

RATIO = 1 / 3  # Gu et al.'s threshold on nearest / second nearest
# Floats in one block of the search: a chunk of training images (and its mirror images), a block of samples and
# their two candidates each, 2^26 (256 MiB in float32) in all: blocks of 4,096 images of 32x32x3 (MAX_BLOCK), 68 of 256x256x3;
# at most MAX_BLOCK images, so that the distances between a chunk and a block stay 64 MiB.
BLOCK_FLOATS = 2**26
MAX_BLOCK = 4096
# The samples a check measures at most (the first ones): Gu et al. measured 10k.
MAX_SAMPLES = 10_000
PAIRS = 16  # the pairs the picture shows, the most copy-like first
PAIRS_PER_ROW = 4
PICTURE = "copies.png"


class Nearest(NamedTuple):
    """Each sample's two nearest training images: `distances` (N, 2) ℓ2 in [0, 1] pixel units, nearest first,
    `indices` (N, 2) into the training images searched, `flipped` (N, 2) whether it is their mirror image;
    `num_training`: how many training images were searched (the readable ones)."""

    distances: torch.Tensor
    indices: torch.Tensor
    flipped: torch.Tensor
    num_training: int

    def ratios(self):
        """Nearest over second nearest, per sample; 0 where both are 0 (a sample equal to an image the
        training set holds twice is a copy)."""
        first, second = self.distances.unbind(1)
        return torch.where(second > 0, first / second.clamp_min(torch.finfo(second.dtype).tiny), 0.0)

    def copies(self):
        """Which samples are copies: ratio under RATIO."""
        return self.ratios() < RATIO


class TrainingImages:
    """The images the samples are compared with: a uint8 tensor (N, C, S, S) on any device, searched where it
    lies; a decoding.PreloadedImages, its readable images' tensor; or a dataset whose items are (image, error)
    (a sources.Images), decoded chunk by chunk at each search and never held whole."""

    def __init__(self, images):
        self.images = images.images if isinstance(images, decoding.PreloadedImages) else images

    def __len__(self):
        return len(self.images)

    def batches(self, size):
        """(uint8 batch, the indices of its images) over every readable image once (metrics.indexed_batches)."""
        return metrics.indexed_batches(self.images, size)

    def at(self, indices):
        """The images at `indices` (a LongTensor), uint8 (K, C, S, S) on the CPU."""
        if isinstance(self.images, torch.Tensor):
            return self.images[indices.to(self.images.device)].cpu()
        return torch.stack([self.images[int(i)][0] for i in indices])


def flat(images, device):
    """uint8 or uint16 (B, C, H, W) -> float32 (B, C·H·W) in [0, 1] on `device`."""
    return images.to(device).flatten(1).float().div_(65535 if images.dtype == torch.uint16 else 255)


def search(samples, training, flips=False, device="cpu"):
    """The two nearest training images of each uint8 sample of `samples` (N, C, S, S) in `training`
    (TrainingImages), with each training image's mirror image too when `flips`: a Nearest, on the CPU.

    TF32 is off (metrics._no_tf32): the squared distances are differences of sums of thousands of terms."""
    if len(samples) == 0:
        raise ConfigError("the copy check needs at least one sample")
    size = samples[0].numel()
    block = min(MAX_BLOCK, max(1, BLOCK_FLOATS // (5 * size)))  # a chunk, its mirror, a block, its candidates
    samples = samples.to(device)
    best = torch.full((len(samples), 2), math.inf, device=device)
    indices = torch.full((len(samples), 2), -1, dtype=torch.long, device=device)
    flipped = torch.zeros((len(samples), 2), dtype=torch.bool, device=device)
    searched = 0
    with torch.no_grad(), metrics._no_tf32():
        for batch, index in training.batches(block):
            if batch.shape[1:] != samples.shape[1:]:
                raise ConfigError(f"the copy check compares samples of {tuple(samples.shape[1:])} with training images "
                                  f"of {tuple(batch.shape[1:])}: give the run's training images at its size")  # fmt: skip
            chunk = flat(batch, device)
            mirror = flat(batch.flip(3), device) if flips else None
            index, searched = index.to(device), searched + len(batch)
            for start in range(0, len(samples), block):
                rows = slice(start, start + block)
                found = _nearest_in_chunk(flat(samples[rows], device), chunk, mirror)
                merged = [torch.cat([kept[rows], new], 1) for kept, new in zip((best, indices, flipped),
                                                                                (found[0], index[found[1]], found[2]))]  # fmt: skip
                order = merged[0].argsort(dim=1, stable=True)[:, :2]
                best[rows], indices[rows], flipped[rows] = (m.gather(1, order) for m in merged)
    if searched < 2:
        raise ConfigError(f"the copy check needs at least 2 training images (found {searched})")
    return Nearest(best.cpu(), indices.cpu(), flipped.cpu(), searched)


def _nearest_in_chunk(x, chunk, mirror):
    """(distances, positions, flipped), each (M, K) with K = min(2, len(chunk)): the nearest images of the
    chunk to each row of `x` (M, D), found by the matmul form and measured again directly."""
    x_norm = (x * x).sum(1, keepdim=True)

    def squared(t):
        return (x_norm + (t * t).sum(1) - 2 * x @ t.T).clamp_min_(0)

    d = squared(chunk)
    flipped = torch.zeros_like(d, dtype=torch.bool)
    if mirror is not None:
        d_mirror = squared(mirror)
        flipped = d_mirror < d
        d = torch.minimum(d, d_mirror)
    positions = d.topk(min(2, len(chunk)), dim=1, largest=False).indices
    flipped = flipped.gather(1, positions)
    candidates = chunk[positions] if mirror is None else torch.where(flipped[..., None], mirror[positions], chunk[positions])
    return (x[:, None] - candidates).square().sum(2).sqrt(), positions, flipped


def numbers(nearest):
    """What a check reports, all numbers: `copy_share` (the share of samples that are copies), `copies` (how
    many), `median_ratio` (nearest over second nearest), `copy_samples` (how many were measured) and
    `training_images` (how many they were compared with)."""
    copies = nearest.copies()
    return dict(copy_share=float(copies.double().mean()), copies=int(copies.sum()),
                median_ratio=float(nearest.ratios().median()), copy_samples=len(copies),
                training_images=nearest.num_training)  # fmt: skip


def save_pairs(samples, training, nearest, path, count=PAIRS):
    """A PNG at `path` of the `count` samples with the smallest ratio, each beside its nearest training image
    (mirrored where that was the nearer), PAIRS_PER_ROW pairs a row, 2-pixel gaps (torchvision's make_grid)."""
    from torchvision.utils import make_grid, save_image

    shown = nearest.ratios().argsort(stable=True)[:count]
    matches = training.at(nearest.indices[shown, 0])
    matches = torch.where(nearest.flipped[shown, 0].view(-1, 1, 1, 1), matches.flip(3), matches)
    pairs = torch.stack([pixels.eight_bit(samples[shown].cpu()), pixels.eight_bit(matches)], 1).flatten(0, 1)  # sample, match, ...
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rgb = metrics.rgb8(pairs)  # a grayscale or RGBA run's, as RGB
    save_image(make_grid(rgb.float() / 255, nrow=2 * min(PAIRS_PER_ROW, len(shown))), path)
    return path


def trained_with_flips(options):
    """Whether a run (train.py's flags, or its train_config.json) flipped its images at random: --augment,
    or an older run's random_flip (flips were the default then as now)."""
    if options.get("augment") is not None:
        return "flip" in str(options["augment"]).split(",")
    return bool(options.get("random_flip", True))


def run_training_images(options, image_size, images=None):
    """The training images of a run with dataset flags `options` (train.py's, or its train_config.json), as
    TrainingImages: `images` where they are the images it trained on (a uint8 tensor, a PreloadedImages, or a
    streamed dataset of fixed crops), else opened from the flags (metrics.reference_images): for a latent
    run's latents, for None, and for random crops (each epoch's differ), which are searched at the centre."""
    crops = "crop" in str(options.get("augment") or "").split(",")
    if isinstance(images, decoding.PreloadedImages) or (isinstance(images, torch.Tensor) and not images.is_floating_point()):
        return TrainingImages(images)
    if isinstance(images, sources.Images) and not crops:
        return TrainingImages(images)
    return TrainingImages(metrics.reference_images(dict(options, augment="none"), image_size))


def measure(samples, training, flips, device="cpu", path=None):
    """numbers() of the first MAX_SAMPLES of the uint8 `samples` against `training` (TrainingImages), searched on
    `device` (with their mirror images when `flips`); with a `path`, their nearest pairs' picture written there."""
    samples = samples[:MAX_SAMPLES]
    nearest = search(samples, training, flips, device)
    if path is not None:
        save_pairs(samples, training, nearest, path)
    return numbers(nearest)


def check(samples, images, args, path, device=None):
    """The copy check of an evaluation's (or a grid's) uint8 samples (N, C, H, W), for train.py: returns
    numbers() of the first MAX_SAMPLES of them against the run's training images, and writes their nearest
    pairs to `path` (save_pairs). `images`: what the run's data was loaded into (data.load_images' images;
    None or a latent run's latents: opened from `args`, run_training_images); `args`: train.py's flags (or a
    run's train_config.json as a dict), whose --augment says whether flips are searched. `device`: where the
    search runs; None: where a preloaded training tensor lies, else the CPU."""
    options = args if isinstance(args, dict) else vars(args)
    training = run_training_images(options, sizes.of(*samples.shape[-2:]), images)  # (H, W): a non-square run's too
    if device is None:
        device = training.images.device if isinstance(training.images, torch.Tensor) else "cpu"
    return measure(samples, training, trained_with_flips(options), device, path)


def format_line(found, flips, path=None):
    """One line of what measure() found: the share, the count, what was searched, the median ratio, the picture."""
    mirrored = " and their mirror images" if flips else ""
    return (f"copies {found['copy_share']:.1%} ({found['copies']} of {found['copy_samples']} samples nearer one of "
            f"{found['training_images']} training images{mirrored} than a third of the second nearest) | median "
            f"ratio {found['median_ratio']:.3f}" + (f" | nearest pairs in {path}" if path is not None else ""))  # fmt: skip
