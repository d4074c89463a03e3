"""Train an image diffusion model (a diffusers UNet2DModel, EDM2's networks or a DiT/SiT transformer, with DDPM,
EDM or flow matching) and report honest FLOPs and utilization.

    python train.py                                   # built-in shapes, CPU-sized model
    python train.py --dataset path/to/images --image_size 64
    python train.py --dataset huggan/smithsonian_butterflies_subset \\
        --image_size 128 --train_batch_size 64 --num_epochs 50 --learning_rate 1e-4
    python train.py --config configs/cifar10-edm2-E.yaml   # a reference run, as a file (config.py)
    python train.py --dry_run                         # resolved config, parameters, FLOPs; no training

Resume a run: the same command again continues from its newest checkpoint
(`--resume CHECKPOINT` from another one).

What it writes into --output_dir: samples/NNNN.png (a grid from the EMA
weights, the same noise every time), the trained pipeline
(`DDPMPipeline.from_pretrained(output_dir)`), checkpoints/checkpoint-STEP/,
train_config.json and tensorboard logs under logs/. Every --logging_steps it
prints one line: s/step, images/s, TFLOP/step, TFLOP/s, MFU, HFU and the peak
they are measured against.
"""

import time

STARTED = time.perf_counter()  # before the imports: the "ready to train" line's first part

from ddpm_train import errors  # noqa: I001 (first: the standard library only)

if __name__ == "__main__":  # a Ctrl-C in the seconds torch and diffusers take to import: one line, not their traceback
    errors.quit_on_ctrl_c("train.py")

import collections
import contextlib
import json
import math
import shutil
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch

from ddpm_train.training import agreement
from ddpm_train.data import captions
from ddpm_train.training import checkpoint
from ddpm_train.perf import compiling
from ddpm_train.evaluation import copies
from ddpm_train.data import drawn
from ddpm_train.data import data
from ddpm_train.data import workers
from ddpm_train.data import batches
from ddpm_train.data import decoding
from ddpm_train.data import sources
from ddpm_train.data import shapes
from ddpm_train.training import ema as posthoc_ema
from ddpm_train.perf import flops
from ddpm_train.networks import fp8
from ddpm_train.data import autoencoder
from ddpm_train.data import latents
from ddpm_train.perf import memory
from ddpm_train.evaluation import metrics
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.perf import profiling
from ddpm_train.training import resume
from ddpm_train.training import rundir
from ddpm_train.evaluation import sampling
from ddpm_train import sizes
from ddpm_train.training import step
from ddpm_train.training import builder
from ddpm_train.config import network_size, parse_args, recorded, resolve
from ddpm_train.errors import ConfigError, RunError, one_line_errors

if __name__ == "__main__":
    errors.ctrl_c_raises()  # imported: main's own handling from here


def main(args):
    """Train, or with --dry_run describe the run. Errors are one line: exit code 2 for a bad
    flag, path or dataset, 1 when training cannot go on (disk full, non-finite loss with
    --on_fault stop); 143 after a SIGTERM and 130 after Ctrl-C, once the checkpoint is saved.
    Every exit, these and the normal end, leaves no process group behind and the output folder unlocked."""
    try:  # a second Ctrl-C in the loop, or a first one before it: no checkpoint
        with one_line_errors("train.py", interrupted="stopped without saving"):
            resume.keep_recorded_objective(args)  # a resumed run trains on with its own objective
            args = resolve(args)
            return describe(args) if args.dry_run else train(args)
    finally:
        workers.stop_workers()  # the DataLoader workers, which leave SIGTERM and SIGINT to this process
        checkpoint.RunLock.release_all()
        agreement.end_process_group()


def train(args):
    """Build the run, then loop: the next batch, the step, and whatever falls due after it."""
    run = Run(args)  # data, network, objective, optimizer, EMA; resumed where a checkpoint is; the step and its meter
    meter, train_step = run.meter, run.train_step  # step times, where the time went, the profiler, the printed lines
    meter.profile_when_steady(train_step)  # --profile records steps after those that compile or capture it
    with checkpoint.StopSignals() as signals, meter, run.checkpoints.published_on_error():
        for epoch in run.epochs():
            for batch in meter.timed_batches(run.batches_of(epoch)):
                with meter.first_step_clock():
                    losses = train_step(batch, run.step + 1)
                run.step += 1
                meter.step_done(losses, run.step)
                run.after_step(signals)  # checkpoint, stop signals
            meter.epoch_done(epoch, run.whole_epoch(epoch), run.step)
            run.after_epoch(epoch, signals)  # sample grid, evaluation; stop signals
    run.finish()  # the pipeline and run.json
    return run.config


# --- what the run is -----------------------------------------------------------------


def describe_run(args, device, world, num_images):
    """The resolved flags (with the settings apart: config.recorded) and what follows from them:
    train_config.json, and what --dry_run prints. `num_images` None: not known before the data loads."""
    # The denoiser's step: a latent run's at its latents' size and channels (the VAE encodes once, before it)
    cost = flops.step_flops(args.model, network_size(args), args.train_batch_size, args.gradient_checkpointing,
                            models.network_channels(vars(args)), args.token_routing, text_shape(args))  # fmt: skip
    images_per_step = args.train_batch_size * world * args.gradient_accumulation_steps
    steps_per_epoch = num_images // images_per_step if num_images else None
    total_steps = args.max_train_steps or (args.num_epochs * steps_per_epoch if steps_per_epoch else None)
    peak_flops, _ = flops.describe_peak(device, args.mixed_precision, args.allow_tf32)
    remembered = lambda mode, scope: compiling.remembered_compile_s(compiling.compile_key(args, device, mode, scope))  # noqa: E731
    plan = compiling.plan_compile(args, device, world, cost["model_flops"], total_steps, peak_flops, remembered)
    config = dict(
        recorded(args),
        num_processes=world,
        num_images=num_images,
        global_batch_size=images_per_step,
        steps_per_epoch=steps_per_epoch,
        total_train_steps=total_steps,
        total_epochs=math.ceil(total_steps / steps_per_epoch) if total_steps and steps_per_epoch else None,
        params=cost["params"],
        model_flops_per_step=cost["model_flops"] * args.gradient_accumulation_steps * world,  # all processes
        hardware_flops_per_step=cost["hardware_flops"] * args.gradient_accumulation_steps * world,
        step_compile_mode=plan.mode or "eager",
        step_compile_scope=plan.scope,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
    )
    return config, plan.why


def text_shape(args):
    """A captioned run's embeddings' (width, tokens), which its network attends to; None for other runs."""
    return (args.text_dim, args.text_length) if getattr(args, "text_dim", None) else None


def describe(args):
    """--dry_run: the resolved configuration, parameters and FLOPs, without loading any data."""
    from accelerate import PartialState

    state = PartialState(cpu=args.cpu)
    num_images = args.shapes_num_images if args.dataset == shapes.BUILTIN else None
    config, compile_why = describe_run(args, state.device, state.num_processes, num_images)
    if state.is_main_process:
        for key, value in config.items():
            print(f"{key:28s} {value}")
        for line in data.survey_lines(args):
            print(line)
        if args.vae:
            print(latent_words(args))
        flop = config["model_flops_per_step"]
        _, peak_words = flops.describe_peak(state.device, args.mixed_precision, args.allow_tf32)
        print(
            f"model {args.model}: {config['params']:,} parameters, {flop / 1e12:.4g} TFLOP per step "
            f"({flop / config['global_batch_size'] / 1e9:.2f} GFLOP per image, forward+backward); {peak_words}; "
            f"step {compile_why}"
        )
    return config


