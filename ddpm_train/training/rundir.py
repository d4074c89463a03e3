"""Run directories: what a training run leaves on disk, found and read back.

A run's --output_dir holds train_config.json (every flag, what train.py derived, and its settings), its
checkpoints (checkpoints/checkpoint-STEP), and once trained its network: a DDPMPipeline, or
for an EDM run the network alone in unet/ (no diffusers pipeline samples it). `RunDir` takes
any of these folders (the run, `best/`, an `ema.py reconstruct` output, one checkpoint), reads
the run's config once, and loads its network: the EMA weights or the raw ones.
"""

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch

from ddpm_train.errors import ConfigError, error_line  # noqa: I001 (before diffusers: errors.py quiets what importing torchao logs)
import diffusers
from diffusers import DDPMPipeline
from diffusers.utils import logging as diffusers_logging
import safetensors.torch

from ddpm_train.data import autoencoder

from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train import sizes
from ddpm_train.training.checkpoint import checkpoint_dirs

CONFIG_FILE = "train_config.json"


def find_run_folder(path):
    """The training run folder that `path` (a run, pipeline or checkpoint folder) belongs to, or None."""
    path = Path(path)
    candidates = [path, *path.parents][:3]  # run/, run/best/, run/checkpoints/checkpoint-N/
    return next((folder for folder in candidates if (folder / CONFIG_FILE).is_file()), None)


def kept_ema(config):
    """Whether a run with train_config.json `config` kept an EMA of its weights (True when unknown): its
    --ema is not none; a run of before --ema none wrote its --use_ema flag beside an `ema` that named the
    kind only, and an older config.resolve wrote use_ema too: where there is one, it decides."""
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


# Where save_network writes a pipeline before moving it into place (hidden: not a user's file, nor a run's output).
STAGING = ".tmp-pipeline"


def pipeline_mark(pipeline):
    """The file whose presence says a saved network is whole: a DDPMPipeline's model_index.json, or the network's
    config in unet/ (train.py's Evaluation.pipeline_saved)."""
    return "model_index.json" if pipeline else "unet/config.json"


# A captioned run's diffusers pipeline: (pipeline class, its network's folder, the family and encoder it takes)
TEXT_PIPELINES = {"StableDiffusionPipeline": ("unet", "unet", "CLIP")}


def text_pipeline_parts(config, vae, encoder):
    """A captioned run's diffusers pipeline beside its network and scheduler: {"pipeline": its class name, and its
    VAE, text encoder and tokenizer}, where the pipeline samples what the run trained: Stable Diffusion's recipe (a
    UNet, a CLIP encoder, on latents scaled by the VAE's scaling_factor alone, with DDPM's objective: the pipeline's
    scheduler steps DDPM's noise); else None (sample.py samples it). diffusers has no pipeline for a captioned DiT:
    the project's own network (dit.py), not PixArt-α's."""
    normalization = (config.get("latents") or {}).get("normalization") or {}
    if not (config.get("text_encoder") and objectives.of(config.get("objective")).discrete and normalization.get("kind") == "vae"
            and not normalization.get("shift_factor") and "latents_mean" not in normalization
            and normalization.get("target_std") == 1.0):  # fmt: skip
        return None
    family = models.family_name(config["model"])
    for name, (_, wanted, words) in TEXT_PIPELINES.items():
        if family == wanted and words in type(encoder.model).__name__:
            return dict(pipeline=name, vae=vae, text_encoder=encoder.model, tokenizer=encoder.tokenizer)
    return None


def text_pipeline_of(folder):
    """The captioned-run pipeline class name folder/model_index.json names (TEXT_PIPELINES), else None."""
    index = Path(folder) / "model_index.json"
    name = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    return name if name in TEXT_PIPELINES else None


