"""Latent diffusion's data: a VAE, the dataset encoded once to latents and cached, normalised draws.

The core of issue 34, on its own: train.py, data.py and sample.py call it. The API:

    load_vae(id_or_path, subfolder=None) -> vae
        A diffusers AutoencoderKL, or AutoencoderTiny where that is what the folder holds (config.json's
        `_class_name`), loaded by the real `from_pretrained`: from a folder, else its `vae/` subfolder (a
        pipeline's layout), else a Hub id. `vae.latents_source` = {"vae": id_or_path, "subfolder": ...}.
        Bad inputs are a one-line ConfigError: no such folder, a folder (or Hub repo) holding no VAE, a
        Hub id that cannot be had offline (DownloadNeeded: `hf download ID --local-dir DIR`, then `--vae DIR`).
    locate_vae(id_or_path, subfolder=None) -> (class name, source, subfolder, config)   no weights read
    vae_settings(id_or_path, subfolder=None) -> dict   factor, channels, scaling_factor (set or not), from
        the config.json alone: what a run's configuration needs before any weights load
    parse_vae_flag(text) -> (id_or_path, normalisation or None)   `--vae ID_OR_PATH[,vae|dataset]`
    vae_factor(vae) -> int                  the encoder's spatial downsampling (8 for SD's VAE and TAESD)
    latent_channels(vae) -> int             channels of a latent (the denoiser's in and out channels)
    check_image_size(image_size, factor)    ConfigError unless the factor divides the image size
    latent_size(image_size, factor) -> int  the denoiser's resolution: image_size // factor, checked
    vae_identity(vae) -> dict               what the latents depend on: class, config, encoder weights' hash
    cache_key(dataset, vae, image_size, center_crop=True, flips=True) -> dict
        The cache's key. `dataset` is whatever identifies the images (JSON-able: name or path, config,
        split, column, a fingerprint of the file list, shapes' seed and count...): the caller's choice.
    cache_root(root=None) -> Path           where caches live (below)
    cached_latents(vae, images, key, root=None, max_gib=8.0, device=None, num_images=None,
                   progress=True, log=print) -> LatentCache
        The cache of `key`, read when it is there (one line says so; `images` is not touched), else
        `images` encoded, written, and read back. `images`: an iterable of batches (B, 3, S, S) in
        [-1, 1] (or uint8), or of (images, labels) pairs, or a callable returning one (called only
        on a miss, so a hit decodes no image).
    LatentCache                             .num_images, .channels, .resolution, .labels, .stats, .meta,
                                            .path, .memmapped, .encode_seconds, .images_per_second
        .draw(indices, epoch, seed) -> (B, C, h, w) float32  raw latents, fresh per epoch (below)
    normalization(cache, vae, kind="vae", target_std=1.0) -> dict
        The per-channel normalisation as a record for the run's config: kind "vae" (the VAE config's
        scaling_factor and shift_factor, or latents_mean/latents_std) or "dataset" (the cache's own
        per-channel mean and std); `shift`, `scale` (normalised = (z - shift) * scale), the numbers
        they came from, and `normalized_std`, the std of each channel after it on this dataset.
    normalize(z, record) / denormalize(z, record)   (…, C, h, w) tensors, per channel
    decode(vae, latents, record, batch_size=32) -> images in [-1, 1]  (denormalises, then decodes)
    LatentDataset(cache, record=None, seed=0)   a torch Dataset of normalised draws: .set_epoch(epoch),
        [i] -> latent (or (latent, label)), .batch(indices) -> a batch of them, .epoch

What is stored, and why. For an AutoencoderKL the cache holds the posterior's mean and std of every
image (as EDM2 does), and each epoch draws a fresh z = mean + std * eps. With random flips on (the
`flips` of the key) it also holds the mean and std of the flipped image, and each epoch picks one of
the two orientations, because the latent of a flipped image is not the flipped latent. A convolutional
encoder commutes with flips only if every kernel is mirror-symmetric (learned ones are not) and every
downsampler samples a mirror-symmetric grid, and diffusers' KL downsamplers do not: a 3x3 stride-2
conv after padding the right and bottom edge (Downsample2D's pad (0, 1, 0, 1)) centres its outputs on
pixels 1, 3, 5, ... of its input, half an input pixel off the symmetric grid. Over SD's three halvings
the latent grid sits 3.5 image pixels off; the flipped image's latent is the flipped latent shifted
by 7 image pixels, nearly a latent pixel (the tests show a mirror-symmetric random encoder still
disagrees, and agrees once its downsampler is removed). A flipped latent is then a latent the encoder
never makes and the decoder was not trained on: training on flipped latents would teach the denoiser
samples outside what the decoder knows. Encoding both orientations costs a second
encoding, once per cache, and twice the disk, and is exact. Storing the two orientations' means alone
would lose EDM2's per-epoch posterior noise, so each orientation keeps both. So: mean and std, as
EDM2 does, and the flipped image encoded rather than the latent flipped; without flips (the cheaper
choice for a large dataset, as EDM2 trains ImageNet) one orientation is stored. An AutoencoderTiny is
deterministic: its latents alone are stored, and its draws differ between epochs only by orientation.

The array is (N, F, K, C, h, w) float32: F orientations (1, or 2 with flips: [original, flipped]), K
= 2 (mean, std) for a KL VAE or 1 (latents) for a Tiny one. A draw for image i in epoch e depends on
(seed, e, i) alone (a generator seeded by their hash), so it does not depend on the batch an image
lands in, the number of processes, or where a run resumed: a resumed run draws bit-identical latents.

The key and where the cache lives. The key (`cache_key`) is the dataset's identity as the caller
gives it, the VAE's identity, the image size, the crop and the flips, with this file's FORMAT. The
VAE's identity is its class, its config (less the fields that leave the raw latents as they are:
scaling_factor, shift_factor, latents_mean, latents_std, force_upcast, private `_` ones), its dtype, and a
SHA-256 of its encoder's weights (the parameters and buffers the latents come from: `encoder.*`,
`quant_conv.*`), not its path or Hub id: the same weights in another folder give the same latents and
reuse the cache, and a VAE fine-tuned and saved over the same folder does not (hashing the
encoder of SD's VAE, 34M parameters, takes a fraction of a second). Its path is recorded in the
cache's meta.json. A fine-tuned decoder (sd-vae-ft-mse against ft-ema) shares the encoder's latents.
The normalisation is not in the key: the cache holds raw latents, normalised as they are drawn.

Caches live in `cache_root()`: `root` (the future `--latent_cache DIR`), else $DDPM_TRAIN_LATENT_CACHE,
else $XDG_CACHE_HOME/ddpm-train/latents, else ~/.cache/ddpm-train/latents: next to the user's other
caches (~/.cache/huggingface for `datasets`, ~/.cache/torch/hub for torch hub), shared by every run
and output folder. One folder per key, named by the key's hash: latents.npy, labels.npy (when the
images came with labels), meta.json (the full key, shape, stats, encoding time). It is written in a
hidden temporary folder beside it and renamed into place when complete, so a killed encode leaves no
cache that is later read; the next encode of that key removes such leftovers of dead processes.

Memory: latents.npy is a plain .npy. It is read into memory when its size is at most `max_gib` GiB
(the in-memory budget, train.py's --preload_data MAX_GIB), memory-mapped read-only (np.load(mmap_mode="r"))
when larger, so a cache of any size trains with the page cache holding what fits.

Normalisation: "vae" uses the VAE's own constants, (z - shift_factor) * scaling_factor (diffusers'
convention: Stable Diffusion's 0.18215; SD3's and FLUX's shift too), or (z - latents_mean) *
scaling_factor / latents_std where the config has per-channel latents_mean and latents_std (as
diffusers' SDXL pipeline does then). A config.json that does not set scaling_factor (diffusers then fills a default
that belongs to another VAE) is refused for "vae": use "dataset". "dataset" uses the per-channel mean
and std of the training latents as drawn (both orientations, the posterior noise included), computed
while encoding. `target_std` scales either to the std the objective expects (1 for DDPM; EDM2 trains
its latents at sigma_data = 0.5).
"""