def latent_words(args):
    """A latent run's line: what the network takes, how the latents are normalised, and on a dry run
    offline what was assumed of the VAE."""
    size, found = sizes.with_channels(args.latent_size, args.latent_channels), args.latents
    norm = {"vae": "the VAE's scaling_factor", "dataset": "each channel's mean and std over the data",
            None: "the VAE's scaling_factor where its config.json sets one, else the data's mean and std"}  # fmt: skip
    line = (f"latents: the network takes {size} latents of --vae {found['source']} ({found['factor']}x smaller than "
            f"the {sizes.spelled(args.image_size)} images), normalised by {norm[args.latent_normalization]}")  # fmt: skip
    if found.get("assumed"):
        line += (f"; its config.json cannot be had offline, so {size} assumes Stable Diffusion's 8x, 4-channel VAE "
                 f"(training needs it: `hf download {found['source']} --local-dir DIR`, then --vae DIR)")  # fmt: skip
    return line


# Images decoded once and kept (unreadable ones remembered in their places: decoding.PreloadedImages).
PRELOADED = (torch.Tensor, decoding.PreloadedImages)

# With several processes, how long a process may wait in a collective, set explicitly (torch's defaults: NCCL 10
# minutes, gloo 30). STEP_WAIT: the default group's, that of the steps, a checkpoint's save and the starting line, each
# far under it. While the main process works between steps and the others wait, they wait in a gloo group of its own,
# for agreement.MAIN_WORK_WAIT.
STEP_WAIT = timedelta(minutes=15)

# Compile artifacts (torch.compiler's mega-cache) kept beside the run, so that a
# run resumed on a fresh machine, whose Inductor cache is empty, need not compile again.
COMPILE_CACHE_FILE = "compile_cache.bin"

# The samples of an evaluation (its first guidance scale's first ones) that the copy check compares with the training
# set (copies.check): its share of copies has a standard error of at most 1.6 points at 1,000; they are held meanwhile.
COPY_CHECK_SAMPLES = 1000


# --- setting a run up: what it trains on and where it starts ------------------------------


class RunData(NamedTuple):
    """What setting a run up found (set_up_data): the data it trains on, the checkpoint it starts from, and
    a latent run's latents and VAE (None for a run on pixels)."""

    images: object  # a tensor, decoding.PreloadedImages or a streamed dataset; a latent run's drawn.LatentDataset
    labels: object  # a conditional run's class of each image, else None
    class_names: object  # a conditional run's class names, else None
    start_from: object  # the checkpoint to continue from, or None
    flow_sigmas: object  # a flow run's σ draw (objectives.sigma_distribution), also in train_config.json; else None
    latent_space: object = None  # a latent run's VAE and normalisation, hashed: what resume compares
    latents: object = None  # a latent run's record for train_config.json: VAE, normalisation, cache
    decode: object = None  # a latent run's latents -> images, for the grids and FID
    vae: object = None  # a latent run's VAE: on the CPU but while grids and FID samples are decoded
    dataset_contents: object = None  # a latent run's: what its images hold (sources.Images.identity), for FID's key
    captions: object = None  # a captioned run's distinct captions, the empty one last (captions.caption_table)


class LatentSource(NamedTuple):
    """A latent run's VAE and dataset before anything is encoded (latent_source)."""

    vae: object  # loaded, on the CPU
    images: object  # the dataset to encode (data.images_to_encode)
    count: int
    class_names: object
    key: dict  # the latents cache's key (latents.cache_key)
    latent_space: dict  # the VAE and normalisation, hashed: what resume compares
    dataset_contents: object  # what the images hold (sources.Images.identity), for FID's key; None for the built-in data


def set_up_data(args, processes, unreadable):
    """The run's data and starting point (a RunData). Decoded (or generated) before the model is built, so
    that a bad path or file fails in seconds; a latent run's encoded to latents, or read from their cache.
    `unreadable` (decoding.Unreadable) counts the images that cannot be read. Too few images for one step: a ConfigError."""
    resume_from = args.resume if isinstance(args.resume, str) else None  # --resume CHECKPOINT
    flow_sigmas = objectives.sigma_distribution(vars(args))  # a flow run's σ draw, also in train_config.json
    # a captioned run's captions, read before any image decodes: a bad one stops the run here (captions.py)
    texts, choices = captions.caption_table(data.run_captions(args), args.grid_prompts) if args.text_encoder else (None, None)
    if args.vae:  # the checkpoint is chosen, and its latent space checked, before a dataset is encoded
        source = latent_source(args, unreadable)
        start_from = choose_start(args, processes, source.class_names, source.latent_space, flow_sigmas, resume_from)
        dataset, labels, record, decode = latent_data(args, source, processes)
        # a captioned run's latents are labelled by their images' indices (an unreadable image has none)
        found = RunData(dataset, labels if choices is None else choices[labels], source.class_names, start_from,
                        flow_sigmas, source.latent_space, record, decode, source.vae, source.dataset_contents,
                        captions=texts)  # fmt: skip
    else:
        images, labels, class_names = data.load_images(args, unreadable)
        start_from = choose_start(args, processes, class_names, None, flow_sigmas, resume_from)
        found = RunData(images, labels if choices is None else choices, class_names, start_from, flow_sigmas,
                        captions=texts)  # fmt: skip
    if len(found.images) < args.train_batch_size * processes.world * args.gradient_accumulation_steps:
        raise ConfigError(
            f"the dataset has {len(found.images)} images, fewer than one optimizer step takes ({args.train_batch_size} "
            f"x {processes.world} processes x {args.gradient_accumulation_steps} accumulation): "
            "lower --train_batch_size or --gradient_accumulation_steps"
        )
    return found


def choose_start(args, processes, class_names, latent_space, flow_sigmas, resume_from):
    """The checkpoint to continue from (resume.choose_start), checked against what the run is before
    anything is encoded: the flags, the processes, the classes, a latent run's latent space."""
    identity = dict(vars(args), num_processes=processes.world, num_classes=len(class_names) if class_names else 0,
                    latent_space=latent_space, flow_sigmas=flow_sigmas)  # fmt: skip
    chosen = [None]

    def choose():  # the main process's: one run at a time in a folder, and one choice for every process
        checkpoint.RunLock(Path(args.output_dir))  # held till train.main ends (RunLock.held)
        chosen[0] = resume.choose_start(args.output_dir, identity, args.resume is not False, resume_from,
                                        args.overwrite_output_dir)  # fmt: skip

    processes.on_main_process(choose)
    # the main process's choice on every process, not each its own: a node whose view of a shared disk lags
    # would pick an older one
    return processes.from_main(chosen)[0]


def latent_source(args, unreadable):
    """A latent run's VAE and dataset, nothing encoded yet (a LatentSource): the VAE loaded and hashed (its
    latent space, what resume compares), the dataset opened (its identity, count and classes) and the cache's key."""
    vae = autoencoder.load_vae(args.latents["source"], args.latents["subfolder"])  # config.resolve found it
    identity, images, count, class_names = data.images_to_encode(args, unreadable)
    key = latents.cache_key(identity, vae, args.image_size, center_crop=True, flips=data.random_flips(args))
    kind = args.latent_normalization
    latent_space = autoencoder.latent_space(key["vae"]["encoder_sha256"],
                                        dict(kind=kind) | (autoencoder.vae_constants(vae) if kind == "vae" else {}))  # fmt: skip
    # read once here, not again for FID's reference statistics (seconds a 100k files)
    contents = None if args.dataset == shapes.BUILTIN else {k: v for k, v in identity.items() if k not in data.LABELLING}
    return LatentSource(vae, images, count, class_names, key, latent_space, contents)


