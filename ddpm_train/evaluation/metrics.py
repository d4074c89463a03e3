"""FID and KID of generated images: features, cached reference statistics, best checkpoint.

The arithmetic is torchmetrics' (FrechetInceptionDistance,
KernelInceptionDistance); the network is torch-fidelity's Inception-v3 with
the weights of the original TensorFlow FID code, loaded through torchmetrics
(`NoTrainInceptionV3`). Features are computed once per image and handed to
both metrics through a pass-through "feature extractor", so the Inception
network runs once per image, not once per metric, and a cached reference needs
no images at all.

Runs on the built-in shapes without `--fid_weights` are scored offline
instead (`extractor_for`): the same arithmetic on the features of a small
network trained on the built-in images (shapescore.py), a "shape FD" and KID,
plus the fraction of generated images it recognises as valid shape images.
The reference statistics are keyed by the extractor's name, so the two never mix.

Weights: `--fid_weights PATH`, else torch's hub cache, else a download from
`INCEPTION_URL` at start-up; when none works, a one-line error before anything
is trained or sampled.
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import socket
import time
import warnings
from pathlib import Path, PurePath

import torch

from ddpm_train.data import workers
from ddpm_train.data import decoding
from ddpm_train.data import sources
from ddpm_train.data import pixels
from ddpm_train.data import shapes
from ddpm_train.data import folders
from ddpm_train.data import pieces
from ddpm_train.evaluation import shapescore
from ddpm_train.errors import ConfigError

# torch-fidelity's URL_INCEPTION_V3, the file torchmetrics downloads (a test keeps them equal).
INCEPTION_URL = (
    "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth"
)
INCEPTION_FEATURES = "2048"  # the pool3 features FID is defined on
# KID keeps every feature vector; beyond this many images per side its
# estimate (subsets of KID_SUBSET_SIZE) no longer improves, memory still grows.
KID_MAX_IMAGES = 10_000
KID_SUBSET_SIZE = 1000
KID_SUBSETS = 100
REFERENCE_FILE = "fid_reference.pt"
REFERENCE_CACHE_ENV = "DDPM_TRAIN_FID_CACHE"  # the folder of the statistics every run shares (reference_root)
# A training run's FID samples and embeds max(this, --eval_batch_size) images at a time (fid_batch_size).
FID_BATCH_SIZE = 64
RESULTS_FILE = "eval_results.json"


def fid_batch_size(eval_batch_size):
    """The images a training run's evaluation generates and embeds at a time: at least FID_BATCH_SIZE."""
    return max(FID_BATCH_SIZE, eval_batch_size)


# --- the feature extractor -----------------------------------------------------------


def inception_weights(fid_weights=None):
    """Path of the Inception weights: the given file, the hub cache, or a fresh download."""
    if fid_weights is not None:
        path = Path(fid_weights).expanduser()
        if not path.is_file():
            raise ConfigError(f"--fid_weights {fid_weights}: no such file")
        return path
    cached = Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_URL.rsplit("/", 1)[1]
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(60)  # a network that drops packets fails in a minute, not never
    try:
        torch.hub.download_url_to_file(INCEPTION_URL, str(cached), progress=True)
    except Exception as e:
        raise ConfigError(
            f"FID needs the Inception weights and they could not be downloaded ({type(e).__name__}: {' '.join(str(e).split())}): "
            f"on a machine with internet download {INCEPTION_URL} and pass --fid_weights PATH"
        ) from None
    finally:
        socket.setdefaulttimeout(previous)
    return cached


def feature_extractor(fid_weights=None):
    """(Inception-v3 returning 2048 pool features for uint8 images of any size, its name)."""
    from torchmetrics.image.fid import NoTrainInceptionV3

    path = inception_weights(fid_weights)
    try:
        network = NoTrainInceptionV3(
            name="inception-v3-compat", features_list=[INCEPTION_FEATURES], feature_extractor_weights_path=str(path)
        )
    except Exception as e:
        raise ConfigError(f"cannot load Inception weights from {path} ({type(e).__name__}): pass a valid --fid_weights file") from None
    return network, f"inception-v3-compat:{INCEPTION_FEATURES}:{path.name}"


