"""The training pieces, built once for train.py and the speed ladder alike.

`build(args, ...)` turns a resolved configuration (config.resolve) into the network, the
noise schedule, the objective, the optimizer (optimizer.py), the learning-rate schedule and the EMA, in the order
and with the settings train.py trains with: a row of `python -m bench` and a training run
built from the same configuration train the same step. What differs is what each does
with the pieces next (train.py hands them to accelerate and registers them for
checkpoints; the ladder times one step of them).
"""

from dataclasses import dataclass

import torch

from ddpm_train.networks import dit
from ddpm_train.training import ema as posthoc_ema
from ddpm_train.networks import fp8
from ddpm_train.networks import init_from
from ddpm_train.diffusion import loss_terms
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.training import optimizer as optimizers


@dataclass
class Pieces:
    network: torch.nn.Module  # the bare network (what is saved, sampled and averaged)
    model: torch.nn.Module  # what the step calls: the network as `prepare` returned it (accelerate's wrapper)
    noise_scheduler: object  # DDPMScheduler (DDPM's forward process; an EDM run's grids use its config too), or a flow run's
    objective: torch.nn.Module  # DDPMObjective, EDMObjective (holds its learned loss weighting) or FlowObjective, with --loss_terms'
    optimizer: torch.optim.Optimizer
    lr_scheduler: object
    ema: object  # diffusers' EMAModel, ema.PowerEMA, or None
    sampling_scheduler: object
    started_from: str = None  # --init_from: the line that says what the network starts from and what was adapted


def build(args, total_steps, device="cpu", num_classes=0, lr_ref_steps=None, write_ema=True, init_state=None,
          ema_foreach=True, adam_foreach=True, prepare=None, unwrap=None, class_names=None):  # fmt: skip
    """The pieces of a run with configuration `args` (config.resolve's), `total_steps` long.

    The network is built on the CPU (with `init_state` loaded when given, else the weights of an --init_from
    source, adapted: init_from.initial_state; a resumed run's checkpoint replaces them) and moved to
    `device` before AdamW is made, so that a fused AdamW finds its kernel there. A latent
    run's network takes its latents' size and channels (args.latent_size, latent_channels).
    Under --mixed_precision fp8 a DiT's block linear layers become FP8 ones (fp8.convert).
    `write_ema`: whether this process writes the power EMA's snapshots (the main one).
    `adam_foreach`: an AdamW that is not fused runs foreach (True: train.py's), or as torch picks (None:
    the speed ladder's diffusers_example row, AdamW as diffusers' example builds it).
    `prepare(network, optimizer)` -> (model, optimizer): accelerate's, before the EMA is made,
    so that with several processes every EMA starts from the weights they all train (rank 0's);
    `unwrap(model)`: the network inside it.
    """
    network = models.build_run_network(dict(vars(args), num_classes=num_classes))  # a latent run's: its latents' size
    started_from = None
    if init_state is None and getattr(args, "init_source", None):
        init_state, started_from = init_from.initial_state(args.init_source, network, num_classes, class_names)
    if init_state is not None:
        network.load_state_dict(init_state)
    network.to(device)
    if args.gradient_checkpointing:
        network.enable_gradient_checkpointing()
    if args.mixed_precision == "fp8":  # a DiT's block linear layers, in place: the same weights (fp8.py)
        fp8.convert(network)
    if args.token_routing:  # a DiT's (config.resolve): routed while it trains, every token otherwise
        network.routing = dit.routing(args.token_routing, len(network.transformer_blocks))
    kind, family = objectives.of(args.objective), models.family(args.model)[0]
    noise_scheduler = kind.noise_scheduler(vars(args))
    # The network's time input is its family's (model.Family.time_input), not read off the wrappers the step
    # calls it through (torch.compile's, DDP's, compiling.RegionalNetwork).
    objective = kind.from_args(args, family.time_input, noise_scheduler)
    # --loss_terms (config.resolve checked where they apply): their blocks' hooks go on the bare network
    objective = loss_terms.attach(objective, network, family, loss_terms.parse(args.loss_terms))
    objective.to(device)
    if args.channels_last:  # NHWC, the parameters converted in place: checkpoints and the saved pipeline see them
        network.to(memory_format=torch.channels_last)
    # --optimizer: AdamW, or Muon for the blocks' matrices and AdamW for the rest (optimizer.py). A fused AdamW is
    # one kernel for all its parameters, and it can skip a step on the device (step.NonFiniteGuard), so a NaN
    # costs no host sync per step.
    optimizer = optimizers.build(
        args.optimizer, network, args.fused_adam, also=objective.parameters(),  # EDM's u(sigma) trains too
        foreach=adam_foreach, lr=args.learning_rate, betas=tuple(args.adam_betas), weight_decay=args.weight_decay,
        eps=args.adam_epsilon,
    )  # fmt: skip
    if args.fused_norm:  # class swaps in place: the parameters and the state dict stay as they are
        from ddpm_train.networks import fused_norm  # Triton kernels: loaded only when asked for (tests/test_layout.py)

        fused_norm.keep_channels_last(fused_norm.use_fused_norm(network))
    lr_scheduler = models.make_lr_scheduler(args.lr_scheduler, optimizer, args.lr_warmup_steps, total_steps, lr_ref_steps)
    model, optimizer = prepare(network, optimizer) if prepare else (network, optimizer)
    network = unwrap(model) if unwrap else network
    ema = posthoc_ema.make_ema(args, network, write=write_ema, foreach=ema_foreach)
    if ema is not None:
        ema.to(device)
    sampling_scheduler = objectives.make_sampler(args.objective, args.sampler, noise_scheduler.config, args.sigma_data,
                                             args.churn, clip=not args.vae)  # latents are not clipped to [-1, 1]
    return Pieces(network, model, noise_scheduler, objective, optimizer, lr_scheduler, ema, sampling_scheduler,
                  started_from)
