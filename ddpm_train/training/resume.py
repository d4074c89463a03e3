"""Resuming: which checkpoint a run continues from, and what it may not change when it does.

A checkpoint belongs to the run that wrote it: its network, its data and their order, what its
network's output means, its optimizer's and EMA's saved state. `choose_start` finds the
checkpoint the same command continues from, and refuses one written under other values of
those settings (RUN_IDENTITY) with the list of differences, in one line. Every flag of
train.py is either identity or declared free to change on resume, with the reason
(CHANGES_ON_RESUME; tests/test_resume.py fails on a flag in neither).
"""

import functools
import json
from pathlib import Path

from ddpm_train.training import checkpoint
from ddpm_train import config
from ddpm_train.training import ema as posthoc_ema
from ddpm_train.data import autoencoder
from ddpm_train.diffusion import loss_terms
from ddpm_train.diffusion import objectives
from ddpm_train.errors import ConfigError

# What a checkpoint holds or means: resuming it with any of these changed is
# refused, with the list of differences (choose_start). Every flag of
# config.build_parser() is either here or in CHANGES_ON_RESUME, with the reason
# (tests/test_resume.py fails on a flag in neither).
RUN_IDENTITY = (
    # the network's shape: the saved weights fit no other (a conditional run's class embedding too, and its labels);
    # --init_from's source gives the network settings beyond its preset (a DDPM UNet's time embedding), and a
    # checkpoint means nothing under another's (its weights, not the source's, are what a resume loads)
    "model", "image_size", "class_conditional", "num_classes", "init_from",
    # a captioned run's encoder and its width: the cross-attention's weights fit those embeddings alone
    "text_encoder", "caption_column", "text_dim",
    # ... and the images' channels (config._fill_pixels: a gray set that gained a colour image trains RGB), and their
    # bits: what a value of the data the network learned means
    "image_channels", "image_bits",
    # the data, its order and what a step is: the step count and the position in the data mean these
    # (--augment: its random crops, compared alone: flips are drawn afresh each step)
    "dataset", "dataset_config", "split", "image_column", "shapes_num_images", "augment",
    "train_batch_size", "gradient_accumulation_steps", "num_processes", "seed",
    # what the network's output means: the objective, the noise process and the parametrisation it learned
    "objective", "prediction_type", "beta_schedule", "zero_terminal_snr",
    # the objective's terms and noise coupling (loss_terms.py): what the network is taught, as the objective is;
    # a resumed run that names none keeps its own (keep_recorded_objective), another set is refused
    "loss_terms",
    # the optimizer's saved param groups (and the LR schedule's base LR): loading them restores these, so a
    # new value would be silently ignored
    "learning_rate", "adam_betas", "weight_decay", "optimizer",
    # the EMA saved: its kind (none too), the power EMA's widths, and the decay settings EMAModel's state restores
    "ema", "ema_stds", "ema_max_decay", "ema_power",
    # fp16 saves a GradScaler's state and loads one: compared as fp16 or not (bf16 <-> no saves the same)
    "mixed_precision",
    # a latent run's latent space: the network's inputs and outputs are latents of this encoder (its weights'
    # hash, not the --vae text), normalised so (autoencoder.latent_space; None for a run on pixels)
    "latent_space",
    # a flow run's σ distribution (objectives.sigma_distribution: uniform or logit-normal(m, s); None for
    # other objectives, whose --timestep_sampling and --P_mean_std may change): what the network was
    # taught where; its shift is in --objective
    "flow_sigmas",
)  # fmt: skip

# Identity keys train.py computes (config.DERIVED_KEYS), not flags, and what a run that did
# not record one had: num_classes 0, unconditional (None: always recorded, or see PIXEL_RUN).
DERIVED_IDENTITY = {"num_processes": None, "num_classes": 0, "latent_space": None, "flow_sigmas": None, "text_dim": None,
                    "image_channels": 3, "image_bits": 8}  # fmt: skip