def uses_shape_score(options, fid_weights):
    """The built-in shapes are scored offline by the shape scorer, unless Inception weights are given."""
    return options.get("dataset") == shapes.BUILTIN and fid_weights is None


def extractor_for(options, image_size, fid_weights=None, device="cpu", log=print):
    """(network, name) embedding the images of a run with dataset `options` (train.py's flags):
    the shape scorer for the built-in shapes (trained once and cached, no download), else Inception."""
    if uses_shape_score(options, fid_weights):
        scorer = shapescore.load_or_train(image_size, device=device, log=log)
        return scorer, scorer.name
    return feature_extractor(fid_weights)


def uint8_batches(images, batch_size, num_workers=0):
    """uint8 batches from a (N, 3, S, S) tensor or from a dataset of such images; an image that
    cannot be decoded is left out with a warning, as training skips it."""
    return (batch for batch, _ in indexed_batches(images, batch_size, num_workers))


def indexed_batches(images, batch_size, num_workers=0):
    """uint8_batches' batches, each with the indices in `images` of the images it holds (LongTensor)."""
    if isinstance(images, torch.Tensor):
        for start in range(0, len(images), batch_size):
            batch = images[start : start + batch_size]
            yield batch, torch.arange(start, start + len(batch))
        return
    unreadable = decoding.Unreadable()
    loader = torch.utils.data.DataLoader(images, batch_size=batch_size, num_workers=num_workers, collate_fn=decoding.collate_decoded)
    start = 0
    for batch, errors, decoded in workers.iterate(loader):
        unreadable.report(errors)
        if batch is not None:
            yield batch, torch.arange(start, start + len(decoded))[decoded]
        start += len(decoded)


@contextlib.contextmanager
def _no_tf32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def rgb8(images):
    """Images (B, C, S, S) as the 8-bit RGB images Inception takes: 16 bits rounded to 8, a grayscale channel
    repeated in three, an alpha channel composited over black (the colour of a transparent pixel says nothing)."""
    images = pixels.eight_bit(images)
    if images.shape[1] == 1:
        return images.expand(-1, 3, -1, -1)
    if images.shape[1] == 4:
        return (images[:, :3].float() * images[:, 3:].float() / 255).round().to(torch.uint8)
    return images


def embedded(extractor, indexed, device):
    """(features (B, D) in float64 on `device`, indices) of each (uint8 batch, indices) of `indexed`.

    TF32 is off while the extractor runs, so the features (and the FID) do not
    depend on whether training allowed it.
    """
    extractor = extractor.to(device).eval()
    for batch, index in indexed:
        with torch.no_grad(), _no_tf32():
            features = extractor(rgb8(batch.to(device))).double()
        yield features, index


def embed(extractor, batches, device):
    """Features (N, D) in float64 on the CPU of every uint8 batch."""
    return torch.cat([features.cpu() for features, _ in embedded(extractor, ((b, None) for b in batches), device)])


# --- the metrics ---------------------------------------------------------------------


class _Precomputed(torch.nn.Module):
    """The "feature extractor" torchmetrics gets: the features are already computed."""

    def __init__(self, num_features):
        super().__init__()
        self.num_features = num_features

    def forward(self, features):
        return features


def _fid_metric(num_features):
    from torchmetrics.image.fid import FrechetInceptionDistance

    # sync_on_compute=False: only the main process evaluates; a sync would wait for the others forever.
    # (Its feature sums are float64 already.)
    return FrechetInceptionDistance(feature=_Precomputed(num_features), reset_real_features=False, sync_on_compute=False)