import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from errors import ConfigError

FORMAT = 1  # raise when what a cache holds, or how, changes
PROJECT = "ddpm-train"
CACHE_ENV = "DDPM_TRAIN_LATENT_CACHE"
VAE_CLASSES = ("AutoencoderKL", "AutoencoderTiny")
LATENTS_FILE, LABELS_FILE, META_FILE = "latents.npy", "labels.npy", "meta.json"
NPY_HEADER_BYTES = 256  # the .npy header, written before the data and filled in once the count is known
# Config fields that leave the raw latents as they are (the cache holds raw latents): not in the key.
NORMALISATION_FIELDS = ("scaling_factor", "shift_factor", "latents_mean", "latents_std", "force_upcast")
# Images through the encoder at once, by their pixels (32 at 256px, 8 at 512px): a bound on its activations,
# which grow with the pixels, whatever the batches `images` come in (measured: docs/latents.md).
ENCODE_PIXELS = 32 * 256 * 256
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_IN_PROGRESS = set()  # this process's temporary folders being written


# --- the VAE -------------------------------------------------------------------------------------


def _read_config(config_file):
    """A diffusers config.json as a dict ({} when unreadable), None when there is no such file."""
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _class_name(config):
    return str(config.get("_class_name", ""))


def _no_vae(source, where, found):
    seen = "; ".join(f"{w} is a {c}" if c else f"{w} has no _class_name" for w, c in found) or "no config.json"
    return ConfigError(
        f"--vae {source} holds no VAE ({seen}; looked in {' and '.join(where)}): point --vae at a folder with "
        "the config.json and weights of an AutoencoderKL or AutoencoderTiny, or at a pipeline folder with vae/"
    )