# Identity keys that came with latent runs: a run that did not record them trained on pixels,
# or is a latent run of before latent_space, whose train_config.json's latents record gives it.
PIXEL_RUN = {"latent_space": None}

# What of a value the checkpoint depends on, where it is not the whole value.
COMPARED_AS = {"mixed_precision": lambda value: value == "fp16",
               "augment": lambda value: "crop" in str(value).split(",")}  # fmt: skip

# Flags that may change on resume, and why: the checkpoint neither holds them nor means
# something else under them.
CHANGES_ON_RESUME = {
    "the run's length and LR schedule: the schedule's function is rebuilt from the flags (the checkpoint "
    "holds its position and base LR)": (
        "num_epochs", "max_train_steps", "lr_scheduler", "lr_warmup_steps", "lr_ref_steps",
    ),
    "which noise levels a step draws, which tokens it routes past the middle blocks, how its loss is weighted and "
    "clipped: drawn or applied afresh each step, nothing of them saved": (
        "timestep_sampling", "P_mean_std", "snr_gamma", "max_grad_norm", "token_routing",
    ),
    "how the data is read, not which images nor their order (batches.epoch_batches: the seed and the epoch)": (
        "preload_data", "dataloader_num_workers",
    ),
    "how a step runs on the machine: the same tensors are saved and loaded (tried on CPU: channels_last, "
    "gradient checkpointing, bf16)": (
        "cpu", "compile_mode",
    ),
    "sampling, evaluation and outputs: they read the weights, a checkpoint holds none of them": (
        "output_dir", "logger", "save_images_epochs", "eval_batch_size", "sampler", "churn",
        "num_inference_steps", "guidance_scale", "guide", "ema_snapshot_every", "eval_every_epochs",
        "eval_num_samples", "fid_weights",
    ),
    "which VAE, as spelled: its weights and normalisation are compared (latent_space), so the same VAE in "
    "another folder, by a relative path or with its ',vae' suffix resumes": (
        "vae",
    ),
    "checkpoints, faults and this invocation": (
        "checkpointing_steps", "checkpoints_total_limit", "resume", "overwrite_output_dir", "on_fault", "config",
        "dry_run",
    ),
    "the performance report and the profiler": (
        "logging_steps", "profile",
    ),
}  # fmt: skip

# Of those, the ones that change what the steps after a resume do: a resume that changes one says so, beside
# "resumed from" (changed_since).
ANNOUNCED_ON_RESUME = (
    "num_epochs", "max_train_steps", "lr_scheduler", "lr_warmup_steps", "lr_ref_steps",
    "timestep_sampling", "P_mean_std", "snr_gamma", "max_grad_norm",
)  # fmt: skip


# --- starting or resuming ------------------------------------------------------------


def run_identity(config):
    return {key: config.get(key) for key in RUN_IDENTITY}


@functools.cache
def identity_defaults():
    """What a run that did not record an identity key had: the flag's default (a flag added
    later defaults to what runs did before it) or DERIVED_IDENTITY's; None where unknown
    (config.resolve fills it from the preset or the machine)."""
    defaults = {key: value for key, value in vars(config.build_parser().parse_args([])).items() if key in RUN_IDENTITY}
    if defaults.get("beta_schedule") is None:  # filled by config.resolve since flow runs have none; DDPM's was linear
        defaults["beta_schedule"] = "linear"
    if defaults.get("loss_terms") is None:  # filled by config.resolve; a run of before --loss_terms had none
        defaults["loss_terms"] = loss_terms.NONE
    if isinstance(defaults.get("ema_stds"), str):
        defaults["ema_stds"] = posthoc_ema.parse_stds(defaults["ema_stds"])  # as config.resolve gives it
    return defaults | DERIVED_IDENTITY