def save_network(unet, folder, noise_scheduler=None, text=None):
    """What RunDir.load reads back: a DDPMPipeline in `folder` (a DDPM run: pass its
    `noise_scheduler`), a StableDiffusionPipeline (`text`: text_pipeline_parts', with the scheduler), or the
    network alone in folder/unet (an EDM run: no diffusers pipeline samples it; model.load_network reads it).

    Its mark (pipeline_mark) goes first; the network is written whole into folder/STAGING, then moved into
    place with the mark last. A save cut short (a kill, a full disk) leaves no mark, and train.py's next start
    saves it again from the last checkpoint rather than take a half-written or an older one for saved."""
    folder = Path(folder)
    mark = pipeline_mark(noise_scheduler is not None)
    for stale in (pipeline_mark(True), mark):  # a pipeline an earlier run left here would load this network as its own
        (folder / stale).unlink(missing_ok=True)
    staging = folder / STAGING
    shutil.rmtree(staging, ignore_errors=True)  # what a save cut short left
    if text is not None:  # the network as diffusers' own class: model.TextUNet adds no weights
        text = dict(text)
        name = text.pop("pipeline")
        plain = type(unet).__base__.from_config(unet.config)
        plain.load_state_dict(unet.state_dict())
        text.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        getattr(diffusers, name)(scheduler=noise_scheduler, **{TEXT_PIPELINES[name][0]: plain}, **text).save_pretrained(str(staging))
    elif noise_scheduler is not None:
        DDPMPipeline(unet=unet, scheduler=noise_scheduler).save_pretrained(str(staging))
    else:
        unet.save_pretrained(str(staging / "unet"))
    for entry in sorted(staging.iterdir(), key=lambda path: mark.startswith(path.name)):  # the mark's last
        if (folder / entry.name).is_dir():
            shutil.rmtree(folder / entry.name)
        else:
            (folder / entry.name).unlink(missing_ok=True)
        os.replace(entry, folder / entry.name)
    staging.rmdir()


