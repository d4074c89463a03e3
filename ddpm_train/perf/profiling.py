"""Where the time goes: the step-time breakdown, torch.profiler traces, plots and the run manifest.

    python profiling.py plots RUN_DIR      # (re)draw RUN_DIR/plots/*.png from the run's tensorboard logs

train.py uses the pieces here: `Breakdown` times the phases of every step
(printed at the end of each run), `--profile` records a few steps with
torch.profiler (`make_profiler`), `draw_run_plots` draws the logged scalars
at the end, and `write_manifest` writes `run.json`.
"""

import contextlib
import json
import math
import os
import platform
import re
import subprocess
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch

from ddpm_train.errors import ConfigError, OneLineParser, one_line_errors
from ddpm_train.perf.flops import seconds_between, time_mark

# The phases of a training step, in order ("step": all but the data, when the
# step is one CUDA graph), then what happens outside the steps ("compile": the
# first step, which compiles).
STEP_PHASES = ("data", "forward", "backward", "optimizer", "ema", "step")
PAUSES = ("compile", "sampling", "evaluation", "checkpointing")


class Breakdown:
    """Seconds spent in each phase of the step, and in sampling and checkpointing.

    On a GPU each phase boundary is a CUDA event recorded in the stream: no
    host sync per step; the events are read when `collect()` is called (once
    per log interval). On a CPU, where the work is synchronous, boundaries are
    clock readings. Sampling and checkpointing synchronize anyway, so they are
    timed with the host clock (`pause`). `wall_s()` is the host clock since
    `start()`, after a final sync.
    """

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.seconds = dict.fromkeys(STEP_PHASES + PAUSES, 0.0)
        self.pending = []  # (phase, start mark, end mark) not yet read
        self.last = None
        self.started = None
        self.epoch_mark = None  # (host clock, paused seconds) at the start of an epoch
        self.paused = False

    def paused_s(self):
        return sum(self.seconds[name] for name in PAUSES)

    def start(self):
        self.started = time.perf_counter()

    def begin_step(self):
        self.last = time_mark(self.cuda)

    def phase_done(self, phase):
        if self.paused:  # inside a pause, the pause's clock counts everything
            return
        now = time_mark(self.cuda)
        self.pending.append((phase, self.last, now))
        self.last = now

    @contextlib.contextmanager
    def pause(self, name):
        """Time a block (sampling, checkpointing) with the host clock, synchronized at both ends."""
        self._sync()
        t0 = time.perf_counter()
        self.paused = True
        try:
            yield
        finally:
            self.paused = False
            self._sync()
            self.seconds[name] += time.perf_counter() - t0

    def begin_epoch(self):
        self._sync()
        self.epoch_mark = (time.perf_counter(), self.paused_s())

    def epoch_s(self):
        """Wall seconds since `begin_epoch()`, less the pauses inside it: one device sync per epoch."""
        self._sync()
        started, paused = self.epoch_mark
        return time.perf_counter() - started - (self.paused_s() - paused)

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def collect(self):
        if self.cuda and self.pending:
            self.pending[-1][2].synchronize()
        for phase, start, end in self.pending:
            self.seconds[phase] += seconds_between(start, end)
        self.pending = []

    def wall_s(self):
        self._sync()
        return time.perf_counter() - self.started

    def summary(self):
        """{part: seconds} with 'unaccounted' (logging, Python between steps) and the wall time."""
        self.collect()
        wall = self.wall_s()
        parts = dict(self.seconds)
        parts["unaccounted"] = max(0.0, wall - sum(parts.values()))
        return parts, wall

    def format(self):
        parts, wall = self.summary()
        shares = ", ".join(f"{name} {100 * s / wall:.1f}%" for name, s in parts.items() if s > 0)  # parts the run had
        return f"where the time went ({wall:.1f} s of training): {shares}"


class StartupClock:
    """Seconds from train.py's start to its first step, by part: each `mark(part)` ends the part that began at
    the mark before it (the first at `started`, train.py's first line: its imports come first)."""

    def __init__(self, started):
        self.started = self.last = started
        self.parts = {}

    def mark(self, part):
        now = time.perf_counter()
        self.parts[part] = now - self.last
        self.last = now

    def line(self):
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.parts.items() if seconds >= 0.05)
        return f"ready to train {self.last - self.started:.1f} s after train.py started: {parts}"