def saved_identity(start):
    """The identity of the run that wrote checkpoint `start`, or None where nothing is recorded.

    Each key from the checkpoint's own record ("run" in trainer_state.json), else from its
    run's train_config.json (a checkpoint written before the key was checked), else its
    default (identity_defaults); a key with none of these is left out and not compared.
    A checkpoint whose record names a flag that is gone (config.REMOVED) is refused in one line.
    """
    start = Path(start)
    recorded = checkpoint.read_state(start).get("run") or {}
    run_config = start.parent.parent / "train_config.json"  # output_dir/checkpoints/checkpoint-STEP
    in_a_run = start.parent.name == "checkpoints" and run_config.is_file()
    written = json.loads(run_config.read_text()) if in_a_run else {}
    if not recorded and not written:
        return None
    known = written | recorded  # the record first; the train_config.json tells what it leaves out
    gone = [key for key in known if key in config.REMOVED or key in config.SETTINGS]
    if gone:
        raise ConfigError(f"cannot resume {start}: it was written by an earlier train.py, whose --{gone[0]} is gone; "
                          f"resume it with that version, or start a new run from its weights with --init_from {start}")
    if "flow_sigmas" not in known:  # derived from what the run recorded: none of flow's before flow runs
        known["flow_sigmas"] = objectives.sigma_distribution(known)
    if "latent_space" not in known and known.get("latents"):  # a latent run of before latent_space
        known["latent_space"] = autoencoder.recorded_latent_space(known)
    saved = {}
    for key in RUN_IDENTITY:
        if key in known:
            saved[key] = known[key]
        elif identity_defaults().get(key) is not None:
            saved[key] = identity_defaults()[key]
        elif key in PIXEL_RUN:
            saved[key] = PIXEL_RUN[key]
    return saved


def keep_recorded_objective(args):
    """A command that names no --objective and continues a checkpoint trains on with the objective the
    checkpoint's run recorded, not the preset's default (which may have changed since: the objective is
    RUN_IDENTITY, and a resume under another is refused); one that names no --loss_terms, with the run's
    terms. Sets `args.objective` and `args.loss_terms` before config.resolve fills the rest from them; returns
    the objective kept, or None (a fresh start, --objective given, or no checkpoint to continue: choose_start
    says what is wrong with one)."""
    if args.objective is not None and args.loss_terms is not None or args.resume is False:
        return None
    resume_from = args.resume if isinstance(args.resume, str) else None  # as train.py passes it to choose_start
    start = continued_checkpoint(args.output_dir, True, resume_from, args.overwrite_output_dir)
    if start is None or not (start / checkpoint.STATE_FILE).is_file():
        return None
    try:
        saved = saved_identity(start) or {}
    except ConfigError:
        return None  # choose_start refuses it, in one line
    if args.loss_terms is None:
        args.loss_terms = saved.get("loss_terms")
    if args.objective is not None:
        return None
    args.objective = saved.get("objective")
    return args.objective


def changed_since(start, current):
    """'--flag before -> now' for each flag of ANNOUNCED_ON_RESUME that differs from what the run of checkpoint
    `start` last trained with (its train_config.json, not yet rewritten by this run); none without that record."""
    start = Path(start)
    if start.parent.name != "checkpoints":  # a checkpoint folder on its own: no run's record beside it
        return []
    try:
        before = json.loads((start.parent.parent / "train_config.json").read_text())
    except (OSError, ValueError):
        return []

    def plain(value):  # as JSON holds it (a tuple is a list)
        return json.loads(json.dumps(value, default=str))

    return [f"--{key} {before[key]!r} -> {current.get(key)!r}" for key in ANNOUNCED_ON_RESUME
            if key in before and plain(before[key]) != plain(current.get(key))]  # fmt: skip


def differences(saved, current):
    """'--flag saved -> now' for each identity key that differs; a key not in `saved` is not compared."""
    return [
        _difference(key, saved[key], current.get(key))
        for key in RUN_IDENTITY
        if key in saved and _compared(key, saved[key]) != _compared(key, current.get(key))
    ]


