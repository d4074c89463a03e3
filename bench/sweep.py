"""Sweeps: whole `train.py` runs with one setting varied, time per epoch and images/s against it.

    python -m bench --sweep batch_size --values 32,64,128,256 --workload ref128
    python -m bench --sweep dataloader_num_workers --values 0,2,4,8   # the DataLoader, and the preloaded data
    python -m bench --sweep mixed_precision                           # no, bf16 (and fp16 on a GPU)
    python -m bench --sweep compile                                   # off, on
    python -m bench --sweep num_processes                             # 1, 2, 4, ... up to the GPUs present
    python -m bench --sweep model --workload edm2g                    # ddpm32 against edm2g at 32px, batch 512

The ladder (bench/speed.py) times one training step on a batch that
sits on the device. A sweep times what a user waits for: every point is a
`train.py` run in a process of its own (`accelerate launch` for several
processes) for --sweep_epochs epochs of --num_images images, with everything
not swept at train.py's defaults for the workload (plus --train_args). The
first epoch compiles and warms up; time per epoch is the median over the
epochs after it, read from the run's run.json (`epoch_times_s`: fetching and
decoding the data counts, sample grids and checkpoints do not), and images/s
is the images of an epoch over that time. The run's median step time, MFU,
data-wait share and peak memory come along from run.json.

The data-loader sweep streams the images through a DataLoader (train.py
--no-preload_data) with each number of workers, and runs once more with the
images preloaded (in GPU memory on a GPU), drawn as a line across. It needs
images to decode: without --dataset, the built-in shapes are written as JPEG
files at twice the training size (so that every image is decoded, resized and
cropped), in a temporary folder.

It writes, into --output, named by device, sweep and workload: the JSON of
every point (rewritten after each), the printed table (.txt) and the plot
(.png: time per epoch and images/s against the swept value).
"""

import contextlib
import io
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ddpm_train import config
from ddpm_train.data import shapes
from ddpm_train.networks import model as models
from ddpm_train.perf import profiling
from ddpm_train.errors import ConfigError, one_line_errors

HERE = Path(__file__).resolve().parent.parent  # the repository's root: train.py
TRAIN = str(HERE / "train.py")
PRELOADED = "preloaded"


def _ints(values, name, low):
    try:
        numbers = [int(v) for v in values]
    except ValueError:
        raise ConfigError(f"--sweep {name} takes whole numbers in --values (got '{','.join(values)}')") from None
    if min(numbers) < low:
        raise ConfigError(f"--sweep {name} takes --values of at least {low} (got '{','.join(values)}')")
    return sorted(set(numbers))


def _choices(values, name, allowed):
    wrong = [v for v in values if v not in allowed]
    if wrong:
        raise ConfigError(f"--sweep {name} takes --values from {', '.join(allowed)} (got '{','.join(wrong)}')")
    return list(dict.fromkeys(values))


def _gpu_count():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _default_processes():
    gpus = _gpu_count()
    if gpus == 1:
        raise ConfigError("--sweep num_processes needs more than one GPU (this machine has 1)")
    if gpus == 0:  # CPU processes (gloo) share the cores: this shows the overhead, not scaling
        return [1, 2]
    return sorted({2**k for k in range(int(math.log2(gpus)) + 1)} | {gpus})


