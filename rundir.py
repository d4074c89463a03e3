"""Run directories: what a training run leaves on disk, found and read back.

A run's --output_dir holds train_config.json (every flag, what train.py derived, and its settings), its
checkpoints (checkpoints/checkpoint-STEP), and once trained its network: a DDPMPipeline, or
for an EDM run the network alone in unet/ (no diffusers pipeline samples it). `RunDir` takes
any of these folders (the run, `best/`, an `ema.py reconstruct` output, one checkpoint), reads
the run's config once, and loads its network: the EMA weights or the raw ones.
"""

import contextlib
import json
from pathlib import Path

import torch
from diffusers import DDPMPipeline
from diffusers.utils import logging as diffusers_logging
from safetensors.torch import load_file

import latents
import model as models
from checkpoint import checkpoint_dirs
from errors import ConfigError

CONFIG_FILE = "train_config.json"


def find_run_folder(path):
    """The training run folder that `path` (a run, pipeline or checkpoint folder) belongs to, or None."""
    path = Path(path)
    candidates = [path, *path.parents][:3]  # run/, run/best/, run/checkpoints/checkpoint-N/
    return next((folder for folder in candidates if (folder / CONFIG_FILE).is_file()), None)


def find_run_config(path):
    """The train_config.json of the run that `path` belongs to, or None."""
    return RunDir(path).config


def kept_ema(config):
    """Whether a run with train_config.json `config` kept an EMA of its weights (True when unknown): its
    --ema is not none; a run of before --ema none wrote its --use_ema flag beside an `ema` that named the
    kind only, and config.resolve of before issue 37 wrote use_ema too: where there is one, it decides."""
    config = config or {}
    if config.get("use_ema") is not None:
        return bool(config["use_ema"])
    return config.get("ema") in (None, "standard", "power")


def newest_checkpoint(run_dir):
    found = checkpoint_dirs(run_dir)  # complete ones only
    return found[-1] if found else None


def resolve_source(path):
    """('pipeline' or 'checkpoint', folder) for what `path` names.

    A pipeline is a DDPMPipeline folder, or (an EDM run's network, which no
    diffusers pipeline holds) a folder with the network in unet/.
    """
    path = Path(path)
    if (path / "model_index.json").is_file() or (path / "unet" / "config.json").is_file():
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
    for path in sorted(Path(checkpoint).glob("custom_checkpoint_*.pkl")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        if isinstance(state, dict) and "shadow_params" in state:
            return state["shadow_params"]
        if isinstance(state, dict) and "shadows" in state:
            return state["shadows"][0]
    return None


@contextlib.contextmanager
def quiet_loading():
    """No "Loading pipeline components" bar: an error after it should be the only line on stderr."""
    was_enabled = diffusers_logging.is_progress_bar_enabled()
    diffusers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            diffusers_logging.enable_progress_bar()


def save_network(unet, folder, noise_scheduler=None):
    """What RunDir.load reads back: a DDPMPipeline in `folder` (a DDPM run: pass its
    `noise_scheduler`), or the network alone in folder/unet (an EDM run: no diffusers
    pipeline samples it; model.load_network reads it)."""
    if noise_scheduler is not None:
        DDPMPipeline(unet=unet, scheduler=noise_scheduler).save_pretrained(str(folder))
    else:
        unet.save_pretrained(str(Path(folder) / "unet"))


class RunDir:
    """A run, pipeline or checkpoint folder, with the config of the run it belongs to read once.

    `config` is None for a folder outside any run (a pipeline saved elsewhere).
    """

    def __init__(self, path):
        self.path = Path(path)
        self.folder = find_run_folder(self.path)
        self.config = json.loads((self.folder / CONFIG_FILE).read_text()) if self.folder else None

    def get(self, key, default=None):
        return (self.config or {}).get(key, default)

    def setting(self, name, default):
        """A setting of the run (config.SETTINGS), as models.run_setting reads it; `default` outside a run."""
        return models.run_setting(self.config or {}, name, default)

    @property
    def objective(self):
        """The training objective: train_config.json's "objective", else "ddpm"."""
        return self.get("objective", "ddpm")

    @property
    def kept_ema(self):
        return kept_ema(self.config)

    def load(self, ema=None):
        """(network in eval mode, training-scheduler config or None) from the pipeline or checkpoint.

        `ema`: the EMA weights (True), the raw weights (False, checkpoints only), or
        None: the EMA where the run kept one (a run trained with --ema none has
        only its raw weights, and its pipeline holds them). The scheduler config is
        None for a network saved without a DDPMPipeline (EDM runs: model.load_network
        reads unet/, a UNet2DModel or an EDM2 network).
        """
        kind, folder = resolve_source(self.path)
        if ema and not self.kept_ema:
            raise ConfigError(f"{folder}: the run kept no EMA (trained with --ema none), so it has raw weights only: drop --ema")
        if kind == "pipeline":
            return self._load_pipeline(folder, ema)
        return self._load_checkpoint(folder, ema)

    def _load_pipeline(self, folder, ema):
        if ema is False and self.kept_ema:
            raise ConfigError(
                f"{folder} is a saved pipeline, which holds the EMA weights only: "
                "for the raw weights pass a checkpoint folder (RUN_DIR/checkpoints/checkpoint-STEP) with --no-ema"
            )
        if not (folder / "model_index.json").is_file():
            return models.load_network(folder / "unet"), None
        with quiet_loading():
            pipeline = DDPMPipeline.from_pretrained(str(folder))
        return pipeline.unet.eval(), pipeline.scheduler.config

    def _load_checkpoint(self, folder, ema):
        config = self.config
        if config is None:
            raise ConfigError(f"{folder}: no train_config.json in the run folder above it, so the model is unknown")
        unet = models.build_run_network(config)
        weights = folder / "model.safetensors"
        if not weights.is_file():
            raise ConfigError(f"{folder}: no model.safetensors in the checkpoint")
        unet.load_state_dict(load_file(str(weights)))
        if self.kept_ema and ema is not False:
            shadow = ema_weights_from_checkpoint(folder)
            if shadow is None:
                raise ConfigError(f"{folder}: the checkpoint has no EMA weights: add --no-ema for its raw weights")
            with torch.no_grad():
                for parameter, value in zip(unet.parameters(), shadow, strict=True):
                    parameter.copy_(value)
        if config.get("objective", "ddpm") == "edm":
            return unet.eval(), None
        return unet.eval(), models.run_noise_scheduler(config).config


    def decoder(self, device="cpu"):
        """A latent run's latents -> images in [-1, 1], through the VAE its train_config.json records
        (loaded now, on `device`) and its normalisation; None for a run on pixels."""
        record = self.get("latents")
        if not record:
            return None
        vae = latents.load_vae(record["vae"], record.get("subfolder")).to(device)
        if latents.vae_identity(vae)["encoder_sha256"] != record["encoder_sha256"]:
            raise ConfigError(
                f"the VAE at {record['vae']} is not the one {self.folder} was trained on (its encoder's weights "
                "differ): put that VAE back there"
            )
        return lambda z: latents.decode(vae, z, record["normalization"])


def load_model(path, ema=None):
    """RunDir(path).load(ema): (network in eval mode, training-scheduler config or None)."""
    return RunDir(path).load(ema)
