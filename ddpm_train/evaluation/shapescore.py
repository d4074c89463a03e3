"""The offline reference score of the built-in shapes: a small CNN that knows what they hold.

FID needs Inception weights, a download. The built-in generator knows what
every image holds (`shapes.make_shapes(..., with_labels=True)`), so a network
trained on its images, once, on the CPU, gives features to measure a Fréchet
distance ("shape FD") and KID with, and says whether an image is a
recognisable shape image at all. metrics.py uses it in place of Inception for
runs on the built-in shapes (`--dataset shapes` without `--fid_weights`):

    python train.py --eval_every_epochs 2 --eval_num_samples 2048   # "shape FD ... | valid 0.87"
    python sample.py ddpm-output --fid --num_images 2048             # the same score, afterwards
    python -m bench.trust --image_size 32 --num_images 2048 samples/shapes-small-cpu-eps.png   # how far to trust it

What the network predicts, and why. A shape "shows" when at least 40% of it is
not drawn over by a later one, not at all below 10%, and by a linear ramp in
between (a sliver is half a shape to the eye too; a hard cut there would be
label noise):
  - how many shapes show (1, 2 or 3), and which kinds show (circle, square,
    triangle: one yes/no each). These are what samples of this data get wrong
    first (an under-trained run draws coloured blobs of no clear number or
    outline), and what "valid" is made of.
  - for each 4x4-pixel cell, how much of it is background, circle, square or
    triangle, and whether a shape's centre lies in it: dense targets, 64 cells
    per image at 32px, a stronger signal for the convolutions than a few
    numbers per image, and the cells' kinds and centres are pooled into the
    features (a count is a sum of centres, a kind shows if it shows anywhere).
  - the background colour, the mean colour of the shapes and the fraction of
    the image they cover (regressions). Without these the features need not
    carry colour or size, and the distance would not see a wrong palette.
    Weighted low (0.3): at 10, the kinds were learned later in our runs.

Features: the 128 activations before the heads, as Inception's pool3 is for FID.

Valid: the classifier is sure of what the image holds, and the image looks
like real ones to it.
  - Sure: its least sure answer (the count's top class, each kind's yes or
    no) is at least as probable as on 95% of held-out real images. A fixed
    0.9 passed only about half of the real images with the training that a
    minute of CPU buys (the count is the least sure head: two shapes of near
    hue side by side).
  - Looks real: its features lie within the k-nearest-neighbour balls (k = 3)
    of the training images' features, the "improved precision" of
    Kynkäänniemi et al. (2019). Being sure is not enough: 93% of uniform-noise
    images are "sure" (classifiers are sure far from their data, Nguyen et al.
    2015); none look real. (A Mahalanobis distance to the real features, tried
    first, let 92% of images blurred by 2 px through; the k-NN balls 69%.)
On real images of another seed 0.89 are valid, on noise none (the trust
table, docs/sampling.md).

The trained network is cached in `cache_dir()` (`$SHAPES_SCORER_DIR`, else
torch's hub folder: ~/.cache/torch/hub/shapescore/), one file per image size,
seed, training length and VERSION; scores are comparable when they come from
the same file. Raise VERSION when training changes. `$SHAPES_SCORER_IMAGES` and
`$SHAPES_SCORER_STEPS` set the default training length (4096 images, 1200 steps):
the tests use a shorter one in the runs they start.
"""

import math
import os
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


from ddpm_train.data import shapes
from ddpm_train import sizes

VERSION = 1
# One scorer per image size for every run, so that their scores compare; trained on
# images of its own seed, none of a run's (runs use small seeds).
SEED = 1_000_003
# The training length of the default scorer. $SHAPES_SCORER_IMAGES and $SHAPES_SCORER_STEPS, read
# at import, set another (a shorter one for tests, in the processes they start); the length is in
# the scorer's name and its file, so that scores of different lengths never mix.
IMAGES_ENV, STEPS_ENV = "SHAPES_SCORER_IMAGES", "SHAPES_SCORER_STEPS"
TRAIN_IMAGES = int(os.environ.get(IMAGES_ENV) or 4096)
TRAIN_STEPS = int(os.environ.get(STEPS_ENV) or 1200)
BATCH_SIZE = 32
LEARNING_RATE = 1e-2
HELD_OUT_IMAGES = 1024  # from SEED + 1: the accuracies and the sureness threshold
SURE_QUANTILE = 0.05  # sure: as sure as on 95% of held-out real images
NEIGHBOURS = 3  # k of the k-NN balls of "looks real" (Kynkäänniemi et al. 2019 use 3)
CACHE_ENV = "SHAPES_SCORER_DIR"
KINDS = ("circle", "square", "triangle")
CELL = 4  # pixels per side of a cell of the dense targets (the convolutions' stride)