def _from_pretrained(class_name, source, subfolder):
    import diffusers

    try:
        vae = getattr(diffusers, class_name).from_pretrained(source, subfolder=subfolder)
    except (OSError, ValueError, RuntimeError) as e:
        reason = _first_line(e, 200)
        where = f"{source}/{subfolder}" if subfolder else source
        raise ConfigError(f"--vae {where}: cannot load the {class_name} ({reason}); check its weights") from None
    vae.eval().requires_grad_(False)
    vae.latents_source = {"vae": str(source), "subfolder": subfolder}
    return vae


class DownloadNeeded(ConfigError):
    """A Hub id whose VAE this machine cannot have (offline, unreachable, not in the local Hub cache)."""


def _download_advice(repo_id, reason):
    return DownloadNeeded(
        f"--vae {repo_id}: no such folder, and the Hugging Face Hub cannot give it ({reason}): "
        f"on a machine that reaches the Hub run `hf download {repo_id} --local-dir DIR` (add --include 'vae/*' "
        "for a pipeline), copy DIR here and pass --vae DIR"
    )


class _Unreachable(Exception):
    """The Hub could not be asked (offline, no network, gated): the reason."""


def _hub_config(repo_id, subfolder, local_only=False):
    """A Hub repo's config.json in `subfolder` as a dict (from the local Hub cache when offline or
    `local_only`), None when the repo has no such file; _Unreachable when the Hub cannot tell. The Hub
    client's retry warnings are kept quiet: the one-line error says it."""
    import logging

    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    try:
        return _read_config(Path(hf_hub_download(repo_id, "config.json", subfolder=subfolder, local_files_only=local_only)))
    except RepositoryNotFoundError:
        raise ConfigError(
            f"--vae {repo_id}: no such folder, and no such repository on the Hugging Face Hub: check the path or id"
        ) from None
    except LocalEntryNotFoundError:  # offline or unreachable, and not in the local Hub cache
        import huggingface_hub.constants as hub

        offline = "HF_HUB_OFFLINE is set" if hub.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise _Unreachable(f"{offline}, and it is not in the local Hub cache") from None
    except EntryNotFoundError:
        return None
    except Exception as e:  # a network error, a gated repo...
        raise _Unreachable(_first_line(e)) from None
    finally:
        hub_logger.setLevel(level)


def _first_line(e, limit=160):
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__