class Reference:
    """The reference set's statistics: FID's feature sums (all images) and KID's features (up to KID_MAX_IMAGES)."""

    FID_STATES = ("real_features_sum", "real_features_cov_sum", "real_features_num_samples")

    def __init__(self, fid_state, kid_features, key):
        self.fid_state, self.kid_features, self.key = fid_state, kid_features, key

    @classmethod
    def from_features(cls, features, key):
        """The statistics of the reference images' `features` (N, D)."""
        statistics = _Statistics(len(features))
        statistics.add(features, torch.arange(len(features)))
        return statistics.reference(key)

    @classmethod
    def of_images(cls, images, extractor, device, batch_size, key, num_workers=0):
        """The statistics of `images` (a uint8 tensor or a dataset), embedded batch by batch: what is held is
        FID's sums (D x D) and KID's subset, not every image's features (21 GB for ImageNet's 1.28M)."""
        return statistics_of_share(images, extractor, device, batch_size, num_workers).reference(key)

    @property
    def num_images(self):
        return int(self.fid_state["real_features_num_samples"])

    def save(self, path):
        """Written whole or not at all, also when two runs write the same file at once (a file each, renamed)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = folders.temporary(path)
        try:
            torch.save(dict(key=self.key, fid_state=self.fid_state, kid_features=self.kid_features), tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path, key, ignore=()):
        """The cached reference at `path` if it was computed for `key` (its entries named in `ignore` aside),
        else None; also None for a file that cannot be read as one (it is computed again)."""
        if not path.is_file():
            return None
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            found = cls(saved["fid_state"], saved["kid_features"], saved["key"])
        except Exception as e:
            warnings.warn(f"{path} cannot be read as FID reference statistics ({type(e).__name__}): computing them again")
            return None
        same = {k: v for k, v in found.key.items() if k not in ignore} == {k: v for k, v in key.items() if k not in ignore}
        return found if same else None

    def scores(self, features, device="cpu"):
        """{'fid', 'kid_mean', 'kid_std'} of generated-image `features` (N, D) against this reference."""
        generated = Generated()
        generated.add(features.to(device))
        return generated.scores(self, device)


class Generated:
    """Generated images' features taken a batch at a time (`add`), scored against a Reference at the end: what
    is held is FID's sums of them, the first KID_MAX_IMAGES features for KID and, with the shape scorer, each
    image's validity and kind, never every feature (800 MB in float64 at FID-50k)."""

    def __init__(self, scorer=None):
        self.scorer, self.fid, self.kid, self.num_kid = scorer, None, [], 0
        self.valid, self.kinds, self.labels = [], [], []

    def add(self, features, labels=None):
        """`features` (B, D) of B generated images, and the labels they were asked for (a conditional run's)."""
        if self.fid is None:
            self.fid = _fid_metric(features.shape[1]).to(features.device)
        self.fid.update(features.double(), real=False)
        if self.num_kid < KID_MAX_IMAGES:
            self.kid.append(features[: KID_MAX_IMAGES - self.num_kid].float().cpu())
            self.num_kid += len(self.kid[-1])
        if self.scorer is not None:
            with torch.no_grad():
                scorer = self.scorer.to(features.device)
                self.valid.append(scorer.valid(features).cpu())
                if labels is not None:
                    self.kinds.append(scorer.single_kind(features).cpu())
                    self.labels.append(labels.cpu())

    def scores(self, reference, device="cpu"):
        """{'fid', 'kid_mean', 'kid_std'} of the images added, against `reference`; with the shape scorer also
        `valid_fraction`, and with labels `class_match` and `class_match_chance` (score).

        Computed on `device`: KID's kernels are a few TFLOP at 10k images, a GPU's work.
        """
        from torchmetrics.image.kid import KernelInceptionDistance

        if self.num_images < 2:
            raise ConfigError(f"FID needs at least 2 generated images (got {self.num_images})")
        fid = self.fid.to(device)
        for name, value in reference.fid_state.items():
            setattr(fid, name, value.clone().to(device))
        fake = torch.cat(self.kid)
        subset = min(KID_SUBSET_SIZE, len(fake), len(reference.kid_features))
        with warnings.catch_warnings():  # that KID keeps every feature is why KID_MAX_IMAGES exists
            warnings.filterwarnings("ignore", "Metric `Kernel Inception Distance` will save all extracted features")
            kid = KernelInceptionDistance(
                feature=_Precomputed(fake.shape[1]), subsets=KID_SUBSETS, subset_size=subset, sync_on_compute=False
            )
        kid.update(reference.kid_features.to(device), real=True)
        kid.update(fake.to(device), real=False)
        # KID draws its subsets with the global RNG: a private, seeded one keeps the
        # score reproducible and leaves the training's random stream untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            kid_mean, kid_std = kid.compute()
        result = dict(fid=float(fid.compute()), kid_mean=float(kid_mean), kid_std=float(kid_std))
        if self.valid:
            result["valid_fraction"] = float(torch.cat(self.valid).float().mean())
        if self.kinds:
            kinds, labels = torch.cat(self.kinds), torch.cat(self.labels)
            result["class_match"] = float((kinds == labels).float().mean())
            result["class_match_chance"] = chance_match(kinds, labels)
        return result

    @property
    def num_images(self):
        return 0 if self.fid is None else int(self.fid.fake_features_num_samples)


