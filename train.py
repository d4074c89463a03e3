"""Train a DDPM (a diffusers UNet2DModel) and report honest FLOPs and utilization.

    python train.py                                   # built-in shapes, CPU-sized model
    python train.py --dataset path/to/images --image_size 64
    python train.py --dataset huggan/smithsonian_butterflies_subset \\
        --image_size 128 --train_batch_size 64 --num_epochs 50 --learning_rate 1e-4
    python train.py --config configs/cifar10-edm2-E.yaml   # a reference run, as a file (config.py)
    python train.py --dry_run                         # resolved config, parameters, FLOPs; no training

Resume a run from its newest checkpoint:

    python train.py ...same flags... --resume_from_checkpoint latest

What it writes into --output_dir: samples/NNNN.png (a grid from the EMA
weights, the same noise every time), the trained pipeline
(`DDPMPipeline.from_pretrained(output_dir)`), checkpoints/checkpoint-STEP/,
train_config.json and tensorboard logs under logs/. Every --logging_steps it
prints one line: s/step, images/s, TFLOP/step, TFLOP/s, MFU, HFU and the peak
they are measured against.
"""

import copy
import json
import math
import os
import sys
from pathlib import Path

import torch

import checkpoint
import data
import ema as posthoc_ema
import flops
import metrics
import model as models
import profiling
import sample
import step as steps
from config import parse_args, resolve
from errors import ConfigError, RunError

def main(args):
    """Train. Errors are one line: exit code 2 for a bad flag, path or dataset,
    1 when training cannot go on (disk full, non-finite loss with --on_nonfinite stop);
    143 after a SIGTERM and 130 after Ctrl-C, once the checkpoint is saved."""
    try:
        return train(resolve(args))
    except ConfigError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except RunError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint
        print("train.py: interrupted twice: stopped without saving", file=sys.stderr)
        raise SystemExit(130) from None


# --- pieces of the run -------------------------------------------------------------


def load_images(args, unreadable):
    """The training images: a uint8 tensor (preloaded) or a Dataset to stream."""
    if args.dataset == data.BUILTIN:
        return data.make_shapes(args.shapes_num_images, args.image_size, seed=args.seed)
    dataset = data.open_dataset(
        args.dataset, args.image_size, args.center_crop, args.dataset_config, args.split, args.image_column
    )
    gib = len(dataset) * 3 * args.image_size**2 / 2**30
    if not args.preload_data or not args.center_crop or gib > args.preload_max_gib:
        data.check_readable(dataset, unreadable)
        return dataset
    return data.preload(dataset, args.dataloader_num_workers, progress=unreadable.verbose, unreadable=unreadable)


def ema_unet(accelerator, model, ema):
    """A stand-alone copy of the UNet carrying the EMA weights (or the raw ones without EMA)."""
    unet = copy.deepcopy(accelerator.unwrap_model(model)).eval()
    if ema is not None:
        ema.copy_to(unet.parameters())
    return unet


def save_sample_grid(unet, scheduler, args, path, accelerator):
    """Sample `eval_batch_size` images from fixed noise and write them as one grid PNG."""
    from diffusers import DDPMPipeline
    from torchvision.utils import make_grid, save_image

    pipeline = DDPMPipeline(unet=unet, scheduler=scheduler)
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(args.seed)  # the same noise at every epoch
    with accelerator.autocast():
        images = pipeline(
            batch_size=args.eval_batch_size,
            generator=generator,
            num_inference_steps=args.num_inference_steps,
            output_type="pt",
        ).images
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(make_grid(images.float(), nrow=math.ceil(math.sqrt(len(images)))), path)


