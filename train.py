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

import errors  # noqa: I001 (first: the standard library only)

if __name__ == "__main__":  # a Ctrl-C in the seconds torch and diffusers take to import: one line, not their traceback
    errors.quit_on_ctrl_c("train.py")

import collections
import contextlib
import json
import math
import shutil
from datetime import timedelta
from pathlib import Path

import torch

import agreement
import checkpoint
import compiling
import data
import ema as posthoc_ema
import flops
import fp8
import latents
import memory
import metrics
import model as models
import profiling
import resume
import rundir
import sample
import step as steps
import training
from config import network_size, parse_args, recorded, resolve
from errors import ConfigError, RunError, one_line_errors

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
        data.stop_workers()  # the DataLoader workers, which leave SIGTERM and SIGINT to this process
        checkpoint.RunLock.release_all()
        agreement.end_process_group()


def train(args):
    """Build the run, then loop: the next batch, the step, and whatever falls due after it."""
    run = Run(args)  # data, network, objective, optimizer, EMA; resumed where a checkpoint is
    meter = Meter(run)  # step times, where the time went, the profiler, the printed lines
    try:
        train_step = run.build_step(meter)  # compiled or captured on a GPU (compiling.py)
    except BaseException:
        meter.progress.close()  # its bar, not left drawn beside the error's one line
        raise
    meter.profile_when_steady(train_step)  # --profile records steps after those that compile or capture it
    with checkpoint.StopSignals() as signals, meter, run.published_on_error():
        for epoch in run.epochs():
            for batch in meter.timed_batches(run.batches_of(epoch)):
                with meter.first_step_clock():
                    losses = train_step(batch, run.step + 1)
                run.step += 1
                meter.step_done(losses)
                run.after_step(meter, signals)  # checkpoint, stop signals
            meter.epoch_done(epoch, run.whole_epoch(epoch))
            run.after_epoch(epoch, meter, signals)  # sample grid, evaluation; stop signals
    run.finish(meter)  # the pipeline and run.json
    return run.config


# --- what the run is -----------------------------------------------------------------


def describe_run(args, device, world, num_images):
    """The resolved flags (with the settings apart: config.recorded) and what follows from them:
    train_config.json, and what --dry_run prints. `num_images` None: not known before the data loads."""
    # The denoiser's step: a latent run's at its latents' size and channels (the VAE encodes once, before it)
    cost = flops.step_flops(args.model, network_size(args), args.train_batch_size, args.gradient_checkpointing,
                            args.latent_channels or 3)  # fmt: skip
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


def describe(args):
    """--dry_run: the resolved configuration, parameters and FLOPs, without loading any data."""
    from accelerate import PartialState

    state = PartialState(cpu=args.cpu)
    num_images = args.shapes_num_images if args.dataset == data.BUILTIN else None
    config, compile_why = describe_run(args, state.device, state.num_processes, num_images)
    if state.is_main_process:
        for key, value in config.items():
            print(f"{key:28s} {value}")
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
    size, found = f"{args.latent_size}x{args.latent_size}x{args.latent_channels}", args.latents
    norm = {"vae": "the VAE's scaling_factor", "dataset": "each channel's mean and std over the data",
            None: "the VAE's scaling_factor where its config.json sets one, else the data's mean and std"}  # fmt: skip
    line = (f"latents: the network takes {size} latents of --vae {found['source']} ({found['factor']}x smaller than "
            f"the {args.image_size}px images), normalised by {norm[args.latent_normalization]}")  # fmt: skip
    if found.get("assumed"):
        line += (f"; its config.json cannot be had offline, so {size} assumes Stable Diffusion's 8x, 4-channel VAE "
                 f"(training needs it: `hf download {found['source']} --local-dir DIR`, then --vae DIR)")  # fmt: skip
    return line


# Images decoded once and kept (unreadable ones remembered in their places: data.PreloadedImages).
PRELOADED = (torch.Tensor, data.PreloadedImages)

# With several processes, how long a process may wait in a collective, set explicitly (torch's defaults: NCCL 10
# minutes, gloo 30). STEP_WAIT: the default group's, that of the steps, a checkpoint's save and the starting line, each
# far under it. While the main process works between steps and the others wait, they wait in a gloo group of its own,
# for processes.MAIN_WORK_WAIT.
STEP_WAIT = timedelta(minutes=15)

# Compile artifacts (torch.compiler's mega-cache) kept beside the run, so that a
# run resumed on a fresh machine, whose Inductor cache is empty, need not compile again.
COMPILE_CACHE_FILE = "compile_cache.bin"