def latent_data(args, source, processes):
    """A latent run's data: (drawn.LatentDataset, labels, its record, decode). The latents of the dataset
    from their cache: when they are not there every process encodes its share of the dataset into it (one
    line says how fast; a cache hit decodes no image and says so), and reads the cache assembled. Each
    epoch draws each image's latent afresh (drawn.LatentCache.draw), normalised as the record (for
    train_config.json) says; `decode` turns latents into images for the grids and FID."""
    vae, key, name, device, say = source.vae, source.key, args.latents["source"], processes.device, processes.accelerator.print
    # Every process encodes its share on its own device (latents.cached_latents: the waits for the slowest
    # share in a gloo group of their own, with an explicit timeout); the main process decodes grids and FID.
    if processes.is_main:
        vae.to(device)
    cache = latents.cached_latents(vae, source.images, key, device=device, num_images=source.count,
                                   progress=processes.is_main, max_gib=data.preload_max_gib(args), log=say)  # fmt: skip
    # Encoded: its memory back to training (0.31 GiB for SD's VAE). Decoding grids and FID samples brings it
    # back to the device, and after_epoch sends it away again (docs/performance.md, Memory).
    vae.to("cpu")
    # EDM expects data of std sigma_data (0.5); DDPM's forward process, unit std (LDM's latents)
    target_std = objectives.of(args.objective).data_std(args)
    normalization = autoencoder.normalization(cache, vae, args.latent_normalization, target_std)
    low, high = min(normalization["normalized_std"]), max(normalization["normalized_std"])
    if normalization["kind"] == "vae" and not 0.5 * target_std <= low <= high <= 2 * target_std:
        say(
            f"warning: the VAE's scaling_factor leaves the latents of this data with a std of {low:.3g} to {high:.3g} "
            f"per channel, where the objective expects {target_std:g}: --vae {name},dataset normalises by their own"
        )  # fmt: skip
    where = Path(name).expanduser()
    record = dict(
        args.latents, vae=str(where.resolve()) if where.exists() else name, encoder_sha256=key["vae"]["encoder_sha256"],
        normalization=normalization, cache=str(cache.path), cache_key=key, memmapped=cache.memmapped,
        encode_seconds=cache.encode_seconds, images_per_second=cache.images_per_second,
    )  # fmt: skip
    decode = lambda z: autoencoder.decode(vae.to(z.device), z, normalization)  # noqa: E731  (the VAE joins the latents to decode)
    return drawn.LatentDataset(cache, normalization, seed=args.seed), cache.labels, record, decode


def prepare_reference(args, evaluator, processes, images, dataset_contents):
    """FID's reference statistics of the training images (`images`; a latent run's decoded from the dataset,
    whose `dataset_contents` were read with it): read where an earlier run (or this one, before a resume) left
    them, or waited for where another run is making them (metrics.claimed_reference), else made by every process
    embedding its share of the images (the shape scorer's on the built-in shapes: the main process's alone),
    summed to the main process, which keeps them for every later run. `evaluator`: the main process's."""
    found = [True]

    def find():  # what the images hold: a latent run's read with them, a streamed dataset's from it (not opened again)
        contents = dataset_contents if args.vae else (
            images.identity(args) if isinstance(images, sources.Images) else None)  # fmt: skip
        found[0] = evaluator.find_reference(contents)

    processes.on_main_process(find)
    try:
        if not processes.from_main(found)[0]:
            make_reference(args, evaluator, processes, images)
    finally:
        if processes.is_main:
            evaluator.release()  # made and kept, or failed: another run may make them


def make_reference(args, evaluator, processes, images):
    """The statistics prepare_reference found nowhere, made on every process and kept by the main process."""
    shared = processes.world > 1 and not metrics.uses_shape_score(vars(args), args.fid_weights)
    world, together = (processes.world, processes.on_every_process) if shared else (1, processes.on_main_process)
    ready = [None, None]  # this process's (images, extractor): an error in either stops every process here

    def prepare():
        extractor = evaluator.extractor if processes.is_main else metrics.extractor_for(vars(args), args.image_size, args.fid_weights)[0]
        ready[:] = metrics.reference_images(vars(args), args.image_size) if args.vae else images, extractor
        if processes.is_main:
            processes.accelerator.print(metrics.computing_line(len(ready[0]), evaluator.reference_key, world))

    together(prepare)
    statistics = [None]
    rank = processes.rank if shared else 0

    def embed():  # a share each, summed to the main process in the group that waits long enough for it
        statistics[0] = metrics.statistics_of_share(*ready, processes.device, metrics.fid_batch_size(args.eval_batch_size),
                                                    args.dataloader_num_workers, rank, world, processes.main_work_group)  # fmt: skip

    together(embed)
    processes.on_main_process(lambda: evaluator.keep_reference(statistics[0]))


# --- building a run: the accelerator, the pieces, what they hold -----------------------------------


def make_accelerator(args):
    """accelerate's Accelerator for the run: its device and processes, the autocast, gradient accumulation, the trackers."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    return Accelerator(
        cpu=args.cpu,
        # fp8: bf16 autocast, as accelerate's fp8 mode runs; the FP8 layers are builder.build's (fp8.py)
        mixed_precision="bf16" if args.mixed_precision == "fp8" else args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.logger == "none" else args.logger,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=str(Path(args.output_dir) / "logs")),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=STEP_WAIT)],
    )


def build_pieces(args, accelerator, total_steps, num_classes, lr_ref_steps, class_names=None):
    """Network, objective, optimizer, learning-rate schedule and EMA (builder.Pieces), as the speed ladder's rows
    build them (builder.build), prepared by accelerate and registered for checkpoints."""
    from accelerate.utils import broadcast

    pieces = builder.build(args, total_steps, accelerator.device, num_classes=num_classes, lr_ref_steps=lr_ref_steps,
                            write_ema=accelerator.is_main_process, prepare=accelerator.prepare,
                            unwrap=accelerator.unwrap_model, class_names=class_names)  # fmt: skip
    # EDM's u(sigma) was drawn from this process's own seed, and DDP does not hold it: every process takes rank 0's,
    # as it does the network's weights, so that they all learn one weighting and a resume (rank 0's) continues it
    for tensor in pieces.objective.state_dict().values():
        broadcast(tensor, from_process=0)
    accelerator.register_for_checkpointing(pieces.lr_scheduler)
    if any(True for _ in pieces.objective.parameters()):
        accelerator.register_for_checkpointing(pieces.objective)
    if pieces.ema is not None:
        accelerator.register_for_checkpointing(pieces.ema)
    pieces.model.train()
    return pieces


def memory_plan(args, pieces, world):
    """What this process will hold on its device (memory.Plan): the pieces' own bytes, and the activations of
    one micro-batch counted on the meta device; beside it, a captioned run's caption table in host memory."""
    step_of = (args.model, network_size(args), args.train_batch_size, models.network_channels(vars(args)), args.mixed_precision)
    count = memory.count_step(*step_of, args.gradient_checkpointing, text_shape(args), args.token_routing)
    trained = [*pieces.network.parameters(), *pieces.network.buffers(), *pieces.objective.parameters()]
    table = getattr(pieces.network, "captions", None)
    return memory.plan(trained, pieces.optimizer, pieces.ema, count, args.train_batch_size, world,
                       host=table.nbytes if table is not None else 0)  # fmt: skip