# --- torch.profiler ---------------------------------------------------------------------


def past_trial_calls(step):
    """Whether train.py's step (a compiling.FastStep), asked after a step is done, is past its trial calls.

    Those compile the network, warm up and record reduce-overhead's CUDA graph
    trees, or warm up and capture step-graph's whole step (a fallback to
    another mode starts its own): `--profile` warms up and records only the
    steady steps after them, and after at least one step in eager mode.
    """
    return step.calls >= step.trial_calls


def make_profiler(
    out_dir, skip_steps, warmup_steps, active_steps, top, with_stack=False, on_done=None, level="kernels"
):
    """A torch.profiler that skips, warms up, then records `active_steps` steps once.

    When the recording is done it writes `out_dir/trace.json` (open it in
    Perfetto or chrome://tracing), prints the `top` device kernels by time
    (`level="operators"`: the operators that launched them; CPU operators by
    CPU time on a CPU), draws them as `out_dir/top_ops.png`, and calls
    `on_done(table rows)`.
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    out_dir = Path(out_dir)

    def ready(prof):
        out_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out_dir / "trace.json"))
        rows = top_operators(prof, top, level)
        print(format_top_operators(rows), flush=True)
        draw_top_operators(rows, out_dir / "top_ops.png")
        (out_dir / "top_ops.json").write_text(json.dumps(rows, indent=1) + "\n")
        if on_done is not None:
            on_done(rows)

    return profile(
        activities=activities,
        schedule=schedule(skip_first=skip_steps, wait=0, warmup=warmup_steps, active=active_steps, repeat=1),
        on_trace_ready=ready,
        record_shapes=False,
        with_stack=with_stack,
    )


LEVELS = ("kernels", "operators")


def top_operators(prof, top, level="kernels"):
    """[{name, self_ms, share, calls, where, level}]: the `top` kernels (or operators) by self time.

    A GPU profile holds every kernel twice: as an event of its own on the
    device, and in the self device time of the CPU operator that launched it
    (Inductor even names the launch after its Triton kernel). Ranking both
    listed each kernel twice and halved every share. So the device's own
    events are taken, once each: by kernel name (`"kernels"`), or by the name
    of the operator that launched them (`"operators"`, found through the
    kernel's `linked_correlation_id`, as torch.profiler links them). Ranges
    that `record_function` draws on the device's timeline are not work and
    are left out; they are why operators' `self_device_time_total` is not
    used (it counts them, pytorch/pytorch#130730). A share is of the time the
    device was busy (all kernel time over the recorded steps), so the shares
    of all rows add up to 1. Without device events (a CPU) both levels rank
    CPU operators by self CPU time.
    """
    from torch.autograd import DeviceType

    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
    events = [e for e in prof.events() if not e.is_async and not getattr(e, "is_python_function", False)]
    on_cpu = [e for e in events if e.device_type == DeviceType.CPU]
    kernels = [e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    if not kernels:
        where, level = "cpu", "operators"
        timed = [(e.name, id(e), e.self_cpu_time_total) for e in on_cpu if not e.name.startswith("ProfilerStep")]
    elif level == "kernels":
        where, timed = "device", [(k.name, id(k), k.self_device_time_total) for k in kernels]
    else:
        where = "device"
        timed = [(name, call, k.self_device_time_total) for k, name, call in _launchers(kernels, on_cpu)]

    us, calls = {}, {}
    for name, call, self_us in timed:
        us[name] = us.get(name, 0.0) + self_us
        calls.setdefault(name, set()).add(call)  # an operator that launched two kernels was called once
    total = sum(us.values()) or 1.0
    ranked = sorted(us, key=us.get, reverse=True)[:top]
    return [
        dict(name=n, self_ms=us[n] / 1e3, share=us[n] / total, calls=len(calls[n]), where=where, level=level)
        for n in ranked
    ]


def _launchers(kernels, on_cpu):
    """(kernel, name of the CPU operator that launched it, that operator's id) for each kernel."""
    by_id = {e.id: e for e in on_cpu}
    # torch.profiler folds an operator into its parent of the same name (EventList._remove_dup_nodes),
    # handing the parent its kernels; and torch 2.11's events (the GPU image's) have no linked_correlation_id.
    # Those kernels are found by name and duration instead: the n-th such kernel to run, in the n-th
    # operator (by start) that holds one, as a stream runs its kernels in the order they were launched.
    holders = {}
    for e in sorted(on_cpu, key=lambda e: e.time_range.start):
        for k in e.kernels:
            holders.setdefault((k.name, k.duration), []).append(e)
    taken = {}
    for k in sorted(kernels, key=lambda k: k.time_range.start):
        op = by_id.get(getattr(k, "linked_correlation_id", None))
        if op is None:
            key = (k.name, k.self_device_time_total)
            found = holders.get(key, [])
            n = taken[key] = taken.get(key, -1) + 1
            op = found[min(n, len(found) - 1)] if found else None
        yield (k, op.name, id(op)) if op is not None else (k, "(no operator recorded)", id(k))


def _what(rows):
    """'device kernels', 'operators' (by device time) or 'operators' (by CPU time), and where."""
    where = rows[0]["where"] if rows else "cpu"
    level = rows[0].get("level", "operators") if rows else "operators"
    return ("device kernels" if where == "device" and level == "kernels" else "operators"), where


def format_top_operators(rows):
    what, where = _what(rows)
    title = f"top {len(rows)} {what} by self {where} time while profiling"
    title += " (shares of the time the device was busy):" if where == "device" else ":"
    column = "kernel" if what == "device kernels" else "operator"
    lines = [title, f"{column:44s} {'self ms':>10s} {'share':>7s} {'calls':>7s}"]
    for r in rows:
        lines.append(f"{r['name'][:44]:44s} {r['self_ms']:10.2f} {100 * r['share']:6.1f}% {r['calls']:7d}")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def draw_top_operators(rows, path):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.2))
    names = [r["name"] for r in rows][::-1]
    ax.barh(names, [r["self_ms"] for r in rows][::-1], color="tab:blue")
    what, where = _what(rows)
    ax.set_xlabel(f"self {where} time (ms) over the profiled steps")
    ax.set_title(f"most expensive {what}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- compile warnings ------------------------------------------------------------------

# torch/_dynamo/variables/functions.py (torch 2.14.1, in the lru_cache wrapper's `call_function`)
# warns once per call site, through torch._dynamo.utils.warn_once, i.e. warnings.warn(UserWarning):
#   "Dynamo detected a call to a `functools.lru_cache`-wrapped function at 'upsampling.py:156'.
#    Dynamo ignores the cache wrapper and directly traces the wrapped function. Silent incorrectness
#    is only a *potential* risk, not something we have observed. ..."
# diffusers' Upsample2D.forward (models/upsampling.py, lines 156 and 180 in diffusers 0.42.1) calls
# `is_torch_version("<", "2.1")`, an lru_cache'd comparison of two version strings: tracing through
# the cache gives the same constant, so the warning is harmless there. Only that call site is
# silenced; an lru_cache call anywhere else still warns.
KNOWN_COMPILE_WARNINGS = (
    r"Dynamo detected a call to a `functools\.lru_cache`-wrapped function at 'upsampling\.py:\d+'\. "
    r"Dynamo ignores the cache wrapper and directly traces the wrapped function\."
    r"(?s:.*)[/\\]diffusers[/\\]models[/\\]upsampling\.py\", line \d+, in forward",
)


def quiet_known_compile_warnings():
    """Silence the Dynamo warnings known to be harmless for this model (above); nothing else."""
    for message in KNOWN_COMPILE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


# --- plots of a run ---------------------------------------------------------------------

PLOTS = {
    # tag: (file name, y label)
    "loss": ("loss.png", "loss (mean over the log interval)"),
    "lr": ("lr.png", "learning rate"),
    "images_per_s": ("images_per_s.png", "images/s"),
    "mfu": ("mfu.png", "MFU (fraction of peak)"),
}


def read_scalars(run_dir):
    """{tag: ([steps], [values])} from the run's tensorboard logs, sorted by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for events in sorted((Path(run_dir) / "logs").rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})  # a resume re-logs steps
    return {tag: (sorted(values), [values[s] for s in sorted(values)]) for tag, values in found.items()}


def smooth(values, weight=0.9):
    """Tensorboard-style exponential smoothing, debiased so the first points are not pulled to 0."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i))
    return out


def draw_run_plots(run_dir):
    """Draw run_dir/plots/*.png from the logged scalars; returns {tag: (steps, values)} as drawn."""
    plt = _pyplot()
    scalars = read_scalars(run_dir)
    out = Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    drawn = {}
    for tag, (filename, label) in PLOTS.items():
        if tag not in scalars:
            continue
        steps, values = scalars[tag]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, values, color="tab:blue", alpha=0.4 if tag == "loss" else 1.0, label="raw")
        if tag == "loss" and len(values) > 2:
            ax.plot(steps, smooth(values), color="tab:blue", label="smoothed")
            ax.set_yscale("log")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=100)
        plt.close(fig)
        drawn[tag] = (steps, values)
    return drawn


