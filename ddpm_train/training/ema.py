"""Power-function EMA and post-hoc EMA reconstruction (Karras et al. 2024).

"Analyzing and Improving the Training Dynamics of Diffusion Models" (EDM2,
arXiv:2312.02696), Section 3 and Appendix C. Equation numbers below are
those of the arXiv version's appendix, as the authors' reference code
(NVlabs/edm2, training/phema.py) cites them.

    python train.py --ema power --ema_stds 0.05,0.10 --ema_snapshot_every 1000 ...
    python ema.py reconstruct RUN_DIR --std 0.07            # -> RUN_DIR/ema-std-0.07/, a DDPMPipeline
    python sample.py RUN_DIR/ema-std-0.07 --num_images 64 --output samples/

A power-function EMA averages the training trajectory theta(tau) over
0 <= tau <= t with weights growing like tau^gamma:

    theta_gamma(t) = (gamma + 1) / t^(gamma + 1) * integral_0^t tau^gamma theta(tau) dtau

Its width is given as sigma_rel, the standard deviation of the weight profile
relative to t (Eq. 123). Unlike a fixed-decay EMA it has no warm-up to tune
and scales with the length of training. During training we track it for
each of a few sigma_rel (--ema_stds) and save snapshots of each every
--ema_snapshot_every steps. Afterwards, the EMA for any other sigma_rel is a
linear combination of the snapshots: the one whose weight profile is closest
in least squares to the wanted profile (Algorithm 3).

Time is the optimizer step, counted from 1.
"""

import json
import types
from copy import deepcopy
from pathlib import Path

import numpy as np
import torch
from diffusers.training_utils import EMAModel

from ddpm_train.networks import fp8
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.errors import ConfigError, OneLineParser, one_line_errors
from ddpm_train.training.rundir import CONFIG_FILE, RunDir, save_network

SNAPSHOT_DIR = "ema_snapshots"
MAX_STD = (1 / 12) ** 0.5  # sigma_rel of gamma = 0, the uniform average of the whole run


# --- the weight profiles -------------------------------------------------------------


def gamma_to_std(gamma):
    """sigma_rel of exponent gamma: sqrt((gamma + 1) / ((gamma + 2)^2 (gamma + 3))) (Eq. 123).

    The profile (gamma + 1) x^gamma on x = tau/t in [0, 1] has mean
    (gamma + 1)/(gamma + 2) and second moment (gamma + 1)/(gamma + 3).
    """
    gamma = np.float64(gamma)
    return np.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


def std_to_gamma(std):
    """The exponent gamma with sigma_rel = std (Eq. 126, Algorithm 2).

    Squaring Eq. 123 and writing s = std^-2 gives the cubic
    gamma^3 + 7 gamma^2 + (16 - s) gamma + (12 - s) = 0, whose largest real
    root is the exponent.
    """
    s = np.float64(std) ** -2
    return float(np.roots([1.0, 7.0, 16.0 - s, 12.0 - s]).real.max())


def profile_inner_product(t_a, gamma_a, t_b, gamma_b):
    """<p_a, p_b>: the integral of the product of two power-function weight profiles (Eq. 151).

    p(tau) = (gamma + 1) tau^gamma / t^(gamma + 1) on [0, t]; for t_a <= t_b the
    integral runs to t_a and equals
    (gamma_a + 1)(gamma_b + 1) / (gamma_a + gamma_b + 1) * (t_a / t_b)^gamma_b / t_b,
    and symmetrically. Works elementwise on numpy arrays.
    """
    t_a, gamma_a, t_b, gamma_b = (np.asarray(x, dtype=np.float64) for x in (t_a, gamma_a, t_b, gamma_b))
    ratio_power = np.where(t_a <= t_b, (t_a / t_b) ** gamma_b, (t_b / t_a) ** gamma_a)
    return (gamma_a + 1) * (gamma_b + 1) / (gamma_a + gamma_b + 1) * ratio_power / np.maximum(t_a, t_b)


def reconstruction_weights(times, stds, target_time, target_std):
    """Coefficients x of snapshots (times[i], stds[i]) whose combination approximates (target_time, target_std).

    Least squares in profile space (Algorithm 3): minimise
    || sum_i x_i p_i - p_target ||^2, i.e. solve the normal equations
    A x = b with A_ij = <p_i, p_j> and b_i = <p_i, p_target>. Normalised to
    sum to 1, as each profile does, so a constant trajectory is reproduced exactly.
    """
    times = np.asarray(times, dtype=np.float64)
    gammas = np.array([std_to_gamma(s) for s in stds])
    gram = profile_inner_product(times[:, None], gammas[:, None], times[None, :], gammas[None, :])
    target = profile_inner_product(times, gammas, target_time, std_to_gamma(target_std))
    x = np.linalg.solve(gram, target)
    return x / x.sum()


