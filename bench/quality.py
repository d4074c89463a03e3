"""The quality ladder: whole train.py runs on the built-in shapes or real photos, each scored offline.

    python -m bench --quality                                   # every row, to --quality_images images each
    python -m bench --quality --rows ddpm,v_prediction,edm --quality_images 8192
    python -m bench --quality --rows ddpm --train_args="--compile_mode auto"   # any speed setting, scored the same way
    python -m bench --quality --quality_data faces --rows lognormal_t_v,flow_em     # on scikit-image's LFW crops
    python -m bench --quality --quality_data labelled --rows lognormal_t_v,flow_em  # class-conditional, w = 1, 2, 3

--quality_data picks the images and the score. `shapes` (the default): the built-in shapes,
scored as they train (below). `faces`: scikit-image's 200 LFW crops (bench/faces.py), each
score the faces FD of --quality_samples images sampled from the run's checkpoint by
sample.py. `labelled`: scikit-image's photos as ten classes (bench/labelled.py), trained with
--class_conditional, each score the class match (with its standard error) and the photos FD
of --quality_samples images at every --quality_guidance w, beside the ceiling (the training
images' own match) and chance. On the photos the rows train --quality_images images as
--max_train_steps, and sample with the sampler the run was trained with.

Every row is the bare `python train.py` (the `small` preset at 32px on the
built-in shapes, batch 16) with a few flags changed, trained in a process of
its own to the same number of images, --quality_evals times scored along the
way by the offline shape score (metrics.py: a Fréchet distance and KID on the
features of a small network trained on the built-in images, and the fraction
of samples it recognises as valid shape images). Beside each score stand the
images seen, the run's images/s and its wall time, so that a row that trains
faster can be shown to train as good a model, and a row that trains better can
be weighed against what it costs.

It writes, into --output: the JSON of every row (rewritten after each), the
printed table (.txt) and a plot of the score against images seen (.png). Run
again with the same settings, it keeps the rows that JSON already holds and
trains the others, so a ladder stopped part-way goes on where it was.
"""

import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ddpm_train import config
from ddpm_train.perf import profiling
from ddpm_train.evaluation import sampling
from bench import faces, labelled
from ddpm_train.errors import ConfigError, one_line_errors

HERE = Path(__file__).resolve().parent.parent  # the repository's root: train.py

# The base every row changes: the small preset on the built-in shapes at batch 16 with an EMA,
# so that the batch_8, batch_4 and no_ema rows can show what the preset's batch 4 without an
# EMA buys. Its objective is DDPM (the rows were chosen on it; the `flow` rows and `edm` change it).
# The samplers are pinned to the deterministic DPM-Solver++ and Heun, so that rows
# compare training alone; the `sde_sampler` row measures the stochastic default.
BASE = ["--dataset", "shapes", "--model", "small", "--image_size", "32", "--train_batch_size", "16", "--ema", "standard",
        "--objective", "ddpm", "--sampler", "dpmsolver", "--churn", "0"]