def locate_vae(id_or_path, subfolder=None):
    """(class name, source, subfolder, config dict) of the VAE `--vae` names, its config.json read and
    no weights: the folder itself, else its vae/ subfolder, else a Hub id (see the module doc)."""
    source = str(id_or_path)
    path = Path(source).expanduser()
    subfolders = [subfolder] if subfolder else [None, "vae"]
    if path.exists():
        if not path.is_dir():
            raise ConfigError(
                f"--vae {source} is a file: point it at the folder that holds the VAE's config.json and weights"
            )
        found = []
        for sub in subfolders:
            folder = path / sub if sub else path
            config = _read_config(folder / "config.json")
            if config is not None and _class_name(config) in VAE_CLASSES:
                return _class_name(config), str(path), sub, config
            if config is not None:
                found.append((f"{folder}/config.json", _class_name(config)))
        raise _no_vae(source, [str(path / s) if s else str(path) for s in subfolders], found)
    if not _HUB_ID.match(source) or ".." in source:
        raise ConfigError(f"--vae {source}: no such folder; check the path")
    found, unreachable = [], None
    for sub in subfolders:
        try:  # once the Hub proved unreachable, only the local Hub cache is asked
            config = _hub_config(source, sub, local_only=unreachable is not None)
        except _Unreachable as e:  # perhaps the other layout is in the local Hub cache
            unreachable = unreachable or str(e)
            continue
        if config is not None and _class_name(config) in VAE_CLASSES:
            return _class_name(config), source, sub, config
        if config is not None:
            found.append((f"{source}/{sub}/config.json" if sub else f"{source}/config.json", _class_name(config)))
    if unreachable:
        raise _download_advice(source, unreachable)
    raise _no_vae(source, [f"{source}/{s}" if s else source for s in subfolders], found)


def load_vae(id_or_path, subfolder=None):
    """The VAE of `--vae` (locate_vae), loaded by its class's `from_pretrained`."""
    name, source, sub, _ = locate_vae(id_or_path, subfolder)
    try:
        return _from_pretrained(name, source, sub)
    except ConfigError as e:
        if Path(source).expanduser().exists():
            raise
        raise _download_advice(source, str(e)[:160]) from None  # a Hub config in the local cache, its weights not


NORMALIZATIONS = ("vae", "dataset")


def parse_vae_flag(text):
    """`--vae ID_OR_PATH[,NORM]` -> (the VAE's id or path, NORM or None). NORM: 'vae' or 'dataset'
    (`normalization`); None leaves it to `normalization_kind`. (A Hub id holds no comma.)"""
    source, _, tail = str(text).rpartition(",")
    if source and tail.strip() in NORMALIZATIONS:
        return source, tail.strip()
    return str(text), None


def normalization_kind(settings, wanted=None):
    """The normalisation a run takes: `wanted`, else the VAE's own constants where its config.json sets a
    scaling_factor (its authors' calibration, diffusers' convention), else the dataset's mean and std."""
    kind = wanted or ("vae" if settings["scaling_factor"] else "dataset")
    if kind == "vae" and not settings["scaling_factor"]:
        raise ConfigError(
            f"--vae {settings['source']},vae: the VAE's config.json sets no scaling_factor to normalise by: "
            f"use --vae {settings['source']},dataset (its latents' own mean and std)"
        )
    return kind


def vae_settings(id_or_path, subfolder=None):
    """What a run needs to know of the VAE before loading it, from its config.json alone: its
    `factor`, latent `channels`, whether its config sets a `scaling_factor`, and where it is."""
    name, source, sub, config = locate_vae(id_or_path, subfolder)
    return dict(cls=name, source=source, subfolder=sub, factor=vae_factor(config), channels=int(config["latent_channels"]),
                scaling_factor=config.get("scaling_factor") is not None)  # fmt: skip


def _is_tiny(vae):
    return type(vae).__name__ == "AutoencoderTiny"


def vae_factor(vae):
    """How many image pixels a latent pixel spans along a side, of a VAE or of its config (a dict)."""
    config = vae if isinstance(vae, dict) else vae.config
    if "num_encoder_blocks" in config:  # AutoencoderTiny: the first encoder block keeps the size, each later one halves it
        return 2 ** (len(config["num_encoder_blocks"]) - 1)
    return 2 ** (len(config["block_out_channels"]) - 1)  # every down block but the last halves it


def latent_channels(vae):
    return int(vae.config.latent_channels)