def write_model_card(folder, config):
    """folder/README.md: a Hugging Face model card (huggingface_hub.ModelCard) for the run in `folder`, so that
    the output folder is a model repository as it stands: metadata (library diffusers, the pipeline tag, the
    dataset where it is a Hub id, the objective in the tags), the run's settings and FLOPs from its
    train_config.json (`config`) and run.json, its newest grid, and the lines that load it. Uploading is
    the Hub's own command (`hf upload`), which the card gives."""
    from huggingface_hub import ModelCard, ModelCardData

    folder = Path(folder)
    run = json.loads((folder / "run.json").read_text()) if (folder / "run.json").is_file() else {}
    kind = objectives.of(config.get("objective"))
    captioned = bool(config.get("text_encoder"))
    conditional, latent = bool(config.get("num_classes")) or captioned, bool(config.get("latents"))
    dataset = str(config.get("dataset") or "")
    shown = "the built-in shapes" if dataset == "shapes" else f"`{dataset}`" if dataset else "its data"
    hub_dataset = dataset if dataset.count("/") == 1 and not Path(dataset).exists() else None
    tags = ["ddpm-train", kind.tag, "text-to-image" if captioned else "class-conditional" if conditional else "unconditional"]
    if latent:
        tags.append("latent-diffusion")
    pipeline_tag = "text-to-image" if captioned else None if conditional else "unconditional-image-generation"
    data = ModelCardData(library_name="diffusers", pipeline_tag=pipeline_tag,
                         tags=tags, datasets=[hub_dataset] if hub_dataset else None)  # fmt: skip
    grids = sorted((folder / "samples").glob("*.png"))
    size = sizes.spelled(config.get("image_size")) + (
        f" ({sizes.with_channels(config.get('latent_size'), config.get('latent_channels'))} latents of "
        f"{config['latents'].get('vae')})" if latent else "")  # fmt: skip
    kind_of = {1: "grayscale", 3: "RGB", 4: "RGBA"}.get(config.get("image_channels"))  # docs/images.md
    bits = config.get("image_bits") or 8
    if kind_of and not latent and (kind_of, bits) != ("RGB", 8):
        size += f", {kind_of} at {bits} bits"
    objective_line = kind.card_words(config)
    lines = [
        f"# {config.get('model')} trained with ddpm-train",
        "",
        f"A `{config.get('model')}` network ({config.get('params', 0):,} parameters) trained on {shown} "
        f"at {size} by ddpm-train's `train.py`.",
        "",
        "| | |",
        "|---|---|",
        f"| objective | {objective_line} |",
        f"| training | {run.get('steps', config.get('total_train_steps'))} steps of {config.get('global_batch_size')} images, "
        f"learning rate {config.get('learning_rate')}, EMA {config.get('ema')}, mixed precision {config.get('mixed_precision')} |",
        f"| FLOPs | {config.get('model_flops_per_step', 0) / 1e12:.4g} TFLOP per step"
        + (f"; {run['mfu'] * 100:.1f}% MFU on {run.get('device', {}).get('name', 'its device')}" if run.get("mfu") else "")
        + " |",
        f"| captions | {config.get('num_captions')} distinct, embedded by `{config.get('text_encoder')}` |" if captioned else
        f"| classes | {', '.join(map(str, config.get('class_names') or [])) or 'none (unconditional)'} |",
        "",
    ]
    if grids:
        lines += [f"![samples after training](samples/{grids[-1].name})", ""]
    lines += ["## Use", ""]
    pipeline = text_pipeline_of(folder)
    if pipeline:
        lines += ["```python", f"from diffusers import {pipeline}", "",
                  f'pipeline = {pipeline}.from_pretrained("USER/REPO")  # or this folder',
                  f'images = pipeline("a prompt", num_inference_steps={config.get("num_inference_steps")}, '
                  f"guidance_scale={config.get('guidance_scale', [1])[0]}).images", "```", "",
                  "`python sample.py FOLDER --prompt TEXT` samples it too.", ""]  # fmt: skip
    elif objectives.saves_pipeline(config) and not conditional and not latent:
        lines += ["```python", "from diffusers import DDPMPipeline", "",
                  'pipeline = DDPMPipeline.from_pretrained("USER/REPO")  # or this folder',
                  f"images = pipeline(batch_size=16, num_inference_steps={config.get('num_inference_steps')}).images",
                  "```", ""]  # fmt: skip
        lines += kind.pipeline_words(config)
    else:
        family = models.family(config["model"])[0]
        why = ("a network of captions" if captioned else "a class-conditional network" if conditional else "latents to decode" if latent else "EDM's sampler"
               if not kind.saves_pipeline else family.called)  # fmt: skip
        prompt = ' --prompt "..."' if captioned else ""
        lines += [f"This run needs ddpm-train's sampler ({why}): `python sample.py FOLDER{prompt} --num_images 16 --output "
                  "samples/`.", ""]  # fmt: skip
        if family.card_lines and not captioned:
            lines += family.card_lines(isinstance(sizes.sample_size(config.get("latent_size") or config.get("image_size")), int))
    lines += ["## Upload", "", "The folder is a model repository as it is:", "",
              "```bash", "hf upload USER/REPO THIS_FOLDER --exclude 'checkpoints/*'", "```", ""]  # fmt: skip
    ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)).save(folder / "README.md")


def unreadable(path, error):
    """The one line (a ConfigError) for a run's file or folder that cannot be read: removed while it was read (a run
    still training drops its old checkpoints past its --checkpoints_total_limit), or damaged."""
    if not Path(path).exists():
        return ConfigError(f"{path} was removed while it was read (a run still training there drops checkpoints "
                           "past its --checkpoints_total_limit): run the command again")  # fmt: skip
    return ConfigError(f"cannot read {path} ({error_line(error)}): its files are damaged or incomplete; "
                       "point at another checkpoint of the run (RUN_DIR/checkpoints/checkpoint-STEP)")  # fmt: skip