def announce(args, config, compile_why, accelerator, network, memory_plan, start_step, unreadable):
    """train_config.json (`config`), the trackers and the first lines of a run with steps to take, from `start_step`:
    what it trains, on what, how (`compile_why`: how its step is compiled; `network`: FP8's layers, said), what
    it will hold (`memory_plan`) and whether its checkpoints fit the disk. `unreadable`: images skipped so far."""
    output_dir, device = Path(args.output_dir), accelerator.device
    if accelerator.is_main_process:
        if args.overwrite_output_dir:  # the run it starts over: not before every check has passed
            shutil.rmtree(checkpoint.checkpoints_root(output_dir), ignore_errors=True)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "train_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        scalars = {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers("train", config=scalars)
    for line in data.survey_lines(args):
        accelerator.print(line)
    _, peak_words = flops.describe_peak(device, args.mixed_precision, args.allow_tf32)
    latent = f" as {sizes.with_channels(args.latent_size, args.latent_channels)} latents" if args.vae else ""
    skipped = f" ({unreadable} unreadable so far: skipped)" if unreadable else ""  # preloaded: all
    precision = fp8.describe(network, device) if args.mixed_precision == "fp8" else ""
    routed = f" ({network.routing.words(len(network.transformer_blocks))})" if args.token_routing else ""
    total_steps = config["total_train_steps"]
    accelerator.print(
        f"training {args.model} ({config['params']:,} parameters, --objective {args.objective}) "
        f"on {config['num_images']} images{skipped} at {sizes.spelled(args.image_size)}{latent}: "
        f"{total_steps} steps of {config['global_batch_size']} images, mixed precision {args.mixed_precision}{precision}, "
        f"{config['num_processes']} process(es) on {config['device']}; {config['model_flops_per_step'] / 1e12:.4g} TFLOP per "
        f"step{routed}; {peak_words}; step {compile_why}"
    )
    cuda = device.type == "cuda"
    # on a CPU the host memory free now (a container's limit included; None where unknown)
    capacity = torch.cuda.get_device_properties(device).total_memory if cuda else checkpoint.available_memory() or None
    accelerator.print(memory.plan_line(memory_plan, capacity, "this GPU" if cuda else "this machine's free memory",
                                       compiled=compiling.compiles(config["step_compile_mode"])))  # fmt: skip
    full = checkpoint.disk_warning(output_dir, memory_plan.state, start_step, total_steps, args.checkpointing_steps,
                                   args.checkpoints_total_limit)  # fmt: skip
    if full:
        accelerator.print(full)


# --- the run -------------------------------------------------------------------------------