# --- tracking during training --------------------------------------------------------


class PowerEMA:
    """Power-function EMAs of the parameters, one per sigma_rel in `stds`; the first is "the" EMA.

    The same interface as diffusers' EMAModel where train.py uses it (step,
    copy_to, to, state_dict, load_state_dict), so it drops in. With
    `snapshot_dir`, step() also writes every EMA to a snapshot file every
    `snapshot_every` steps (when `write` is true: the main process).
    """

    def __init__(self, parameters, stds, names=None, snapshot_dir=None, snapshot_every=None, write=True):
        parameters = list(parameters)
        self.stds = [float(s) for s in stds]
        self.gammas = [std_to_gamma(s) for s in self.stds]
        self.shadows = [[p.detach().clone().float() for p in parameters] for _ in self.stds]
        self.names = names
        self.snapshot_dir = Path(snapshot_dir) if snapshot_dir is not None else None
        self.snapshot_every, self.write = snapshot_every, write
        self.optimization_step = 0

    @torch.no_grad()
    def step(self, parameters):
        """One update after optimizer step t: theta_hat <- beta theta_hat + (1 - beta) theta (Eq. 127).

        beta(t) = (1 - 1/t)^(gamma + 1) is the discrete form of the profile:
        0 at t = 1 (the EMA starts as the weights) and rising towards 1.
        """
        self.optimization_step += 1
        parameters = [p.detach().float() for p in parameters]
        for beta, shadow in zip(self.decays(self.optimization_step), self.shadows):
            torch._foreach_lerp_(shadow, parameters, 1 - beta)
        self.snapshot_if_due()

    def decays(self, t):
        """beta(t) of each tracked EMA after optimizer step t."""
        return [(1 - 1 / t) ** (gamma + 1) for gamma in self.gammas]

    def snapshot_if_due(self):
        """A snapshot every `snapshot_every` steps (with a snapshot_dir)."""
        if self.snapshot_dir is not None and self.snapshot_every and self.optimization_step % self.snapshot_every == 0:
            self.save_snapshot()

    def copy_to(self, parameters, index=0):
        with torch.no_grad():
            for p, value in zip(parameters, self.shadows[index], strict=True):
                p.copy_(value.to(p.dtype))

    def to(self, device=None, dtype=None):
        self.shadows = [[s.to(device=device) for s in shadow] for shadow in self.shadows]
        return self

    def state_dict(self):
        return dict(stds=self.stds, optimization_step=self.optimization_step, shadows=self.shadows)

    def load_state_dict(self, state):
        if [float(s) for s in state["stds"]] != self.stds:
            raise ConfigError(f"the checkpoint tracked --ema_stds {state['stds']}, not {self.stds}: resume with those")
        self.optimization_step = state["optimization_step"]
        self.shadows = [[s.clone() for s in shadow] for shadow in state["shadows"]]

    def save_snapshot(self):
        """Write each EMA as ema_snapshots/step-STEP-std-STD.safetensors (step and std also in its metadata)."""
        from safetensors.torch import save_file

        if not self.write or self.snapshot_dir is None or self.optimization_step == 0:
            return
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        step = self.optimization_step
        for std, shadow in zip(self.stds, self.shadows):
            tensors = {name: s.detach().cpu().contiguous() for name, s in zip(self.names, shadow, strict=True)}
            path = self.snapshot_dir / f"step-{step:09d}-std-{std:g}.safetensors"
            tmp = path.with_name(path.name + ".tmp")
            save_file(tensors, str(tmp), metadata=dict(step=str(step), std=repr(std)))
            tmp.replace(path)


class LerpEMA(EMAModel):
    """diffusers' EMAModel (the same decay, warm-up, state and checkpoints) whose foreach update is one pass:
    average <- lerp(average, weight, 1 - decay) reads each average and weight once and writes the average once.
    diffusers' foreach update, average -= (1 - decay) * (average - weight), also writes and reads back a
    temporary copy of every weight, allocated each step: twice the memory traffic of the update (a memory-bound
    part of a large network's step: DiT-XL/2's 2.7 GB of fp32 weights). Without foreach, diffusers' own loop."""

    @torch.no_grad()
    def step(self, parameters):
        if not self.foreach:
            return super().step(parameters)
        parameters = list(parameters)
        self.optimization_step += 1
        self.cur_decay_value = decay = self.get_decay(self.optimization_step)
        trained = [(s, p) for s, p in zip(self.shadow_params, parameters, strict=True) if p.requires_grad]
        fixed = [(s, p) for s, p in zip(self.shadow_params, parameters) if not p.requires_grad]
        if fixed:  # as diffusers does: a weight that is not trained is copied
            torch._foreach_copy_(*map(list, zip(*fixed)), non_blocking=True)
        if trained:
            torch._foreach_lerp_(*map(list, zip(*trained)), 1 - decay)