# name -> (what it tests, the flags it changes). The rows of issue 18's list:
# the objective's parametrisation and weighting, the noise schedule, the
# optimiser and EMA, the sampler, the objective itself and the network.
# The small preset trains DDPM as `lognormal_t_v` does, at batch 4 and without an
# EMA, as chosen by this ladder (BENCHMARKS.md). The first rows are Ho et al.'s
# DDPM (HO: eps-prediction, uniform timesteps) with one thing changed; the
# rows after `lognormal_t_v` change it.
HO = ["--prediction_type", "epsilon", "--timestep_sampling", "uniform"]
ROWS = {
    "ddpm": ("Ho et al.'s DDPM: eps-prediction, uniform t, linear betas, lr 2e-3, EMA 0.9999 with warm-up, DPM-Solver++ 25",
             HO),
    "v_prediction": ("v-prediction (Salimans & Ho 2022)", [*HO, "--prediction_type", "v_prediction"]),
    "min_snr": ("min-SNR-5 loss weighting (Hang et al. 2023)", [*HO, "--snr_gamma", "5"]),
    "v_zero_snr": ("v-prediction with zero terminal SNR (Lin et al. 2024)",
                   [*HO, "--prediction_type", "v_prediction", "--zero_terminal_snr"]),
    "cosine_betas": ("the cosine noise schedule (Nichol & Dhariwal 2021)", [*HO, "--beta_schedule", "squaredcos_cap_v2"]),
    "cosine_min_snr": ("the cosine schedule with min-SNR-5 weighting",
                       [*HO, "--beta_schedule", "squaredcos_cap_v2", "--snr_gamma", "5"]),
    "v_min_snr": ("v-prediction with min-SNR-5 weighting", [*HO, "--prediction_type", "v_prediction", "--snr_gamma", "5"]),
    "lognormal_t": ("EDM's noise levels on DDPM's timesteps: ln sigma_t ~ N(-1.2, 1.2^2)", [*HO, "--timestep_sampling", "lognormal"]),
    "lognormal_t_v": ("lognormal_t with v-prediction: the small preset's DDPM",
                      ["--timestep_sampling", "lognormal", "--prediction_type", "v_prediction"]),
    "lognormal_t_v_wide": ("lognormal_t_v with EDM2's ImageNet-64 noise levels: ln sigma_t ~ N(-0.8, 1.6^2)",
                           ["--timestep_sampling", "lognormal", "--prediction_type", "v_prediction",
                            "--P_mean_std=-0.8,1.6"]),
    "small_deep": ("capacity: a 4x4 level and attention at 8x8 and 4x4 (4x the parameters, ~1.3x the cost)",
                   [*HO, "--model", "small_deep"]),
    "edm": ("the EDM objective (Karras et al. 2022, EDM2's weighting) on the same UNet, Heun 18 steps",
            ["--objective", "edm"]),
    "edm2tiny": ("an EDM2 network (Config G, 16 channels) with the EDM objective", ["--model", "edm2tiny", "--objective", "edm"]),
    "edm2small": ("an EDM2 network of the UNet's cost (Config G, 32 channels, 1.26M) with the EDM objective",
                  ["--model", "edm2small", "--objective", "edm"]),
    "flow": ("flow matching (SiT, SD3): logit-normal(0, 1) noise levels, velocity prediction, Euler 25 steps",
             ["--objective", "flow", "--sampler", "euler"]),
    "flow_heun": ("flow with Heun 13 steps (25 network evaluations)",
                  ["--objective", "flow", "--sampler", "heun", "--num_inference_steps", "13"]),
    "flow_em": ("flow with SiT's Euler-Maruyama SDE, 25 steps (flow's default sampler; beside sde_sampler)",
                ["--objective", "flow", "--sampler", "euler_maruyama"]),
    # On lognormal_t_v (the small preset trains it at batch 4, without an EMA):
    "lr_5e-4": ("a lower learning rate", ["--learning_rate", "5e-4"]),
    "batch_8": ("batch 8: twice the optimizer steps for the same images", ["--train_batch_size", "8"]),
    "batch_4": ("batch 4: four times the optimizer steps for the same images (the small preset's batch)",
                ["--train_batch_size", "4"]),
    "adam_beta2_0.99": ("AdamW beta2 0.99: second moments that follow a short run", ["--adam_betas", "0.95,0.99"]),
    # (--ema_max_decay does nothing here: the warm-up keeps the decay below 0.991 for the first 512 steps.)
    "ema_short": ("a shorter EMA: warm-up power 0.5, decay 0.956 at step 512 (0.991 by default)", ["--ema_power", "0.5"]),
    "no_ema": ("no EMA: the raw weights sample (the small preset's choice)", ["--ema", "none"]),
    "sde_sampler": ("SDE-DPM-Solver++, 25 steps, for the grids and the score (the default sampler)",
                    ["--sampler", "dpmsolver_sde"]),
    "ddim_50": ("DDIM, 50 steps, for the grids and the score", ["--sampler", "ddim", "--num_inference_steps", "50"]),
}  # fmt: skip

# What the ladder sets itself: --train_args may not.
OWN_FLAGS = ("--dataset", "--output_dir", "--num_epochs", "--max_train_steps", "--eval_every_epochs", "--shapes_num_images",
             "--class_conditional", "--checkpointing_steps")  # fmt: skip
DATA = {  # --quality_data: what the rows train on, and what scores them
    "shapes": "the built-in shapes at 32px, scored as they train (shape FD)",
    "faces": "scikit-image's 200 LFW crops at 32px (bench/faces.py), faces FD of sample.py's images",
    "labelled": "scikit-image's photos as 10 classes of 32px crops (bench/labelled.py), class-conditional, class match",
}