class Run:
    """A training run: its pieces, built, and what it does between steps.

    Building it sets the run up first (set_up_data: the data, so that a bad path fails in seconds, and
    the checkpoint it starts from), then builds the network, objective, optimizer, learning-rate
    schedule and EMA (`pieces`), resumes from that checkpoint where there is one, and builds the step
    (`train_step`) and its `meter`. `step` counts optimizer steps taken; `epochs()` is what is left to
    train (nothing for a run already trained). Between steps it writes checkpoints (`checkpoints`),
    sample grids and evaluations (`evaluation`), and stops for a signal; at the end it saves the
    pipeline and run.json. Work only the main process does goes through
    `processes.on_main_process`, so that a failure there stops every process.
    """

    def __init__(self, args):
        from accelerate.utils import set_seed

        self.startup = profiling.StartupClock(STARTED)
        self.startup.mark("imports")
        self.args, self.output_dir = args, Path(args.output_dir)
        self.accelerator = accelerator = make_accelerator(args)
        self.device, self.world, self.is_main = accelerator.device, accelerator.num_processes, accelerator.is_main_process
        self.processes = agreement.Processes(accelerator)  # the processes' agreement
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.allow_tf32
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
        evaluator = None
        if args.eval_every_epochs and self.is_main:
            # Loads the scoring network now (Inception, or the shape scorer on the built-in data): missing weights stop the run before any training.
            evaluator = metrics.TrainingEvaluator(args, args.output_dir, self.device, log=accelerator.print)
        self.startup.mark("accelerate")

        self.unreadable = decoding.Unreadable(strict=args.on_fault == "stop", verbose=self.is_main)
        found = set_up_data(args, self.processes, self.unreadable)
        images, labels, class_names = found.images, found.labels, found.class_names
        # a captioned run's captions, each encoded once (or read from their cache: captions.cached_embeddings)
        encoder = captions.load_text_encoder(args.text_encoder) if found.captions else None
        table = encoder and captions.cached_embeddings(encoder, found.captions, device=self.device, log=accelerator.print)
        self.startup.mark("data")
        self.config, self.compile_why = describe_run(args, self.device, self.world, len(images))
        self.startup.mark("FLOPs and compile plan")
        # one compile plan for every process, rank 0's: each node plans from its own compile record
        plan = self.processes.from_main([self.config["step_compile_mode"], self.config["step_compile_scope"], self.compile_why])
        self.config["step_compile_mode"], self.config["step_compile_scope"], self.compile_why = plan
        # Inductor's workers start while the network is built, not at the first compile (none for an eager step)
        compiling.start_compile_workers(self.device, self.config["step_compile_mode"])
        self.config["data_path"] = "preloaded" if isinstance(images, PRELOADED) else "latents" if args.vae else "streamed"
        if found.latents is not None:
            self.config |= dict(latents=found.latents, latent_space=found.latent_space)
        # The classes of a conditional run, kept with it: sample.py takes their names.
        num_classes = len(class_names) if class_names else 0
        self.config |= dict(num_classes=num_classes, class_names=class_names, flow_sigmas=found.flow_sigmas,
                            class_counts=None if labels is None or table else torch.bincount(labels, minlength=num_classes).tolist())  # fmt: skip
        # What a label stands for: a class, or a captioned run's caption (its ids; the empty caption's is the null label)
        self.conditions = len(found.captions) - 1 if table else num_classes
        if table:
            self.config["num_captions"] = self.conditions
        self.steps_per_epoch, self.total_steps = self.config["steps_per_epoch"], self.config["total_train_steps"]
        if args.eval_every_epochs:
            prepare_reference(args, evaluator, self.processes, images, found.dataset_contents)
            self.startup.mark("FID's reference")
        set_seed(args.seed, device_specific=True)  # each process draws its own noise
        if isinstance(images, PRELOADED) and self.device.type == "cuda":
            images = images.to(self.device)  # small enough to sit on the GPU: --preload_data's MAX_GIB
        conditions = labels if table is None else captions.Draws(table, labels, args.seed)  # each image's caption drawn
        self.batches = batches.Batches(images, args.train_batch_size, args.seed, self.device, accelerator.process_index,
                                    self.world, args.dataloader_num_workers, self.unreadable, conditions)  # fmt: skip
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            # autoguidance's network: building it (a checkpoint's) draws random numbers, which must not change the
            # network trained or its noise: with or without --guide, the same --seed trains the same weights
            guide = sampling.load_guide(args.guide, self.config, self.device) if args.guide else None
        self.startup.mark("data to the device")
        self.pieces = build_pieces(args, accelerator, self.total_steps, num_classes, self.config["lr_ref_steps"],
                                   class_names)
        self.config["params"] = sum(p.numel() for p in self.pieces.network.parameters())  # with a class embedding
        if table:  # its captions' ids -> embeddings, for the grids and FID (the step's come with its batches)
            self.pieces.network.captions = table
        self.guard = step.NonFiniteGuard(self.pieces.optimizer, args.on_fault, self.device)
        self.memory = memory_plan(args, self.pieces, self.world)
        self.startup.mark("network")
        self.checkpoints = Checkpoints(accelerator, self.output_dir, args.checkpoints_total_limit)
        self.step, self.skipped_before = 0, 0
        if found.start_from is not None:
            self.step, self.skipped_before = self.checkpoints.load(found.start_from, self.processes, self.pieces.ema, args)
            self.startup.mark("resume")
        elif self.pieces.started_from:  # --init_from, on a fresh start only: a resume's weights are its checkpoint's
            accelerator.print(self.pieces.started_from)
        counts = self.config["class_counts"] or (table and torch.bincount(labels[:, 0], minlength=self.conditions).tolist())
        self.evaluation = Evaluation(args, self.processes, self.pieces, evaluator, guide, found.decode, found.vae,
                                     self.conditions, counts, images, found.captions,
                                     encoder and rundir.text_pipeline_parts(self.config, found.vae, encoder))  # fmt: skip
        self.epoch_started_at = None  # the step each epoch of this run began at
        if self.step < self.total_steps:
            announce(args, self.config, self.compile_why, accelerator, self.pieces.network, self.memory, self.step,
                     len(self.unreadable))  # fmt: skip
        self.meter = Meter(args, self.config, self.step, self.device, self.output_dir, accelerator,
                           self.processes.on_main_process, self.startup,
                           learning_rate=lambda: float(self.pieces.lr_scheduler.get_last_lr()[0]))  # fmt: skip
        try:
            # compiled or captured on a GPU (compiling.py); run.json's compile fields (write_manifest: at the end, or at a stop)
            self.train_step = self.build_step(self.meter)
        except BaseException:
            self.meter.progress.close()  # its bar, not left drawn beside the error's one line
            raise

    def build_step(self, meter):
        """The step, from the uint8 batch to the EMA (step.py), reporting its phases to `meter`."""
        pieces, mode = self.pieces, None if self.config["step_compile_mode"] == "eager" else self.config["step_compile_mode"]
        table = getattr(pieces.network, "captions", None)  # a captioned run's null label: the empty caption's Words
        null_label = table.null(self.device) if table is not None else models.null_label(self.conditions)
        whole = step.TrainStep(pieces.model, pieces.model, pieces.objective, pieces.optimizer, pieces.lr_scheduler,
                               pieces.ema, self.guard, self.args.max_grad_norm, data.random_flips(self.args),
                               accelerator=self.accelerator,
                               mark=meter.breakdown.phase_done, label_dropout=self.args.label_dropout,
                               null_label=null_label)  # fmt: skip
        fast = compiling.FastStep(whole, mode, self.device, say=meter.write, scope=self.config["step_compile_scope"])
        if compiling.compiles(mode) and self.step < self.total_steps:
            loaded = compiling.load_compile_artifacts(self.output_dir / COMPILE_CACHE_FILE, self.device)
            if loaded:
                self.accelerator.print(loaded)
        self.startup.mark("step")
        if self.step < self.total_steps:
            meter.write(self.startup.line())
        return fast

    # --- the loop's pace ---

    def epochs(self):
        """The epochs left to train."""
        epoch = self.step // self.steps_per_epoch
        while self.step < self.total_steps:
            yield epoch
            epoch += 1

    def batches_of(self, epoch):
        """The micro-batches of each optimizer step left in `epoch`, resuming mid-epoch where the run stopped."""
        accumulation = self.args.gradient_accumulation_steps
        self.epoch_started_at = self.step
        micro_batches = self.batches.epoch(epoch, start=(self.step - epoch * self.steps_per_epoch) * accumulation)
        for _ in range(self.step, min(self.total_steps, (epoch + 1) * self.steps_per_epoch)):
            yield [next(micro_batches) for _ in range(accumulation)]

    def whole_epoch(self, epoch):
        """Whether this run trained all of `epoch` (its time then stands for an epoch's)."""
        return self.epoch_started_at == epoch * self.steps_per_epoch and self.step == (epoch + 1) * self.steps_per_epoch

    # --- what happens between steps ---

    def after_step(self, signals):
        """The checkpoint due after this step, the one on its way to disk once there, and a stop signal's stop."""
        if self.step % self.args.checkpointing_steps == 0 or self.step == self.total_steps:
            self.save_checkpoint()
        self.checkpoints.flushed(self.meter, wait=False)  # a checkpoint is said saved once on disk; a failed flush stops here
        if self.processes.stop_requested(signals, self.step):
            self.stop_for_signal(signals)

    def after_epoch(self, epoch, signals):
        """The grid and the evaluation due after `epoch`. A stop signal that comes meanwhile (an evaluation of
        --eval_num_samples may take hours, a preemption's grace period a minute) leaves what is left of them
        undone, at the next batch of samples, and the step is kept in a checkpoint as after a step."""
        args, last, meter, evaluation = self.args, self.step >= self.total_steps, self.meter, self.evaluation
        unless_stopped = lambda work: None if signals.requested else work()  # noqa: E731  (the main process's)
        if epoch % args.save_images_epochs == 0 or last:
            with meter.paused("sampling"):
                self.processes.on_main_process(lambda: unless_stopped(lambda: evaluation.write_samples(epoch)))
        if args.eval_every_epochs and ((epoch + 1) % args.eval_every_epochs == 0 or last):
            with meter.paused("evaluation"):  # every process generates a share of the samples
                self.processes.on_every_process(lambda: evaluation.evaluate(epoch, self.step, signals, meter.write))
        evaluation.vae_to_cpu()  # decoded: its memory back to training
        if last:  # the last checkpoint's flush went on beside the grid; what is left of it, timed
            with meter.paused("checkpointing"):
                self.checkpoints.flushed(meter)
        if self.processes.stop_requested(signals, self.step, now=True):
            self.stop_for_signal(signals)

    def skipped(self):
        """The steps skipped for a non-finite loss or gradient, those before a resume included."""
        return self.skipped_before + self.guard.count()

    def save_checkpoint(self):
        """This step's checkpoint, on its way to disk (Checkpoints.save); its path."""
        state = dict(skipped_nonfinite=self.skipped(), run=resume.run_identity(self.config))
        return self.checkpoints.save(self.step, self.pieces.model, state, self.meter)

    def stop_for_signal(self, signals):
        """Keep this step in a checkpoint, say how to go on, and exit with the signal's code."""
        meter, checkpoints = self.meter, self.checkpoints
        meter.progress.close()
        saved_step, path = checkpoints.last_saved
        if saved_step != self.step:
            path = self.save_checkpoint()
        with meter.paused("checkpointing"):
            # on disk before any process says so and exits: a launcher (torchrun) stops the others, in 30 s, once
            # one process has exited, and only the main process writes the checkpoint
            self.processes.on_main_process(lambda: checkpoints.flushed(meter))
            checkpoints.flushed(meter)  # the other processes' part
            # run.json of the steps trained so far (a preempted run's speed is kept; the resumed run's end rewrites it)
            self.processes.on_main_process(lambda: self.write_manifest(meter.manifest() | dict(stopped_by=signals.received.name)))
        again = " with --resume alone (no folder)" if isinstance(self.args.resume, str) else ""  # not from CHECKPOINT
        self.accelerator.print(
            f"stopped by {signals.received.name} at step {self.step}: saved {path}; "
            f"run the same command again{again} to continue"
        )
        self.accelerator.end_training()
        raise SystemExit(signals.exit_code)

    def finish(self):
        """The end: the pipeline and run.json after training; or why nothing was trained."""
        evaluation = self.evaluation
        if not self.meter.trained:  # already trained to the end
            if not evaluation.pipeline_saved():  # the end of the run was cut short
                self.processes.on_main_process(lambda: evaluation.save_pipeline(self.step))
            else:
                self.accelerator.print(
                    f"{self.args.output_dir} is already trained to step {self.step} of {self.total_steps}: "
                    "raise --max_train_steps or --num_epochs to train longer"
                )
        else:
            self.meter.report_end(self.step, self.skipped(), len(self.unreadable), self.memory)
            timing = self.meter.manifest()  # before the pipeline is saved: training ends here
            if self.args.ema == "power":
                self.pieces.ema.save_snapshot()  # the end of training, whatever --ema_snapshot_every (main process only)
            self.processes.on_main_process(lambda: (evaluation.save_pipeline(self.step), self.write_manifest(timing),
                                                    rundir.write_model_card(self.output_dir, self.config)))  # fmt: skip
            self.accelerator.end_training()  # flushes the tensorboard logs that the plots read
            if self.is_main:
                profiling.draw_run_plots(self.output_dir)

    def write_manifest(self, timing):
        """run.json: everything about the run one would need to compare or reproduce it."""
        profiling.write_manifest(
            self.output_dir / "run.json",
            config=self.config,
            git_commit=profiling.git_commit(),
            versions=profiling.library_versions(),
            device=profiling.device_facts(self.device, self.world),
            steps=self.step,
            skipped_nonfinite_steps=self.skipped(),
            unreadable_images=len(self.unreadable),
            step_compile_mode=self.train_step.mode_name,
            compile_fallbacks=self.train_step.fallbacks,
            cuda_graph_skips=self.train_step.graph_skips,
            samples_dir=str(self.output_dir / "samples"),
            checkpoints=[str(p) for p in checkpoint.checkpoint_dirs(self.output_dir)],
            checkpoint_times_s=self.checkpoints.times,
            copy_check=self.evaluation.last_copy_check,  # the last evaluation's (docs/copies.md)
            pipeline_dir=str(self.output_dir),
            **timing,
        )