class Run:
    """A training run: its pieces, built, and what it does between steps.

    Building it loads the data first (a bad path fails in seconds), then the
    network, objective, optimizer, learning-rate schedule and EMA, and resumes
    from a checkpoint where there is one. `step` counts optimizer steps taken;
    `epochs()` is what is left to train (nothing for a run already trained).
    Between steps it writes checkpoints and sample grids, evaluates, and stops
    for a signal; at the end it saves the pipeline and run.json. Work only the
    main process does goes through `on_main_process`, so that a failure there
    stops every process.
    """

    def __init__(self, args):
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration, set_seed

        self.startup = profiling.StartupClock(STARTED)
        self.startup.mark("imports")
        self.args, self.output_dir = args, Path(args.output_dir)
        self.accelerator = accelerator = Accelerator(
            cpu=args.cpu,
            # fp8: bf16 autocast, as accelerate's fp8 mode runs; the FP8 layers are training.build's (fp8.py)
            mixed_precision="bf16" if args.mixed_precision == "fp8" else args.mixed_precision,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            log_with=None if args.logger == "none" else args.logger,
            project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=str(self.output_dir / "logs")),
            kwargs_handlers=[InitProcessGroupKwargs(timeout=STEP_WAIT)],
        )
        self.device, self.world = accelerator.device, accelerator.num_processes
        self.is_main = accelerator.is_main_process
        self.processes = agreement.Processes(accelerator)  # the processes' agreement
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.allow_tf32
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
        self.evaluator = None
        if args.eval_every_epochs and self.is_main:
            # Loads the scoring network now (Inception, or the shape scorer on the built-in data): missing weights stop the run before any training.
            self.evaluator = metrics.TrainingEvaluator(args, args.output_dir, self.device, log=accelerator.print)
        self.startup.mark("accelerate")

        # Data: decoded (or generated) before the model is built, so that a bad path or file fails in seconds;
        # a latent run's encoded to latents, or read from their cache.
        self.unreadable = data.Unreadable(strict=args.on_fault == "stop", verbose=self.is_main)
        self.decode, self.latents, self.latent_space = None, None, None  # a latent run's: latents -> images, records
        self.dataset_contents = None  # a latent run's: what its images hold (data.dataset_identity), for FID's key
        self.vae = None  # a latent run's VAE: on the CPU but while grids and FID samples are decoded
        resume_from = args.resume if isinstance(args.resume, str) else None  # --resume CHECKPOINT
        if args.vae:  # the checkpoint is chosen, and its latent space checked, before a dataset is encoded
            source = self._latent_source()
            start_from = self._choose_start(source["class_names"], resume_from)
            images, labels, class_names = self._latent_data(source)
        else:
            images, labels, class_names = data.load_images(args, self.unreadable)
            start_from = self._choose_start(class_names, resume_from)
        self.images_per_step = args.train_batch_size * self.world * args.gradient_accumulation_steps
        if len(images) < self.images_per_step:
            raise ConfigError(
                f"the dataset has {len(images)} images, fewer than one optimizer step takes ({args.train_batch_size} "
                f"x {self.world} processes x {args.gradient_accumulation_steps} accumulation): "
                "lower --train_batch_size or --gradient_accumulation_steps"
            )
        self.startup.mark("data")
        self.config, self.compile_why = describe_run(args, self.device, self.world, len(images))
        self.startup.mark("FLOPs and compile plan")
        # one compile plan for every process, rank 0's: each node plans from its own compile record
        plan = self.processes.from_main([self.config["step_compile_mode"], self.config["step_compile_scope"], self.compile_why])
        self.config["step_compile_mode"], self.config["step_compile_scope"], self.compile_why = plan
        # Inductor's workers start while the network is built, not at the first compile (none for an eager step)
        compiling.start_compile_workers(self.device, self.config["step_compile_mode"])
        self.config["data_path"] = "preloaded" if isinstance(images, PRELOADED) else "latents" if args.vae else "streamed"
        if self.latents is not None:
            self.config |= dict(latents=self.latents, latent_space=self.latent_space)
        # The classes of a conditional run, kept with it: sample.py takes their names.
        self.num_classes = len(class_names) if class_names else 0
        self.config |= dict(num_classes=self.num_classes, class_names=class_names, flow_sigmas=self.flow_sigmas,
                            class_counts=None if labels is None else torch.bincount(labels, minlength=self.num_classes).tolist())  # fmt: skip
        self.steps_per_epoch, self.total_steps = self.config["steps_per_epoch"], self.config["total_train_steps"]
        if args.eval_every_epochs:
            self._prepare_reference(images)
            self.startup.mark("FID's reference")
        set_seed(args.seed, device_specific=True)  # each process draws its own noise
        if isinstance(images, PRELOADED) and self.device.type == "cuda":
            images = images.to(self.device)  # small enough to sit on the GPU: --preload_data's MAX_GIB
        self.batches = data.Batches(images, args.train_batch_size, args.seed, self.device, accelerator.process_index,
                                    self.world, args.dataloader_num_workers, self.unreadable, labels)  # fmt: skip
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            # autoguidance's network: building it (a checkpoint's) draws random numbers, which must not change the
            # network trained or its noise: with or without --guide, the same --seed trains the same weights
            self.guide = sample.load_guide(args.guide, self.config, self.device) if args.guide else None
        self.num_images = len(images)
        self.startup.mark("data to the device")
        self._build_training()
        self.startup.mark("network")
        self.step, self.skipped_before = 0, 0
        if start_from is not None:
            self._resume(start_from)
            self.startup.mark("resume")
        self.last_saved = (None, None)  # (step, path) of this run's newest checkpoint
        self.flushing = None  # the checkpoint on its way to disk (checkpoint.Flush), behind the steps
        self.checkpoint_times = []  # run.json's checkpoint_times_s
        self.host_copy = checkpoint.host_copy_for(self.device)  # the state's copy that a checkpoint's thread writes
        self.epoch_started_at = None  # the step each epoch of this run began at
        if self.step < self.total_steps:
            self._announce()

    def _prepare_reference(self, images):
        """FID's reference statistics of the training images (`images`; a latent run's decoded from the dataset):
        read where an earlier run (or this one, before a resume) left them, or waited for where another run is making
        them (metrics.claimed_reference), else made by every process embedding its share of the images (the shape
        scorer's on the built-in shapes: the main process's alone), summed to the main process, which keeps them
        for every later run."""
        args, evaluator = self.args, self.evaluator
        found = [True]

        def find():  # what the images hold: a latent run's read with them, a streamed dataset's from it (not opened again)
            contents = self.dataset_contents if args.vae else (
                data.dataset_identity(args, images) if isinstance(images, (data.FileImages, data.HubImages)) else None)  # fmt: skip
            found[0] = evaluator.find_reference(contents)

        self.processes.on_main_process(find)
        try:
            if not self.processes.from_main(found)[0]:
                self._make_reference(images)
        finally:
            if self.is_main:
                evaluator.release()  # made and kept, or failed: another run may make them

    def _make_reference(self, images):
        """The statistics _prepare_reference found nowhere, made on every process and kept by the main process."""
        args, evaluator = self.args, self.evaluator
        shared = self.world > 1 and not metrics.uses_shape_score(vars(args), args.fid_weights)
        world, together = (self.world, self.processes.on_every_process) if shared else (1, self.processes.on_main_process)
        ready = [None, None]  # this process's (images, extractor): an error in either stops every process here

        def prepare():
            extractor = evaluator.extractor if self.is_main else metrics.extractor_for(vars(args), args.image_size, args.fid_weights)[0]
            ready[:] = metrics.reference_images(vars(args), args.image_size) if args.vae else images, extractor
            if self.is_main:
                self.accelerator.print(metrics.computing_line(len(ready[0]), evaluator.reference_key, world))

        together(prepare)
        statistics = [None]
        rank = self.accelerator.process_index if shared else 0

        def embed():  # a share each, summed to the main process in the group that waits long enough for it
            statistics[0] = metrics.statistics_of_share(*ready, self.device, metrics.fid_batch_size(args.eval_batch_size),
                                                        args.dataloader_num_workers, rank, world, self.processes.main_work_group)  # fmt: skip

        together(embed)
        self.processes.on_main_process(lambda: evaluator.keep_reference(statistics[0]))

    def _choose_start(self, class_names, resume_from):
        """The checkpoint to continue from (resume.choose_start), checked against what the run is before
        anything is encoded: the flags, the processes, the classes, a latent run's latent space."""
        args = self.args
        self.flow_sigmas = models.flow_sigma_distribution(vars(args))  # a flow run's σ draw, also in train_config.json
        identity = dict(vars(args), num_processes=self.world, num_classes=len(class_names) if class_names else 0,
                        latent_space=self.latent_space, flow_sigmas=self.flow_sigmas)  # fmt: skip
        chosen = [None]

        def choose():  # the main process's: one run at a time in a folder, and one choice for every process
            checkpoint.RunLock(self.output_dir)  # held till train.main ends (RunLock.held)
            chosen[0] = resume.choose_start(args.output_dir, identity, args.resume is not False, resume_from,
                                            args.overwrite_output_dir)  # fmt: skip

        self.processes.on_main_process(choose)
        # the main process's choice on every process, not each its own: a node whose view of a shared disk lags
        # would pick an older one
        return self.processes.from_main(chosen)[0]

    def _latent_source(self):
        """A latent run's VAE and dataset, nothing encoded yet: the VAE loaded and hashed (`self.latent_space`,
        what resume compares), the dataset opened (its identity, count and classes) and the cache's key."""
        args = self.args
        vae = latents.load_vae(args.latents["source"], args.latents["subfolder"])  # config.resolve found it
        identity, images, count, class_names = data.images_to_encode(args, self.unreadable)
        key = latents.cache_key(identity, vae, args.image_size, center_crop=True, flips=data.random_flips(args))
        kind = args.latent_normalization
        self.latent_space = latents.latent_space(key["vae"]["encoder_sha256"],
                                                 dict(kind=kind) | (latents.vae_constants(vae) if kind == "vae" else {}))  # fmt: skip
        # read once here, not again for FID's reference statistics (seconds a 100k files)
        self.dataset_contents = None if args.dataset == data.BUILTIN else {k: v for k, v in identity.items() if k not in data.LABELLING}
        return dict(vae=vae, images=images, count=count, class_names=class_names, key=key)

    def _latent_data(self, found):
        """A latent run's data: (latents.LatentDataset, labels, class names). The latents of the dataset
        from their cache: when they are not there every process encodes its share of the dataset into it (one
        line says how fast; a cache hit decodes no image and says so), and reads the cache assembled. Each
        epoch draws each image's latent afresh (latents.LatentCache.draw), normalised as `self.latents`
        records for train_config.json; `self.decode` turns latents into images for the grids and FID."""
        args, accelerator = self.args, self.accelerator
        vae, key, source = found["vae"], found["key"], args.latents["source"]
        # Every process encodes its share on its own device (latents.cached_latents: the waits for the slowest
        # share in a gloo group of their own, with an explicit timeout); the main process decodes grids and FID.
        if self.is_main:
            vae.to(self.device)
        cache = latents.cached_latents(vae, found["images"], key, device=self.device, num_images=found["count"],
                                       progress=self.is_main, max_gib=data.preload_max_gib(args),
                                       log=accelerator.print)  # fmt: skip
        # Encoded: its memory back to training (0.31 GiB for SD's VAE). Decoding grids and FID samples brings it
        # back to the device, and after_epoch sends it away again (docs/performance.md, Memory).
        vae.to("cpu")
        self.vae = vae
        # EDM expects data of std sigma_data (0.5); DDPM's forward process, unit std (LDM's latents)
        target_std = args.sigma_data if args.objective == "edm" else 1.0
        record = latents.normalization(cache, vae, args.latent_normalization, target_std)
        low, high = min(record["normalized_std"]), max(record["normalized_std"])
        if record["kind"] == "vae" and not 0.5 * target_std <= low <= high <= 2 * target_std:
            accelerator.print(
                f"warning: the VAE's scaling_factor leaves the latents of this data with a std of {low:.3g} to {high:.3g} "
                f"per channel, where the objective expects {target_std:g}: --vae {source},dataset normalises by their own"
            )  # fmt: skip
        where = Path(source).expanduser()
        self.latents = dict(
            args.latents, vae=str(where.resolve()) if where.exists() else source, encoder_sha256=key["vae"]["encoder_sha256"],
            normalization=record, cache=str(cache.path), cache_key=key, memmapped=cache.memmapped,
            encode_seconds=cache.encode_seconds, images_per_second=cache.images_per_second,
        )  # fmt: skip
        self.decode = lambda z: latents.decode(vae.to(z.device), z, record)  # the VAE joins the latents to decode
        return latents.LatentDataset(cache, record, seed=args.seed), cache.labels, found["class_names"]

    def _build_training(self):
        """Network, objective, optimizer, learning-rate schedule and EMA, as the speed ladder's rows
        build them (training.build), prepared by accelerate and registered for checkpoints."""
        args, accelerator = self.args, self.accelerator
        pieces = training.build(args, self.total_steps, self.device, num_classes=self.num_classes,
                                lr_ref_steps=self.config["lr_ref_steps"], write_ema=self.is_main,
                                prepare=accelerator.prepare, unwrap=accelerator.unwrap_model)  # fmt: skip
        self.config["params"] = sum(p.numel() for p in pieces.network.parameters())  # with a class embedding
        self.model, self.optimizer, self.objective = pieces.model, pieces.optimizer, pieces.objective
        self.noise_scheduler, self.sampling_scheduler = pieces.noise_scheduler, pieces.sampling_scheduler
        self.lr_scheduler, self.ema = pieces.lr_scheduler, pieces.ema
        accelerator.register_for_checkpointing(self.lr_scheduler)
        if any(True for _ in self.objective.parameters()):
            accelerator.register_for_checkpointing(self.objective)
        if self.ema is not None:
            accelerator.register_for_checkpointing(self.ema)
        self.guard = steps.NonFiniteGuard(self.optimizer, args.on_fault, self.device)
        self.model.train()
        self.memory = self._memory_plan(pieces.network)
        self.precision_words = fp8.describe(pieces.network, self.device) if args.mixed_precision == "fp8" else ""

    def _memory_plan(self, network):
        """What this process will hold on its device (memory.Plan): the pieces' own bytes, and the activations of
        one micro-batch counted on the meta device; on a GPU also with gradient checkpointing, for the line's hint."""
        args = self.args
        step = (args.model, network_size(args), args.train_batch_size, args.latent_channels or 3, args.mixed_precision)
        count = memory.count_step(*step, args.gradient_checkpointing)
        checkpointed = None
        if self.device.type == "cuda" and not args.gradient_checkpointing:
            checkpointed = memory.count_step(*step, True)
        trained = [*network.parameters(), *network.buffers(), *self.objective.parameters()]
        return memory.plan(trained, self.optimizer, self.ema, count, args.train_batch_size, self.world, checkpointed)

    def _resume(self, start_from):
        error, rng = None, Path(start_from) / f"random_states_{self.accelerator.process_index}.pkl"  # this process's
        try:  # accelerate skips an RNG state it cannot read, and the run would go on, not as it would have
            torch.load(rng, weights_only=False)
        except Exception as e:  # named: each process has its own
            error = checkpoint.unloadable(start_from, e, rng.name)
        try:
            if error is None:
                self.accelerator.load_state(str(start_from))
        except Exception as e:  # a damaged or missing file (torch's, safetensors' and pickle's errors): one line
            error = checkpoint.unloadable(start_from, e)
        self.processes.stop_together(error, 2)  # one process that cannot load its part (its RNG state) stops them all
        if self.ema is not None:
            self.ema.to(self.device)
        state = checkpoint.read_state(start_from)
        self.step, self.skipped_before = state["step"], state.get("skipped_nonfinite", 0)
        changed = resume.changed_since(start_from, vars(self.args))  # honoured, and said
        said = f"; changed: {'; '.join(changed)}" if changed else ""
        self.accelerator.print(f"resumed from {start_from} at step {self.step}{said}")

    def _announce(self):
        """train_config.json, the trackers and the first line: only for a run with steps to take."""
        args, config = self.args, self.config
        if self.is_main:
            if args.overwrite_output_dir:  # the run it starts over: not before every check has passed
                shutil.rmtree(checkpoint.checkpoints_root(self.output_dir), ignore_errors=True)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "train_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
            scalars = {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))}
            self.accelerator.init_trackers("train", config=scalars)
        _, peak_words = flops.describe_peak(self.device, args.mixed_precision, args.allow_tf32)
        latent = f" as {args.latent_size}x{args.latent_size}x{args.latent_channels} latents" if args.vae else ""
        skipped = f" ({len(self.unreadable)} unreadable so far: skipped)" if len(self.unreadable) else ""  # preloaded: all
        self.accelerator.print(
            f"training {args.model} ({config['params']:,} parameters, --objective {args.objective}) "
            f"on {self.num_images} images{skipped} at {args.image_size}px{latent}: "
            f"{self.total_steps} steps of {self.images_per_step} images, mixed precision {args.mixed_precision}{self.precision_words}, "
            f"{self.world} process(es) on {config['device']}; {config['model_flops_per_step'] / 1e12:.4g} TFLOP per "
            f"step; {peak_words}; step {self.compile_why}"
        )
        cuda = self.device.type == "cuda"
        # on a CPU the host memory free now (a container's limit included; None where unknown)
        capacity = torch.cuda.get_device_properties(self.device).total_memory if cuda else checkpoint.available_memory() or None
        self.accelerator.print(memory.plan_line(self.memory, capacity, "this GPU" if cuda else "this machine's free memory",
                                                compiled=compiling.compiles(config["step_compile_mode"])))  # fmt: skip
        full = checkpoint.disk_warning(self.output_dir, self.memory.state, self.step, self.total_steps,
                                       args.checkpointing_steps, args.checkpoints_total_limit)  # fmt: skip
        if full:
            self.accelerator.print(full)

    def build_step(self, meter):
        """The step, from the uint8 batch to the EMA (step.py), reporting its phases to `meter`."""
        self.meter = meter
        mode = None if self.config["step_compile_mode"] == "eager" else self.config["step_compile_mode"]
        step = steps.TrainStep(self.model, self.model, self.objective, self.optimizer, self.lr_scheduler, self.ema,
                               self.guard, self.args.max_grad_norm, data.random_flips(self.args),
                               accelerator=self.accelerator,
                               mark=meter.breakdown.phase_done, label_dropout=self.args.label_dropout,
                               null_label=models.null_label(self.num_classes))  # fmt: skip
        fast = compiling.FastStep(step, mode, self.device, say=meter.write, scope=self.config["step_compile_scope"])
        if compiling.compiles(mode) and self.step < self.total_steps:
            loaded = compiling.load_compile_artifacts(self.output_dir / COMPILE_CACHE_FILE, self.device)
            if loaded:
                self.accelerator.print(loaded)
        self.startup.mark("step")
        if self.step < self.total_steps:
            meter.write(self.startup.line())
        self.train_step = fast  # run.json's compile fields (write_manifest: at the end, or at a stop)
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

    def after_step(self, meter, signals):
        if self.step % self.args.checkpointing_steps == 0 or self.step == self.total_steps:
            self.save_checkpoint(meter)
        self.flushed(meter, wait=False)  # a checkpoint is said saved once on disk; a failed flush stops here
        if self.processes.stop_requested(signals, self.step):
            self.stop_for_signal(signals, meter)

    def after_epoch(self, epoch, meter, signals):
        """The grid and the evaluation due after `epoch`. A stop signal that comes meanwhile (an evaluation of
        --eval_num_samples may take hours, a preemption's grace period a minute) leaves what is left of them
        undone, at the next batch of samples, and the step is kept in a checkpoint as after a step."""
        args, last = self.args, self.step >= self.total_steps
        unless_stopped = lambda work: None if signals.requested else work()  # noqa: E731  (the main process's)
        if epoch % args.save_images_epochs == 0 or last:
            with meter.paused("sampling"):
                self.processes.on_main_process(lambda: unless_stopped(lambda: self.write_samples(epoch)))
        if args.eval_every_epochs and ((epoch + 1) % args.eval_every_epochs == 0 or last):
            with meter.paused("evaluation"):  # every process generates a share of the samples
                self.processes.on_every_process(lambda: self.evaluate(epoch, signals))
        if self.vae is not None:
            self.vae.to("cpu")  # decoded: its memory back to training
        if last:  # the last checkpoint's flush went on beside the grid; what is left of it, timed
            with meter.paused("checkpointing"):
                self.flushed(meter)
        if self.processes.stop_requested(signals, self.step, now=True):
            self.stop_for_signal(signals, meter)

    def averaged_network(self):
        """A copy of the network with the EMA weights (the raw ones without an EMA)."""
        return posthoc_ema.averaged_copy(self.accelerator.unwrap_model(self.model), self.ema)

    def pipeline_saved(self):
        return (self.output_dir / rundir.pipeline_mark(models.saves_pipeline(vars(self.args)))).is_file()

    def save_network(self, network, folder):
        rundir.save_network(network, folder, self.noise_scheduler if models.saves_pipeline(vars(self.args)) else None)

    def save_pipeline(self):
        """The EMA weights (or the raw ones) in output_dir."""
        try:
            self.save_network(self.averaged_network(), self.output_dir)
        except OSError as e:
            note = f"running again saves it from the checkpoint of step {self.step}"
            raise RunError(checkpoint.cannot_write(f"the pipeline to {self.output_dir}", e, note)) from None
        saved = "the pipeline to" if models.saves_pipeline(vars(self.args)) else "the network to"  # EDM, EDM2, DiT: unet/ alone
        self.accelerator.print(f"saved {saved} {self.output_dir}; sample grids in {self.output_dir / 'samples'}")

    def write_samples(self, epoch):
        """A grid of --eval_batch_size images from the EMA weights, from the same noise every time;
        a conditional run's rows go through the classes in turn."""
        args, path = self.args, self.output_dir / "samples" / f"{epoch:04d}.png"
        seeds = sample.image_seeds(args.seed, args.eval_batch_size)
        labels = sample.grid_labels(self.num_classes, args.eval_batch_size)
        images = sample.generate(self.averaged_network(), self.sampling_scheduler, seeds, args.num_inference_steps,
                                 self.accelerator.autocast, labels, args.guidance_scale[0], self.guide, self.decode)  # fmt: skip
        try:
            sample.save_grid(images, path)
        except OSError as e:
            raise RunError(checkpoint.cannot_write(path, e)) from None

    def evaluate(self, epoch, signals):
        """FID/KID of the EMA weights at each --guidance_scale, on every process: each generates every
        world-th batch of the samples and the main process embeds them all, in image order (the batches one
        process generates), scores them, and puts the best pipeline by FID (at its best scale) in best/. A
        stop signal on any process abandons it at the next batch."""
        args, network = self.args, self.averaged_network()
        counts = self.config["class_counts"]  # a conditional run: labels drawn as in the data
        labels = sample.labels_as_in_data(counts, args.eval_num_samples, args.seed) if counts else None
        batch_size = metrics.fid_batch_size(args.eval_batch_size)

        def batches_for(w):
            mine = sample.generate_batches(network, self.sampling_scheduler, args.eval_num_samples, batch_size,
                                           args.seed, args.num_inference_steps, self.accelerator.autocast, labels, w,
                                           self.guide, self.decode, shard=(self.accelerator.process_index, self.world))  # fmt: skip
            return self.gathered_samples(mine, args.eval_num_samples, batch_size, signals, epoch)

        if not self.is_main:  # its share of each scale's samples, sent to the main process
            for w in args.guidance_scale:
                collections.deque(batches_for(w), maxlen=0)
            return

        sampler = getattr(self.sampling_scheduler, "name", args.sampler)
        save = lambda folder: self.save_network(network, folder)  # noqa: E731
        result = self.evaluator.evaluate(batches_for, args.guidance_scale, sampler, args.num_inference_steps,
                                         epoch, self.step, save, labels)  # fmt: skip
        self.accelerator.log({k: result[k] for k in ("fid", "kid_mean", "kid_std")}, step=self.step)
        at = f"eval epoch {epoch} step {self.step}"
        for scale in result.get("scales", []):
            self.meter.write(f"{at} | guidance scale {scale['guidance_scale']:g}: {metrics.format_scores(dict(result, **scale))}")
        best = " (best so far: saved to best/)" if result["best"] else ""
        scale = f"best guidance scale {result['guidance_scale']:g}: " if "scales" in result else ""
        self.meter.write(f"{at} | {scale}{metrics.format_scores(result)}{best}")

    def gathered_samples(self, mine, num_images, batch_size, signals, epoch):
        """An evaluation's samples, every process's share gathered to the main process (sample.gathered), the
        processes agreeing on a stop signal before each round of batches."""

        def unless_stopped():
            if self.processes.stop_requested(signals, self.step, now=True):
                self.accelerator.print(f"the evaluation after epoch {epoch} is left unfinished, for {signals.received.name}")
                raise agreement.Abandoned

        return sample.gathered(mine, num_images, batch_size, self.args.image_size, self.accelerator.process_index,
                               self.world, self.processes.main_work_group, unless_stopped)  # fmt: skip

    def skipped(self):
        return self.skipped_before + self.guard.count()

    def save_checkpoint(self, meter):
        if not checkpoint.weights_finite(self.model):  # never replace a good checkpoint with a broken state
            raise RunError(f"the weights are not finite at step {self.step}: not saving a checkpoint; resume from the last one")
        state = dict(skipped_nonfinite=self.skipped(), run=resume.run_identity(self.config))
        with meter.paused("checkpointing"):
            self.flushed(meter)  # one checkpoint on its way to disk at a time
            self.flushing = checkpoint.save(self.accelerator, self.output_dir, self.step, state, self.args.checkpoints_total_limit,
                                            self.host_copy)  # fmt: skip
        self.last_saved = (self.step, self.flushing.path)
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
        self.checkpoint_times.append(dict(step=flush.step, waited=flush.waited_s, beside=flush.beside_s, copied=flush.copied))
        if self.is_main:  # the process that flushed it
            held, rest = ("its copy", "written and on disk") if flush.copied else ("its writing", "on disk")
            note = f"; {flush.note}" if flush.note else ""
            meter.write(f"saved {path} (the steps waited {flush.waited_s:.1f} s for {held}; {rest} in {flush.beside_s:.1f} s "
                        f"more, beside training{note})")  # fmt: skip

    def stop_for_signal(self, signals, meter):
        """Keep this step in a checkpoint, say how to go on, and exit with the signal's code."""
        meter.progress.close()
        saved_step, path = self.last_saved
        if saved_step != self.step:
            path = self.save_checkpoint(meter)
        with meter.paused("checkpointing"):
            # on disk before any process says so and exits: a launcher (torchrun) stops the others, in 30 s, once
            # one process has exited, and only the main process writes the checkpoint
            self.processes.on_main_process(lambda: self.flushed(meter))
            self.flushed(meter)  # the other processes' part
            # run.json of the steps trained so far (a preempted run's speed is kept; the resumed run's end rewrites it)
            self.processes.on_main_process(lambda: self.write_manifest(meter.manifest() | dict(stopped_by=signals.received.name)))
        again = " with --resume alone (no folder)" if isinstance(self.args.resume, str) else ""  # not from CHECKPOINT
        self.accelerator.print(
            f"stopped by {signals.received.name} at step {self.step}: saved {path}; "
            f"run the same command again{again} to continue"
        )
        self.accelerator.end_training()
        raise SystemExit(signals.exit_code)

    def finish(self, meter):
        """The end: the pipeline and run.json after training; or why nothing was trained."""
        if not meter.trained:  # already trained to the end
            if not self.pipeline_saved():  # the end of the run was cut short
                self.processes.on_main_process(self.save_pipeline)
            else:
                self.accelerator.print(
                    f"{self.args.output_dir} is already trained to step {self.step} of {self.total_steps}: "
                    "raise --max_train_steps or --num_epochs to train longer"
                )
        else:
            meter.report_end(self.skipped(), len(self.unreadable))
            timing = meter.manifest()  # before the pipeline is saved: training ends here
            if self.args.ema == "power":
                self.ema.save_snapshot()  # the end of training, whatever --ema_snapshot_every (main process only)
            self.processes.on_main_process(lambda: (self.save_pipeline(), self.write_manifest(timing),
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
            checkpoint_times_s=self.checkpoint_times,
            pipeline_dir=str(self.output_dir),
            **timing,
        )


class Meter:
    """How the run goes, measured and said: the step times (flops.StepTimer), where the time
    went (profiling.Breakdown), the first, compiling step, the --profile recording, the loss,
    the progress bar and the printed line every --logging_steps.

    The loop tells it when a batch arrives and when a step is done; `paused(name)` times
    what happens between steps (sampling, evaluation, checkpointing) apart from them.
    """

    def __init__(self, run):
        from tqdm.auto import tqdm

        args, device = run.args, run.device
        self.run, self.args = run, args
        self.breakdown = profiling.Breakdown(device)
        self.timer = flops.StepTimer(device, args.timing_warmup_steps)
        self.losses = steps.LossMeter(device)
        self.peak_flops, self.peak_words = flops.describe_peak(device, args.mixed_precision, args.allow_tf32)
        self.model_flops, self.hardware_flops = run.config["model_flops_per_step"], run.config["hardware_flops_per_step"]
        self.started_at = profiling.now_iso()
        self.epoch_times = []  # each whole epoch's training time: data loading included; sampling, checkpoints not
        self.compile_s = self.compile_phases = None  # seconds the first, compiling step took, and where they went
        self.compiles = compiling.compiles(run.config["step_compile_mode"])
        self.trained = False  # whether this process took a step
        self.progress = tqdm(total=run.total_steps, initial=run.step, disable=not run.accelerator.is_local_main_process,
                             desc="steps")  # fmt: skip
        # --profile: torch.profiler on rank 0 over a few steps (1 warm-up, then recorded) once the
        # step is past its trial calls (profile_when_steady).
        self.profiler = self.profile_until = self.profiled_step = None

    def profile_when_steady(self, step):
        """--profile: record `step` (a compiling.FastStep) once past its trial calls (compile, CUDA graph warm-up,
        recording or capture), so that the steps recorded are steady ones, not those."""
        if self.args.profile:
            self.profiled_step = step

    def _start_profiler(self):
        """After a step: one warm-up step, then config.SETTINGS["profile_steps"] recorded (on rank 0; every rank stops together)."""
        args, run = self.args, self.run
        self.profiled_step, self.profile_until = None, run.step + 1 + args.profile_steps
        if run.is_main:
            self.profiler = profiling.make_profiler(
                run.output_dir / "profile", 0, 1, args.profile_steps, args.profile_top, with_stack=args.profile_stack,
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
        if self.run.accelerator.is_local_main_process:
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
        self.write(f"compiling the step ({self.run.config['step_compile_mode']}) ...")
        clock = compiling.FirstStepClock(self.run.device)
        with self.breakdown.pause("compile"), clock.measure():
            yield
        self.compile_s, self.compile_phases = clock.seconds, clock.phases
        if clock.cold:  # what the next run of this step predicts its (then warm) compile from
            config, args = self.run.config, self.run.args
            compiling.remember_compile(compiling.compile_key(args, self.run.device, config["step_compile_mode"],
                                                     config["step_compile_scope"]), clock.seconds)  # fmt: skip
        cache = self.run.output_dir / COMPILE_CACHE_FILE
        self.run.processes.on_main_process(lambda: compiling.save_compile_artifacts(cache, self.run.device))
        self.write(clock.line)

    @contextlib.contextmanager
    def paused(self, name):
        """Work between steps, timed apart from them."""
        with self.breakdown.pause(name):
            yield
        self.timer.restart()

    def step_done(self, losses):
        self.trained = True
        for loss in losses:
            self.losses.add(loss)
        self.timer.step_done()
        self.progress.update(1)
        if self.profiler is not None:
            self.profiler.step()
            if self.run.step == self.profile_until:  # the trace and table are written
                self.profiler.stop()
                self.profiler = None
        elif self.profiled_step is not None and profiling.past_trial_calls(self.profiled_step):
            self._start_profiler()
        if self.run.step % self.args.logging_steps == 0:
            self.report(self.timer.collect())
            self.breakdown.collect()

    def epoch_done(self, epoch, whole):
        if whole:
            epoch_s = self.breakdown.epoch_s()
            self.epoch_times.append(dict(epoch=epoch, seconds=epoch_s, images_per_s=self.run.steps_per_epoch *
                                         self.run.images_per_step / epoch_s))  # fmt: skip
            self.run.accelerator.log(dict(epoch_time_s=epoch_s), step=self.run.step)

    def perf(self, step_time_s):
        peak = self.peak_flops and self.peak_flops * self.run.world
        return flops.utilization(self.model_flops, self.hardware_flops, step_time_s, peak)

    def report(self, step_times, final=False):
        """The loss since the last report and the throughput line (one host sync)."""
        run, accelerator = self.run, self.run.accelerator
        if self.losses.read():
            lr = float(run.lr_scheduler.get_last_lr()[0])
            terms = self.losses.last_terms if len(self.losses.last_terms) > 1 else {}
            accelerator.log(dict(loss=self.losses.last, lr=lr) | {f"loss/{name}": v for name, v in terms.items()}, step=run.step)
        last_loss, terms = self.losses.last, self.losses.last_terms
        if not step_times:
            line = f"step {run.step}/{run.total_steps} | {flops.loss_words(last_loss, terms)} | timing: still warming up"
        else:
            step_time_s = flops.median(step_times)
            perf = self.perf(step_time_s)
            line = flops.format_perf_line(
                run.step, run.total_steps, last_loss, step_time_s, run.images_per_step, self.model_flops, perf,
                self.peak_words, run.world, profiling.peak_memory_gib(run.device), terms,
            )  # fmt: skip
            if not final:
                images_per_s = run.images_per_step / step_time_s
                self.progress.set_postfix(loss=f"{last_loss:.4f}", img_s=f"{images_per_s:.1f}")
                logs = dict(step_time_s=step_time_s, images_per_s=images_per_s)
                accelerator.log(logs | {k: v for k, v in perf.items() if v is not None}, step=run.step)
        self.write(("final: " if final else "") + line)

    def report_end(self, skipped, unreadable):
        """The last lines: the run's median step, what was skipped, and where the time went."""
        if self.run.step % self.args.logging_steps:
            self.report(self.timer.collect())
        self.timer.collect()
        self.report(self.timer.all_times, final=True)
        if skipped or unreadable:
            self.run.accelerator.print(
                f"skipped {skipped} step(s) with a non-finite loss or gradient and {unreadable} unreadable image(s)"
            )
        self.run.accelerator.print(self.breakdown.format())
        device = self.run.device
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        self.run.accelerator.print(memory.end_line(self.run.memory, peak))

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
            images_per_s=self.run.images_per_step / step_time_s if step_time_s else None,
            achieved_flops=perf.get("achieved_flops"),
            mfu=perf.get("mfu"),
            hfu=perf.get("hfu"),
            peak=self.peak_words,
            peak_memory_gib=profiling.peak_memory_gib(self.run.device),
            compile_s=self.compile_s,
            compile_phases_s=self.compile_phases,  # where the compile went, by torch's timers (compiling.compile_phases)
            startup_s=self.run.startup.parts,  # train.py's start to the loop, by part (the "ready to train" line)
            train_wall_s=wall_s,
            epoch_times_s=self.epoch_times,
            time_breakdown_s=parts,
        )


if __name__ == "__main__":
    main(parse_args())