def check_image_size(image_size, factor):
    if image_size % factor:
        lower, upper = image_size // factor * factor, (image_size // factor + 1) * factor
        sizes = f"{lower} or {upper}" if lower else str(upper)
        raise ConfigError(
            f"--image_size {image_size} is not a multiple of the VAE's factor {factor} (its latents would not "
            f"tile the image): use {sizes}"
        )


def latent_size(image_size, factor):
    check_image_size(image_size, factor)
    return image_size // factor


def _hash_tensors(named):
    h = hashlib.sha256()
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def vae_identity(vae):
    """What the cached latents depend on: class, config (less normalisation), dtype, encoder weights."""
    config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_") and k not in NORMALISATION_FIELDS}
    config = json.loads(json.dumps(config, sort_keys=True, default=str))
    tensors = list(vae.named_parameters()) + list(vae.named_buffers())
    named = [(n, t) for n, t in tensors if n.startswith(("encoder.", "quant_conv."))]
    return dict(
        cls=type(vae).__name__,
        config=config,
        dtype=str(next(vae.parameters()).dtype).removeprefix("torch."),
        encoder_sha256=_hash_tensors(sorted(named, key=lambda x: x[0])),
    )


# --- the cache's key and place ------------------------------------------------------------------


def cache_key(dataset, vae, image_size, center_crop=True, flips=True):
    """The cache's key (JSON-able). With `center_crop` False each image is cached at the one random crop
    it had while encoding (random crops are not redrawn per epoch from a cache)."""
    return dict(
        format=FORMAT,
        dataset=json.loads(json.dumps(dataset, sort_keys=True, default=str)),
        vae=vae_identity(vae),
        image_size=int(image_size),
        center_crop=bool(center_crop),
        flips=bool(flips),
    )


def _key_hash(key):
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def cache_root(root=None):
    """root, else $DDPM_TRAIN_LATENT_CACHE, else $XDG_CACHE_HOME/ddpm-train/latents, else ~/.cache/…"""
    if root:
        return Path(root).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / PROJECT / "latents"


def cache_folder(key, root=None):
    return cache_root(root) / _key_hash(key)[:32]


# --- writing -------------------------------------------------------------------------------------


def _npy_header(shape, dtype=np.float32):
    """A .npy (version 1.0) header of exactly NPY_HEADER_BYTES bytes."""
    header = repr(dict(descr=np.lib.format.dtype_to_descr(np.dtype(dtype)), fortran_order=False, shape=tuple(shape)))
    room = NPY_HEADER_BYTES - len(np.lib.format.MAGIC_PREFIX) - 2 - 2
    return np.lib.format.magic(1, 0) + room.to_bytes(2, "little") + header.ljust(room - 1).encode("latin1") + b"\n"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_leftovers(final):
    """Remove temporary folders of this key left by dead processes of this host (a killed encode)."""
    host = socket.gethostname()
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        if not tmp.name.startswith(f".{final.name}.tmp-{host}-"):
            continue  # another host's (a shared filesystem): it may be writing
        pid = tmp.name.rsplit("-", 2)[1]  # .NAME.tmp-HOST-PID-RANDOM (HOST may hold dashes)
        if not pid.isdigit():
            continue
        pid = int(pid)
        if str(tmp) in _IN_PROGRESS or (pid != os.getpid() and _alive(pid)):
            continue
        shutil.rmtree(tmp, ignore_errors=True)


def _as_input(batch):
    if batch.dtype == torch.uint8:
        return batch.float().div(127.5).sub(1)
    return batch.float()


def _encode_batch(vae, x):
    """(B, K, C, h, w) float32: posterior mean and std (KL) or the latents (Tiny)."""
    x = x.to(device=next(vae.parameters()).device, dtype=next(vae.parameters()).dtype)
    with torch.no_grad():
        if _is_tiny(vae):
            return vae.encode(x).latents.float()[:, None]
        dist = vae.encode(x).latent_dist
        return torch.stack([dist.mean, dist.std], 1).float()