def make_ema(args, unet, write):
    """The EMA of the weights that the samples and the saved pipeline use, or None (--no-use_ema).

    --ema power keeps one power-function EMA per --ema_stds and writes snapshots
    to ema_snapshots/ every --ema_snapshot_every steps (when `write`, the main
    process), for `ema.py reconstruct`; --ema standard is diffusers' EMAModel
    with warm-up, updated by foreach ops.
    """
    from diffusers.training_utils import EMAModel

    if not args.use_ema:
        return None
    if args.ema == "power":
        return posthoc_ema.PowerEMA(
            unet.parameters(),
            args.ema_stds,
            names=[name for name, _ in unet.named_parameters()],
            snapshot_dir=Path(args.output_dir) / posthoc_ema.SNAPSHOT_DIR,
            snapshot_every=args.ema_snapshot_every,
            write=write,
        )
    return EMAModel(
        unet.parameters(),
        decay=args.ema_max_decay,
        use_ema_warmup=True,
        inv_gamma=args.ema_inv_gamma,
        power=args.ema_power,
        foreach=True,
    )


def make_lr_scheduler(args, optimizer, max_train_steps, ref_steps):
    """diffusers' schedules with --lr_warmup_steps, or EDM2's inverse square root:

    lr(t) = lr_ref * min(t / warmup, 1) / sqrt(max(t / t_ref, 1))
    (Karras et al. 2024, Config E; NVlabs/edm2 training_loop.learning_rate_schedule).
    """
    from diffusers.optimization import get_scheduler

    if args.lr_scheduler != "inverse_sqrt":
        return get_scheduler(
            args.lr_scheduler, optimizer, num_warmup_steps=args.lr_warmup_steps, num_training_steps=max_train_steps
        )
    warmup = args.lr_warmup_steps

    def factor(step):
        ramp = min(step / warmup, 1.0) if warmup else 1.0
        return ramp / math.sqrt(max(step / ref_steps, 1.0))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def peak_description(args, device):
    """(peak FLOP/s per device or None, words saying what it is)."""
    precision = flops.matmul_precision(args.mixed_precision, args.allow_tf32 and device.type == "cuda")
    if args.peak_tflops:
        return args.peak_tflops * 1e12, f"peak {args.peak_tflops:g} TFLOP/s (--peak_tflops)"
    if device.type != "cuda":
        return None, f"peak unknown for {device.type} {precision} (pass --peak_tflops)"
    name = torch.cuda.get_device_name(device)
    gpu, peak = flops.lookup_peak(name, precision)
    if peak is None:
        return None, f"peak unknown for {name} {precision} (pass --peak_tflops)"
    return peak, f"peak {name} {precision} {peak / 1e12:g} TFLOP/s"


def dry_run_without_data(args, accelerator):
    """--dry_run on a dataset that is not built in: the resolved configuration and the FLOPs of a
    step, without opening the dataset, so what needs its size (steps per epoch...) is left out."""
    world = accelerator.num_processes
    cost = flops.step_flops(args.model, args.image_size, args.train_batch_size, args.gradient_checkpointing)
    per_step = cost["model_flops"] * args.gradient_accumulation_steps * world
    config = dict(vars(args), num_processes=world, params=cost["params"], model_flops_per_step=per_step)
    for key, value in config.items():
        accelerator.print(f"{key:28s} {value}")
    accelerator.print(
        f"model {args.model}: {cost['params']:,} parameters, {per_step / 1e12:.4g} TFLOP per step; "
        f"--dry_run does not open --dataset {args.dataset}, so its size and the steps per epoch are not shown"
    )
    return config


# --- the run -------------------------------------------------------------------------