# What each sweep varies: its default values, how --values are read, and the
# train.py flags that set one value. The data-loader sweep's extra point, the
# preloaded data, is added in `points`.
SWEEPS = {
    "batch_size": dict(
        what="per-process batch size (--train_batch_size)",
        defaults=lambda workload: [workload["batch_size"] * m // 2 for m in (1, 2, 4, 8)],
        read=lambda values: _ints(values, "batch_size", 1),
        flags=lambda v: ["--train_batch_size", str(v)],
    ),
    "dataloader_num_workers": dict(
        what="DataLoader worker processes (--no-preload_data --dataloader_num_workers)",
        defaults=lambda workload: [n for n in (0, 1, 2, 4, 8) if n <= (os.cpu_count() or 1)],
        read=lambda values: _ints(values, "dataloader_num_workers", 0),
        flags=lambda v: ["--no-preload_data", "--dataloader_num_workers", str(v)],
    ),
    "mixed_precision": dict(
        what="autocast precision (--mixed_precision)",
        defaults=lambda workload: ["no", "fp16", "bf16"] if torch.cuda.is_available() else ["no", "bf16"],
        # fp8 when asked (--values bf16,fp8 on a DiT workload): emulated, and slow, on a CPU; a UNet's is refused
        read=lambda values: _choices(values, "mixed_precision", ("no", "fp16", "bf16", "fp8")),
        flags=lambda v: ["--mixed_precision", v],
    ),
    "compile": dict(
        # on: what train.py does on a GPU (auto: default or CUDA graphs by the step's size); a CPU's auto is off
        what="torch.compile (--compile_mode off, and auto on a GPU or default on a CPU)",
        defaults=lambda workload: ["off", "on"],
        read=lambda values: _choices(values, "compile", ("off", "on")),
        flags=lambda v: ["--compile_mode", "off" if v == "off" else "auto" if torch.cuda.is_available() else "default"],
    ),
    "model": dict(
        what="network and objective (--model: a DDPM UNet against an EDM2 network, each with its own objective)",
        defaults=lambda workload: ["tiny", "edm2tiny"] if workload["image_size"] == 16 else ["ddpm32", "edm2g"],
        read=lambda values: _choices(values, "model", tuple(models.PRESETS)),
        flags=lambda v: ["--model", v],
    ),
    "num_processes": dict(
        what="processes (accelerate launch --num_processes; one per GPU), the per-process batch fixed",
        defaults=lambda workload: _default_processes(),
        read=lambda values: _ints(values, "num_processes", 1),
        flags=lambda v: [],  # the launcher's business
    ),
}

# A flag that --train_args may not set: the sweep sets it.
SWEPT_FLAGS = {
    "batch_size": ("--train_batch_size",),
    "dataloader_num_workers": ("--preload_data", "--no-preload_data", "--dataloader_num_workers"),
    "mixed_precision": ("--mixed_precision",),
    "compile": ("--compile_mode",),
    "model": ("--model", "--objective"),
    "num_processes": (),
}
OWN_FLAGS = ("--model", "--image_size", "--output_dir", "--num_epochs", "--max_train_steps", "--resume")


def add_arguments(p):
    s = p.add_argument_group("sweeps (whole train.py runs; see bench/sweep.py)")
    s.add_argument("--sweep", default=None, choices=tuple(SWEEPS), help="vary this and time whole epochs of train.py")
    s.add_argument("--values", default=None, help="comma-separated values to sweep (default: by sweep, see docs/performance.md)")
    s.add_argument("--sweep_epochs", type=int, default=3, help="epochs per point; the first is warm-up, not timed")
    s.add_argument("--num_images", type=int, default=2048, help="images per epoch (the built-in shapes)")
    s.add_argument("--dataset", default=shapes.BUILTIN, help="train.py --dataset for every point")
    s.add_argument(
        "--train_args",
        default="",
        help="more train.py flags for every point, in one quoted string (one flag alone: --train_args=--augment=none)",
    )
    return s


def validate(args, workloads):
    """Check the sweep's flags; returns the point list. One-line ConfigError on a bad one."""
    args.workload = args.workload or ("ref128" if torch.cuda.is_available() else "tiny")
    if args.batch_sizes or args.variants:
        raise ConfigError("--batch_sizes and --variants are for the ladder: with --sweep use --values")
    if args.workload not in workloads:
        raise ConfigError(f"--sweep runs one workload: pick --workload from {', '.join(workloads)}")
    if args.sweep_epochs < 2:
        raise ConfigError(f"--sweep_epochs must be at least 2: the first only warms up (got {args.sweep_epochs})")
    if args.num_images < 1:
        raise ConfigError(f"--num_images must be at least 1 (got {args.num_images})")
    try:
        args.extra = shlex.split(args.train_args)
    except ValueError as e:
        raise ConfigError(f"--train_args is not a valid command line ({e})") from None
    taken = [f for f in args.extra if f.split("=")[0] in SWEPT_FLAGS[args.sweep] + OWN_FLAGS]
    if taken:
        instead = "pick --workload" if taken[0] in ("--model", "--image_size") else "the sweep sets it"
        raise ConfigError(f"--train_args must not set {taken[0]}: {instead}")
    spec = SWEEPS[args.sweep]
    workload = workloads[args.workload]
    if args.values is None:
        values = spec["defaults"](workload)
    else:
        values = [v.strip() for v in args.values.split(",") if v.strip()]
        if not values:
            raise ConfigError(f"--values is empty: give the {args.sweep} values to sweep, separated by commas")
        values = spec["read"](values)
    if args.sweep == "num_processes" and _gpu_count() and max(values) > _gpu_count():
        raise ConfigError(f"--values asks for {max(values)} processes but this machine has {_gpu_count()} GPUs")
    try:
        Path(args.output).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write to --output {args.output} ({e.strerror})") from None
    # reference: not a swept value, drawn as a line across (the data-loader sweep's preloaded data)
    points = [dict(value=v, reference=False) for v in values]
    if args.sweep == "dataloader_num_workers":
        points.append(dict(value=PRELOADED, reference=True))
    for point in points:  # every point's train.py flags, checked now rather than after an hour
        base = train_flags(args, workload, point, dataset=args.dataset, output_dir="unused")
        settings = config.resolve(_parse_train_flags(base))
        per_step = settings.train_batch_size * settings.gradient_accumulation_steps * processes(args, point)
        if args.dataset == shapes.BUILTIN and args.num_images < per_step:
            raise ConfigError(f"--num_images {args.num_images} is less than one step of {per_step} images: raise it")
    return points


def _parse_train_flags(flags):
    """train.py's flags parsed (config.py), their one-line complaint (about --train_args) made a ConfigError."""
    complaint = io.StringIO()
    try:
        with contextlib.redirect_stderr(complaint):
            return config.parse_args(flags)
    except SystemExit:
        words = complaint.getvalue().strip().removeprefix("train.py: error: ")
        raise ConfigError(f"--train_args: {words}") from None


def processes(args, point):
    return point["value"] if args.sweep == "num_processes" else 1


def train_flags(args, workload, point, dataset, output_dir):
    """train.py's flags for one point: the workload, epochs that only train, --train_args, then the point's own."""
    flags = [
        "--model", workload["model"], "--image_size", str(workload["image_size"]),
        "--train_batch_size", str(workload["batch_size"]),
        "--dataset", dataset, "--shapes_num_images", str(args.num_images), "--seed", str(args.seed),
        "--num_epochs", str(args.sweep_epochs), "--output_dir", output_dir, "--no-resume",
        # one grid and one checkpoint, at the end: neither is in an epoch's time
        "--save_images_epochs", str(args.sweep_epochs + 1), "--checkpointing_steps", str(10**9),
        "--checkpoints_total_limit", "1",
    ]  # fmt: skip
    if processes(args, point) > 1 and not torch.cuda.is_available():
        flags.append("--cpu")  # several CPU processes talk over gloo
    if point["reference"]:
        own = ["--preload_data"]
    else:
        own = SWEEPS[args.sweep]["flags"](point["value"])
    return flags + args.extra + own


def command(args, point, flags):
    """One process runs train.py; several are started by accelerate's launcher (torchrun)."""
    n = processes(args, point)
    if n == 1:
        return [sys.executable, TRAIN, *flags]
    launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(n), "--num_machines", "1",
              "--dynamo_backend", "no"]  # fmt: skip
    return [sys.executable, *launch, TRAIN, *flags]


