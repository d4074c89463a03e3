"""The run directory: atomic checkpoints, which one to resume, and preemption.

A checkpoint is `output_dir/checkpoints/checkpoint-STEP/`: accelerate's
`save_state` (model, optimizer, LR schedule, EMA, every process's RNG state)
plus `trainer_state.json`. It is written into a hidden temporary folder and
renamed into place only once every file is on disk, so a kill at any moment
leaves the previous checkpoint loadable and never a half-written one under a
real name. `trainer_state.json` is written last: a folder without it is not a
checkpoint.
"""

import errno
import json
import os
import shutil
import signal
from pathlib import Path

import torch

from errors import ConfigError, RunError

STATE_FILE = "trainer_state.json"

# Flags whose change makes a checkpoint belong to another run: they fix the
# model's shape, the data, its order and what a step is. Everything else
# (learning rate, number of steps, logging, outputs) may change on resume.
RUN_IDENTITY = (
    "model",
    "image_size",
    "dataset",
    "dataset_config",
    "split",
    "image_column",
    "shapes_num_images",
    "center_crop",
    "train_batch_size",
    "gradient_accumulation_steps",
    "num_processes",
    "seed",
    "num_train_timesteps",
    "beta_schedule",
    "prediction_type",
    "objective",
    "use_ema",
)


def checkpoints_root(output_dir):
    return Path(output_dir) / "checkpoints"


def checkpoint_dirs(output_dir):
    """Complete checkpoints, oldest first."""
    found = []
    for path in checkpoints_root(output_dir).glob("checkpoint-*"):
        step = path.name.removeprefix("checkpoint-")
        if step.isdigit() and (path / STATE_FILE).is_file():
            found.append((int(step), path))
    return [path for _, path in sorted(found)]


def read_state(path):
    return json.loads((Path(path) / STATE_FILE).read_text())


def _fsync_tree(folder):
    """Flush every file under `folder` to disk, so that the rename below publishes complete files."""
    for path in Path(folder).rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def save(accelerator, output_dir, step, state, total_limit=None):
    """Write checkpoint-STEP atomically; then drop all but the newest `total_limit`.

    `state` (JSON) goes into trainer_state.json beside accelerate's files;
    put `run_identity(config)` under "run" so that a resume can check it.
    Disk full or any other OSError: the temporary folder is removed, the
    previous checkpoints are untouched, and a RunError says what happened.
    """
    root = checkpoints_root(output_dir)
    final, tmp = root / f"checkpoint-{step}", root / f".tmp-checkpoint-{step}"
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            root.mkdir(parents=True, exist_ok=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / STATE_FILE).write_text(json.dumps(dict(state, step=step)))
            _fsync_tree(tmp)
            if final.exists():  # the same step saved again (a resume that stopped at once)
                old = root / f".old-checkpoint-{step}"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old)
            else:
                os.replace(tmp, final)
            if total_limit is not None:
                for stale in checkpoint_dirs(output_dir)[:-total_limit]:
                    shutil.rmtree(stale)
    except OSError as e:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = [p for p in checkpoint_dirs(output_dir) if p != final]
        kept = f"the last complete checkpoint, {previous[-1]}, is intact" if previous else "no earlier checkpoint exists"
        raise RunError(cannot_write(f"checkpoint {final}", e, kept)) from None
    accelerator.wait_for_everyone()
    return final


def cannot_write(what, error, note=""):
    """The one-line message for an OSError while writing `what`: why, and what to do before running again."""
    full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    why = "the disk is full" if full else (error.strerror or str(error))
    fix = "free space" if full else "make it writable"
    return f"could not write {what} ({why}){'; ' + note if note else ''}: {fix} and run the same command again"


def weights_finite(model):
    """Whether every weight is finite: a checkpoint never replaces a good one with a broken state."""
    norms = torch._foreach_norm([p.detach() for p in model.parameters()])
    return bool(torch.isfinite(torch.stack(norms)).all())


# --- starting or resuming ------------------------------------------------------------


def run_identity(config):
    return {key: config.get(key) for key in RUN_IDENTITY}


def differences(saved, current):
    """'flag: saved -> now' for each identity flag that differs."""
    return [
        f"--{key} {saved.get(key)!r} -> {current.get(key)!r}"
        for key in RUN_IDENTITY
        if key in saved and saved.get(key) != current.get(key)
    ]


def choose_start(output_dir, config, resume, resume_from, overwrite):
    """The checkpoint to continue from, or None to start fresh; refuses to mix two runs.

    - `resume_from` (a folder, or 'latest'): that checkpoint, or the newest.
    - otherwise, with `resume` (the default), the newest checkpoint in
      output_dir: running the same command again continues the run.
    - an output_dir that holds another run (its own train_config.json) is not
      written over without `overwrite`, which removes its checkpoints.
    A checkpoint whose run had other identity flags (RUN_IDENTITY) is refused
    with the list of differences.
    """
    output_dir = Path(output_dir)
    found = checkpoint_dirs(output_dir)
    saved_config_path = output_dir / "train_config.json"
    if resume_from not in (None, "latest"):
        path = Path(resume_from)
        if not (path / STATE_FILE).is_file():
            raise ConfigError(f"--resume_from_checkpoint {path}: not a checkpoint folder (no {STATE_FILE})")
        start = path
    elif overwrite:
        shutil.rmtree(checkpoints_root(output_dir), ignore_errors=True)
        return None
    elif found and (resume or resume_from == "latest"):
        start = found[-1]
    elif found or saved_config_path.is_file():
        reason = "its checkpoints" if found else "the outputs of an earlier run"
        raise ConfigError(
            f"{output_dir} holds {reason}: run with --resume to continue it, "
            "--overwrite_output_dir to start again there, or choose another --output_dir"
        )
    else:
        return None
    saved = read_state(start).get("run")
    if saved is None and saved_config_path.is_file():
        saved = json.loads(saved_config_path.read_text())
    if saved is not None:
        diff = differences(saved, config)
        if diff:
            raise ConfigError(
                f"cannot resume {start}: it was trained with other settings ({'; '.join(diff)}); "
                "use the same flags, --overwrite_output_dir, or another --output_dir"
            )
    return start


# --- preemption ------------------------------------------------------------------------


class StopSignals:
    """SIGTERM and SIGINT ask the loop to stop after the current step.

    The loop checks `requested` at the end of every step, saves a checkpoint
    and exits. A second SIGINT (Ctrl-C twice) exits at once.
    """

    EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}  # 128 + the signal, as a shell reports it

    def __init__(self):
        self.received = None
        self._previous = {}

    def __enter__(self):
        for sig in self.EXIT_CODES:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.received = signal.Signals(signum)

    @property
    def requested(self):
        return self.received is not None

    @property
    def exit_code(self):
        return self.EXIT_CODES[self.received]