def _difference(key, saved, now):
    if key == "latent_space":
        return autoencoder.latent_space_change(saved, now)
    if key == "num_processes":  # no flag: the launcher's
        return f"processes {saved!r} -> {now!r}: launch it with {saved}"
    return f"{key if key in DERIVED_IDENTITY else '--' + key} {saved!r} -> {now!r}"



def _compared(key, value):
    return COMPARED_AS[key](value) if key in COMPARED_AS else value


def continued_checkpoint(output_dir, resume, resume_from, overwrite):
    """The checkpoint a command continues from, as choose_start picks it, unchecked: `resume_from` (a
    folder), else, unless `overwrite`, the newest in output_dir with `resume` (or resume_from 'latest');
    None for a fresh start."""
    if resume_from not in (None, "latest"):
        return Path(resume_from)
    if overwrite:
        return None
    found = checkpoint.checkpoint_dirs(Path(output_dir))
    return found[-1] if found and (resume or resume_from == "latest") else None


def choose_start(output_dir, config, resume, resume_from, overwrite):
    """The checkpoint to continue from, or None to start fresh; refuses to mix two runs.

    - `resume_from` (a folder, or 'latest'): that checkpoint, or the newest.
    - otherwise, with `resume` (the default), the newest checkpoint in
      output_dir: running the same command again continues the run.
    - an output_dir that holds another run (its own train_config.json) is not
      written over without `overwrite` (whose caller removes its checkpoints, once nothing else can refuse the run);
      nor, without it, one that holds other files (a user's folder: the run's README.md would replace theirs).
    A checkpoint whose run had other identity values (RUN_IDENTITY, as
    saved_identity reads them) is refused with the list of differences.
    """
    output_dir = Path(output_dir)
    start = continued_checkpoint(output_dir, resume, resume_from, overwrite)
    if resume_from not in (None, "latest"):
        if not (start / checkpoint.STATE_FILE).is_file():
            raise ConfigError(f"--resume {start}: not a checkpoint folder (no {checkpoint.STATE_FILE})")
        step = checkpoint.read_state(start)["step"]
        newer = [found for found in checkpoint.checkpoint_dirs(output_dir) if checkpoint.step_of(found) > step]
        if newer:  # their steps and the ones trained from `start` would share one run's folder (and its limit)
            raise ConfigError(
                f"--resume {start}: {output_dir} holds newer checkpoints ({', '.join(p.name for p in newer)}): "
                f"--resume alone continues from the newest; to go back to step {step}, resume into another "
                f"--output_dir or move the newer ones out of {checkpoint.checkpoints_root(output_dir)}"
            )
    elif overwrite:
        return None  # its checkpoints are removed once every check has passed (train.py: announce)
    elif start is None:
        found = checkpoint.checkpoint_dirs(output_dir)
        if found or (output_dir / "train_config.json").is_file():
            reason = "its checkpoints" if found else "the outputs of an earlier run"
            raise ConfigError(
                f"{output_dir} holds {reason}: run with --resume to continue it, "
                "--overwrite_output_dir to start again there, or choose another --output_dir"
            )
        others = sorted(p.name for p in output_dir.glob("*") if not p.name.startswith(".") and p.name != "lost+found")
        if others:  # a user's folder, not a run's: the run's README.md (the model card) and samples/ would replace theirs
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            raise ConfigError(
                f"{output_dir} holds files that are not a run's ({shown}): a run writes its README.md, samples/ and "
                "model there; choose a new or empty --output_dir, or --overwrite_output_dir to write among them"
            )
        return None
    saved = saved_identity(start)
    if saved is not None:
        diff = differences(saved, config)
        if diff:
            raise ConfigError(
                f"cannot resume {start}: it was trained with other settings ({'; '.join(diff)}); "
                "use the same flags, --overwrite_output_dir, or another --output_dir"
            )
    return start
