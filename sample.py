"""Generate images from a trained run, and measure its FID and KID.

    python sample.py ddpm-output --num_images 64 --output samples/
    python sample.py ddpm-output --num_images 16 --sampler ddpm --num_inference_steps 1000 --output slow/
    python sample.py ddpm-output --fid --num_images 10000                  # against the run's training set
    python sample.py ddpm-output/best --fid --dataset path/to/images --fid_weights weights-inception.pth
    python sample.py ddpm-output --class_labels circle,square --guidance_scale 2 --output cfg/     # a conditional run
    python sample.py ddpm-output --guide small-run --guidance_scale 2 --output auto/            # autoguidance
    python sample.py text-run --prompt "a red square" --prompt "green" --guidance_scale 3 --output p/  # from captions
    python sample.py ddpm-output --fid --num_images 1024 --guidance_scale 1,1.5,2,3             # one score per w

RUN_DIR is a training run's --output_dir (its saved pipeline, or its newest
checkpoint while it has none), a pipeline folder (`best/`, a reconstructed
EMA from `ema.py reconstruct`) or one checkpoint folder. A checkpoint gives
the EMA weights unless --no-ema; a pipeline holds the EMA weights only. A run
trained without an EMA (--ema none) has its raw weights only: its pipeline
holds them, and both give them.

Into --output it writes 000000.png, 000001.png, ... and grid.png (the first
64 images). Image i starts from noise drawn from its own generator, seeded by
(--seed, i): the same seed gives the same files, whatever --batch_size.

The copy check runs on every run whose train_config.json names training images
this machine can open (--no-copies: not): the share of the samples that copy a
training image by Gu et al.'s criterion, printed (and in fid.json), and
copies.png in --output, the most copy-like samples each beside its nearest
training image (copies.py, docs/copies.md).

The samplers are diffusers schedulers built from the training schedule
(`samplers.make_scheduler`); train.py uses the same ones for its grids and FID. A run
whose train_config.json says "objective": "edm" samples with EDM's
Heun sampler instead (`samplers.edm_heun_sample`, 18 steps by default), stochastic
(`--churn`, EDM's S_churn; 0 for the deterministic one). A flow run samples with
Euler (its default), Heun or SiT's Euler-Maruyama SDE sampler (`samplers.make_flow_sampler`).
Every sampler takes classifier-free guidance and autoguidance through
`sampling.Guided`, which combines the network's outputs (docs/conditional.md).
"""

from ddpm_train import errors  # noqa: I001 (first: the standard library only)

if __name__ == "__main__":  # a Ctrl-C while torch and diffusers import: one line, not their traceback
    errors.quit_on_ctrl_c("sample.py")

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch

from ddpm_train.data import captions
from ddpm_train.training import checkpoint
from ddpm_train.evaluation import copies
from ddpm_train.data import pixels
from ddpm_train.evaluation import metrics
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.diffusion import samplers
from ddpm_train.evaluation import sampling
from ddpm_train import sizes
from ddpm_train.errors import ConfigError, OneLineParser, one_line_errors
from ddpm_train.training.rundir import RunDir

if __name__ == "__main__":
    errors.ctrl_c_raises()  # imported: main's own handling from here

# --- the command ---------------------------------------------------------------------


# What sampling writes into --output: the first image, the grid and the scores (their presence: samples already there).
WRITTEN = ("000000.png", "000000.tif", "grid.png", "fid.json")