# --- run manifest -----------------------------------------------------------------------


def git_commit():
    """The commit of the code that ran (with '-dirty' for local changes), or None outside git."""
    here = Path(__file__).resolve().parents[2]  # the repository's root
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


def library_versions():
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for name in ("torch", "torchvision", "diffusers", "accelerate", "datasets", "numpy"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def device_facts(device, num_processes):
    facts = dict(type=device.type, name=device.type, count=num_processes, cuda=None, driver=None)
    if device.type == "cuda":
        facts.update(name=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
        try:
            facts["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10,
            ).stdout.split("\n")[0].strip() or None  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            pass
    return facts


def peak_memory_gib(device):
    """Peak memory of this process: allocated on the GPU, or resident on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def now_iso():
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def environment(device, command):
    """What a benchmark's numbers were measured on and with (the versions, as in run.json).

    `command`: the command line that measured them, as a list of words.
    """
    facts = device_facts(device, 1)
    env = dict(
        device=facts["name"] if device.type == "cuda" else cpu_name(),
        device_type=device.type,
        # torch's own version keeps its build tag (+cu130), which the package metadata drops
        **library_versions() | dict(torch=torch.__version__),
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if device.type == "cuda" else None,
        driver=facts["driver"],
        cpu_threads=torch.get_num_threads(),
        git_commit=git_commit(),
        date=now_iso(),
        command=" ".join(command),
    )
    if device.type == "cpu" and hasattr(os, "getloadavg"):
        # A shared machine's other work slows every row: say how busy it was.
        env["load_average_1min_at_start"] = os.getloadavg()[0]
    return env


def device_tag(env):
    """The device's name as a file-name part: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")


def environment_lines(env):
    """The environment as the first lines of a benchmark's printout."""
    keys = ("device", "torch", "diffusers", "cuda", "cudnn", "driver", "python", "cpu_threads",
            "load_average_1min_at_start", "git_commit", "date", "command")  # fmt: skip
    return [f"{key:12s} {env[key]}" for key in keys if env.get(key) is not None]


def cpu_name():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} CPU ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} CPU ({os.cpu_count()} cores)"


def write_manifest(path, **fields):
    """run.json: everything about a run that one would need to compare or reproduce it."""
    fields = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in fields.items()}
    Path(path).write_text(json.dumps(fields, indent=2, default=str) + "\n")


# --- CLI ----------------------------------------------------------------------------------


def parse_args(argv=None):
    p = OneLineParser(prog="profiling.py", description="Plots of a finished or running run.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    plots = sub.add_parser("plots", help="draw RUN_DIR/plots/*.png from the run's tensorboard logs")
    plots.add_argument("run_dir", help="a train.py --output_dir")
    return p.parse_args(argv)


def main(args):
    with one_line_errors("profiling.py", interrupted="stopped: the plots drawn so far stay"):
        return plots_command(args)


def plots_command(args):
    run_dir = Path(args.run_dir)
    if not (run_dir / "logs").is_dir():
        raise ConfigError(f"{run_dir} has no logs/ folder: point at a train.py --output_dir")
    drawn = draw_run_plots(run_dir)
    if not drawn:
        raise ConfigError(f"no scalars logged in {run_dir / 'logs'} yet")
    for tag in drawn:
        print(run_dir / "plots" / PLOTS[tag][0])
    return 0