def train(args):
    """Build the run, then loop: data, step, log, sample, evaluate, checkpoint, stop."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from tqdm.auto import tqdm

    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.dry_run or args.logger == "none" else args.logger,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs")),
    )
    device, world = accelerator.device, accelerator.num_processes
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.allow_tf32
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    if args.dry_run and args.dataset != data.BUILTIN:
        return dry_run_without_data(args, accelerator)  # a dry run never opens (or downloads) a dataset
    evaluator = None
    if args.eval_every_epochs and accelerator.is_main_process and not args.dry_run:
        # Loads the Inception network now: missing weights stop the run before any training.
        evaluator = metrics.TrainingEvaluator(args, args.output_dir, device, log=accelerator.print)

    # Data: decoded (or generated) before the model is built, so that a bad
    # path or file fails in seconds.
    unreadable = data.Unreadable(strict=args.strict_data, verbose=accelerator.is_main_process)
    images = load_images(args, unreadable)
    images_per_step = args.train_batch_size * world * args.gradient_accumulation_steps
    if len(images) < images_per_step:
        raise ConfigError(
            f"the dataset has {len(images)} images, fewer than one optimizer step takes "
            f"({args.train_batch_size} x {world} processes x {args.gradient_accumulation_steps} accumulation): "
            "lower --train_batch_size or --gradient_accumulation_steps"
        )
    steps_per_epoch = len(images) // images_per_step
    max_train_steps = args.max_train_steps or args.num_epochs * steps_per_epoch
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)

    # FLOPs per optimizer step and process, counted once on the meta device.
    cost = flops.step_flops(args.model, args.image_size, args.train_batch_size, args.gradient_checkpointing)
    model_flops = cost["model_flops"] * args.gradient_accumulation_steps * world  # all processes
    hardware_flops = cost["hardware_flops"] * args.gradient_accumulation_steps * world
    peak_flops, peak_words = peak_description(args, device)
    compile_mode, compile_why = steps.choose_compile_mode(args, device, world, cost["model_flops"])

    config = dict(
        vars(args),
        num_processes=world,
        num_images=len(images),
        data_path="preloaded" if isinstance(images, torch.Tensor) else "streamed",
        global_batch_size=images_per_step,
        steps_per_epoch=steps_per_epoch,
        total_train_steps=max_train_steps,
        total_epochs=num_epochs,
        params=cost["params"],
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hardware_flops,
        step_compile_mode=compile_mode or "eager",
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
    )
    if args.dry_run:
        for key, value in config.items():
            accelerator.print(f"{key:28s} {value}")
        accelerator.print(
            f"model {args.model}: {cost['params']:,} parameters, {model_flops / 1e12:.4g} TFLOP per step "
            f"({model_flops / images_per_step / 1e9:.2f} GFLOP per image, forward+backward); {peak_words}; "
            f"step {compile_why}"
        )
        return config

    start_from = checkpoint.choose_start(
        args.output_dir, config, args.resume, args.resume_from_checkpoint, args.overwrite_output_dir
    )
    accelerator.wait_for_everyone()  # every process has looked before rank 0 writes there
    if evaluator is not None:
        evaluator.prepare_reference(images)
    set_seed(args.seed, device_specific=True)  # each process draws its own noise
    if isinstance(images, torch.Tensor) and device.type == "cuda":
        images = images.to(device)  # small enough to sit on the GPU: preload_max_gib
    batches = data.Batches(
        images,
        args.train_batch_size,
        args.seed,
        device,
        accelerator.process_index,
        world,
        args.dataloader_num_workers,
        unreadable,
    )

    unet = models.build_unet(args.model, args.image_size)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    noise_scheduler = models.make_noise_scheduler(args.num_train_timesteps, args.beta_schedule, args.prediction_type)
    if args.objective == "edm":
        objective = models.EDMObjective(args.P_mean, args.P_std, args.sigma_data, args.loss_weighting).to(device)
    else:
        objective = models.DDPMObjective(noise_scheduler).to(device)

    # Fused AdamW (--fused_adam, the default): one kernel for all parameters, and
    # it can skip a step on the device (see NonFiniteGuard), so a NaN costs no
    # host sync per step. channels_last converts the UNet in place first.
    optimizer = models.prepare_for_training(
        unet,
        args.channels_last,
        args.fused_adam,
        also=objective.parameters(),  # EDM's u(sigma) trains with the network
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.weight_decay,
        eps=args.adam_epsilon,
    )
    if args.fused_norm:  # class swaps in place: the parameters and the state dict stay as they are
        import fused_norm

        fused_norm.keep_channels_last(fused_norm.use_fused_norm(unet))
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, config["lr_ref_steps"])
    model, optimizer = accelerator.prepare(unet, optimizer)
    accelerator.register_for_checkpointing(lr_scheduler)
    if any(True for _ in objective.parameters()):
        accelerator.register_for_checkpointing(objective)
    ema = make_ema(args, accelerator.unwrap_model(model), write=accelerator.is_main_process)
    if ema is not None:
        ema.to(device)
        accelerator.register_for_checkpointing(ema)
    run = Run(args, accelerator, model, ema, noise_scheduler, evaluator, config)

    if start_from is not None:
        accelerator.load_state(str(start_from))
        if ema is not None:
            ema.to(device)
        state = checkpoint.read_state(start_from)
        run.step, run.skipped_before = state["step"], state.get("skipped_nonfinite", 0)
        accelerator.print(f"resumed from {start_from} at step {run.step}")
    if run.step >= max_train_steps:
        if not run.pipeline_saved():  # the end of the run was cut short
            run.on_main_process(run.save_pipeline)
            return config
        accelerator.print(
            f"{args.output_dir} is already trained to step {run.step} of {max_train_steps}: "
            "raise --max_train_steps or --num_epochs to train longer"
        )
        return config

    if accelerator.is_main_process:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        (run.output_dir / "train_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        accelerator.init_trackers("train", config={k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))})

    accelerator.print(
        f"training {args.model} ({cost['params']:,} parameters) on {len(images)} images at {args.image_size}px: "
        f"{max_train_steps} steps of {images_per_step} images, mixed precision {args.mixed_precision}, "
        f"{world} process(es) on {config['device']}; {model_flops / 1e12:.4g} TFLOP per step; {peak_words}; "
        f"step {compile_why}"
    )

    # The step: everything from the uint8 batch to the EMA, in one object (step.py).
    breakdown = profiling.Breakdown(device)
    run.guard = steps.NonFiniteGuard(optimizer, args.on_nonfinite, device)
    train_step = steps.build_step(
        steps.TrainStep(
            steps.compile_network(model, compile_mode),
            model,
            objective,
            optimizer,
            lr_scheduler,
            ema,
            run.guard,
            args.max_grad_norm,
            args.random_flip,
            accelerator=accelerator,
            mark=breakdown.phase_done,
        ),
        compile_mode,
        device,
    )
    compile_cache = run.output_dir / COMPILE_CACHE_FILE
    if compile_mode is not None and steps.load_compile_artifacts(compile_cache):
        accelerator.print(f"loaded compile artifacts from {compile_cache}")

    timer = flops.StepTimer(device, args.timing_warmup_steps)
    losses = steps.LossMeter(device)
    report = Reporter(run, lr_scheduler, losses, max_train_steps, images_per_step, model_flops, hardware_flops,
                      peak_flops, peak_words)  # fmt: skip
    started_at = profiling.now_iso()
    epoch_times = []  # each whole epoch's training time: data loading included; sampling, checkpoints not

    # --profile: torch.profiler on rank 0 over a few steps (1 skipped, 1 warm-up, then recorded).
    profiler, profile_until = None, run.step + 2 + args.profile_steps
    if args.profile and accelerator.is_main_process:
        profiler = profiling.make_profiler(
            run.output_dir / "profile", 1, 1, args.profile_steps, args.profile_top, with_stack=args.profile_stack,
            level=args.profile,
        )  # fmt: skip
        profiler.start()

    first_epoch = run.step // steps_per_epoch
    model.train()
    run.progress = tqdm(total=max_train_steps, initial=run.step, disable=not accelerator.is_local_main_process, desc="steps")
    breakdown.start()
    with checkpoint.StopSignals() as signals, run.progress:  # the bar is closed before any error is printed
        for epoch in range(first_epoch, num_epochs):
            start = (run.step - epoch * steps_per_epoch) * args.gradient_accumulation_steps
            micro_batches = batches.epoch(epoch, start=start)
            breakdown.begin_epoch()
            timer.restart()
            while run.step < min(max_train_steps, (epoch + 1) * steps_per_epoch):
                breakdown.begin_step()
                batch = [next(micro_batches) for _ in range(args.gradient_accumulation_steps)]
                breakdown.phase_done("data")
                if compile_mode is not None and run.compile_s is None:
                    step_losses = run.compile_step(train_step, batch, breakdown, compile_cache)
                else:
                    step_losses = train_step(batch, run.step + 1)
                for loss in step_losses:
                    losses.add(loss)
                run.step += 1
                timer.step_done()
                run.progress.update(1)

                if profiler is not None:
                    profiler.step()
                    if run.step == profile_until:  # the trace and table are written
                        profiler.stop()
                        profiler = None
                if args.profile_only and run.step == profile_until:
                    run.progress.close()
                    accelerator.print(f"stopped after profiling at step {run.step}: see {run.output_dir / 'profile'}")
                    accelerator.end_training()
                    return config
                if run.step % args.logging_steps == 0:
                    report(timer.collect())
                    breakdown.collect()
                if run.step % args.checkpointing_steps == 0 or run.step == max_train_steps:
                    run.save_checkpoint(breakdown)
                    timer.restart()
                if run.stop_requested(signals):
                    run.stop_for_signal(signals, breakdown)

            if start == 0 and run.step == (epoch + 1) * steps_per_epoch:  # a whole epoch in this run
                epoch_s = breakdown.epoch_s()
                epoch_times.append(dict(epoch=epoch, seconds=epoch_s, images_per_s=steps_per_epoch * images_per_step / epoch_s))
                accelerator.log(dict(epoch_time_s=epoch_s), step=run.step)
            last_epoch = run.step >= max_train_steps
            if epoch % args.save_images_epochs == 0 or last_epoch:
                with breakdown.pause("sampling"):
                    run.on_main_process(lambda: run.write_samples(epoch))
                timer.restart()
            if args.eval_every_epochs and ((epoch + 1) % args.eval_every_epochs == 0 or last_epoch):
                with breakdown.pause("evaluation"):
                    run.on_main_process(lambda: run.evaluate(epoch))
                timer.restart()
            if last_epoch:
                break

    if run.step % args.logging_steps:
        report(timer.collect())
    timer.collect()
    report(timer.all_times, final=True)
    skipped = run.skipped_before + run.guard.count()
    if skipped or len(unreadable):
        accelerator.print(
            f"skipped {skipped} step(s) with a non-finite loss or gradient and {len(unreadable)} unreadable image(s)"
        )
    parts, wall_s = breakdown.summary()
    accelerator.print(breakdown.format())
    if args.use_ema and args.ema == "power":
        ema.save_snapshot()  # the end of training, whatever --ema_snapshot_every (main process only)

    def finish():
        """The pipeline, then run.json (the main process)."""
        run.save_pipeline()
        step_time_s = flops.median(timer.all_times) if timer.all_times else None
        perf = report.perf(step_time_s) if step_time_s else {}
        profiling.write_manifest(
            run.output_dir / "run.json",
            config=config,
            git_commit=profiling.git_commit(),
            versions=profiling.library_versions(),
            device=profiling.device_facts(device, world),
            start_time=started_at,
            end_time=profiling.now_iso(),
            steps=run.step,
            skipped_nonfinite_steps=skipped,
            unreadable_images=len(unreadable),
            final_loss=losses.last,
            median_step_time_s=step_time_s,
            images_per_s=images_per_step / step_time_s if step_time_s else None,
            achieved_flops=perf.get("achieved_flops"),
            mfu=perf.get("mfu"),
            hfu=perf.get("hfu"),
            peak=peak_words,
            peak_memory_gib=profiling.peak_memory_gib(device),
            compile_s=run.compile_s,
            train_wall_s=wall_s,
            epoch_times_s=epoch_times,
            time_breakdown_s=parts,
            samples_dir=str(run.output_dir / "samples"),
            checkpoints=[str(p) for p in checkpoint.checkpoint_dirs(run.output_dir)],
            pipeline_dir=str(run.output_dir),
        )

    run.on_main_process(finish)
    accelerator.end_training()  # flushes the tensorboard logs that the plots read
    if accelerator.is_main_process:
        profiling.draw_run_plots(run.output_dir)
    return config


# With several processes, how often they agree on whether a signal asked them to stop.
STOP_CHECK_STEPS = 10

# Compile artifacts (torch.compiler's mega-cache) kept beside the run, so that a
# run resumed on a fresh machine, whose Inductor cache is empty, need not compile again.
COMPILE_CACHE_FILE = "compile_cache.bin"


class Run:
    """What happens between steps: checkpoints, sample grids, evaluation, the pipeline, stopping.

    `step` is the number of optimizer steps taken; `progress` the bar the
    loop sets. Work that only the main process does goes through
    `on_main_process`, so that a failure there stops every process.
    """

    def __init__(self, args, accelerator, model, ema, noise_scheduler, evaluator, config):
        self.args, self.accelerator, self.model, self.ema = args, accelerator, model, ema
        self.noise_scheduler = noise_scheduler
        self.sampling_scheduler = sample.make_sampler(args.objective, args.sampler, noise_scheduler.config, args.sigma_data)
        self.evaluator, self.config = evaluator, config
        self.output_dir = Path(args.output_dir)
        self.device, self.world = accelerator.device, accelerator.num_processes
        self.step, self.skipped_before = 0, 0
        self.guard = self.progress = None
        self.last_saved = (None, None)  # (step, path) of this run's newest checkpoint
        self.compile_s = None  # seconds the first, compiling step took

    def write(self, text):
        if self.accelerator.is_local_main_process:
            self.progress.write(text)

    def compile_step(self, train_step, batch, breakdown, cache_file):
        """The first step, which compiles: timed as its own part of the breakdown, and said."""
        self.write(f"compiling the step ({self.config['step_compile_mode']}) ...")
        clock = steps.FirstStepClock(self.device)
        with breakdown.pause("compile"), clock.measure():
            step_losses = train_step(batch, self.step + 1)
        self.compile_s = clock.seconds
        self.on_main_process(lambda: steps.save_compile_artifacts(cache_file))
        self.write(clock.line)
        return step_losses

    def on_main_process(self, work):
        """`work()` on the main process while the others wait. If it fails, every process
        stops (the main one with its error), rather than the others waiting forever."""
        error = None
        if self.accelerator.is_main_process:
            try:
                work()
            except RunError as e:
                error = e
        failed = torch.tensor(float(error is not None), device=self.device)
        if self.world > 1:
            failed = self.accelerator.reduce(failed, reduction="sum")  # also the barrier
        if error is not None:
            raise error
        if failed.item():
            raise SystemExit(1)  # the main process prints why

    def ema_unet(self):
        return ema_unet(self.accelerator, self.model, self.ema)

    def pipeline_saved(self):
        return (self.output_dir / ("model_index.json" if self.args.objective == "ddpm" else "unet/config.json")).is_file()

    def save_network(self, unet, folder):
        sample.save_network(unet, folder, self.noise_scheduler if self.args.objective == "ddpm" else None)

    def save_pipeline(self):
        """The EMA weights (or the raw ones) in output_dir."""
        try:
            self.save_network(self.ema_unet(), self.output_dir)
        except OSError as e:
            note = f"running again saves it from the checkpoint of step {self.step}"
            raise RunError(checkpoint.cannot_write(f"the pipeline to {self.output_dir}", e, note)) from None
        self.accelerator.print(f"saved the pipeline to {self.output_dir}; sample grids in {self.output_dir / 'samples'}")

    def write_samples(self, epoch):
        path = self.output_dir / "samples" / f"{epoch:04d}.png"
        try:
            if self.args.objective == "ddpm":
                save_sample_grid(self.ema_unet(), self.sampling_scheduler, self.args, path, self.accelerator)
            else:
                seeds = sample.image_seeds(self.args.seed, self.args.eval_batch_size)  # the same noise every time
                images = sample.generate(
                    self.ema_unet(), self.sampling_scheduler, seeds, self.args.num_inference_steps, self.accelerator.autocast
                )
                sample.save_grid(images, path)
        except OSError as e:
            raise RunError(checkpoint.cannot_write(path, e)) from None

    def evaluate(self, epoch):
        """FID/KID of the EMA weights (main process); the best pipeline by FID goes to best/."""
        unet = self.ema_unet()
        save = lambda folder: self.save_network(unet, folder)  # noqa: E731
        args = self.args
        batches = sample.generate_batches(unet, self.sampling_scheduler, args.eval_num_samples, args.fid_batch_size, args.seed,
                                          args.num_inference_steps, self.accelerator.autocast)  # fmt: skip
        sampler = getattr(self.sampling_scheduler, "name", args.sampler)
        result = self.evaluator.evaluate(batches, sampler, args.num_inference_steps, epoch, self.step, save)
        self.accelerator.log({k: result[k] for k in ("fid", "kid_mean", "kid_std")}, step=self.step)
        best = " (best so far: saved to best/)" if result["best"] else ""
        self.write(f"eval epoch {epoch} step {self.step} | {metrics.format_scores(result)}{best}")

    def save_checkpoint(self, breakdown):
        if not weights_finite(self.model):  # never replace a good checkpoint with a broken state
            raise RunError(f"the weights are not finite at step {self.step}: not saving a checkpoint; resume from the last one")
        state = dict(skipped_nonfinite=self.skipped_before + self.guard.count(), run=checkpoint.run_identity(self.config))
        with breakdown.pause("checkpointing"):
            path = checkpoint.save(self.accelerator, self.output_dir, self.step, state, self.args.checkpoints_total_limit)
        self.last_saved = (self.step, path)
        self.write(f"saved {path}")
        return path

    def stop_requested(self, signals):
        """Whether to stop now. Processes must agree, or one would wait in save_state for
        the others forever: with several, they compare notes every STOP_CHECK_STEPS steps."""
        if self.world == 1:
            return signals.requested
        if self.step % STOP_CHECK_STEPS:
            return False
        flag = torch.tensor(float(signals.requested), device=self.device)
        return self.accelerator.reduce(flag, reduction="sum").item() > 0

    def stop_for_signal(self, signals, breakdown):
        """Keep this step in a checkpoint, say how to go on, and exit with the signal's code."""
        self.progress.close()
        saved_step, path = self.last_saved
        if saved_step != self.step:
            path = self.save_checkpoint(breakdown)
        self.accelerator.print(
            f"stopped by {signals.received.name} at step {self.step}: saved {path}; "
            "run the same command again to continue"
        )
        self.accelerator.end_training()
        raise SystemExit(signals.exit_code)