# --- what each image holds -------------------------------------------------------------


def targets(labels, image_size):
    """The training targets of `shapes.make_shapes` labels (see the module docstring).

    count (n, 3): P(1, 2, 3 shapes show); kinds (n, 3): P(a circle, square, triangle shows);
    colors (n, 7): background RGB, shapes' mean RGB, fraction covered; cells (n, 5, H/4, W/4):
    the share of background and of each kind in each cell, and P(a shape's centre is in it).
    """
    shown = labels["visible_pixels"] / labels["pixels"].clamp(min=1e-6)
    p = ((shown - 0.1) / 0.3).clamp(0, 1) * labels["drawn"]  # (n, k): P(the shape shows)
    count = torch.zeros(len(p), p.shape[1] + 1)  # P(c show), c = 0..k, slot by slot
    count[:, 0] = 1
    for j in range(p.shape[1]):
        count = count * (1 - p[:, j, None]) + F.pad(count, (1, 0))[:, :-1] * p[:, j, None]
    kinds = torch.stack([1 - torch.where(labels["kind"] == c, 1 - p, 1.0).prod(1) for c in range(len(KINDS))], 1)
    visible = labels["visible_pixels"]
    foreground = (visible[..., None] * labels["color"]).sum(1) / visible.sum(1, keepdim=True).clamp(min=1e-6)
    cover = visible.sum(1, keepdim=True) / sizes.pixels(image_size)
    slot = labels["shape_map"].long()
    kind_map = torch.where(slot >= 0, labels["kind"].gather(1, slot.clamp(min=0).flatten(1)).view_as(slot), -1) + 1
    cells = F.avg_pool2d(F.one_hot(kind_map, 1 + len(KINDS)).permute(0, 3, 1, 2).float(), CELL)
    rows, columns = cells.shape[-2:]
    at = (labels["center"] * min(sizes.height_width(image_size)) / CELL).long()  # (n, k, 2): the cell of each centre
    at = torch.stack([at[..., 0].clamp(0, columns - 1), at[..., 1].clamp(0, rows - 1)], -1)
    centres = torch.zeros(len(p), rows * columns).scatter_add_(1, at[..., 1] * columns + at[..., 0], p).clamp(max=1)
    cells = torch.cat([cells, centres.view(-1, 1, rows, columns)], 1)
    # The last shape drawn always shows, so P(0 shapes) is 0.
    return dict(count=count[:, 1:], kinds=kinds, colors=torch.cat([labels["background"], foreground, cover], 1), cells=cells)


# --- the network ---------------------------------------------------------------------