class Checkpoints:
    """A run's checkpoints: the one it resumes from loaded (`load`), and each one `save`d between steps, written
    to disk beside the steps that follow (checkpoint.save) and said once it is there (`flushed`)."""

    def __init__(self, accelerator, output_dir, total_limit):
        self.accelerator, self.output_dir, self.total_limit = accelerator, output_dir, total_limit
        self.last_saved = (None, None)  # (step, path) of this run's newest checkpoint
        self.flushing = None  # the checkpoint on its way to disk (checkpoint.Flush), behind the steps
        self.times = []  # run.json's checkpoint_times_s

    def load(self, start_from, processes, ema, args):
        """The state of checkpoint `start_from` loaded on every process (`processes`: all stop where one cannot
        load its part) and what changed since it said; (the step it was saved at, the non-finite steps skipped by then)."""
        accelerator = self.accelerator
        error, rng = None, Path(start_from) / f"random_states_{accelerator.process_index}.pkl"  # this process's
        try:  # accelerate skips an RNG state it cannot read, and the run would go on, not as it would have
            torch.load(rng, weights_only=False)
        except Exception as e:  # named: each process has its own
            error = checkpoint.unloadable(start_from, e, rng.name)
        try:
            if error is None:
                accelerator.load_state(str(start_from))
        except Exception as e:  # a damaged or missing file (torch's, safetensors' and pickle's errors): one line
            error = checkpoint.unloadable(start_from, e)
        processes.stop_together(error, 2)  # one process that cannot load its part (its RNG state) stops them all
        if ema is not None:
            ema.to(accelerator.device)
        state = checkpoint.read_state(start_from)
        changed = resume.changed_since(start_from, vars(args))  # honoured, and said
        said = f"; changed: {'; '.join(changed)}" if changed else ""
        accelerator.print(f"resumed from {start_from} at step {state['step']}{said}")
        return state["step"], state.get("skipped_nonfinite", 0)

    def save(self, step_number, model, state, meter):
        """Step `step_number`'s checkpoint, with `state` (checkpoint.read_state's), on its way to disk once the one
        before it is there; its path. Never one of weights that are not finite (`model`'s)."""
        if not checkpoint.weights_finite(model):  # never replace a good checkpoint with a broken state
            raise RunError(f"the weights are not finite at step {step_number}: not saving a checkpoint; resume from the last one")
        with meter.paused("checkpointing"):
            self.flushed(meter)  # one checkpoint on its way to disk at a time
            self.flushing = checkpoint.save(self.accelerator, self.output_dir, step_number, state, self.total_limit)
        self.last_saved = (step_number, self.flushing.path)
        return self.flushing.path

    @contextlib.contextmanager
    def published_on_error(self):
        """Around the loop: an error on its way out waits for the checkpoint on its way to disk (the last good
        one), so that it is published before the error says it is there."""
        try:
            yield
        except BaseException:
            if self.flushing is not None:
                self.flushing.join()
            raise

    def flushed(self, meter, wait=True):
        """The checkpoint on its way to disk, once it is there (waited for, or only if it is, without
        `wait`): said, and its times kept. Its flush's error, if any, as a RunError."""
        flush = self.flushing
        if flush is None or not (wait or flush.done):
            return
        self.flushing = None
        path = flush.wait()
        self.times.append(dict(step=flush.step, waited=flush.waited_s, beside=flush.beside_s))
        if self.accelerator.is_main_process:  # the process that flushed it
            meter.write(f"saved {path} (the steps waited {flush.waited_s:.1f} s for its writing; on disk in {flush.beside_s:.1f} s "
                        "more, beside training)")  # fmt: skip


