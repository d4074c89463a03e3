"""--init_from SOURCE: a new run that starts from trained weights (docs/init_from.md).

SOURCE is a diffusers pipeline folder (its unet/ or transformer/), a model folder (config.json and
weights), a Hub id (downloaded with huggingface_hub's snapshot_download, then read as a folder), or a
run or checkpoint folder of this project (rundir.RunDir: its EMA weights where it kept one).

`read_source` reads it before any data loads: which preset its network is (model.PRESETS, by the
layout its config gives), what its config sets beyond the preset (`settings`, which the run's network
is built with: google's DDPM UNets embed time with other sinusoids than diffusers' default), how it was
trained (its scheduler config or its run's record), and the sha256 of its weights, which it loads and
keeps for `initial_state`. What cannot be adapted (another architecture, other input channels, a noise
schedule this project does not train) is a ConfigError. `initial_state` gives the state dict the run's
network starts from, adapted where the run differs (`adapt`), and the line that says what was adapted.
"""

import hashlib
import inspect
import json
import logging
import re
from pathlib import Path

import torch

from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.training import rundir
from ddpm_train import sizes
from ddpm_train.errors import ConfigError, error_line

# The config keys that are the run's, not the source's: its size, channels and classes.
RUNS_OWN = {"sample_size", "in_channels", "out_channels", "num_class_embeds", "num_classes", "num_embeds_ada_norm"}


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# What a Hub download takes: the configs, the pipeline's network and scheduler, or a model repo's weights.
HUB_FILES = ["*.json", "unet/*", "transformer/*", "scheduler/*", "diffusion_pytorch_model*"]

# The source's weights, loaded by read_source (to hash and check them) and kept for initial_state.
_LOADED = {}


