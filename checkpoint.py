"""The run directory: atomic checkpoints, which one to resume, and preemption.

A checkpoint is `output_dir/checkpoints/checkpoint-STEP/`: accelerate's
`save_state` (model, optimizer, LR schedule, EMA, every process's RNG state)
plus `trainer_state.json`. It is written into a hidden temporary folder and
renamed into place only once every file is on disk, so a kill at any moment
leaves the previous checkpoint loadable and never a half-written one under a
real name. `trainer_state.json` is written last: a folder without it is not a
checkpoint. The wait for the disk and the rename (Flush) run beside training.
"""

import errno
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import torch

from errors import RunError

STATE_FILE = "trainer_state.json"

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
    """Write checkpoint-STEP atomically and return its Flush, which the main process runs in a thread while
    training goes on: the files to disk, then the rename into place, then all but the newest
    `total_limit` dropped. Call `wait()` on it before the next save, a stop or the end.

    `state` (JSON) goes into trainer_state.json beside accelerate's files;
    put `run_identity(config)` under "run" so that a resume can check it.
    Disk full or any other OSError: the temporary folder is removed, the
    previous checkpoints are untouched, and a RunError (here, or from the
    Flush's `wait()`) says what happened.
    """
    root = checkpoints_root(output_dir)
    final, tmp = root / f"checkpoint-{step}", root / f".tmp-checkpoint-{step}"
    started = time.perf_counter()
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            root.mkdir(parents=True, exist_ok=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / STATE_FILE).write_text(json.dumps(dict(state, step=step)))
    except OSError as e:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RunError(_not_written(output_dir, final, e)) from None
    flush = Flush(output_dir, step, tmp, final, total_limit, time.perf_counter() - started)
    if accelerator.is_main_process:  # every process's files are written (the barrier above)
        flush.start()
    return flush


class Flush:
    """A written checkpoint's way to disk, in a thread of the main process: fsync every file, rename the
    temporary folder into place (a checkpoint is only ever published complete), drop the stale ones.

    Training goes on meanwhile: the files are closed and the GPU's tensors already copied out, so all
    that is left is the kernel writing its page cache to the disk (long where the disk is slow or remote).
    The thread is not a daemon: a process that exits, even with an error, first publishes what it wrote.
    On another process, or before start(), it is done at once."""

    def __init__(self, output_dir, step, tmp, final, total_limit, written_s):
        self.output_dir, self.step, self.tmp, self.path, self.total_limit = output_dir, step, tmp, final, total_limit
        self.written_s, self.flushed_s, self.error, self.thread = written_s, 0.0, None, None

    def start(self):
        self.thread = threading.Thread(target=self._flush, name=f"flush {self.path.name}")
        self.thread.start()

    def _flush(self):
        started = time.perf_counter()
        try:
            _fsync_tree(self.tmp)
            if self.path.exists():  # the same step saved again (a resume that stopped at once)
                old = self.path.parent / f".old-{self.path.name}"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(self.path, old)
                os.replace(self.tmp, self.path)
                shutil.rmtree(old)
            else:
                os.replace(self.tmp, self.path)
            if self.total_limit is not None:
                for stale in checkpoint_dirs(self.output_dir)[: -self.total_limit]:
                    shutil.rmtree(stale)
        except OSError as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.error = e
        self.flushed_s = time.perf_counter() - started

    @property
    def done(self):
        return self.thread is None or not self.thread.is_alive()

    def wait(self):
        """Until the checkpoint is on disk under its name; a RunError if it could not be."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise RunError(_not_written(self.output_dir, self.path, error))
        return self.path


def _not_written(output_dir, final, error):
    previous = [p for p in checkpoint_dirs(output_dir) if p != final]
    kept = f"the last complete checkpoint, {previous[-1]}, is intact" if previous else "no earlier checkpoint exists"
    return cannot_write(f"checkpoint {final}", error, kept)


def disk_warning(output_dir, each, step, total_steps, every, total_limit=None):
    """One line when the checkpoints this run has still to write (`each` bytes apiece, every `every` steps and at
    the last) will not fit in the space free on output_dir's disk; None when they will. With a
    --checkpoints_total_limit of N, N + 1 are on disk at once (the new one is complete before the oldest goes)."""
    future = total_steps // every - step // every + (1 if total_steps % every and total_steps > step else 0)
    if future <= 0:
        return None
    existing = len(checkpoint_dirs(output_dir))
    at_once = existing + future if total_limit is None else min(existing + future, total_limit + 1)
    need = max(1, at_once - existing) * each
    where = Path(output_dir).absolute()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if need <= free:
        return None
    gib = lambda n: f"{n / 2**30:.3g} GiB"  # noqa: E731
    fit = free // each - 1  # with a limit of N, N + 1 at once
    fix = f"pass --checkpoints_total_limit {fit}" if fit >= 1 else "free space"
    return (f"warning: the {future} checkpoint(s) still to come ({gib(each)} each, {gib(need)} on disk at once) will not "
            f"fit in the {gib(free)} free under {where}: {fix}, or a larger --checkpointing_steps")  # fmt: skip


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


# --- preemption ------------------------------------------------------------------------


class StopSignals:
    """SIGTERM and SIGINT ask the loop to stop after the current step.

    The loop checks `requested` at the end of every step, saves a checkpoint
    and exits; with several processes, they agree first (tally, agree). A
    second SIGINT (Ctrl-C twice) exits at once.
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

    def tally(self):
        """For agreeing with other processes: 1.0 for the signal this one got, in EXIT_CODES' order."""
        return [float(self.received == sig) for sig in self.EXIT_CODES]

    def agree(self, totals):
        """`totals`: tally() summed over the processes. Whether to stop; a process that no signal
        reached stops as the others do, for the signal they got (SIGTERM before SIGINT)."""
        if self.received is None:
            self.received = next((sig for sig, count in zip(self.EXIT_CODES, totals) if count), None)
        return self.requested

    @property
    def requested(self):
        return self.received is not None

    @property
    def exit_code(self):
        return self.EXIT_CODES[self.received]