def make_ema(args, network, write, foreach=True):
    """The EMA of the weights that the samples and the saved pipeline use, or None (--ema none).

    --ema power keeps one power-function EMA per --ema_stds and writes snapshots
    to ema_snapshots/ every --ema_snapshot_every steps (when `write`, the main
    process), for `ema.py reconstruct`; --ema standard is diffusers' EMAModel
    with warm-up, updated by foreach ops (`foreach` False: one parameter at a time, the
    speed ladder's baseline), in one pass over the weights (LerpEMA).
    """
    if args.ema == "none":
        return None
    if args.ema == "power":
        return PowerEMA(
            network.parameters(),
            args.ema_stds,
            names=[name for name, _ in network.named_parameters()],
            snapshot_dir=Path(args.output_dir) / SNAPSHOT_DIR,
            snapshot_every=args.ema_snapshot_every,
            write=write,
        )
    return LerpEMA(
        network.parameters(),
        decay=args.ema_max_decay,
        use_ema_warmup=True,
        inv_gamma=args.ema_inv_gamma,
        power=args.ema_power,
        foreach=foreach,
    )


def averaged_copy(network, ema):
    """A stand-alone copy of `network` (unwrapped) carrying the EMA weights (the raw ones without an EMA), for
    sampling and saving: no gradients (autocast caches a cast copy of every parameter that requires one), and
    none of accelerate's forward wrappers, which would keep the copy alive after its last use (drop_bound_methods),
    no forward hooks (drop_forward_hooks), and no FP8 layers (an fp8 run's copy samples in the autocast's precision
    and saves as an ordinary network)."""
    copy = fp8.plain(drop_forward_hooks(drop_bound_methods(deepcopy(network)))).eval().requires_grad_(False)
    if ema is not None:
        ema.copy_to(copy.parameters())
    return copy


def drop_bound_methods(module):
    """`module` without the instance attributes that are methods bound to itself. accelerate's mixed precision
    puts two on the network it prepares (`forward`, autocast and fp32 outputs around the class's, and
    `_original_forward`); deep-copied, each is bound to the copy: a reference cycle, so the copy (a whole second
    set of weights on the GPU) outlives its last use until Python's cyclic collector runs, and a run held it
    through the training steps after each grid (docs/performance.md, Memory). The class's forward remains:
    the samplers call it under autocast themselves."""
    for name, value in list(vars(module).items()):
        if isinstance(value, types.MethodType) and value.__self__ is module:
            delattr(module, name)
    return module


def drop_forward_hooks(module):
    """`module` without the forward hooks of its submodules. The loss terms' (BlockOutputs: --loss_terms
    dispersive, layersync) are closures over the live objective's dict of block outputs; deep-copied, they
    still are, so every call of the copy wrote its blocks' outputs into the training objective's dict and held
    them there (an activation pinned until the next step). Only the copy's own hooks go (deepcopy made its dicts):
    the network keeps its hooks, and the copy its pre-hooks."""
    for part in module.modules():
        part._forward_hooks.clear()
        part._forward_hooks_with_kwargs.clear()
        part._forward_hooks_always_called.clear()
    return module


def parse_stds(text):
    """'0.05,0.10' -> [0.05, 0.1], each in (0, 0.2887) and distinct."""
    try:
        stds = [float(s) for s in text.split(",")]
    except ValueError:
        raise ConfigError(f"--ema_stds '{text}': give comma-separated numbers, e.g. 0.05,0.10") from None
    if not all(0 < s < MAX_STD for s in stds) or len(set(stds)) != len(stds):
        raise ConfigError(
            f"--ema_stds '{text}': each must be between 0 and {MAX_STD:.4f} (the whole-run average), all different"
        )
    return stds


# --- reconstruction ------------------------------------------------------------------


def list_snapshots(folder):
    """[(step, std, path)] of the snapshots in `folder`, sorted by step then std."""
    from safetensors import safe_open

    found = []
    for path in Path(folder).glob("step-*-std-*.safetensors"):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        found.append((int(meta["step"]), float(meta["std"]), path))
    return sorted(found)