def _write(vae, images, key, tmp, num_images, progress):
    """Encode `images` into the folder `tmp`; returns the meta dict written there."""
    from tqdm.auto import tqdm

    flips, size = key["flips"], key["image_size"]
    latents_file = tmp / LATENTS_FILE
    sums = None
    labels, count, shape = [], 0, None
    start = time.perf_counter()
    with open(latents_file, "wb") as f, tqdm(
        total=num_images, desc="encoding latents", unit="img", disable=not progress, leave=False, file=sys.stderr
    ) as bar:
        f.write(b"\0" * NPY_HEADER_BYTES)
        for batch in images:
            if isinstance(batch, (tuple, list)):
                batch, batch_labels = batch
                labels.append(torch.as_tensor(batch_labels).long().cpu())
            x = _as_input(batch)
            if x.shape[-2:] != (size, size):
                raise ValueError(f"images of {tuple(x.shape[-2:])} pixels for a cache of {size}x{size}")
            x = torch.cat([x, x.flip(3)]) if flips else x
            z = torch.cat([_encode_batch(vae, part) for part in x.split(max(1, ENCODE_PIXELS // size**2))])
            if flips:  # (B, 2 orientations, K, C, h, w)
                z = torch.stack(z.chunk(2), 1)
            else:
                z = z[:, None]
            z = z.cpu()
            shape = tuple(z.shape[1:])
            f.write(np.ascontiguousarray(z.numpy(), dtype="<f4").tobytes())
            # Per-channel moments of the latents as drawn: mean^2 + std^2 is E[z^2] of a draw.
            mean = z[:, :, 0].double().transpose(0, 2).flatten(1)  # (C, B*F*h*w)
            square = mean.square()
            if z.shape[2] == 2:
                square = square + z[:, :, 1].double().transpose(0, 2).flatten(1).square()
            moments = torch.stack([mean.sum(1), square.sum(1), torch.full_like(mean[:, 0], mean.shape[1])])
            sums = moments if sums is None else sums + moments
            count += len(z)
            bar.update(len(z))
        if count == 0:
            raise ValueError("no images to encode")
        f.seek(0)
        f.write(_npy_header((count, *shape)))
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    if labels:
        np.save(tmp / LABELS_FILE, torch.cat(labels).numpy())
        if len(np.load(tmp / LABELS_FILE)) != count:
            raise ValueError(f"{len(np.load(tmp / LABELS_FILE))} labels for {count} images")
    mean = sums[0] / sums[2]
    std = (sums[1] / sums[2] - mean.square()).clamp(min=0).sqrt()
    device = next(vae.parameters()).device
    meta = dict(
        key=key,
        vae_source=getattr(vae, "latents_source", None),
        shape=[count, *shape],
        layout="(N, orientations [original, flipped], [mean, std] or [latents], C, h, w)",
        stats=dict(mean=mean.tolist(), std=std.tolist()),
        encode_seconds=seconds,
        images_per_second=count / seconds if seconds > 0 else None,
        encode_device=str(device),
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    return meta


def cached_latents(vae, images, key, root=None, max_gib=8.0, device=None, num_images=None, progress=True, log=print):
    """The LatentCache of `key`: read if it is there, else `images` encoded and cached (module doc)."""
    final = cache_folder(key, root)
    cache = _read(final, key, max_gib)
    if cache is not None:
        log(
            f"latents: reusing the cache {final} ({cache.num_images} images, encoded once at "
            f"{cache.images_per_second or 0:.1f} images/s): encoding nothing"
        )
        return cache
    if device is not None:
        vae = vae.to(device)
    if callable(images):
        images = images()
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(final)
    tmp = final.parent / f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    _IN_PROGRESS.add(str(tmp))
    try:
        meta = _write(vae, images, key, tmp, num_images, progress)
        if final.exists():  # a stale or mismatched cache of this name: replace it
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if _read(final, key, max_gib) is None:  # not another process's finished cache of this key
                raise
    finally:
        _IN_PROGRESS.discard(str(tmp))
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    count, seconds = meta["shape"][0], meta["encode_seconds"]
    log(
        f"encoded {count} images to latents in {seconds:.1f} s ({count / max(seconds, 1e-9):.1f} images/s"
        f"{', both flips' if key['flips'] else ''}, on {meta['encode_device']}); cached in {final}"
    )
    return LatentCache(final, max_gib)


# --- reading and drawing ---------------------------------------------------------------------------


def _read(folder, key, max_gib):
    """The cache in `folder` if it is complete and made for `key`, else None."""
    meta_file = folder / META_FILE
    if not meta_file.is_file() or not (folder / LATENTS_FILE).is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        return None
    if json.dumps(meta.get("key"), sort_keys=True) != json.dumps(key, sort_keys=True, default=str):
        return None
    try:
        return LatentCache(folder, max_gib)
    except (OSError, ValueError):
        return None


def _item_seed(seed, epoch, index):
    digest = hashlib.blake2b(f"{int(seed)},{int(epoch)},{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class LatentCache:
    """A cache folder, read into memory or memory-mapped (above `max_gib` GiB)."""

    def __init__(self, folder, max_gib=8.0):
        self.path = Path(folder)
        self.meta = json.loads((self.path / META_FILE).read_text())
        file = self.path / LATENTS_FILE
        self.memmapped = file.stat().st_size > max_gib * 2**30
        self.array = np.load(file, mmap_mode="r" if self.memmapped else None)
        if list(self.array.shape) != self.meta["shape"]:
            raise ValueError(f"{file} holds {self.array.shape}, its meta.json says {self.meta['shape']}")
        labels = self.path / LABELS_FILE
        self.labels = torch.from_numpy(np.load(labels)) if labels.is_file() else None
        self.stats = self.meta["stats"]
        self.encode_seconds = self.meta.get("encode_seconds")
        self.images_per_second = self.meta.get("images_per_second")
        self.num_images, self.orientations, kinds, self.channels, self.resolution, _ = self.array.shape
        self.stochastic = kinds == 2  # (mean, std) of a KL VAE, else a Tiny VAE's latents

    def __len__(self):
        return self.num_images

    def draw(self, indices, epoch, seed):
        """Raw latents (B, C, h, w) of images `indices` for `epoch`: an orientation and the posterior
        noise each drawn from (seed, epoch, index) alone."""
        indices = torch.as_tensor(indices).reshape(-1).tolist()
        out = torch.empty(len(indices), self.channels, self.resolution, self.resolution)
        for row, i in enumerate(indices):
            g = torch.Generator().manual_seed(_item_seed(seed, epoch, i))
            side = int(torch.randint(self.orientations, (1,), generator=g)) if self.orientations > 1 else 0
            stored = torch.from_numpy(np.array(self.array[i, side]))  # a copy: the memmap is read-only
            if self.stochastic:
                eps = torch.randn(stored.shape[1:], generator=g)
                out[row] = stored[0] + stored[1] * eps
            else:
                out[row] = stored[0]
        return out


# --- normalisation and decoding -----------------------------------------------------------------


def _floats(x, channels):
    values = [float(v) for v in (x if isinstance(x, (list, tuple)) else [x] * channels)]
    if len(values) != channels:
        raise ConfigError(f"the VAE's config has {len(values)} per-channel values for {channels} latent channels")
    return values


def vae_constants(vae):
    """Kind "vae"'s constants from the VAE's config: scaling_factor, and latents_mean and latents_std
    (per channel) where the config sets both, else shift_factor (None where unset)."""
    config, channels = vae.config, latent_channels(vae)
    defaults = set(config.get("_use_default_values", None) or [])
    if config.get("scaling_factor") is None or "scaling_factor" in defaults:
        raise ConfigError(
            "the VAE's config.json sets no scaling_factor: normalise by the dataset's own mean and std instead"
        )
    constants = dict(scaling_factor=float(config["scaling_factor"]))
    if config.get("latents_mean") is not None and config.get("latents_std") is not None:
        return constants | dict(latents_mean=_floats(config["latents_mean"], channels),
                                latents_std=_floats(config["latents_std"], channels))  # fmt: skip
    return constants | dict(shift_factor=config.get("shift_factor"))


VAE_CONSTANTS = ("scaling_factor", "shift_factor", "latents_mean", "latents_std")


def latent_space(encoder_sha256, normalization):
    """What a latent run's network takes, as resume and guidance compare it: the encoder's weights (their
    hash: vae_identity) and the normalisation's kind, with the VAE's constants for kind "vae" (`normalization`:
    a record of `normalization()`, or the kind and vae_constants). Not the --vae text: the same weights
    spelled otherwise (another path, a `,vae` suffix) are the same latent space. A "dataset" normalisation's
    mean and std follow from the data and the encoder, both compared."""
    same = {"kind": normalization["kind"]}
    if same["kind"] == "vae":
        same |= {k: normalization[k] for k in VAE_CONSTANTS if normalization.get(k) is not None}
    return dict(encoder_sha256=encoder_sha256, normalization=same)


def recorded_latent_space(config):
    """The latent space a run's train_config.json (`config`) records: its latent_space, else (a run of before
    it) its latents record's, else None: a run on pixels."""
    if config.get("latent_space") is not None:
        return config["latent_space"]
    record = config.get("latents")
    return latent_space(record["encoder_sha256"], record["normalization"]) if record else None


def latent_space_change(saved, now):
    """A change of latent space (latent_space's, or None for pixels) in words: pixels <-> latents, another
    encoder, another normalisation."""
    if saved is None or now is None:
        return f"--vae: {'pixels' if saved is None else 'latents'} -> {'pixels' if now is None else 'latents'}"
    if saved["encoder_sha256"] != now["encoder_sha256"]:
        return (f"--vae: another VAE (its encoder's weights: SHA-256 {saved['encoder_sha256'][:12]}... -> "
                f"{now['encoder_sha256'][:12]}...)")  # fmt: skip
    return f"the latents' normalisation {saved['normalization']} -> {now['normalization']}"


def normalization(cache, vae, kind="vae", target_std=1.0):
    """The per-channel normalisation record (module doc): kind "vae" or "dataset"."""
    channels = cache.channels
    mean, std = cache.stats["mean"], cache.stats["std"]
    if kind == "vae":
        record = dict(kind="vae") | vae_constants(vae)
        factor = record["scaling_factor"]
        if "latents_mean" in record:
            shift = record["latents_mean"]
            scale = [factor * target_std / s for s in record["latents_std"]]
        else:
            shift = _floats(record["shift_factor"] or 0.0, channels)
            scale = [factor * target_std] * channels
    elif kind == "dataset":
        shift = [float(m) for m in mean]
        scale = [target_std / max(float(s), 1e-12) for s in std]
        record = dict(kind="dataset", mean=shift, std=[float(s) for s in std])
    else:
        raise ConfigError(f"latent normalisation '{kind}': use 'vae' or 'dataset'")
    normalized_std = [s * c for s, c in zip(std, scale)]
    return record | dict(shift=shift, scale=scale, target_std=float(target_std), normalized_std=normalized_std)


def _per_channel(values, z):
    return torch.tensor(values, dtype=z.dtype, device=z.device).view(-1, 1, 1)


def normalize(z, record):
    """(z - shift) * scale per channel; z is (…, C, h, w)."""
    return (z - _per_channel(record["shift"], z)) * _per_channel(record["scale"], z)


def denormalize(z, record):
    return z / _per_channel(record["scale"], z) + _per_channel(record["shift"], z)


def decode(vae, latents, record, batch_size=32):
    """Images in [-1, 1] (B, 3, H, W) on the latents' device, from normalised latents."""
    param = next(vae.parameters())
    out = []
    with torch.no_grad():
        for part in latents.split(batch_size):
            z = denormalize(part.float(), record).to(device=param.device, dtype=param.dtype)
            out.append(vae.decode(z).sample.float().clamp(-1, 1).to(latents.device))
    return torch.cat(out)


class LatentDataset(torch.utils.data.Dataset):
    """Normalised latents drawn fresh each epoch: `set_epoch(e)`, then [i] or `batch(indices)`."""

    def __init__(self, cache, record=None, seed=0):
        self.cache, self.record, self.seed, self.epoch = cache, record, seed, 0
        self.labels = cache.labels

    def set_epoch(self, epoch):
        self.epoch = int(epoch)

    def __len__(self):
        return len(self.cache)

    def batch(self, indices):
        z = self.cache.draw(indices, self.epoch, self.seed)
        return normalize(z, self.record) if self.record is not None else z

    def __getitem__(self, i):
        z = self.batch([i])[0]
        return z if self.labels is None else (z, self.labels[i])