class Evaluation:
    """What a run shows of its EMA weights between steps and at its end: sample grids (`write_samples`), FID/KID
    (`evaluate`, the samples a share on each process) and the pipeline saved (`save_pipeline`). `pieces`:
    the run's (builder.Pieces); `evaluator`: the main process's metrics.TrainingEvaluator where the run
    evaluates; `decode` and `vae`: a latent run's, else None; `images`: what the data was loaded into, which the
    copy check searches (copies.check)."""

    def __init__(self, args, processes, pieces, evaluator, guide, decode, vae, num_classes, class_counts, images,
                 texts=None, text_pipeline=None):  # fmt: skip
        self.args, self.output_dir, self.processes, self.pieces = args, Path(args.output_dir), processes, pieces
        self.evaluator, self.guide, self.decode, self.vae = evaluator, guide, decode, vae
        self.num_classes, self.class_counts = num_classes, class_counts  # a conditional run's: labels drawn as in the data
        self.texts = texts  # a captioned run's captions (its labels are their ids), which the grid's rows ask for
        self.text_pipeline = text_pipeline  # a captioned run's pipeline and its parts (rundir.text_pipeline_parts), or None
        self.images = images
        self.last_copy_check = None  # the latest evaluation's copy check, for run.json
    def vae_to_cpu(self):
        """A latent run's VAE (which joins the latents on the device to decode them) back on the CPU."""
        if self.vae is not None:
            self.vae.to("cpu")

    def averaged_network(self):
        """A copy of the network with the EMA weights (the raw ones without an EMA)."""
        return posthoc_ema.averaged_copy(self.processes.accelerator.unwrap_model(self.pieces.model), self.pieces.ema)

    def saves_a_pipeline(self):
        """Whether the run saves a diffusers pipeline (a DDPMPipeline, or a captioned run's), not its network alone."""
        return objectives.saves_pipeline(vars(self.args)) or self.text_pipeline is not None

    def pipeline_saved(self):
        """Whether output_dir holds the pipeline (or the network) of the run's end."""
        return (self.output_dir / rundir.pipeline_mark(self.saves_a_pipeline())).is_file()

    def save_network(self, network, folder):
        """`network` into `folder`, as a diffusers pipeline where the run saves one (with its noise schedule)."""
        scheduler = self.pieces.noise_scheduler if self.saves_a_pipeline() else None
        rundir.save_network(network, folder, scheduler, self.text_pipeline)

    def save_pipeline(self, step_number):
        """The EMA weights (or the raw ones) in output_dir, trained for `step_number` steps."""
        try:
            self.save_network(self.averaged_network(), self.output_dir)
        except OSError as e:
            note = f"running again saves it from the checkpoint of step {step_number}"
            raise RunError(checkpoint.cannot_write(f"the pipeline to {self.output_dir}", e, note)) from None
        saved = "the pipeline to" if self.saves_a_pipeline() else "the network to"  # EDM, EDM2, DiT: unet/ alone
        self.processes.accelerator.print(f"saved {saved} {self.output_dir}; sample grids in {self.output_dir / 'samples'}")

    def write_samples(self, epoch):
        """A grid of --eval_batch_size images from the EMA weights, from the same noise every time;
        a conditional run's rows go through the classes in turn."""
        args, path = self.args, self.output_dir / "samples" / f"{epoch:04d}.png"
        seeds = sampling.image_seeds(args.seed, args.eval_batch_size)
        # a captioned run's rows: its grid prompts (a --config file's, first in its table), else its captions spread
        # over the rows (a folder sorted by class would otherwise show one class)
        labels = sampling.grid_labels(len(args.grid_prompts or ()) or self.num_classes, args.eval_batch_size, args.image_size)
        images = sampling.generate(self.averaged_network(), self.pieces.sampling_scheduler, seeds, args.num_inference_steps,
                                 self.processes.accelerator.autocast, labels, args.guidance_scale[0], self.guide,
                                 self.decode)  # fmt: skip
        try:
            sampling.save_grid(images, path)
            if self.texts:  # the prompt of each row, beside the grid
                row_labels = labels[:: sampling.grid_columns(len(labels), *sizes.height_width(args.image_size))].tolist()
                path.with_suffix(".txt").write_text("".join(f"row {r + 1}: {self.texts[label]}\n"
                                                            for r, label in enumerate(row_labels)))  # fmt: skip
        except OSError as e:
            raise RunError(checkpoint.cannot_write(path, e)) from None

    def evaluate(self, epoch, step_number, signals, write):
        """FID/KID of the EMA weights after `epoch` (at step `step_number`) at each --guidance_scale, on every process: each
        generates every world-th batch of the samples and the main process embeds them all, in image order (the
        batches one process generates), scores them, says them (`write`), and puts the best pipeline by FID (at
        its best scale) in best/. A stop signal on any process abandons it at the next batch."""
        args, network, processes = self.args, self.averaged_network(), self.processes
        accelerator, counts = processes.accelerator, self.class_counts
        labels = sampling.labels_as_in_data(counts, args.eval_num_samples, args.seed) if counts else None
        batch_size = metrics.fid_batch_size(args.eval_batch_size)

        def batches_for(w):
            mine = sampling.generate_batches(network, self.pieces.sampling_scheduler, args.eval_num_samples, batch_size,
                                           args.seed, args.num_inference_steps, accelerator.autocast, labels, w,
                                           self.guide, self.decode, shard=(processes.rank, processes.world))  # fmt: skip
            return self.gathered_samples(mine, args.eval_num_samples, batch_size, signals, epoch, step_number)

        if not processes.is_main:  # its share of each scale's samples, sent to the main process
            for w in args.guidance_scale:
                collections.deque(batches_for(w), maxlen=0)
            return

        sampler = getattr(self.pieces.sampling_scheduler, "name", args.sampler)
        save = lambda folder: self.save_network(network, folder)  # noqa: E731
        kept = []  # the first scale's first COPY_CHECK_SAMPLES samples, for the copy check

        def keeping(w):
            for batch in batches_for(w):
                if w == args.guidance_scale[0] and sum(map(len, kept)) < COPY_CHECK_SAMPLES:
                    kept.append(batch[: COPY_CHECK_SAMPLES - sum(map(len, kept))])
                yield batch

        result = self.evaluator.evaluate(keeping, args.guidance_scale, sampler, args.num_inference_steps,
                                         epoch, step_number, save, labels)  # fmt: skip
        picture = self.output_dir / "copies" / f"{epoch:04d}.png"
        found = copies.check(torch.cat(kept), self.images, args, picture)
        accelerator.log({k: result[k] for k in ("fid", "kid_mean", "kid_std")} | {f"copies/{k}": found[k] for k in
                        ("copy_share", "median_ratio")}, step=step_number)  # fmt: skip
        at = f"eval epoch {epoch} step {step_number}"
        for scale in result.get("scales", []):
            write(f"{at} | guidance scale {scale['guidance_scale']:g}: {metrics.format_scores(dict(result, **scale))}")
        best = " (best so far: saved to best/)" if result["best"] else ""
        scale = f"best guidance scale {result['guidance_scale']:g}: " if "scales" in result else ""
        write(f"{at} | {scale}{metrics.format_scores(result)}{best}")
        write(f"{at} | {copies.format_line(found, copies.trained_with_flips(vars(args)), picture)}")
        self.last_copy_check = dict(found, epoch=epoch, step=step_number)

    def gathered_samples(self, mine, num_images, batch_size, signals, epoch, step_number):
        """An evaluation's samples, every process's share gathered to the main process (sampling.gathered), the
        processes agreeing on a stop signal before each round of batches."""
        processes = self.processes

        def unless_stopped():
            if processes.stop_requested(signals, step_number, now=True):
                processes.accelerator.print(f"the evaluation after epoch {epoch} is left unfinished, for {signals.received.name}")
                raise agreement.Abandoned

        shape = (self.args.image_channels, *sizes.height_width(self.args.image_size))
        return sampling.gathered(mine, num_images, batch_size, shape, processes.rank, processes.world,
                               processes.main_work_group, unless_stopped)  # fmt: skip