def process_environment(args, point):
    env = dict(os.environ)
    if args.sweep == "num_processes" and not torch.cuda.is_available():
        # CPU processes share the machine's cores, as GPU processes share nothing
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes(args, point)))
    return env


def write_shapes_folder(folder, num_images, side, seed):
    """The built-in shapes as JPEG files, for the DataLoader to decode."""
    from PIL import Image

    folder.mkdir(parents=True)
    for i, image in enumerate(shapes.make_shapes(num_images, side, seed=seed)):
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{i:05d}.jpg", quality=95)
    return str(folder)


def run_point(args, workload, point, dataset, output_dir):
    """Train one point in its own process(es); its numbers from the run's run.json."""
    cmd = command(args, point, train_flags(args, workload, point, dataset, str(output_dir)))
    done = subprocess.run(cmd, cwd=HERE, env=process_environment(args, point), capture_output=True, text=True)
    result = dict(point, processes=processes(args, point), command=shlex.join(cmd), returncode=done.returncode)
    manifest = Path(output_dir) / "run.json"
    if done.returncode != 0 or not manifest.is_file():
        lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        return result | dict(status="error", reason=lines[-1] if lines else f"exit code {done.returncode}")
    run = json.loads(manifest.read_text())
    timed = [e["seconds"] for e in run["epoch_times_s"] if e["epoch"] >= 1]  # epoch 0 compiles and warms up
    if not timed:
        return result | dict(status="error", reason="no whole epoch after the first was timed")
    config, parts = run["config"], run["time_breakdown_s"]
    images_per_epoch = config["steps_per_epoch"] * config["global_batch_size"]
    time_per_epoch_s = statistics.median(timed)
    stepping = sum(parts[p] for p in profiling.STEP_PHASES)
    return result | dict(
        status="ok",
        time_per_epoch_s=time_per_epoch_s,
        images_per_s=images_per_epoch / time_per_epoch_s,
        images_per_epoch=images_per_epoch,
        epoch_times_s=run["epoch_times_s"],
        data_path=config["data_path"],
        global_batch_size=config["global_batch_size"],
        steps_per_epoch=config["steps_per_epoch"],
        step_time_s_median=run["median_step_time_s"],
        step_images_per_s=run["images_per_s"],
        mfu=run["mfu"],
        hfu=run["hfu"],
        data_share=parts["data"] / stepping if stepping else None,
        peak_memory_gib=run["peak_memory_gib"],
        final_loss=run["final_loss"],
        output=[ln for ln in done.stdout.splitlines() if ln.startswith(("final: ", "where the time went"))],
    )


