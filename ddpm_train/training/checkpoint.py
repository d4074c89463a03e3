"""The run directory: atomic checkpoints, which one to resume, and preemption.

A checkpoint is `output_dir/checkpoints/checkpoint-STEP/`: accelerate's
`save_state` (model, optimizer, LR schedule, EMA, every process's RNG state)
plus `trainer_state.json`. It is written into a hidden temporary folder and
renamed into place only once every file is on disk, so a kill at any moment
leaves the previous checkpoint loadable and never a half-written one under a
real name. `trainer_state.json` is written last: a folder without it is not a
checkpoint.

The steps wait while save_state writes the files; the wait for the disk and the
rename (Flush) run beside training.
"""

import errno
import fcntl
import functools
import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import torch

from ddpm_train.errors import ConfigError, RunError, error_line

STATE_FILE = "trainer_state.json"
LOCK_FILE = ".lock"  # RunLock's, in the output folder

def checkpoints_root(output_dir):
    return Path(output_dir) / "checkpoints"


def checkpoint_dirs(output_dir):
    """Complete checkpoints, oldest first."""
    found = [path for path in checkpoints_root(output_dir).glob("checkpoint-*") if step_of(path) is not None]
    return sorted((path for path in found if (path / STATE_FILE).is_file()), key=step_of)


def step_of(path):
    """The step in a checkpoint folder's name, None for another name."""
    step = Path(path).name.removeprefix("checkpoint-")
    return int(step) if step.isdigit() else None


def read_state(path):
    try:
        return json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError) as e:  # a damaged or unreadable file: one line, not a traceback
        raise unloadable(path, e) from None


def unloadable(path, error, file=None):
    """The one line (a ConfigError) for a checkpoint that cannot be read: what failed (in `file`, where the error
    does not name it), and what to resume instead: the newest checkpoint before it in its run, or a fresh start
    where there is none."""
    path, step = Path(path), step_of(path)
    earlier = [found for found in checkpoint_dirs(path.parent.parent) if step is not None and step_of(found) < step]
    instead = (f"move it out of {path.parent} and the run resumes from the one before it, {earlier[-1].name}" if earlier else
               "start again with --overwrite_output_dir (it removes the run's checkpoints) or choose another --output_dir")
    return ConfigError(f"cannot load checkpoint {path} ({file + ': ' if file else ''}{error_line(error)}); {instead}")


def check_writable(folder, flag, writable=True):
    """A ConfigError, before any data loads, where `folder` cannot be made or written: a file stands at it or on
    its path, or (`writable`) the nearest folder that exists is not writable (permissions, a read-only mount)."""
    if not str(folder).strip():
        raise ConfigError(f"{flag} is empty: name a folder")
    folder = Path(folder).absolute()
    there = next(path for path in (folder, *folder.parents) if path.exists())
    if not there.is_dir():
        raise ConfigError(f"{flag} {folder}: {there} is a file, not a folder; choose another {flag}")
    if writable and not os.access(there, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {folder}: cannot write in {there} (permissions or a read-only disk); "
                          f"choose another {flag}")  # fmt: skip