def _conv(i, o, k=3):
    return [nn.Conv2d(i, o, k, padding=k // 2, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True)]


class ShapeScorer(nn.Module):
    """uint8 images (N, 3, S, S) -> features (N, 128); `heads`, `sure`, `looks_real`, `valid` on features.

    They take the features, not the images, so that one pass of the network
    serves both the distance and the valid fraction (metrics.embed, metrics.score).
    """

    def __init__(self, image_size, seed=SEED, num_images=TRAIN_IMAGES, steps=TRAIN_STEPS, width=16, num_features=128):
        super().__init__()
        self.image_size, self.seed, self.num_images, self.steps = image_size, seed, num_images, steps
        w = width
        self.convs = nn.Sequential(
            *_conv(3, w, 5), nn.MaxPool2d(2), *_conv(w, 2 * w), nn.MaxPool2d(2), *_conv(2 * w, 4 * w), *_conv(4 * w, 4 * w)
        )  # fmt: skip
        self.cells = nn.Conv2d(4 * w, 2 + len(KINDS), 1)  # background or each kind; a centre
        self.features = nn.Sequential(nn.Linear(8 * w + 2 * (1 + len(KINDS)) + 1, num_features), nn.ReLU())
        self.count = nn.Linear(num_features, 3)
        self.kinds = nn.Linear(num_features, len(KINDS))
        self.colors = nn.Linear(num_features, 7)
        # What `valid` compares with, set at the end of training.
        self.register_buffer("sure_enough", torch.tensor(0.0))
        self.register_buffer("real_features", torch.zeros(num_images, num_features))
        self.register_buffer("real_radii", torch.full((num_images,), -math.inf))
        self.info = {}

    @property
    def name(self):
        """What the scores depend on; metrics.py keys the cached reference statistics by it."""
        return f"shapescore-v{VERSION}:{self.image_size}px:seed{self.seed}:{self.num_images}images:{self.steps}steps"

    def _maps(self, images):
        maps = self.convs(images.float() / 127.5 - 1)
        return maps, self.cells(maps)

    def _pool(self, maps, cells):
        # Averages (how much) and maxima (whether anywhere) over the image, of the
        # convolution's maps and of the cells' kinds; the sum of the centres is a count.
        kinds, centres = cells[:, :-1].softmax(1), cells[:, -1:].sigmoid()
        pooled = [maps.mean((2, 3)), maps.amax((2, 3)), kinds.mean((2, 3)), kinds.amax((2, 3)), centres.sum((2, 3))]
        return self.features(torch.cat(pooled, 1))

    def forward(self, images):
        return self._pool(*self._maps(images))

    def heads(self, features):
        """count (N, 3): P(1, 2, 3 shapes); kinds (N, 3): P(each kind shows); colors (N, 7)."""
        features = features.float()
        return dict(count=self.count(features).softmax(1), kinds=self.kinds(features).sigmoid(), colors=self.colors(features))

    def single_kind(self, features):
        """(N,) the one kind of shape the image shows (0 circle, 1 square, 2 triangle), -1 when it
        shows none or several: what a class-conditional run on one-shape images is checked by."""
        shows = self.heads(features)["kinds"] > 0.5
        return torch.where(shows.sum(1) == 1, shows.float().argmax(1), torch.full_like(shows[:, 0], -1, dtype=torch.long))

    def sureness(self, features):
        """(N,) the probability of its least sure answer: the count's top class, each kind's yes or no."""
        p = self.heads(features)
        return torch.cat([p["count"].amax(1, keepdim=True), torch.maximum(p["kinds"], 1 - p["kinds"])], 1).amin(1)

    def sure(self, features):
        """(N,) bool: as sure of what the image holds as of 95% of held-out real images."""
        return self.sureness(features) >= self.sure_enough

    def looks_real(self, features, chunk=1024):
        """(N,) bool: within the k-NN ball of some training image's features (Kynkäänniemi et al. 2019)."""
        features = features.float()
        inside = [
            (torch.cdist(part, self.real_features) <= self.real_radii).any(1) for part in features.split(chunk)
        ]  # fmt: skip
        return torch.cat(inside) if inside else torch.zeros(0, dtype=torch.bool, device=features.device)

    def valid(self, features):
        """(N,) bool: recognised as a valid shape image (sure, and looks real)."""
        return self.sure(features) & self.looks_real(features)


# --- training --------------------------------------------------------------------------


def _loss(scorer, images, target):
    maps, cell_logits = scorer._maps(images)
    features = scorer._pool(maps, cell_logits)
    cells, centres = cell_logits.split([1 + len(KINDS), 1], 1)
    cells = -(target["cells"][:, :-1] * cells.log_softmax(1)).sum(1).mean()
    centres = 10 * F.binary_cross_entropy_with_logits(centres, target["cells"][:, -1:])  # x10: few cells hold one
    count = -(target["count"] * scorer.count(features).log_softmax(1)).sum(1).mean()
    kinds = F.binary_cross_entropy_with_logits(scorer.kinds(features), target["kinds"])
    colors = 0.3 * F.mse_loss(scorer.colors(features), target["colors"])
    return cells + centres + count + kinds + colors


@torch.no_grad()
def _features(scorer, images, batch_size=256):
    return torch.cat([scorer(images[i : i + batch_size]) for i in range(0, len(images), batch_size)])


def train(image_size, seed=SEED, num_images=TRAIN_IMAGES, steps=TRAIN_STEPS, device="cpu", log=print):
    """A ShapeScorer trained on `num_images` built-in images of `seed` for `steps` batches of BATCH_SIZE.

    It draws from its own generators and leaves the caller's random stream as it
    was, so a run that evaluates trains exactly as one that does not.
    """
    start = time.perf_counter()
    images, labels = shapes.make_shapes(num_images, image_size, seed=seed, with_labels=True)
    target = targets(labels, image_size)
    data_s = time.perf_counter() - start
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        scorer = ShapeScorer(image_size, seed, num_images, steps)
    scorer.to(device).train()
    images, target = images.to(device), {k: v.to(device) for k, v in target.items()}
    optimizer = torch.optim.AdamW(scorer.parameters(), lr=LEARNING_RATE, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, LEARNING_RATE, total_steps=steps, pct_start=0.15)
    g = torch.Generator(device).manual_seed(seed)
    batch = min(BATCH_SIZE, num_images)
    order, first = torch.randperm(num_images, generator=g, device=device), 0
    for _ in range(steps):
        if first + batch > num_images:
            order, first = torch.randperm(num_images, generator=g, device=device), 0
        index, first = order[first : first + batch], first + batch
        flip = (torch.rand(batch, generator=g, device=device) < 0.5).view(-1, 1, 1, 1)  # a mirror image holds the same
        t = {k: v[index] for k, v in target.items()}
        t["cells"] = torch.where(flip, t["cells"].flip(3), t["cells"])
        loss = _loss(scorer, torch.where(flip, images[index].flip(3), images[index]), t)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    scorer.eval()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    train_s = time.perf_counter() - start - data_s

    with torch.no_grad():
        # Looks real: each training image's k-NN radius among the others' features.
        real = _features(scorer, images)
        radii = torch.cat([torch.cdist(part, real).kthvalue(NEIGHBOURS + 1, 1).values for part in real.split(1024)])
        scorer.real_features.copy_(real)
        scorer.real_radii.copy_(radii)
        # Sure: thresholded on held-out images.
        held_out, held_labels = shapes.make_shapes(HELD_OUT_IMAGES, image_size, seed=seed + 1, with_labels=True)
        held = _features(scorer, held_out.to(device))
        scorer.sure_enough.fill_(float(torch.quantile(scorer.sureness(held).double().cpu(), SURE_QUANTILE)))
        scorer.info = dict(
            data_s=round(data_s, 1), train_s=round(train_s, 1), total_s=round(time.perf_counter() - start, 1), device=str(device),
            threads=torch.get_num_threads(), **_accuracy(scorer, held, targets(held_labels, image_size)),
        )  # fmt: skip
    i = scorer.info
    log(
        f"trained the shape scorer ({image_size}px, {num_images} images, {steps} steps) in {i['total_s']} s "
        f"({i['data_s']} s making the images, {i['train_s']} s training): on "
        f"{HELD_OUT_IMAGES} held-out images the count is right for {i['count_accuracy']:.3f}, all kinds for "
        f"{i['kinds_accuracy']:.3f}; {i['valid_fraction']:.3f} valid"
    )
    return scorer


def _accuracy(scorer, features, target):
    """On held-out images: the share whose count, and whose every kind, is right (where the label is sure)."""
    p, target = scorer.heads(features), {k: v.to(features.device) for k, v in target.items()}
    sure = target["count"].amax(1) == 1
    count = (p["count"].argmax(1) == target["count"].argmax(1))[sure].float().mean()
    sure = ((target["kinds"] == 0) | (target["kinds"] == 1)).all(1)
    kinds = ((p["kinds"] > 0.5) == (target["kinds"] > 0.5)).all(1)[sure].float().mean()
    return dict(
        count_accuracy=float(count), kinds_accuracy=float(kinds), sure_enough=float(scorer.sure_enough),
        valid_fraction=float(scorer.valid(features).float().mean()),
    )  # fmt: skip


# --- the cache -------------------------------------------------------------------------


def cache_dir():
    """$SHAPES_SCORER_DIR, else shapescore/ in torch's hub folder (~/.cache/torch/hub/shapescore)."""
    folder = os.environ.get(CACHE_ENV)
    return Path(folder).expanduser() if folder else Path(torch.hub.get_dir()) / "shapescore"


def _settings(seed, num_images, steps):
    """The module's defaults where None: read at call time, so that tests can shorten training."""
    return (SEED if seed is None else seed), (num_images or TRAIN_IMAGES), (steps or TRAIN_STEPS)


def cache_path(image_size, seed=None, num_images=None, steps=None):
    seed, num_images, steps = _settings(seed, num_images, steps)
    return cache_dir() / f"v{VERSION}-{image_size}px-seed{seed}-{num_images}images-{steps}steps.pt"


def load_or_train(image_size, seed=None, num_images=None, steps=None, device="cpu", log=print):
    """The scorer for `image_size` (on the CPU): from the cache, else trained now (about a minute
    at 32px on 2 CPU cores) and cached. Defaults: SEED, TRAIN_IMAGES, TRAIN_STEPS."""
    seed, num_images, steps = _settings(seed, num_images, steps)
    path = cache_path(image_size, seed, num_images, steps)
    if path.is_file():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        scorer = ShapeScorer(image_size, seed, num_images, steps)
        scorer.load_state_dict(saved["state"])
        scorer.info = saved["info"]
        return scorer.eval()
    log(f"training the offline shape scorer for {image_size}px images, once (cached in {path})")
    scorer = train(image_size, seed, num_images, steps, device, log).cpu()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two processes may train it at once
    torch.save(dict(state=scorer.state_dict(), info=scorer.info), tmp)
    os.replace(tmp, path)
    return scorer