def reconstruct(folder, std, step=None):
    """(state dict of the EMA with sigma_rel `std` at `step` (default: the newest snapshot), the weights used)."""
    from safetensors.torch import load_file

    snapshots = list_snapshots(folder)
    if not snapshots:
        raise ConfigError(f"{folder}: no EMA snapshots (train with --ema power and --ema_snapshot_every)")
    steps = sorted({s for s, _, _ in snapshots})
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ConfigError(f"--step {step}: no snapshot at that step; there are {', '.join(map(str, steps))}")
    used = [(s, sd, path) for s, sd, path in snapshots if s <= step]
    weights = reconstruction_weights([s for s, _, _ in used], [sd for _, sd, _ in used], step, std)
    total = None
    for weight, (_, _, path) in zip(weights, used):
        tensors = load_file(str(path))
        if total is None:
            total = {name: torch.zeros_like(t, dtype=torch.float64) for name, t in tensors.items()}
        for name, t in tensors.items():
            total[name] += weight * t.double()
    state = {name: t.float() for name, t in total.items()}
    return state, [dict(step=s, std=sd, weight=float(w)) for w, (s, sd, _) in zip(weights, used)]


def parse_args(argv=None):
    p = OneLineParser(prog="ema.py", description="Post-hoc EMA (Karras et al. 2024) from a run's power-EMA snapshots.")
    commands = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    r = commands.add_parser("reconstruct", help="the EMA for any sigma_rel, saved as a DDPMPipeline (an EDM run: the network in OUTPUT/unet)")
    r.add_argument("run_dir", help="a run trained with --ema power (holding ema_snapshots/)")
    r.add_argument("--std", type=float, required=True, help="the relative standard deviation wanted, e.g. 0.07")
    r.add_argument("--step", type=int, default=None, help="the training step to reconstruct at (default: the last snapshot)")
    r.add_argument("--output", default=None, help="pipeline folder (default: RUN_DIR/ema-std-STD)")
    return p.parse_args(argv)


def main(args):
    with one_line_errors("ema.py", interrupted="stopped before the end: run it again to write the network whole"):
        return reconstruct_command(args)


def loaded_through_another_name(net, state):
    """The names in net's state dict whose tensor is also reached by a name in `state`: a module tied into
    several places (a DiT's one embedder in every block) has one name among the parameters, which the
    snapshots hold, and one per place in the state dict."""
    names_of = {}
    for name, tensor in net.state_dict(keep_vars=True).items():
        names_of.setdefault(id(tensor), set()).add(name)
    return {name for names in names_of.values() if names & state.keys() for name in names}


def reconstruct_command(args):
    if not 0 < args.std < MAX_STD:
        raise ConfigError(f"--std must be between 0 and {MAX_STD:.4f} (got {args.std})")
    run_dir = Path(args.run_dir)
    source = RunDir(run_dir)
    config = source.config
    if config is None:
        raise ConfigError(f"{run_dir}: not a training run folder (no train_config.json)")
    state, used = reconstruct(run_dir / SNAPSHOT_DIR, args.std, args.step)
    output = Path(args.output) if args.output else run_dir / f"ema-std-{args.std:g}"
    if not objectives.saves_pipeline(config):
        # The snapshots hold parameters only; the run's saved network brings its buffers
        # (the fixed random Fourier frequencies of EDM2's noise embedding).
        if not (run_dir / "unet" / "config.json").is_file():
            raise ConfigError(f"{run_dir}: no saved network in unet/ yet: let the run finish (or run it again) first")
        unet = models.load_network(run_dir / "unet")
        missing, unexpected = unet.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {name for name, _ in unet.named_buffers()} - loaded_through_another_name(unet, state):
            raise ConfigError(f"{run_dir}: the EMA snapshots do not match the saved network")
        save_network(unet, output)
    else:
        unet = models.build_run_network(config)  # a latent run's at its latents' size and channels
        unet.load_state_dict(state)
        scheduler = objectives.run_noise_scheduler(config)
        save_network(unet, output, scheduler)
    step = max(u["step"] for u in used)
    # the run's configuration beside the network: the folder samples (sample.py reads how the run was trained
    # from it) wherever it is moved or uploaded
    (output / CONFIG_FILE).write_text((source.folder / CONFIG_FILE).read_text())
    (output / "ema.json").write_text(json.dumps(dict(std=args.std, step=step, snapshots=used), indent=2) + "\n")
    print(f"reconstructed the EMA with sigma_rel {args.std:g} at step {step} from {len(used)} snapshots into {output}")
    return output