# --- output ---------------------------------------------------------------------------


def _label(point):
    return str(point["value"])


def format_table(result):
    s, points = result["sweep"], result["points"]
    lines = [
        f"sweep {s['name']}: {s['what']}; {s['workload']} ({s['model']} at {s['image_size']}px, batch {s['batch_size']} "
        f"unless swept), {s['epochs']} epochs of {s['num_images']} images; time per epoch: median of epochs 2 to {s['epochs']}",
    ]
    header = ["value", "data", "s/epoch", "img/s", "ms/step", "img/s (steps)", "MFU %", "data wait %", "peak GiB"]
    rows = [header]
    for p in points:
        if p["status"] != "ok":
            rows.append([_label(p), f"{p['status']}: {p['reason']}"])
            continue
        rows.append([
            _label(p), p["data_path"], f"{p['time_per_epoch_s']:.4g}", f"{p['images_per_s']:.1f}",
            f"{1e3 * p['step_time_s_median']:.4g}", f"{p['step_images_per_s']:.1f}",
            "n/a" if p["mfu"] is None else f"{100 * p['mfu']:.1f}",
            "-" if p["data_share"] is None else f"{100 * p['data_share']:.1f}",
            "n/a" if p["peak_memory_gib"] is None else f"{p['peak_memory_gib']:.2f}",
        ])  # fmt: skip
    full = [r for r in rows if len(r) == len(header)]
    widths = [max(len(r[c]) for r in full) for c in range(len(header))]
    for r in rows:
        lines.append("  ".join(f"{cell:<{w}}" for cell, w in zip(r, widths)) if len(r) == len(header) else f"{r[0]:<{widths[0]}}  {r[1]}")
    return lines