class Reporter:
    """Every --logging_steps: the loss since the last report and the throughput line."""

    def __init__(self, run, lr_scheduler, losses, max_train_steps, images_per_step, model_flops, hardware_flops,
                 peak_flops, peak_words):  # fmt: skip
        self.run, self.lr_scheduler, self.losses = run, lr_scheduler, losses
        self.max_train_steps, self.images_per_step = max_train_steps, images_per_step
        self.model_flops, self.hardware_flops = model_flops, hardware_flops
        self.peak_flops, self.peak_words = peak_flops, peak_words

    def perf(self, step_time_s):
        peak = self.peak_flops and self.peak_flops * self.run.world
        return flops.utilization(self.model_flops, self.hardware_flops, step_time_s, peak)

    def __call__(self, step_times, final=False):
        run, accelerator = self.run, self.run.accelerator
        if self.losses.read():  # the one host sync per log interval
            lr = float(self.lr_scheduler.get_last_lr()[0])
            accelerator.log(dict(loss=self.losses.last, lr=lr), step=run.step)
        last_loss = self.losses.last
        if not step_times:
            line = f"step {run.step}/{self.max_train_steps} | loss {last_loss:.4f} | timing: still warming up"
        else:
            step_time_s = flops.median(step_times)
            perf = self.perf(step_time_s)
            line = flops.format_perf_line(
                run.step, self.max_train_steps, last_loss, step_time_s, self.images_per_step, self.model_flops, perf,
                self.peak_words, run.world, profiling.peak_memory_gib(run.device),
            )  # fmt: skip
            if not final:
                images_per_s = self.images_per_step / step_time_s
                run.progress.set_postfix(loss=f"{last_loss:.4f}", img_s=f"{images_per_s:.1f}")
                logs = dict(step_time_s=step_time_s, images_per_s=images_per_s)
                accelerator.log(logs | {k: v for k, v in perf.items() if v is not None}, step=run.step)
        run.write(("final: " if final else "") + line)


def weights_finite(model):
    norms = torch._foreach_norm([p.detach() for p in model.parameters()])
    return bool(torch.isfinite(torch.stack(norms)).all())


if __name__ == "__main__":
    main(parse_args())