def add_arguments(p):
    q = p.add_argument_group("the quality ladder (whole train.py runs, scored offline; see bench/quality.py)")
    q.add_argument("--quality", action="store_true", help="train each --rows row and score it as it trains")
    q.add_argument("--rows", default=None, help=f"comma-separated rows (default: all): {', '.join(ROWS)}")
    q.add_argument("--quality_images", type=int, default=8192, help="images each row trains on (images seen)")
    q.add_argument("--quality_evals", type=int, default=2, help="scores along each row, evenly spaced, the last at the end")
    q.add_argument("--quality_samples", type=int, default=256, help="images generated for each score")
    q.add_argument("--quality_data", default="shapes", choices=list(DATA),
                   help="the images: the built-in shapes, the LFW crops (faces FD) or labelled photos (class match)")
    q.add_argument("--quality_guidance", default="1,2,3",
                   help="--quality_data labelled: the guidance scales w each score samples at, comma-separated")
    return q


def validate(args):
    """The rows to run, each with its train.py flags; a one-line ConfigError on a bad flag."""
    names = list(ROWS) if args.rows is None else [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in names if r not in ROWS]
    if unknown or not names:
        raise ConfigError(f"unknown --rows '{','.join(unknown)}': choose from {', '.join(ROWS)}")
    for name, low in dict(quality_images=16, quality_evals=1, quality_samples=2).items():
        if getattr(args, name) < low:
            raise ConfigError(f"--{name} must be at least {low} (got {getattr(args, name)})")
    args.guidance = sampling.parse_scales(args.quality_guidance, "--quality_guidance") if args.quality_data == "labelled" else []
    try:
        args.extra = shlex.split(args.train_args)
    except ValueError as e:
        raise ConfigError(f"--train_args is not a valid command line ({e})") from None
    taken = [f for f in args.extra if f.split("=")[0] in OWN_FLAGS]
    if taken:
        raise ConfigError(f"--train_args must not set {taken[0]}: the quality ladder sets it")
    rows = []
    for name in names:
        # checked on the built-in shapes (with their labels for `labelled`): the photos are written later
        resolved = config.resolve(config.parse_args(train_flags(args, name, "unused")))  # every row before the first trains
        row = dict(name=name, what=ROWS[name][0], flags=ROWS[name][1], model=resolved.model)
        if args.quality_data != "shapes":
            per_step = resolved.train_batch_size * resolved.gradient_accumulation_steps
            row["steps"] = max(args.quality_evals, args.quality_images // per_step)
        rows.append(row)
    Path(args.output).mkdir(parents=True, exist_ok=True)
    return rows


def train_flags(args, name, output_dir, data_dir=None, steps=None):
    """The bare run, the ladder's length and scoring, --train_args, then the row's own flags. On the
    photos (`data_dir` and `steps` given) `steps` steps, a checkpoint at each of the --quality_evals
    scores; without them, the flags checked on the built-in shapes."""
    epochs = args.quality_evals
    labels = ["--class_conditional"] if args.quality_data == "labelled" else []
    if args.quality_data == "shapes" or data_dir is None:
        length = ["--shapes_num_images", str(args.quality_images // epochs), "--num_epochs", str(epochs)]
        scoring = ["--eval_every_epochs", "1", "--eval_num_samples", str(args.quality_samples), "--save_images_epochs", "1",
                   "--checkpointing_steps", str(10**9), "--checkpoints_total_limit", "1"]  # fmt: skip
        base = BASE
    else:  # no FID while training (Inception needs a download): sample.py scores the checkpoints afterwards
        length = ["--max_train_steps", str(steps)]
        scoring = ["--checkpointing_steps", str(max(1, steps // epochs)), "--save_images_epochs", str(10**6)]
        base = [data_dir if flag == "shapes" else flag for flag in BASE]
    return [
        *base, *labels, *length, *scoring, "--seed", str(args.seed),
        "--output_dir", output_dir, "--no-resume", *args.extra, *ROWS[name][1],
    ]  # fmt: skip


def prepare_data(args, work):
    """The photos' folder to train on and their scorer, written and fitted once for the ladder:
    (data_dir, scorer, trust); (None, None, None) for the built-in shapes."""
    if args.quality_data == "faces":
        folder = Path(work) / "faces"
        faces.write(folder)
        return folder, faces.Scorer(faces.read_grey(folder)), None
    if args.quality_data == "labelled":
        folder = Path(work) / "labelled"
        labelled.write(folder)
        judge = labelled.Judge(folder)
        ceiling = judge.match(judge.train, judge.labels)
        trust = dict(classes=judge.names, ceiling=ceiling["match"], ceiling_per_class=ceiling["per_class"],
                     chance=1 / len(judge.names))  # fmt: skip
        return folder / "train", judge, trust
    return None, None, None


def sampler_flags(run_config):
    """sample.py's flags that sample as the run sampled its grids: its sampler, steps and churn (EDM's)."""
    steps = ["--num_inference_steps", str(run_config["num_inference_steps"])] if run_config.get("num_inference_steps") else []
    sampler = ["--sampler", run_config["sampler"]] if run_config.get("sampler") else []
    return [*steps, *sampler, "--churn", str(run_config.get("churn", 0))]  # the churn: EDM's Heun sampler's alone


def score_checkpoint(args, checkpoint, run_config, scorer, generated):
    """One evaluation of a photo row: sample.py's images from `checkpoint` (into `generated`), scored:
    {"faces_fd": FD} or {"match": {w: class_match}}; and the folders of the images, by w. A failed
    sample.py raises RuntimeError with its last line."""
    common = ["--num_images", str(args.quality_samples), "--batch_size", str(min(64, args.quality_samples)),
              "--seed", str(args.seed), *sampler_flags(run_config)]  # fmt: skip
    folders = {}
    for w in args.guidance or [None]:
        out = Path(generated) / ("samples" if w is None else f"w{w:g}")
        guided = [] if w is None else ["--guidance_scale", f"{w:g}"]
        cmd = [sys.executable, str(HERE / "sample.py"), str(checkpoint), "--output", str(out), *common, *guided]
        done = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True)
        if done.returncode != 0:
            lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
            raise RuntimeError(lines[-1] if lines else f"sample.py: exit code {done.returncode}")
        folders[w] = out
    if args.quality_data == "faces":
        return dict(faces_fd=scorer.fd(faces.read_grey(folders[None]))), folders
    matches = {}
    for w, out in folders.items():
        images, asked = labelled.read_generated(out, scorer.names, run=checkpoint)
        matches[f"{w:g}"] = scorer.score(images, asked)
    return dict(match=matches), folders


def run_row(args, row, output_dir, data_dir=None, scorer=None):
    """Train one row in its own process; its scores from eval_results.json (the shapes) or from its
    checkpoints sampled by sample.py (the photos), its pace from run.json."""
    flags = train_flags(args, row["name"], str(output_dir), None if data_dir is None else str(data_dir), row.get("steps"))
    cmd = [sys.executable, str(HERE / "train.py"), *flags]
    done = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True)
    result = dict(row, command=shlex.join(cmd), returncode=done.returncode)
    printed = [line.rsplit("\r", 1)[-1] for line in (done.stdout + done.stderr).split("\n")]  # a progress bar's last state
    (Path(args.output) / f"{args.tag_prefix}_{row['name']}-stdout.txt").write_text("\n".join(printed) + "\n")
    manifest, scores = Path(output_dir) / "run.json", Path(output_dir) / "eval_results.json"
    if done.returncode != 0 or not manifest.is_file() or (data_dir is None and not scores.is_file()):
        lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        return result | dict(status="error", reason=lines[-1] if lines else f"exit code {done.returncode}")
    run = json.loads(manifest.read_text())
    per_step = run["config"]["global_batch_size"]
    if data_dir is None:
        evals = [dict(images_seen=e["step"] * per_step, **{k: e.get(k) for k in ("step", "fid", "kid_mean", "kid_std", "valid_fraction")})
                 for e in json.loads(scores.read_text())]  # fmt: skip
    else:
        evals = []
        every = max(1, row["steps"] // args.quality_evals)
        at = sorted({min(row["steps"], every * j) for j in range(1, args.quality_evals)} | {row["steps"]})
        try:
            for step in at:
                checkpoint = Path(output_dir) / "checkpoints" / f"checkpoint-{step}"
                found, folders = score_checkpoint(args, checkpoint, run["config"], scorer, Path(output_dir) / f"generated-{step}")
                evals.append(dict(step=step, images_seen=step * per_step, **found))
        except (RuntimeError, SystemExit) as e:
            return result | dict(status="error", reason=f"scoring: {e}")
        keep_sample_grids(args, row, folders, scorer, checkpoint)
    grid = sorted((Path(output_dir) / "samples").glob("*.png"))
    if grid:  # the last grid, kept beside the results
        (Path(args.output) / f"{args.tag_prefix}_{row['name']}.png").write_bytes(grid[-1].read_bytes())
    parts = run["time_breakdown_s"]
    return result | dict(
        status="ok",
        params=run["config"]["params"],
        images_seen=run["steps"] * per_step,
        evals=evals,
        images_per_s=run["images_per_s"],
        train_wall_s=run["train_wall_s"] - parts.get("evaluation", 0) - parts.get("sampling", 0),
        final_loss=run["final_loss"],
    )


def keep_sample_grids(args, row, folders, scorer, checkpoint):
    """The last evaluation's samples beside the results: sample.py's grid (faces), or a row of 8 a
    class at each w (labelled), as {tag}_{row}_samples.png or {tag}_{row}_w{w}.png."""
    if args.quality_data == "faces":
        grid = folders[None] / "grid.png"
        if grid.is_file():
            (Path(args.output) / f"{args.tag_prefix}_{row['name']}_samples.png").write_bytes(grid.read_bytes())
        return
    for w, out in folders.items():
        images, asked = labelled.read_generated(out, scorer.names, run=checkpoint)
        labelled.class_grid(images, asked, len(scorer.names)).save(Path(args.output) / f"{args.tag_prefix}_{row['name']}_w{w:g}.png")


def finished_rows(path, result):
    """{name: row} of the rows an earlier ladder in `path` trained with the same settings (the
    same images, scores, samples, base and --train_args, the same data and guidance, and the same row flags)."""
    if not path.is_file():
        return {}
    earlier = json.loads(path.read_text())
    same = all(earlier.get(k) == result[k] for k in ("images", "evals", "samples", "base", "train_args"))
    same = same and all(earlier.get(k, d) == result.get(k, d) for k, d in (("data", "shapes"), ("guidance", [])))
    return {r["name"]: r for r in earlier["rows"] if same and r["status"] == "ok" and r["flags"] == ROWS[r["name"]][1]} if same else {}


def format_table(result):
    data = result.get("data", "shapes")  # a ladder from before --quality_data: the shapes
    where = {"shapes": "on the built-in shapes", "faces": "on the LFW crops", "labelled": "on the labelled photos"}[data]
    says = {"shapes": "shape FD: lower is better", "faces": "faces FD: lower is better",
            "labelled": "at each w: class match, % ± binomial SE, higher is better; photos FD, lower is better"}[data]  # fmt: skip
    lines = [f"quality ladder: {result['images']} images per row at 32px {where}, scored "
             f"{result['evals']} times on {result['samples']} samples ({says})"]  # fmt: skip
    if data == "labelled":
        trust = result["trust"]
        lines.append(f"class match of the training images themselves (the ceiling) {100 * trust['ceiling']:.1f}%, "
                     f"chance {100 * trust['chance']:.1f}% ({len(trust['classes'])} classes, asked in equal shares)")  # fmt: skip
    scores = {"shapes": ["shape FD", "KID", "valid %"], "faces": ["faces FD"],
              "labelled": [f"w={w:g}" for w in result.get("guidance", [])]}[data]  # fmt: skip
    header = ["row", "params", "images", *scores, "img/s", "train s", "what it tests"]
    rows = [header]
    for r in result["rows"]:
        if r["status"] != "ok":
            rows.append([r["name"], f"{r['status']}: {r['reason']}"])
            continue
        last = r["evals"][-1]
        if data == "shapes":
            cells = [f"{last['fid']:.4g}", f"{last['kid_mean']:.4g}",
                     "n/a" if last["valid_fraction"] is None else f"{100 * last['valid_fraction']:.0f}"]  # fmt: skip
        elif data == "faces":
            cells = [f"{last['faces_fd']:.4g}"]
        else:
            cells = [f"{100 * m['match']:.1f} ± {100 * m['se']:.1f}" + (f", {m['fd']:.3g}" if "fd" in m else "")
                     for m in last["match"].values()]  # fmt: skip
        rows.append([
            r["name"], f"{r['params']:,}", str(r["images_seen"]), *cells,
            "n/a" if r["images_per_s"] is None else f"{r['images_per_s']:.1f}", f"{r['train_wall_s']:.0f}", r["what"],
        ])  # fmt: skip
    full = [r for r in rows if len(r) == len(header)]
    widths = [max(len(r[c]) for r in full) for c in range(len(header))]
    for r in rows:
        cells = r if len(r) == len(header) else [r[0], r[1]]
        lines.append("  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)).rstrip())
    return lines


def draw(result, path):
    """The score against images seen, one line per row (labelled: per row and w)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = result.get("data", "shapes")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in result["rows"]:
        if r["status"] != "ok":
            continue
        seen = [e["images_seen"] for e in r["evals"]]
        if data == "labelled":
            for w in result.get("guidance", []):
                ax.plot(seen, [100 * e["match"][f"{w:g}"]["match"] for e in r["evals"]], "o-", label=f"{r['name']} w={w:g}")
        else:
            ax.plot(seen, [e["fid" if data == "shapes" else "faces_fd"] for e in r["evals"]], "o-", label=r["name"])
    ax.set_xlabel("images seen")
    if data == "labelled":
        trust = result["trust"]
        ax.axhline(100 * trust["ceiling"], color="k", ls="--", lw=0.8, label="the training images (ceiling)")
        ax.axhline(100 * trust["chance"], color="k", ls=":", lw=0.8, label="chance")
        ax.set_ylabel("class match, % (higher is better)")
    else:
        ax.set_ylabel(f"{'shape' if data == 'shapes' else 'faces'} FD (lower is better)")
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    env = result["environment"]
    where = {"shapes": "built-in shapes", "faces": "LFW crops", "labelled": "labelled photos"}[data]
    ax.set_title(f"quality ladder, {where} at 32px; {env['device']}, torch {env['torch']}, {env['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args):
    """Run the ladder: 0 when every row trained, 1 when one failed; a bad flag exits 2 with one line."""
    with one_line_errors("bench"):
        rows = validate(args)
    env = profiling.environment(torch.device("cpu") if not torch.cuda.is_available() else torch.device("cuda"),
                                ["python -m bench", *args.argv])  # fmt: skip
    lines = profiling.environment_lines(env)
    print("\n".join(lines))
    out = Path(args.output)
    tag = args.tag or f"{profiling.device_tag(env)}_quality" + ("" if args.quality_data == "shapes" else f"_{args.quality_data}")
    args.tag_prefix = tag
    result = dict(environment=env, images=args.quality_images, evals=args.quality_evals, samples=args.quality_samples,
                  base=BASE, train_args=args.extra, data=args.quality_data, guidance=args.guidance, rows=[])  # fmt: skip
    done = finished_rows(out / f"{tag}.json", result)
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as work:
        data_dir, scorer, trust = prepare_data(args, work)
        if trust is not None:
            result["trust"] = trust
        for row in rows:
            if row["name"] in done:  # a ladder stopped part-way goes on where it was
                print(f"  {row['name']}: kept from {out / tag}.json", flush=True)
                result["rows"].append(done[row["name"]])
                continue
            print(f"  {row['name']} ...", flush=True)
            result["rows"].append(run_row(args, row, Path(work) / row["name"], data_dir, scorer))
            (out / f"{tag}.json").write_text(json.dumps(result, indent=1) + "\n")  # after every row
    table = format_table(result)
    print("\n".join(table))
    (out / f"{tag}.txt").write_text("\n".join([*lines, "", *table]) + "\n")
    draw(result, out / f"{tag}.png")
    grids = {"shapes": "each row's last grid as {tag}_ROW.png", "faces": "each row's last training grid as {tag}_ROW.png "
             "and its scored samples as {tag}_ROW_samples.png", "labelled": "each row's last training grid as "
             "{tag}_ROW.png and 8 samples a class at each w as {tag}_ROW_wW.png"}[args.quality_data]  # fmt: skip
    print(f"\nwrote {out / tag}.json, .txt and .png, {grids.format(tag=tag)}, and what each row's train.py printed "
          f"as {tag}_ROW-stdout.txt")
    failed = [r["name"] for r in result["rows"] if r["status"] != "ok"]
    if failed:
        print(f"bench: {len(failed)} row(s) failed: {', '.join(failed)} (reasons in the table)", file=sys.stderr)
        return 1
    return 0