class RunDir:
    """A run, pipeline or checkpoint folder, with the config of the run it belongs to read once.

    `config` is None for a folder outside any run (a pipeline saved elsewhere).
    """

    def __init__(self, path):
        self.path = Path(path)
        self.folder = find_run_folder(self.path)
        try:
            self.config = json.loads((self.folder / CONFIG_FILE).read_text()) if self.folder else None
        except ValueError as e:
            raise unreadable(self.folder / CONFIG_FILE, e) from None

    def get(self, key, default=None):
        return (self.config or {}).get(key, default)

    def setting(self, name, default):
        """A setting of the run (config.SETTINGS), as objectives.run_setting reads it; `default` outside a run."""
        return objectives.run_setting(self.config or {}, name, default)

    @property
    def objective(self):
        """The training objective: train_config.json's "objective"; outside a run, a flow pipeline's (its saved
        scheduler is FlowMatchEulerDiscreteScheduler, with the run's shift), else "ddpm"."""
        if self.config is None:
            saved = self.path / "scheduler" / "scheduler_config.json"
            scheduler = json.loads(saved.read_text()) if saved.is_file() else {}
            try:
                trained = objectives.from_scheduler(scheduler, self.path) if scheduler else None
            except ConfigError:  # a DDPM schedule that --init_from does not train from: sampled as DDPM's all the same
                trained = None
            if trained:
                return trained["objective"]
        return self.get("objective", objectives.DDPMObjective.name)

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
        try:
            if kind == "pipeline":
                return self._load_pipeline(folder, ema)
            return self._load_checkpoint(folder, ema)
        except ConfigError:
            raise
        except Exception as e:  # a damaged or missing file (diffusers', safetensors' and torch's errors): one line
            raise unreadable(folder, e) from None

    def _load_pipeline(self, folder, ema):
        if ema is False and self.kept_ema:
            raise ConfigError(
                f"{folder} holds the network the run saved, which holds the EMA weights only: "
                "for the raw weights pass a checkpoint folder (RUN_DIR/checkpoints/checkpoint-STEP) with --no-ema"
            )
        if not (folder / "model_index.json").is_file():
            if self.config is None:  # its objective, schedule and any VAE are in no file here: say so, not guess DDPM
                raise ConfigError(
                    f"{folder} holds a network saved without a pipeline (an EDM, EDM2 or DiT run's) and no "
                    f"{CONFIG_FILE} in it or above it says how it was trained: copy its run's {CONFIG_FILE} into it"
                )
            return models.load_network(folder / "unet"), None
        text = text_pipeline_of(folder)
        if text:  # a captioned run's (sample.py encodes the prompts)
            scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
            return models.load_network(folder / TEXT_PIPELINES[text][0]), scheduler
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
            raise unreadable(folder, FileNotFoundError("no model.safetensors in the checkpoint"))
        # safetensors' load_model, not load_state_dict: accelerate saved one copy of tensors that share memory
        # (a DiT's one embedder, tied into every block), and load_model fills in the others
        safetensors.torch.load_model(unet, str(weights))
        if self.kept_ema and ema is not False:
            shadow = ema_weights_from_checkpoint(folder)
            if shadow is None:
                raise ConfigError(f"{folder}: the checkpoint has no EMA weights: add --no-ema for its raw weights")
            with torch.no_grad():
                for parameter, value in zip(unet.parameters(), shadow, strict=True):
                    parameter.copy_(value)
        if not objectives.saves_pipeline(config):
            return unet.eval(), None
        return unet.eval(), objectives.run_noise_scheduler(config).config


    def decoder(self, device="cpu"):
        """A latent run's latents -> images in [-1, 1], through the VAE its train_config.json records
        (loaded now, on `device`) and its normalisation; None for a run on pixels."""
        record = self.get("latents")
        if not record:
            return None
        vae = autoencoder.load_vae(record["vae"], record.get("subfolder")).to(device)
        if autoencoder.vae_identity(vae)["encoder_sha256"] != record["encoder_sha256"]:
            raise ConfigError(
                f"the VAE at {record['vae']} is not the one {self.folder} was trained on (its encoder's weights "
                "differ): put that VAE back there"
            )
        return lambda z: autoencoder.decode(vae, z, record["normalization"])


def load_model(path, ema=None):
    """RunDir(path).load(ema): (network in eval mode, training-scheduler config or None)."""
    return RunDir(path).load(ema)