class _Statistics:
    """Reference statistics made a batch at a time: FID's sums over every image, and the features of KID's
    subset, a fixed random one of the `num_images` items (so that KID does not see only the dataset's first
    files), kept by the images' indices: the same subset however the images come in batches. The subset's
    rows are one tensor, filled in place: a list of each batch's few rows grew the heap with the dataset
    (fragments between the batches' features: 1.1 GB more at 100k images)."""

    def __init__(self, num_images):
        self.keep = torch.zeros(num_images, dtype=torch.bool)
        self.keep[torch.randperm(num_images, generator=torch.Generator().manual_seed(0))[:KID_MAX_IMAGES]] = True
        self.row = self.keep.cumsum(0) - 1  # item i's row in the subset, if kept
        self.fid, self.kid, self.filled = None, None, torch.zeros(int(self.keep.sum()), dtype=torch.bool)

    def _allocate(self, num_features, device):
        if self.fid is None:
            self.fid = _fid_metric(num_features).to(device)
            self.kid = torch.zeros(len(self.filled), num_features)

    def add(self, features, index):
        """`features` (B, D) of the images of indices `index` (B,)."""
        self._allocate(features.shape[1], features.device)
        self.fid.update(features.double(), real=True)
        kept = self.keep[index]
        if kept.any():
            rows = self.row[index[kept]]
            self.kid[rows] = features[kept.to(features.device)].float().cpu()
            self.filled[rows] = True

    def sum_to_first(self, group):
        """Every process's statistics (of its share of the images) summed into rank 0's through `group` (gloo:
        CPU tensors): FID's sums, and KID's rows, each filled by the one process whose share held its image."""
        dist = torch.distributed
        width = torch.tensor(0 if self.kid is None else self.kid.shape[1])
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)  # 0 where a share had no readable image
        self._allocate(int(width), "cpu")
        for name in Reference.FID_STATES:
            value = getattr(self.fid, name)
            total = value.cpu()
            dist.reduce(total, dst=0, group=group)
            setattr(self.fid, name, total.to(value.device))
        filled = self.filled.to(torch.uint8)
        dist.reduce(self.kid, dst=0, group=group)
        dist.reduce(filled, dst=0, group=group)
        self.filled = filled.bool()

    def reference(self, key):
        found = 0 if self.fid is None else int(self.fid.real_features_num_samples)
        if found < 2:
            raise ConfigError(f"FID needs at least 2 reference images (the dataset has {found})")
        state = {name: getattr(self.fid, name).clone().cpu() for name in Reference.FID_STATES}
        return Reference(state, self.kid[self.filled], key)  # less the kept items that did not decode


def statistics_of_share(images, extractor, device, batch_size, num_workers=0, rank=0, world=1, group=None):
    """The reference statistics (_Statistics) of share `rank` of `world` of `images` (contiguous), summed over the
    processes into rank 0's through `group` when `world` > 1: every process embeds its share, and rank 0's
    `.reference(key)` is that of all the images, as one process makes it (to float64 rounding)."""
    statistics = _Statistics(len(images))
    start, stop = len(images) * rank // world, len(images) * (rank + 1) // world
    if (start, stop) != (0, len(images)):
        images = images[start:stop] if isinstance(images, torch.Tensor) else torch.utils.data.Subset(images, range(start, stop))
    for features, index in embedded(extractor, indexed_batches(images, batch_size, num_workers), device):
        statistics.add(features, index + start)
    if world > 1:
        statistics.sum_to_first(group)
    return statistics


