"""A VAE for latent diffusion: found and loaded (a folder, a pipeline's vae/, a Hub id), what a run reads of it
before any weights load (its factor, channels, scaling), its identity for the latent cache's key, and the latents'
normalisation and decoding. latents.py caches what it encodes; train.py, sample.py and rundir.py load and decode
with this. The API:

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
    latent_size(image_size, factor)         the denoiser's size (sizes: a side or "WxH"): image_size / factor, checked
    vae_identity(vae) -> dict               what the latents depend on: class, config, encoder weights' hash
    normalization(cache, vae, kind="vae", target_std=1.0) -> dict
        The per-channel normalisation as a record for the run's config: kind "vae" (the VAE config's
        scaling_factor and shift_factor, or latents_mean/latents_std) or "dataset" (the cache's own
        per-channel mean and std); `shift`, `scale` (normalised = (z - shift) * scale), the numbers
        they came from, and `normalized_std`, the std of each channel after it on this dataset.
    normalize(z, record) / denormalize(z, record)   (…, C, h, w) tensors, per channel
    decode(vae, latents, record, batch_size=None) -> images in [-1, 1]  (denormalises, then decodes, at most
        ENCODE_PIXELS image pixels at once unless batch_size says)

Normalisation: "vae" uses the VAE's own constants, (z - shift_factor) * scaling_factor (diffusers'
convention: Stable Diffusion's 0.18215; SD3's and FLUX's shift too), or (z - latents_mean) *
scaling_factor / latents_std where the config has per-channel latents_mean and latents_std (as
diffusers' SDXL pipeline does then). A config.json that does not set scaling_factor (diffusers then fills a default
that belongs to another VAE) is refused for "vae": use "dataset". "dataset" uses the per-channel mean
and std of the training latents as drawn (both orientations, the posterior noise included), computed
while encoding. `target_std` scales either to the std the objective expects (1 for DDPM; EDM2 trains
its latents at sigma_data = 0.5).
"""

import contextlib
import hashlib
import json
import re
from pathlib import Path

import torch

from ddpm_train import sizes
from ddpm_train.errors import ConfigError, first_line

# Images through the encoder at once, by their pixels (32 at 256px, 8 at 512px): a bound on its activations,
# which grow with the pixels, whatever the batches `images` come in (measured: docs/latents.md).
ENCODE_PIXELS = 32 * 256 * 256


VAE_CLASSES = ("AutoencoderKL", "AutoencoderTiny")


# Config fields that leave the raw latents as they are (the cache holds raw latents): not in the key.
NORMALISATION_FIELDS = ("scaling_factor", "shift_factor", "latents_mean", "latents_std", "force_upcast")


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


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
        reason = first_line(e, 200)
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
        raise _Unreachable(first_line(e)) from None
    finally:
        hub_logger.setLevel(level)


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
                in_channels=int(config.get("in_channels", 3)), scaling_factor=config.get("scaling_factor") is not None)  # fmt: skip


def is_tiny(vae):
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
    height, width = sizes.height_width(image_size)
    if height % factor or width % factor:
        down = sizes.of(height // factor * factor, width // factor * factor)
        up = sizes.of(-(-height // factor) * factor, -(-width // factor) * factor)
        nearest = f"{down} or {up}" if min(sizes.height_width(down)) else str(up)
        raise ConfigError(
            f"--image_size {image_size} is not a multiple of the VAE's factor {factor} (its latents would not "
            f"tile the image): use {nearest}"
        )


def latent_size(image_size, factor):
    check_image_size(image_size, factor)
    return sizes.divided(image_size, factor)


def hash_tensors(named):
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
        encoder_sha256=hash_tensors(sorted(named, key=lambda x: x[0])),
    )


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


def decode(vae, latents, record, batch_size=None):
    """Images in [-1, 1] (B, 3, H, W) on the latents' device, from normalised latents, `batch_size` at a time:
    by default as many as make ENCODE_PIXELS image pixels (the VAE's factor times the latents' side, squared),
    the bound encoding keeps."""
    if batch_size is None:
        side = latents.shape[-1] * vae_factor(vae)
        batch_size = max(1, ENCODE_PIXELS // side**2)
    param = next(vae.parameters())
    out = []
    with torch.no_grad(), no_cudnn_benchmark():
        for part in latents.split(batch_size):
            z = denormalize(part.float(), record).to(device=param.device, dtype=param.dtype)
            out.append(vae.decode(z).sample.float().clamp(-1, 1).to(latents.device))
    return torch.cat(out)


@contextlib.contextmanager
def no_cudnn_benchmark():
    """cuDNN's heuristic choice of convolution algorithms, not its benchmark, inside. For each new shape the
    benchmark allocates one workspace as large as the largest any candidate algorithm asks for, up to all the
    GPU memory free (PyTorch's cudnn/Conv_v8.cpp, generate_and_filter_plans), and allocated it counts in the
    run's peak. The VAE's large convolutions (256 channels at 256px) are where that can take many GiB, for a
    few calls a run: they are not worth timing (docs/performance.md, Memory)."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before