def _fsync_tree(folder):
    """Flush every file under `folder` to disk, so that the rename below publishes complete files."""
    for path in Path(folder).rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def save(accelerator, output_dir, step, state, total_limit=None):
    """Write checkpoint-STEP atomically and return its Flush, which the main process runs in a thread while
    training goes on: every file to disk, then the rename into place, then all but the newest `total_limit`
    dropped. Call `wait()` on it before the next save, a stop or the end.

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
    except OSError as e:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RunError(_not_written(output_dir, final, e)) from None
    last = functools.partial((tmp / STATE_FILE).write_text, json.dumps(dict(state, step=step)))
    flush = Flush(output_dir, step, tmp, final, total_limit, time.perf_counter() - started, [last])
    if accelerator.is_main_process:  # every process's files are written (the barrier above)
        flush.start()
    return flush


def available_memory(root=Path("/")):
    """Bytes of host memory this process can still take: Linux's MemAvailable (free plus reclaimable cache), or
    less where its cgroup's limit (a container's: Docker, Kubernetes) allows less; 0 where unknown."""
    free = 0
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    room = cgroup_room(root)
    return free if room is None else min(free, room)


def cgroup_room(root=Path("/")):
    """Bytes this process's memory cgroup still allows: its limit less what it holds that cannot be reclaimed
    (usage less inactive file cache: the working set, as the kubelet counts it); None without a limit. cgroup v2
    (the process's own group, from /proc/self/cgroup, else the mount's root: a container's view) or v1."""
    groups = [root / "sys/fs/cgroup"]
    try:
        groups = [root / "sys/fs/cgroup" / line[3:].strip("/") for line in (root / "proc/self/cgroup").read_text().splitlines()
                  if line.startswith("0::")] + groups  # fmt: skip
    except OSError:
        pass
    v1 = root / "sys/fs/cgroup/memory"
    files = [(g / "memory.max", g / "memory.current", g / "memory.stat", "inactive_file") for g in groups]
    files.append((v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes", v1 / "memory.stat", "total_inactive_file"))
    for limit, usage, stat, reclaimable in files:
        try:
            limit, usage = limit.read_text().strip(), int(usage.read_text())
            cache = int(dict(line.split()[:2] for line in stat.read_text().splitlines() if line.strip()).get(reclaimable, 0))
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 2**62:  # "max", or v1's unlimited (a page short of 2**63)
            return None
        return max(0, int(limit) - (usage - cache))
    return None


class Flush:
    """A checkpoint's way to disk, in a thread of the main process: the writes left to it (trainer_state.json),
    fsync of every file, the rename of the temporary folder into place (a checkpoint is only ever published
    complete), the stale ones dropped.

    Training goes on meanwhile: the files the thread flushes are already closed.
    The thread is not a daemon: a process that exits, even with an error, first publishes what it wrote.
    On another process, or before start(), it is done at once."""

    def __init__(self, output_dir, step, tmp, final, total_limit, waited_s, writes=()):
        self.output_dir, self.step, self.tmp, self.path, self.total_limit = output_dir, step, tmp, final, total_limit
        self.writes = list(writes)
        self.waited_s, self.beside_s, self.error, self.thread = waited_s, 0.0, None, None

    def start(self):
        self.thread = threading.Thread(target=self._flush, name=f"flush {self.path.name}")
        self.thread.start()

    def _flush(self):
        started = time.perf_counter()
        try:
            for write in self.writes:
                write()
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
        except BaseException as e:  # noqa: BLE001 (any failure: nothing half-written is left, wait() says why)
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.error = e
        self.beside_s = time.perf_counter() - started

    @property
    def done(self):
        return self.thread is None or not self.thread.is_alive()

    def join(self):
        """Until the thread is done, published or not (a failure stays for wait() to raise)."""
        if self.thread is not None:
            self.thread.join()

    def wait(self):
        """Until the checkpoint is on disk under its name; a RunError if it could not be written (an OSError),
        the error itself otherwise."""
        self.join()
        if self.error is not None:
            error, self.error = self.error, None
            if isinstance(error, OSError):
                raise RunError(_not_written(self.output_dir, self.path, error))
            raise error
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
    fit = free // each - 1  # with a limit of N, N + 1 at once
    fix = f"pass --checkpoints_total_limit {fit}" if fit >= 1 else "free space"
    return (f"warning: the {future} checkpoint(s) still to come ({_gib(each)} each, {_gib(need)} on disk at once) will not "
            f"fit in the {_gib(free)} free under {where}: {fix}, or a larger --checkpointing_steps")  # fmt: skip


def _gib(n):
    return f"{n / 2**30:.3g} GiB"


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


class RunLock:
    """Held by a run's main process for its life: a second run started in the same --output_dir (a job requeued
    while the first still runs) is refused in one line, rather than both writing checkpoints there. The kernel
    drops the lock when the process ends, however it ends. A disk that cannot lock (some network file systems)
    is used without one. `release_all` lets the same process start another run (train.main's end)."""

    held = []  # this process's open lock files

    def __init__(self, output_dir):
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.file = open(Path(output_dir) / LOCK_FILE, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise ConfigError(f"{output_dir} is in use by another run ({holder}): wait for it to end, or choose "
                              "another --output_dir") from None  # fmt: skip
        except OSError:  # no locks on this disk
            self.file.close()
            return
        self.file.truncate(0)
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self.file.flush()
        RunLock.held.append(self.file)

    @classmethod
    def release_all(cls):
        while cls.held:
            cls.held.pop().close()  # closing the file drops its lock


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
        if self.received is None and os.environ.get("RANK", "0") == "0":  # said now: a step may take minutes
            again = " (Ctrl-C again: stop now, without saving)" if signum == signal.SIGINT else ""
            # os.write: no lock a print (or tqdm's) may hold in the code this signal interrupted
            os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step, once it is saved{again}\n".encode())
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