def reference_root():
    """Where the reference statistics of every run are shared: $DDPM_TRAIN_FID_CACHE, else
    $XDG_CACHE_HOME/ddpm-train/fid, else ~/.cache/ddpm-train/fid (beside the latent caches)."""
    if os.environ.get(REFERENCE_CACHE_ENV):
        return Path(os.environ[REFERENCE_CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddpm-train" / "fid"


def shared_reference_path(key):
    """The file of `key`'s statistics in reference_root(): named by a hash of the key."""
    return reference_root() / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]}.pt"


def cached_reference(folder, key, get_images, extractor, device, batch_size, num_workers=0, log=print):
    """The reference statistics of `get_images()` for `key`: read from folder/fid_reference.pt, else from the
    cache every run shares (shared_reference_path; linked into the folder), else computed and kept in both
    (kept_reference), so that the next run on the same images reads them: one process's way."""
    reference = found_reference(folder, key, log)
    if reference is None:
        images = get_images()
        log(computing_line(len(images), key))
        reference = kept_reference(Reference.of_images(images, extractor, device, batch_size, key, num_workers), folder, log)
    return reference


def found_reference(folder, key, log=print):
    """The statistics of `key` from folder/fid_reference.pt, else from the cache every run shares (then linked
    into the folder), else None. `folder` None: the shared cache alone."""
    path, shared = _run_file(folder), shared_reference_path(key)
    reference = Reference.load(path, key) if path else None
    if reference is None:
        reference = Reference.load(shared, key)
        if reference is not None:
            log(f"FID reference statistics of {reference.num_images} images read from {shared} (an earlier run's)")
            if path:
                _linked_or_saved(reference, shared, path)
    return reference


def claimed_reference(folder, key, log=print):
    """found_reference's statistics, else this run's claim to make them: (reference, None), or (None, claims) where
    it makes them (claims.close() once they are kept, or on failure). Runs started together on new images (a sweep)
    make them once: a run that finds another live run's claim (pieces.Claims, in the shared cache) waits for its
    statistics, and makes them itself if that run dies."""
    shared, claims, said = shared_reference_path(key), None, False
    while True:
        reference = found_reference(folder, key, log)
        if reference is not None:
            if claims is not None:
                claims.close()
            return reference, None
        if claims is not None and claims.held:
            return None, claims  # claimed, and looked again: not made by the claimer just before
        if claims is None:
            try:
                shared.parent.mkdir(parents=True, exist_ok=True)
            except OSError:
                return None, None  # an unwritable shared folder (kept_reference warns): nothing to share
            claims = pieces.Claims(shared.parent)
        if claims.take(shared.name):
            if not claims.held:
                return None, claims  # a folder that takes no claims
            continue
        if not said:
            log(f"waiting for another run making the FID reference statistics of these images ({shared})")
            said = True
        time.sleep(pieces.CLAIM_POLL_S)


def _run_file(folder):
    return None if folder is None else Path(folder) / REFERENCE_FILE