def draw(result, path):
    """Time per epoch and images/s against the swept value; the preloaded data as a line across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, env = result["sweep"], result["environment"]
    swept = [p for p in result["points"] if not p["reference"]]
    preloaded = [p for p in result["points"] if p["reference"] and p["status"] == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = list(range(len(swept)))  # evenly spaced, labelled with the values
    categorical = not all(isinstance(p["value"], int) for p in swept)  # precisions, off/on: bars
    for ax, key, ylabel in zip(axes, ("time_per_epoch_s", "images_per_s"), ("time per epoch (s)", "images/s")):
        ok = [(x, p[key]) for x, p in zip(xs, swept) if p["status"] == "ok"]
        if ok and categorical:
            ax.bar(*zip(*ok), width=0.5, color="C0")
        elif ok:
            ax.plot(*zip(*ok), "o-", color="C0", label="DataLoader (streamed)" if preloaded else None)
        for x, y in ok:
            ax.annotate(f"{y:.3g}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        for x, p in zip(xs, swept):
            if p["status"] != "ok":
                ax.annotate(p["status"], (x, 0), ha="center", va="bottom", fontsize=8, color="grey")
        if preloaded:
            where = "in GPU memory" if env["device_type"] == "cuda" else "in memory"
            ax.axhline(preloaded[0][key], ls="--", color="C1", label=f"preloaded ({where}): {preloaded[0][key]:.3g}")
        if key == "images_per_s" and s["name"] == "num_processes" and swept and swept[0]["status"] == "ok":
            one = swept[0]["images_per_s"] / swept[0]["value"]
            ax.plot(xs, [one * p["value"] for p in swept], ":", color="grey", label="linear scaling")
        ax.set_xticks(xs, [_label(p) for p in swept])
        ax.set_xlabel(s["what"], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 1.12 * ax.get_ylim()[1])  # from zero, with room for the labels above the points
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(
        f"{s['workload']}: {s['model']} at {s['image_size']}px, batch {s['batch_size']}; "
        f"{env['device']}, torch {env['torch']}, {env['date'][:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args, workloads, draw_if_possible):
    """Run the sweep: 0 when every point trained, 1 when one failed, 130 on Ctrl-C; a bad flag exits 2 with one line.

    `draw_if_possible(result, path)`: the ladder's, which says how to draw later without matplotlib.
    """
    with one_line_errors("bench"):
        points = validate(args, workloads)
    workload = workloads[args.workload]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = profiling.environment(device, ["python -m bench", *args.argv])
    lines = profiling.environment_lines(env)
    for line in lines:
        print(line)
    sweep = dict(
        name=args.sweep, what=SWEEPS[args.sweep]["what"], values=[p["value"] for p in points], workload=args.workload,
        **workload, epochs=args.sweep_epochs, num_images=args.num_images, dataset=args.dataset, train_args=args.extra,
    )  # fmt: skip
    result = dict(environment=env, sweep=sweep, points=[])
    out = Path(args.output)
    tag = args.tag or f"{profiling.device_tag(env)}_sweep-{args.sweep}_{args.workload}"
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as work:
        dataset = args.dataset
        if args.sweep == "dataloader_num_workers" and dataset == shapes.BUILTIN:
            side = 2 * workload["image_size"]
            print(f"writing {args.num_images} shapes as {side}px JPEG files for the DataLoader to decode", flush=True)
            dataset = sweep["dataset"] = write_shapes_folder(Path(work) / "images", args.num_images, side, args.seed)
            sweep["dataset_note"] = f"the built-in shapes written as {side}px JPEG files (quality 95), decoded every epoch"
        interrupted = False
        try:
            for i, point in enumerate(points):
                print(f"  {args.sweep} = {_label(point)} ...", flush=True)
                result["points"].append(run_point(args, workload, point, dataset, Path(work) / f"point-{i}"))
                (out / f"{tag}.json").write_text(json.dumps(result, indent=1) + "\n")  # after every point
        except KeyboardInterrupt:  # Ctrl-C: keep, print and draw the points measured so far
            interrupted = True
    table = format_table(result)
    print("\n".join(table))
    (out / f"{tag}.txt").write_text("\n".join([*lines, "", *table]) + "\n")
    print(f"\nwrote {out / tag}.json and .txt; {draw_if_possible(result, out / f'{tag}.png')}")
    if interrupted:
        print(f"bench: interrupted after {len(result['points'])} of {len(points)} points", file=sys.stderr)
        return 130
    failed = [_label(p) for p in result["points"] if p["status"] != "ok"]
    if failed:
        print(f"bench: {len(failed)} point(s) of the sweep failed: {', '.join(failed)} (reasons in the table)", file=sys.stderr)
        return 1
    return 0