def parse_args(argv=None):
    p = OneLineParser(prog="sample.py", description="Generate images from a trained run; measure FID and KID.")
    ddpm, edm, flow = objectives.DDPMObjective, objectives.EDMObjective, objectives.FlowObjective
    p.add_argument("run_dir", help="a run's --output_dir, a pipeline folder or a checkpoint folder")
    p.add_argument("--num_images", type=int, default=16, help="images to generate")
    p.add_argument("--output", default=None, help="folder for the PNGs and grid.png (optional with --fid)")
    p.add_argument("--batch_size", type=int, default=16, help="images generated at once")
    p.add_argument("--seed", type=int, default=0, help="image i's noise is seeded by (seed, i)")
    p.add_argument(
        "--sampler", default=None, choices=ddpm.samplers + flow.samplers,
        help=f"diffusers scheduler that samples a DDPM run (default: {ddpm.default_sampler}) or a flow run (default: "
             f"{flow.default_sampler}; {', '.join(flow.samplers)}); an EDM run always samples with EDM's Heun sampler",
    )  # fmt: skip
    p.add_argument("--churn", type=float, default=samplers.EDM_CHURN, help=samplers.CHURN_HELP)
    p.add_argument(
        "--num_inference_steps", type=int, default=None,
        help=f"sampling steps (default: {ddpm.default_steps}; an EDM run {edm.default_steps} Heun steps, {2 * edm.default_steps - 1} evaluations)",
    )  # fmt: skip
    p.add_argument(
        "--ema", action=argparse.BooleanOptionalAction, default=None,
        help="EMA weights (--no-ema: raw, checkpoints only; default: the EMA where the run kept one)",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")

    g = p.add_argument_group("classes and guidance")
    g.add_argument("--class_labels", default=None,
                   help="a conditional run: comma-separated class names or numbers, taken in turn by image i "
                        "(default: spread over the classes in runs; with --fid, drawn as in the data)")  # fmt: skip
    g.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a captioned run (--text_encoder): what to draw; repeat it for several, taken in turn by image i")  # fmt: skip
    g.add_argument("--prompt_file", default=None, metavar="FILE", help="a captioned run: prompts, one a line (after --prompt's)")
    g.add_argument("--guidance_scale", default="1",
                   help="w: classifier-free guidance of a conditional run, or autoguidance with --guide (1: none); "
                        "with --fid a comma-separated list, scored in turn")  # fmt: skip
    g.add_argument("--guide", default=None,
                   help="autoguidance: a run (pipeline or checkpoint folder) of the same data, objective and classes, "
                        "smaller or trained less, that guides this one (Karras et al. 2024)")  # fmt: skip

    p.add_argument("--copies", action=argparse.BooleanOptionalAction, default=True,
                   help=f"the copy check (docs/copies.md): the share of the first {copies.MAX_SAMPLES} samples that copy a "
                        f"training image of the run (Gu et al. 2023), and {copies.PICTURE} of the nearest pairs in --output; "
                        "--no-copies: none (it reads the whole training set: minutes for a large one)")  # fmt: skip

    f = p.add_argument_group("FID and KID")
    f.add_argument("--fid", action=argparse.BooleanOptionalAction, default=False, help="measure FID and KID")
    f.add_argument(
        "--dataset", default=None, help="reference images, as train.py's --dataset (default: the run's training set)"
    )
    f.add_argument("--dataset_config", default=None, help="Hub dataset configuration name")
    f.add_argument("--split", default=None, help="dataset split (default: the run's, else train)")
    f.add_argument("--image_column", default=None, help="column holding the images")
    f.add_argument("--fid_weights", default=None, help="Inception weights file, for machines without internet")
    return p.parse_args(argv)


def validate(args):
    for name in ("num_images", "batch_size", "num_inference_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.churn < 0:
        raise ConfigError(f"--churn must be at least 0 (got {args.churn:g})")
    if args.output is None and not args.fid:
        raise ConfigError("say where the images go with --output DIR (or measure them with --fid)")
    if args.output is not None:
        checkpoint.check_writable(args.output, "--output")
        written = [name for name in WRITTEN if (Path(args.output) / name).exists()]
        if written:  # an earlier sampling's images, written over one by one
            raise ConfigError(f"--output {args.output} already holds samples ({written[0]}): give another folder, "
                              "or move them away first")  # fmt: skip
    if args.fid and args.num_images < 2:
        raise ConfigError(f"--fid needs --num_images of at least 2 (got {args.num_images})")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ConfigError(f"--device {args.device}: not a device torch knows: use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: this machine has no CUDA GPU torch can use: use --device cpu")
    if not Path(args.run_dir).exists():
        raise ConfigError(f"{args.run_dir}: no such folder")
    if args.guide is not None and not Path(args.guide).exists():
        raise ConfigError(f"--guide {args.guide}: no such folder")
    args.guidance_scales = sampling.parse_scales(args.guidance_scale, "--guidance_scale")
    if len(args.guidance_scales) > 1 and not args.fid:
        raise ConfigError("several --guidance_scale values are for --fid: give one to write images")
    return args


def labels_of(args, config, net):
    """Image i's label: a captioned run's prompt (prompt_labels), else its class (class_labels_for), else None."""
    if (config or {}).get("text_encoder"):
        return prompt_labels(args, config, net)
    if args.prompt or args.prompt_file:
        raise ConfigError(f"--prompt is for a run trained from captions (--text_encoder); {args.run_dir} was not")
    return class_labels_for(args.class_labels, config, models.num_classes_of(net), args.num_images, args.seed, args.fid)


def prompt_labels(args, config, net):
    """Image i's label for a captioned run: prompt i (in turn) of --prompt and --prompt_file, each encoded by the run's
    text encoder, beside the empty prompt that guidance takes; the network attends to them (model.TextUNet)."""
    prompts = list(args.prompt or [])
    if args.prompt_file:
        try:
            prompts += [line.strip() for line in Path(args.prompt_file).read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompt_file {args.prompt_file}: cannot read it as UTF-8 text ({e})") from None
    if not prompts:
        raise ConfigError(f"{args.run_dir} was trained from captions: say what to draw with --prompt TEXT (or --prompt_file FILE)")
    encoder = captions.load_text_encoder(config["text_encoder"])
    embeddings, mask, lengths = captions.encode(encoder, prompts + [""], args.device)
    net.captions = captions.table_of(embeddings, mask, lengths)
    return torch.arange(args.num_images) % len(prompts)


def class_labels_for(spec, config, num_classes, count, seed, as_in_data):
    """Image i's label for a run with `num_classes` classes (None for an unconditional one).

    `spec`: --class_labels, names (the run's class_names) or numbers, taken in
    turn; None: spread over the classes, or with `as_in_data` drawn with the
    data's class frequencies (what FID compares with).
    """
    if not num_classes:
        if spec is not None:
            raise ConfigError("--class_labels is for a class-conditional run: this one was trained without labels")
        return None
    names = (config or {}).get("class_names") or [str(i) for i in range(num_classes)]
    if spec is None:
        counts = (config or {}).get("class_counts")
        return sampling.labels_as_in_data(counts, count, seed) if as_in_data and counts else sampling.spread_labels(num_classes, count)
    wanted = []
    items = [w.strip() for w in spec.split(",")]
    if any(not w for w in items) and any(items):
        raise ConfigError(f"--class_labels {spec!r} has an empty entry: give names or numbers separated by single commas")
    for item in (w for w in items if w):
        if item in names:
            wanted.append(names.index(item))
        elif item.isdigit() and int(item) < num_classes:
            wanted.append(int(item))
        else:
            raise ConfigError(f"--class_labels: no class {item!r} (the classes: {', '.join(names)}, or 0..{num_classes - 1})")
    if not wanted:
        raise ConfigError("--class_labels is empty: name at least one class")
    return torch.tensor([wanted[i % len(wanted)] for i in range(count)])


def main(args):
    with one_line_errors("sample.py", interrupted="stopped before the end; the images written so far stay"):
        return run(validate(args))


# How long a process of a launch by torchrun or accelerate launch waits for the others (its slowest batch, rank 0's
# reference statistics): hours at FID-50k's scale, and it fires only when a process hangs (one that dies ends it).
PROCESS_WAIT = timedelta(hours=12)


def processes(args):
    """(rank, world, group) of a launch by torchrun or `accelerate launch` (WORLD_SIZE > 1): a gloo process group
    that carries the images to rank 0, each process on its own GPU (cuda:LOCAL_RANK); (0, 1, None) otherwise.
    Every process has validated its flags before any joins (--output is looked at before rank 0 writes to it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=PROCESS_WAIT)
    args.device = device_of_process(args.device, int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), world, dist.group.WORLD


def device_of_process(device, local_rank):
    """A launched process's device: its own GPU, cuda:LOCAL_RANK, for `cuda` (the default on a GPU machine); a
    device named in full, or the CPU, as given."""
    return f"cuda:{local_rank}" if device == "cuda" else device


def run(args):
    rank, world, group = processes(args)
    try:
        return _run(args, rank, world, group)
    finally:
        if group is not None:
            torch.distributed.destroy_process_group()


def _run(args, rank, world, group):
    run_dir = Path(args.run_dir)
    source = RunDir(run_dir)
    config = source.config
    ema = source.kept_ema if args.ema is None else args.ema  # which weights sample, as recorded below
    net, training_config = source.load(ema=ema)
    net.to(args.device)
    decode = source.decoder(args.device)  # a latent run's VAE, as its train_config.json records it; else None
    # a network of pixels takes the channels its run recorded (1, 3 or 4); one of no run, grayscale or RGB
    recorded = (config or {}).get("image_channels")
    if decode is None and sampling.image_shape(net)[0] not in ([recorded] if recorded else [1, 3]):
        raise ConfigError(
            f"{run_dir} holds a network of {sampling.image_shape(net)[0]}-channel latents, in no run folder whose "
            "train_config.json names their VAE: sample it from its run's --output_dir (or a folder inside it)"
        )
    kind = objectives.of(source.objective)
    steps, sampler_name = args.num_inference_steps or kind.default_steps, args.sampler or kind.default_sampler
    if sampler_name not in kind.samplers:
        owner = next(o for o in objectives.OBJECTIVES.values() if sampler_name in o.samplers)  # the flag's choices
        raise ConfigError(f"--sampler {sampler_name} samples {owner.run_words}; {run_dir} is {kind.run_words}: "
                          f"choose one of {', '.join(kind.samplers)}")  # fmt: skip
    if training_config is None and config is not None:  # a run that saves no pipeline (a DiT's, EDM's)
        training_config = objectives.run_noise_scheduler(config).config
    kind.check_steps(steps, training_config)
    scheduler = kind.sampler(source.objective, sampler_name, training_config, source.setting("sigma_data", objectives.SIGMA_DATA),
                             args.churn, decode is None)  # fmt: skip
    sampler_name = getattr(scheduler, "name", sampler_name)  # EDM's: its Heun sampler, with its churn
    labels = labels_of(args, config, net)
    guide = sampling.load_guide(args.guide, config, args.device, main=(source, net)) if args.guide else None
    if labels is None and guide is None and any(w != 1 for w in args.guidance_scales):
        raise ConfigError(f"--guidance_scale guides a class-conditional run, or autoguides with --guide: {run_dir} has "
                          "no classes, so give --guide RUN (a weaker run or checkpoint) or drop --guidance_scale")  # fmt: skip
    # The Inception weights and the reference statistics before any sampling: rank 0 loads the network (a missing
    # file fails now) and looks for them; found nowhere, every process makes its share (make_reference).
    evaluation, failed = None, [None, False]  # rank 0's error, whether the statistics are to be made
    image_size = source.get("image_size") if decode is not None else sizes.of(*sampling.image_shape(net)[1:])
    channels = sampling.image_shape(net)[0] if decode is None else 3
    bits = pixels.pixels_of(config or {}).bits if decode is None else 8  # a 16-bit run's PNGs are 16-bit
    if args.fid and rank == 0:
        try:
            evaluation = metrics.SampleEvaluation(run_dir, source.folder, config, args, image_size)
            failed[1] = evaluation.reference is None
        except ConfigError as e:
            failed[0] = str(e)
            if group is None:
                raise
    if group is not None:
        torch.distributed.broadcast_object_list(failed, src=0, group=group)
        if failed[0] is not None:  # said by rank 0
            raise ConfigError(failed[0]) if rank == 0 else SystemExit(2)
    if failed[1]:
        make_reference(evaluation, metrics.reference_options(run_dir, source.folder, config, args), args, image_size,
                       rank, world, group)  # fmt: skip
    training = copy_training_images(source, image_size) if args.copies and rank == 0 else None
    output = Path(args.output) if args.output else None
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
    quiet = rank != 0  # rank 0 says what all did

    base = dict(
        run=str(run_dir), num_images=args.num_images, seed=args.seed, sampler=sampler_name,
        num_inference_steps=steps, ema=ema, guide=args.guide,
    )  # fmt: skip
    results, writes = [], output is not None and len(args.guidance_scales) == 1

    def written(batches):  # this process's batches (every world-th), each image saved as it comes, then at 8 bits
        for k, images in enumerate(batches):
            start = (rank + k * world) * args.batch_size
            for i, image in enumerate(images if writes else ()):
                sampling.save_image(image, output / f"{start + i:06d}.png")
            yield pixels.eight_bit(images)

    for w in args.guidance_scales:
        grid, measured, done = [], [], 0  # measured: the copy check's samples
        mine = sampling.generate_batches(net, scheduler, args.num_images, args.batch_size, args.seed, steps,
                                labels=labels, guidance_scale=w, guide=guide, decode=decode, shard=(rank, world),
                                bits=bits)  # fmt: skip
        shape = (channels, *sizes.height_width(image_size))
        for images in sampling.gathered(written(mine), args.num_images, args.batch_size, shape, rank, world, group):
            if evaluation is not None:
                evaluation.add(images, None if labels is None else labels[done : done + len(images)])
            if writes:
                grid.extend(images[: max(0, sampling.GRID_IMAGES - len(grid))])
            if training is not None:
                measured.extend(images[: max(0, copies.MAX_SAMPLES - len(measured))])
            done += len(images)
            print(f"generated {done}/{args.num_images}", end="\r", file=sys.stderr)
        if quiet:
            continue
        print(file=sys.stderr)
        result = dict(base, guidance_scale=w)
        if grid:
            sampling.save_grid(torch.stack(grid), output / "grid.png")
            print(f"wrote {args.num_images} images and grid.png to {output}" + (f" ({world} processes)" if world > 1 else ""))
        guided = len(args.guidance_scales) > 1 or w != 1 or guide is not None
        if evaluation is not None:
            result |= evaluation.result()
            print(f"guidance scale {w:g}: " * guided + metrics.format_scores(result))
        if training is not None:
            flips, picture = copies.trained_with_flips(config), output / copies.PICTURE if writes else None
            result |= copies.measure(torch.stack(measured), training, flips, args.device, picture)
            print(f"guidance scale {w:g}: " * guided + copies.format_line(result, flips, picture))
        results.append(result)
    if quiet:
        return None
    if evaluation is None:
        return results[0]
    best = metrics.lowest_fid(results)
    summary = dict(best, scales=results) if len(results) > 1 else best
    if len(results) > 1:
        print(f"best guidance scale: {best['guidance_scale']:g}")
    if output is not None:
        (output / "fid.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def copy_training_images(source, image_size):
    """The training images of the run `source` (a RunDir) for the copy check (copies.run_training_images), or
    None, said in a line, where there are none to compare with: a folder outside any run, or a training set
    that cannot be opened here (moved, or on the Hub and this machine offline)."""
    if source.config is None:
        print(f"no copy check: {source.path} is in no run folder whose train_config.json names its training images",
              file=sys.stderr)  # fmt: skip
        return None
    try:
        return copies.run_training_images(source.config, image_size)
    except ConfigError as e:
        print(f"no copy check: the run's training images cannot be opened ({e})", file=sys.stderr)
        return None


def make_reference(evaluation, options, args, image_size, rank, world, group):
    """The reference statistics that rank 0's `evaluation` found nowhere, made: every process embeds its share of
    the images (`options`' at `image_size`; on the built-in shapes the shape scorer's, rank 0's alone), summed
    to rank 0, which keeps them. A process's error stops every process (together)."""
    if metrics.uses_shape_score(options, args.fid_weights):
        world, group = 1, None
        if rank != 0:
            return

    def ready():
        if rank == 0:
            images = evaluation.images  # opened for the statistics' key
            return metrics.reference_images(options, image_size) if images is None else images, evaluation.extractor
        return metrics.reference_images(options, image_size), metrics.extractor_for(options, image_size, args.fid_weights)[0]

    try:
        images, extractor = together(ready, world, group)
        if rank == 0:
            print(metrics.computing_line(len(images), evaluation.key, world))
        statistics = metrics.statistics_of_share(images, extractor, args.device, args.batch_size, 0, rank, world, group)
        together(lambda: rank == 0 and evaluation.keep_reference(statistics), world, group)
    finally:
        if rank == 0:
            evaluation.release()  # made and kept, or failed: another run may make them


def together(work, world, group):
    """work() on every process of `group`; where it fails on any, every process stops: that one with its error,
    the others with exit code 2 and nothing said."""
    error, result = None, None
    try:
        result = work()
    except ConfigError as e:
        error = e
    if world > 1:
        errors = [None] * world
        torch.distributed.all_gather_object(errors, None if error is None else str(error), group=group)
        if error is None and any(errors):
            raise SystemExit(2)
    if error is not None:
        raise error
    return result


if __name__ == "__main__":
    main(parse_args())