def _linked_or_saved(reference, source, path):
    """`reference` (read from the file `source`) at `path`: a hard link to `source` (no second ~110 MB on disk for
    each run of a sweep; it stays when the shared cache is cleared), else a copy (another filesystem)."""
    tmp = folders.temporary(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        reference.save(path)
        return
    os.replace(tmp, path)


def computing_line(num_images, key, processes=1):
    on = f" on {processes} processes" if processes > 1 else ""
    return f"computing FID reference statistics of {num_images} images{on} (once: cached in {shared_reference_path(key)} for every run)"


def kept_reference(reference, folder, log=print):
    """`reference`, written to the cache every run shares (a warning where it cannot be) and linked (else written)
    to folder/fid_reference.pt (`folder` None: the shared cache alone)."""
    shared, path = shared_reference_path(reference.key), _run_file(folder)
    try:
        reference.save(shared)
    except OSError as e:
        log(f"warning: cannot write {shared} ({type(e).__name__}): the next run computes them again; "
            f"${REFERENCE_CACHE_ENV} sets another folder")  # fmt: skip
        if path:
            reference.save(path)
    else:
        if path:
            _linked_or_saved(reference, shared, path)
    return reference


def reference_key(options, image_size, extractor_name, contents=None):
    """What the reference statistics depend on: the dataset options, the size, the network, and `contents`:
    what the dataset holds (dataset_contents), so that images added, removed or changed are not scored
    against statistics of the images that were there before."""
    key = {name: options.get(name) for name in ("dataset", "dataset_config", "split", "image_column")}
    folder = Path(key["dataset"]).expanduser() if key["dataset"] not in (None, shapes.BUILTIN) else None
    if folder is not None and folder.is_dir():  # one folder given as relative, absolute or through a link: one key
        key["dataset"] = str(folder.resolve())
    key["center_crop"] = center_crop(options)
    if options.get("dataset") == shapes.BUILTIN:
        key |= dict(shapes_num_images=options.get("shapes_num_images"), seed=options.get("seed"),
                    class_conditional=bool(options.get("class_conditional")))  # one shape per image when conditional
    if pixels.pixels_of(options) != pixels.Pixels():  # grayscale, 16 bits or alpha reach Inception otherwise (rgb8)
        key["pixels"] = list(pixels.pixels_of(options))
    return key | dict(image_size=image_size, extractor=extractor_name, contents=contents)


def dataset_contents(options, image_size, images=None):
    """What the images `options` name hold (sources.Images.identity: the files' names, sizes and modification
    times, or a `datasets` dataset's fingerprint), read without decoding an image; None for the built-in
    shapes, which their seed and count say. `images`: reference_images' answer, where the caller has it."""
    if options.get("dataset") == shapes.BUILTIN:
        return None
    images = reference_images(options, image_size) if images is None else images
    return images.identity(argparse.Namespace(**options))


def score(reference, extractor, extractor_name, features, device="cpu", labels=None):
    """The scores of generated-image `features` against `reference`, with the extractor's name;
    from the shape scorer also `valid_fraction`, the share it recognises as valid shape images,
    and with the `labels` the images were asked for (a conditional run on the built-in shapes,
    whose label is the kind of its one shape), `class_match`: the share recognised as showing
    that kind and no other."""
    generated = generated_by(extractor)
    generated.add(features.to(device), labels)
    return generated.scores(reference, device) | dict(extractor=extractor_name)


def generated_by(extractor):
    """An empty Generated for features of `extractor`: the shape scorer's also scored by it."""
    return Generated(extractor if isinstance(extractor, shapescore.ShapeScorer) else None)


def lowest_fid(results):
    """The result with the lowest FID of several (one per guidance scale); a NaN FID never wins."""
    return min(results, key=lambda r: (math.isnan(r["fid"]), r["fid"]))


def chance_match(kinds, labels):
    """The class match that samples blind to their labels would get: sum over classes k of
    P(asked for k) P(recognised as k), each frequency from these samples."""
    classes = int(max(kinds.max(), labels.max())) + 1
    asked = torch.bincount(labels, minlength=classes).float() / len(labels)
    shown = torch.bincount(kinds[kinds >= 0], minlength=classes).float() / len(kinds)
    return float((asked * shown).sum())


def format_scores(result):
    """One line: 'FID ...' from Inception, 'shape FD ... | valid ...' from the shape scorer."""
    shape = "valid_fraction" in result
    return (
        f"{'shape FD' if shape else 'FID'} {result['fid']:.3f} | KID {result['kid_mean']:.5f} ± {result['kid_std']:.5f} | "
        + (f"valid {result['valid_fraction']:.3f} | " if shape else "")
        + (f"class match {result['class_match']:.3f} (blind to the labels: {result['class_match_chance']:.3f}) | "
           if "class_match" in result else "")
        + f"{result['num_images']} images, {result['sampler']} {result['num_inference_steps']} steps, "
        f"against {result['reference_images']} reference images"
    )


# --- the best checkpoint -------------------------------------------------------------


class BestCheckpoint:
    """Keeps in `folder` the pipeline with the lowest FID so far, with its scores in eval.json.

    The best FID survives a restart: it is read back from folder/eval.json.
    """

    def __init__(self, folder):
        self.folder = Path(folder)
        scores = self.folder / "eval.json"
        self.best_fid = json.loads(scores.read_text())["fid"] if scores.is_file() else float("inf")

    def offer(self, result, save):
        """Keep `save(folder)`'s output if result['fid'] is the lowest yet (a NaN never is). True if kept."""
        if not result["fid"] < self.best_fid:
            return False
        tmp = self.folder.with_name(f".tmp-{self.folder.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save(tmp)
        (tmp / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        shutil.rmtree(self.folder, ignore_errors=True)  # the old best goes only once the new one is complete
        os.replace(tmp, self.folder)
        self.best_fid = result["fid"]
        return True


# --- during training -----------------------------------------------------------------


class TrainingEvaluator:
    """FID and KID of the EMA weights every --eval_every_epochs, for train.py (main process only).

    Creating it loads the Inception network, so missing weights stop the run
    before training; on the built-in shapes it loads (or trains, once) the shape
    scorer instead. Results go to eval_results.json in the run folder; the best
    pipeline by FID (the shape FD) to best/.
    """

    def __init__(self, args, output_dir, device, log=print):
        self.args, self.output_dir, self.device, self.log = args, Path(output_dir), device, log
        self.extractor, self.extractor_name = extractor_for(vars(args), args.image_size, args.fid_weights, device, log)
        self.best = BestCheckpoint(self.output_dir / "best")
        self.reference, self.claims = None, None  # claims: to make the statistics (claimed_reference)

    def find_reference(self, contents=None):
        """Whether the training set's statistics were made before (by this run or another: found_reference);
        they are then `self.reference`. `contents`: dataset_contents' answer where the caller has it, else None."""
        options, size = vars(self.args), self.args.image_size
        contents = dataset_contents(options, size) if contents is None else contents
        self.reference_key = reference_key(options, size, self.extractor_name, contents)
        self.reference, self.claims = claimed_reference(self.output_dir, self.reference_key, self.log)
        return self.reference is not None

    def keep_reference(self, statistics):
        """The training set's statistics from `statistics` (_Statistics: this process's, or every process's
        summed into it), kept (kept_reference)."""
        self.reference = kept_reference(statistics.reference(self.reference_key), self.output_dir, self.log)

    def release(self):
        """Give up the claim to make the statistics (claimed_reference), made or not: another run may make them."""
        if self.claims is not None:
            self.claims.close()
            self.claims = None

    def evaluate(self, batches_for, scales, sampler, num_inference_steps, epoch, step, save_pipeline, labels=None):
        """Score the uint8 batches `batches_for(w)` generates (--eval_num_samples images) at each guidance
        scale w of `scales`, record them; returns the result dict: the best scale's scores, and with
        several scales, every scale's under "scales".

        The caller generates them (train.py, through sampling.generate_batches), so that
        this module needs nothing of the samplers.
        """
        scores = []
        for w in scales:
            generated, done = generated_by(self.extractor), 0
            for features, _ in embedded(self.extractor, ((batch, None) for batch in batches_for(w)), self.device):
                generated.add(features, None if labels is None else labels[done : done + len(features)])
                done += len(features)
            found = generated.scores(self.reference, self.device) | dict(extractor=self.extractor_name)
            scores.append(dict(guidance_scale=w, **found, num_images=generated.num_images))
        best = lowest_fid(scores)
        result = dict(
            epoch=epoch, step=step, **best,
            sampler=sampler, num_inference_steps=num_inference_steps, reference_images=self.reference.num_images,
        )  # fmt: skip
        if len(scores) > 1:
            result["scales"] = scores
        result["best"] = self.best.offer(result, save_pipeline)
        self._record(result)
        return result

    def _record(self, result):
        """Append to eval_results.json; entries from an abandoned later run (before a resume) are dropped."""
        path = self.output_dir / RESULTS_FILE
        results = json.loads(path.read_text()) if path.is_file() else []
        results = [r for r in results if r["step"] < result["step"]] + [result]
        path.write_text(json.dumps(results, indent=2) + "\n")


# --- sample.py --fid -----------------------------------------------------------------


class SampleEvaluation:
    """`sample.py --fid`: collects the generated images' features, scores them at the end.

    The reference defaults to the run's training set, whose statistics train.py
    cached in the run folder when it evaluated during training. Statistics
    found nowhere are `None` until `keep_reference` is given them (sample.py
    makes them: a share on each process).
    """

    def __init__(self, run_dir, run_folder, run_config, args, image_size, log=print):
        """`run_folder` and `run_config`: the training run `run_dir` belongs to, and its
        train_config.json (None for a bare pipeline folder)."""
        self.options, self.device, self.log = reference_options(run_dir, run_folder, run_config, args), args.device, log
        self.extractor, self.extractor_name = extractor_for(self.options, image_size, args.fid_weights, self.device, log)
        self.folder, self.key = Path(run_folder or run_dir), reference_key(self.options, image_size, self.extractor_name)
        # The run's own training set: the statistics cached while it trained are of the images it trained on,
        # whatever its folder holds now, whether this machine has it, or where it is seen from. Another
        # --dataset's statistics stay out of the run's folder (in the shared cache alone).
        self.reference = self._own_reference() if args.dataset is None else None
        if args.dataset is not None:
            self.folder = None
        self.images, self.claims = None, None  # a dataset's images, opened once: for the key, and to embed on a miss
        if self.reference is None:
            if self.options.get("dataset") != shapes.BUILTIN:
                self.images = reference_images(self.options, image_size)
            self.key["contents"] = dataset_contents(self.options, image_size, self.images)
            self.reference, self.claims = claimed_reference(self.folder, self.key, log)
        self.generated = generated_by(self.extractor)

    def _own_reference(self):
        """The run folder's statistics of its training set: its name as train.py resolved it (reference_key), or as
        given, relative, and seen from another directory or machine, where it does not resolve to the same folder."""
        found = Reference.load(self.folder / REFERENCE_FILE, self.key, ignore=("contents", "dataset"))
        given = PurePath(self.key["dataset"])
        if found is None or found.key["dataset"] == self.key["dataset"]:
            return found
        return found if not given.is_absolute() and PurePath(found.key["dataset"]).parts[-len(given.parts) :] == given.parts else None

    def keep_reference(self, statistics):
        """The reference statistics from `statistics` (_Statistics, summed over the processes), kept (kept_reference)."""
        self.reference = kept_reference(statistics.reference(self.key), self.folder, self.log)

    release = TrainingEvaluator.release

    def add(self, images, labels=None):
        for features, _ in embedded(self.extractor, [(images, None)], self.device):
            self.generated.add(features, labels)

    def result(self):
        """The scores of the images added since the last result."""
        generated, self.generated = self.generated, generated_by(self.extractor)
        scores = generated.scores(self.reference, self.device) | dict(extractor=self.extractor_name)
        return scores | dict(reference_images=self.reference.num_images)


def reference_options(run_dir, run_folder, run_config, args):
    """The dataset flags of sample.py --fid's reference images: the run's training set (`run_config`, its
    train_config.json), else --dataset's (with --dataset_config, --split, --image_column)."""
    if args.dataset is None and run_folder is None:
        raise ConfigError(f"{run_dir} has no train_config.json to take the training set from: pass --dataset")
    if args.dataset is None:
        return run_config  # the training set, loaded as it was for training
    return dict(
        dataset=args.dataset, dataset_config=args.dataset_config, split=args.split or "train",
        image_column=args.image_column, augment="none", shapes_num_images=2048, seed=0,
    )  # fmt: skip


def center_crop(options):
    """Whether the images of `options` (train.py's flags, or a run's train_config.json) are cropped at the
    centre: --augment without crop; an older run's file without --augment says it as its center_crop."""
    if options.get("augment") is not None:
        return "crop" not in str(options["augment"]).split(",")
    return options.get("center_crop", True)


def reference_images(options, image_size):
    """The images `options` (train.py's dataset flags) name, at `image_size`: a tensor or a dataset.

    A conditional run on the built-in data trains on one shape per image: those are its reference."""
    if options["dataset"] == shapes.BUILTIN:
        conditional = bool(options.get("class_conditional"))
        return shapes.builtin_images(options["shapes_num_images"], image_size, options["seed"], conditional)[0]
    return sources.open_dataset(
        options["dataset"], image_size, center_crop(options), options.get("dataset_config"),
        options.get("split") or "train", options.get("image_column"), pixels=pixels.pixels_of(options),
    )  # fmt: skip