class Meter:
    """How the run goes, measured and said: the step times (flops.StepTimer), where the time
    went (profiling.Breakdown), the first, compiling step, the --profile recording, the loss,
    the progress bar and the printed line every --logging_steps.

    The loop tells it when a batch arrives and when a step is done (and which); `paused(name)` times
    what happens between steps (sampling, evaluation, checkpointing) apart from them.

    It takes the run's numbers, not the run: `config` as describe_run made it (total steps, steps per epoch,
    images per step, processes, FLOPs per step, the compile plan), the step it starts at, the device,
    output_dir (the profile, the compile cache), `accelerator` (its print, its trackers, which process this
    is), `on_main_process` (the processes' agreement), `startup` (profiling.StartupClock) and the
    learning rate now (`learning_rate()`).
    """

    def __init__(self, args, config, start_step, device, output_dir, accelerator, on_main_process, startup,
                 learning_rate):  # fmt: skip
        from tqdm.auto import tqdm

        self.args, self.device, self.output_dir, self.startup = args, device, output_dir, startup
        self.total_steps, self.steps_per_epoch = config["total_train_steps"], config["steps_per_epoch"]
        self.images_per_step, self.world = config["global_batch_size"], config["num_processes"]
        self.compile_plan = (config["step_compile_mode"], config["step_compile_scope"])
        self.is_main, self.shows = accelerator.is_main_process, accelerator.is_local_main_process
        self.say, self.log, self.on_main_process, self.learning_rate = accelerator.print, accelerator.log, on_main_process, learning_rate
        self.breakdown = profiling.Breakdown(device)
        self.timer = flops.StepTimer(device, args.timing_warmup_steps)
        self.losses = step.LossMeter(device)
        self.peak_flops, self.peak_words = flops.describe_peak(device, args.mixed_precision, args.allow_tf32)
        self.model_flops, self.hardware_flops = config["model_flops_per_step"], config["hardware_flops_per_step"]
        self.started_at = profiling.now_iso()
        self.epoch_times = []  # each whole epoch's training time: data loading included; sampling, checkpoints not
        self.compile_s = self.compile_phases = None  # seconds the first, compiling step took, and where they went
        self.compiles = compiling.compiles(config["step_compile_mode"])
        self.trained = False  # whether this process took a step
        self.progress = tqdm(total=self.total_steps, initial=start_step, disable=not self.shows, desc="steps")
        # --profile: torch.profiler on rank 0 over a few steps (1 warm-up, then recorded) once the
        # step is past its trial calls (profile_when_steady).
        self.profiler = self.profile_until = self.profiled_step = None

    def profile_when_steady(self, train_step):
        """--profile: record `train_step` (a compiling.FastStep) once past its trial calls (compile, CUDA graph
        warm-up, recording or capture), so that the steps recorded are steady ones, not those."""
        if self.args.profile:
            self.profiled_step = train_step

    def _start_profiler(self, step_number):
        """After step `step_number`: one warm-up step, then config.SETTINGS["profile_steps"] recorded (on rank 0;
        every rank stops together)."""
        args = self.args
        self.profiled_step, self.profile_until = None, step_number + 1 + args.profile_steps
        if self.is_main:
            self.profiler = profiling.make_profiler(
                self.output_dir / "profile", 0, 1, args.profile_steps, args.profile_top, with_stack=args.profile_stack,
                level=args.profile,
            )  # fmt: skip
            self.profiler.start()

    def __enter__(self):
        self.breakdown.start()
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self.profiler is not None:  # the run ended while --profile recorded: what it holds is written, and no
            self.profiler.stop()  # profiler is left running to the interpreter's exit (a segmentation fault there)
            self.profiler = None
        return self.progress.__exit__(*exc)  # the bar is closed before any error is printed

    def write(self, text):
        """A line above the progress bar, from the node's main process."""
        if self.shows:
            self.progress.write(text)

    def timed_batches(self, batches):
        """`batches`, the wait for each counted as its step's data phase."""
        self.breakdown.begin_epoch()
        self.timer.restart()
        batches = iter(batches)
        while True:
            self.breakdown.begin_step()
            batch = next(batches, None)
            if batch is None:
                return
            self.breakdown.phase_done("data")
            yield batch

    @contextlib.contextmanager
    def first_step_clock(self):
        """The first step of a compiled run compiles: timed as its own part of the breakdown, and said."""
        if not self.compiles or self.compile_s is not None:
            yield
            return
        mode, scope = self.compile_plan
        self.write(f"compiling the step ({mode}) ...")
        clock = compiling.FirstStepClock(self.device)
        with self.breakdown.pause("compile"), clock.measure():
            yield
        self.compile_s, self.compile_phases = clock.seconds, clock.phases
        if clock.cold:  # what the next run of this step predicts its (then warm) compile from
            compiling.remember_compile(compiling.compile_key(self.args, self.device, mode, scope), clock.seconds)
        cache = self.output_dir / COMPILE_CACHE_FILE
        self.on_main_process(lambda: compiling.save_compile_artifacts(cache, self.device))
        self.write(clock.line)

    @contextlib.contextmanager
    def paused(self, name):
        """Work between steps, timed apart from them."""
        with self.breakdown.pause(name):
            yield
        self.timer.restart()

    def step_done(self, losses, step_number):
        """Step `step_number` is done, with `losses` (its micro-batches'): timed, counted, and reported when due."""
        self.trained = True
        for loss in losses:
            self.losses.add(loss)
        self.timer.step_done()
        self.progress.update(1)
        if self.profiler is not None:
            self.profiler.step()
            if step_number == self.profile_until:  # the trace and table are written
                self.profiler.stop()
                self.profiler = None
        elif self.profiled_step is not None and profiling.past_trial_calls(self.profiled_step):
            self._start_profiler(step_number)
        if step_number % self.args.logging_steps == 0:
            self.report(self.timer.collect(), step_number)
            self.breakdown.collect()

    def epoch_done(self, epoch, whole, step_number):
        """`epoch` is done, at step `step_number`; its time is kept where the run trained it `whole`."""
        if whole:
            epoch_s = self.breakdown.epoch_s()
            self.epoch_times.append(dict(epoch=epoch, seconds=epoch_s, images_per_s=self.steps_per_epoch *
                                         self.images_per_step / epoch_s))  # fmt: skip
            self.log(dict(epoch_time_s=epoch_s), step=step_number)

    def perf(self, step_time_s):
        """The FLOP rates and utilizations of a step of `step_time_s` (flops.utilization)."""
        peak = self.peak_flops and self.peak_flops * self.world
        return flops.utilization(self.model_flops, self.hardware_flops, step_time_s, peak)

    def report(self, step_times, step_number, final=False):
        """The loss since the last report and the throughput line at step `step_number` (one host sync)."""
        if self.losses.read():
            terms = self.losses.last_terms if len(self.losses.last_terms) > 1 else {}
            self.log(dict(loss=self.losses.last, lr=self.learning_rate()) | {f"loss/{name}": v for name, v in terms.items()},
                     step=step_number)  # fmt: skip
        last_loss, terms = self.losses.last, self.losses.last_terms
        if not step_times:
            line = f"step {step_number}/{self.total_steps} | {flops.loss_words(last_loss, terms)} | timing: still warming up"
        else:
            step_time_s = flops.median(step_times)
            perf = self.perf(step_time_s)
            line = flops.format_perf_line(
                step_number, self.total_steps, last_loss, step_time_s, self.images_per_step, self.model_flops, perf,
                self.peak_words, self.world, profiling.peak_memory_gib(self.device), terms,
            )  # fmt: skip
            if not final:
                images_per_s = self.images_per_step / step_time_s
                self.progress.set_postfix(loss=f"{last_loss:.4f}", img_s=f"{images_per_s:.1f}")
                logs = dict(step_time_s=step_time_s, images_per_s=images_per_s)
                self.log(logs | {k: v for k, v in perf.items() if v is not None}, step=step_number)
        self.write(("final: " if final else "") + line)

    def report_end(self, step_number, skipped, unreadable, memory_plan):
        """The last lines, at step `step_number`: the run's median step, what was skipped, where the time went,
        and the memory it held against what `memory_plan` (memory.Plan) estimated."""
        if step_number % self.args.logging_steps:
            self.report(self.timer.collect(), step_number)
        self.timer.collect()
        self.report(self.timer.all_times, step_number, final=True)
        if skipped or unreadable:
            self.say(f"skipped {skipped} step(s) with a non-finite loss or gradient and {unreadable} unreadable image(s)")
        self.say(self.breakdown.format())
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        self.say(memory.end_line(memory_plan, peak))

    def manifest(self):
        """run.json's timing fields."""
        step_time_s = flops.median(self.timer.all_times) if self.timer.all_times else None
        perf = self.perf(step_time_s) if step_time_s else {}
        parts, wall_s = self.breakdown.summary()
        return dict(
            start_time=self.started_at,
            end_time=profiling.now_iso(),
            final_loss=self.losses.last,
            final_loss_terms=self.losses.last_terms,
            median_step_time_s=step_time_s,
            images_per_s=self.images_per_step / step_time_s if step_time_s else None,
            achieved_flops=perf.get("achieved_flops"),
            mfu=perf.get("mfu"),
            hfu=perf.get("hfu"),
            peak=self.peak_words,
            peak_memory_gib=profiling.peak_memory_gib(self.device),
            compile_s=self.compile_s,
            compile_phases_s=self.compile_phases,  # where the compile went, by torch's timers (compiling.compile_phases)
            startup_s=self.startup.parts,  # train.py's start to the loop, by part (the "ready to train" line)
            train_wall_s=wall_s,
            epoch_times_s=self.epoch_times,
            time_breakdown_s=parts,
        )


if __name__ == "__main__":
    main(parse_args())