def local_folder(source):
    """The folder SOURCE names: a folder here, else a Hub id downloaded (snapshot_download; the local Hub
    cache when offline)."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"--init_from {source} is a file: point it at the folder that holds the network")
        return path
    if not HUB_ID.match(str(source)) or ".." in str(source):
        raise ConfigError(f"--init_from {source}: no such folder; check the path")
    from huggingface_hub import snapshot_download

    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    try:
        return Path(snapshot_download(str(source), allow_patterns=HUB_FILES))
    except Exception as e:  # offline and not cached, no such repository, a gated one
        raise ConfigError(
            f"--init_from {source}: no such folder, and the Hugging Face Hub cannot give it ({error_line(e)[:160]}): "
            f"check the id, or on a machine that reaches the Hub run `hf download {source} --local-dir DIR`, copy "
            "DIR here and pass --init_from DIR"
        ) from None
    finally:
        hub_logger.setLevel(level)


def _json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--init_from: cannot read {path} ({error_line(e)})") from None


def _plain(value):
    """A config value as JSON holds it (tuples are lists), to compare a preset's settings with a file's."""
    return json.loads(json.dumps(value))


def find_network(folder, source):
    """(kind, network folder or run path, scheduler config or None) of what `folder` holds: 'run' (a run or
    checkpoint folder of this project), 'pipeline' (its unet/ or transformer/) or 'model' (config.json, its
    scheduler in ../scheduler/ where it is a pipeline's subfolder)."""
    if rundir.find_run_folder(folder) is not None:
        return "run", folder, None
    for sub in ("unet", "transformer"):
        if (folder / sub / "config.json").is_file():
            scheduler = folder / "scheduler" / "scheduler_config.json"
            return "pipeline", folder / sub, _json(scheduler) if scheduler.is_file() else None
    if (folder / "config.json").is_file():
        scheduler = folder.parent / "scheduler" / "scheduler_config.json"
        return "model", folder, _json(scheduler) if scheduler.is_file() else None
    raise ConfigError(
        f"--init_from {source}: {folder} holds no diffusers pipeline (unet/ or transformer/), model (config.json) "
        "or run of this project (train_config.json)"
    )


def preset_of(family, config, source):
    """The preset whose network has the layout of the source's `config` (model.Family.layout), or a ConfigError."""
    keys = models.FAMILIES[family].layout
    for name, preset in models.PRESETS.items():
        if preset.family == family and all(_plain(preset.settings.get(k)) == _plain(config.get(k)) for k in keys):
            return name
    layout = ", ".join(f"{k} {config.get(k)}" for k in keys)
    raise ConfigError(f"--init_from {source}: no preset has its network's layout ({layout}), so it cannot be trained here")


def extra_settings(family, preset, config):
    """What the source's `config` sets beyond the preset's settings and the constructor's defaults (not the
    run's own size, channels and classes): the run's network is built with them (model.build_run_network)."""
    params = inspect.signature(models.FAMILIES[family].network_class.__init__).parameters
    built = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    built |= dict(models.PRESETS[preset].settings)
    return {key: config[key] for key in sorted(config)
            if key in params and key not in RUNS_OWN and _plain(config[key]) != _plain(built.get(key))}  # fmt: skip


def trained_as(scheduler, source):
    """{objective, prediction_type, beta_schedule, zero_terminal_snr} of a diffusers scheduler config (None:
    none; objectives.from_scheduler); a schedule this project does not train: {objective: None, refused: the
    line that says so}, for config to say unless --objective says what to train."""
    try:
        return objectives.from_scheduler(scheduler, f"--init_from {source}")
    except ConfigError as e:
        return dict(objective=None, refused=str(e))


def state_sha256(state):
    """The sha256 of a state dict's tensors (names, dtypes, shapes and bytes, in name order): the same weights
    hash the same from a pipeline, a model folder or a run."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _load_model(cls, folder, source):
    try:
        with rundir.quiet_loading():
            return cls.from_pretrained(str(folder)).eval()
    except Exception as e:  # a damaged or missing weights file
        raise ConfigError(f"--init_from {source}: cannot load the {cls.__name__} in {folder} ({error_line(e)[:200]})") from None


def read_source(source):
    """What the run takes from SOURCE, before any data loads (see the module doc): a dict with `source`,
    `path`, `kind`, `network` (the class), `model` (the preset), `settings`, `sample_size`, `in_channels`,
    `out_channels`, `num_classes`, `class_names` (a run's), `trained` (trained_as's, or a run's record),
    `weights_sha256`. Its weights are kept for `initial_state`."""
    folder = local_folder(source)
    kind, where, scheduler = find_network(folder, source)
    if kind == "run":
        run = rundir.RunDir(where)
        network, _ = run.load()  # its EMA weights where it kept one, as sample.py samples it
        config, record = dict(network.config), run.config
        name = type(network).__name__
        preset = record["model"]
        trained = {key: record.get(key) for key in ("objective", "prediction_type", "beta_schedule", "zero_terminal_snr")}
        class_names = record.get("class_names")
    else:
        config = _json(where / "config.json")
        name = config.get("_class_name")
        if name == "Transformer2DModel" and config.get("norm_type") == "ada_norm_zero":
            name = "DiTTransformer2DModel"  # facebook/DiT-XL-2-256's config, saved before diffusers had the class
        found = models.family_by_class(name)
        if found is None:
            known = sorted(c for kind in models.FAMILIES.values() for c in kind.classes)
            raise ConfigError(f"--init_from {source}: its network is a {name}, not one this project trains "
                              f"({', '.join(known)})")  # fmt: skip
        if config.get("class_embed_type") is not None:
            raise ConfigError(f"--init_from {source}: its class embedding ({config['class_embed_type']}) is not a "
                              "label table, the one this project trains")  # fmt: skip
        preset = preset_of(found[0], config, source)
        trained, class_names = trained_as(scheduler, source), None
        network = _load_model(found[1].source_class, where, source)
    family = models.family_name(preset)
    state = {k: v.detach() for k, v in network.state_dict().items()}  # the network goes: its tensors stay
    _LOADED.clear()
    _LOADED[str(source)] = state
    in_channels = int(config.get("in_channels") or 3)
    if family == "dit":
        classes = config.get("num_classes")
        classes = config.get("num_embeds_ada_norm") or 0 if classes is None else classes
    else:
        classes = models.num_classes_of(network)
    return dict(
        source=str(source), path=str(where), kind=kind, network=name, model=preset,
        settings=extra_settings(family, preset, config),
        sample_size=sizes.of(*sizes.height_width(config["sample_size"])) if config.get("sample_size") else 0,
        in_channels=in_channels, out_channels=int(config.get("out_channels") or in_channels), num_classes=classes,
        class_names=class_names, trained=trained, weights_sha256=state_sha256(state),
    )  # fmt: skip


def check_fits(record, channels, latent=False):
    """A ConfigError where the run's inputs (`channels`: its images' 1, 3 or 4, or with `latent` its VAE's latent
    channels) are not the source's, or where its output is neither its input nor a DiT's learned variance (twice it)."""
    source, have = record["source"], record["in_channels"]
    if have != channels:
        theirs = "latents of its --vae" if latent else "images: docs/images.md"
        raise ConfigError(f"--init_from {source}: it takes {have}-channel inputs and this run's are {channels}-channel "
                          f"({theirs}): its first layer fits no other")  # fmt: skip
    if record["out_channels"] not in (have, 2 * have) or (record["out_channels"] != have and record["network"] == "UNet2DModel"):
        raise ConfigError(f"--init_from {source}: it outputs {record['out_channels']} channels for {have} in, which this "
                          "project cannot train")  # fmt: skip


def adaptations(record, size, patch=None):
    """What the run changes of the source that is known before the data: its size, a DiT's learned variance."""
    said = []
    if record["sample_size"] and size != record["sample_size"]:
        grid = f" (its position embeddings recomputed for {sizes.box(sizes.divided(size, patch))} patches)" if patch else ""
        said.append(f"inputs of {sizes.box(size)}{grid}, not its {sizes.box(record['sample_size'])}")
    if record["out_channels"] == 2 * record["in_channels"]:
        said.append(f"its learned-variance output ({record['out_channels']} channels) cut to the first "
                    f"{record['in_channels']}, the noise it predicts")  # fmt: skip
    return said


def _class_table_key(state):
    """The name of the label table in a network's state dict, or None."""
    for key in ("class_embedding.weight", "transformer_blocks.0.norm1.emb.class_embedder.embedding_table.weight"):
        if key in state:
            return key
    return None


def adapt(source_state, target_state, record, num_classes, same_classes):
    """(the state the run's network starts from, what was adapted, in words): the source's weights, with
    - an EDM2 network's blocks renamed for the run's size (its names hold each level's width x height);
    - a DiT's per-block timestep and label embedders (diffusers' layout) held once, block 0's (dit.DiT ties them);
    - a learned-variance output layer cut to its first half of channels at every patch position;
    - a new label table where the run's classes are not the source's (`same_classes`: a run of this project on
      the same classes), each row the source's unconditional embedding: its null label's row, or zeros where it
      had no table, so that the first step predicts what the source predicts, whatever the label;
      none for an unconditional UNet.
    `target_state`: the run's network's state dict, for the shapes."""
    state, said = dict(source_state), []
    level = lambda key: re.sub(r"\.\d+x\d+_", ".", key)  # noqa: E731 (an EDM2 block's name without its level's size)
    if list(state) != list(target_state) and list(map(level, state)) == list(map(level, target_state)):
        state = dict(zip(target_state, state.values()))  # EDM2's levels at another size: the same blocks, renamed
    blocks = [key for key in state if re.match(r"^transformer_blocks\.[1-9][0-9]*\.norm1\.emb\.", key)]
    if blocks:
        differ = any(not torch.equal(state[key], state[re.sub(r"^transformer_blocks\.\d+\.", "transformer_blocks.0.", key)])
                     for key in blocks)  # fmt: skip
        for key in blocks:
            del state[key]
        if differ:
            said.append("its blocks' own timestep and label embedders tied to block 0's")
    for key in ("proj_out_2.weight", "proj_out_2.bias"):
        have, want = state.get(key), target_state.get(key)
        if have is not None and want is not None and have.shape[0] == 2 * want.shape[0]:
            channels = record["out_channels"]
            state[key] = have.reshape(-1, channels, *have.shape[1:])[:, : channels // 2].reshape(want.shape).clone()
    have_key, want_key = _class_table_key(state), _class_table_key(target_state)
    table = state.pop(have_key) if have_key else None
    if want_key is not None:
        want = target_state[want_key]
        if same_classes and table is not None and table.shape == want.shape:
            state[want_key] = table
        else:
            conditional = bool(record["num_classes"]) and table is not None
            row = table[-1] if conditional else table[0] if table is not None else torch.zeros(want.shape[1])
            state[want_key] = row.expand_as(want).clone()
            said.append(f"a new label table for this run's {num_classes} classes, every row the source's unconditional "
                        "embedding" if num_classes else "the unconditional run's label: the source's unconditional embedding")  # fmt: skip
    elif table is not None:
        said.append("its label table dropped (an unconditional run)")
    return state, said


def initial_state(record, network, num_classes, class_names=None):
    """(the state dict `network` (the run's, as built) starts from, the line that says so): the source's
    weights that read_source loaded (loaded again where this process did not), adapted (`adapt`)."""
    source = record["source"]
    if source not in _LOADED:  # another process's read, or a second run in this one
        read_source(source)
    state = _LOADED.pop(source)
    same = (record["kind"] == "run" and num_classes == record["num_classes"]
            and (class_names is None or record["class_names"] in (None, list(class_names))))  # fmt: skip
    target = network.state_dict()
    adapted, said = adapt(state, target, record, num_classes, same)
    wrong = sorted(set(adapted) ^ set(target)) or [k for k in target if adapted[k].shape != target[k].shape]
    if wrong:  # read_source's checks should have refused it: said in one line all the same
        raise ConfigError(f"--init_from {source}: its weights do not fit --model {record['model']} ({wrong[0]} "
                          f"differs) and cannot be adapted")  # fmt: skip
    said = record.get("adapted", []) + said
    line = (f"initialized from {source} ({record['network']}, --model {record['model']}, weights sha256 "
            f"{record['weights_sha256'][:12]}); step 0, a fresh optimizer")
    return adapted, line + ("; adapted: " + "; ".join(said) if said else "; nothing adapted")
