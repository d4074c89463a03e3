"""The training objectives, DDPM, EDM and flow matching: one class each, in OBJECTIVES.

Each class holds its loss and everything else the code asks of an objective: the time input it gives each
network family (`time_input`), its samplers and their default, how guidance combines its networks (through
`time_input`), the scheduler its pipeline saves and how a saved one maps back to it (`from_scheduler`), what
resume and a guide must share (`same`), its refusals of other objectives' flags (`check`) and its model
card's words. No code outside this module compares an objective's name: it asks `of(objective)` (or compares
`recorded` values whole: a guide's and its model's).
A new objective is its class and one entry in OBJECTIVES.
"""

import math

import torch
import torch.nn.functional as F

from ddpm_train.errors import ConfigError  # noqa: I001 (before diffusers: errors.py quiets what importing torchao logs)
from diffusers import DDPMScheduler

from ddpm_train.diffusion.samplers import (DDPM_SAMPLERS, EDM_CHURN, EDM_STEPS, FLOW_SAMPLERS, NUM_TRAIN_TIMESTEPS,
                                           SIGMA_DATA, EDMHeunSampler, edm_precondition, make_flow_sampler,
                                           make_scheduler, shift_sigmas)  # fmt: skip
from ddpm_train.networks import edm2
from ddpm_train.networks import model as models



def make_noise_scheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS, beta_schedule="linear", prediction_type="epsilon",
                         zero_terminal_snr=False, latents=False):  # fmt: skip
    """DDPM's forward process. `zero_terminal_snr`: the betas rescaled so that abar_T = 0, x_T pure
    noise as sampling assumes (Lin et al. 2024, Algorithm 1); it needs v-prediction, as eps says
    nothing of x_0 at t = T. `latents`: a latent run's, saved with its pipeline without
    DDPMScheduler's default clipping of x_0 to [-1, 1] (the range of images, not of latents)."""
    return DDPMScheduler(
        num_train_timesteps=num_train_timesteps,
        beta_schedule=beta_schedule,
        prediction_type=prediction_type,
        rescale_betas_zero_snr=zero_terminal_snr,
        clip_sample=not latents,
    )


def run_setting(config, name, default):
    """A setting (config.SETTINGS: not a flag) of the run whose train_config.json is `config`: under its
    "settings"; a run of before they were kept apart has it beside its flags; else `default`."""
    return (config.get("settings") or {}).get(name, config.get(name, default))


def run_noise_scheduler(config):
    """The noise scheduler a run trained with, from its train_config.json or its flags (a dict): what its pipeline
    saves (a flow run's: make_flow_scheduler; DDPM's, and EDM's, whose grids read its config: make_noise_scheduler)."""
    return of(config.get("objective")).noise_scheduler(config)


def ddpm_loss(model, clean_images, noise, timesteps, alphas_cumprod, prediction_type="epsilon", snr_gamma=None):
    """The DDPM training loss, Algorithm 1 of Ho et al. (2020), in fp32.

    x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps          (their eq. 4)
    loss = || target - model(x_t, t) ||^2                  (their eq. 14)

    with target eps ("epsilon"), x_0 ("sample") or the velocity
    v = sqrt(abar_t) eps - sqrt(1 - abar_t) x_0 ("v_prediction", Salimans & Ho
    2022). `alphas_cumprod` is the scheduler's abar table, already on the
    device, so that no step copies it there again.

    `snr_gamma`: min-SNR-gamma weighting (Hang et al. 2023, eq. 8): each image's
    loss times min(SNR, gamma) / SNR for eps, / (SNR + 1) for v, and
    min(SNR, gamma) for x_0, SNR = abar / (1 - abar); as diffusers'
    train_text_to_image.py computes it.
    """
    abar = alphas_cumprod[timesteps].float().view(-1, 1, 1, 1)
    clean_images, noise = clean_images.float(), noise.float()
    noisy = abar.sqrt() * clean_images + (1 - abar).sqrt() * noise
    prediction = model(noisy, timesteps, return_dict=False)[0]
    if prediction_type == "epsilon":
        target = noise
    elif prediction_type == "sample":
        target = clean_images
    elif prediction_type == "v_prediction":
        target = abar.sqrt() * noise - (1 - abar).sqrt() * clean_images
    else:
        raise ConfigError(f"unknown --prediction_type '{prediction_type}': choose epsilon, v_prediction or sample")
    if snr_gamma is None:
        return F.mse_loss(prediction.float(), target)
    snr = (abar / (1 - abar)).view(-1)
    clipped = torch.minimum(snr, torch.full_like(snr, snr_gamma))
    weight = {"epsilon": clipped / snr, "v_prediction": clipped / (snr + 1), "sample": clipped}[prediction_type]
    per_image = F.mse_loss(prediction.float(), target, reduction="none").mean(dim=(1, 2, 3))
    return (per_image * weight).mean()


# EDM's noise levels, and DDPM's with --timestep_sampling lognormal: ln σ ~ N(P_mean, P_std²) (EDM Table 1). The defaults are EDM's CIFAR-10 values,
# which the seed repository (FutureXiang/edm2, config/cifar10/*.yaml) keeps for its
# EDM2 networks; EDM2 used -0.8/1.6 for ImageNet-64 and -0.4/1.0 for ImageNet-512
# latents (NVlabs/edm2 train_edm2.py, config_presets).
P_MEAN, P_STD = -1.2, 1.2
TIMESTEP_SAMPLINGS = ("uniform", "lognormal")


def lognormal_timestep_cdf(alphas_cumprod, P_mean, P_std):
    """The cumulative probabilities of timesteps t = 0..T-1 such that ln σ_t ~ N(P_mean, P_std²),
    σ_t = sqrt((1 - abar_t) / abar_t): EDM's noise distribution (Karras et al. 2022, Table 1)
    on DDPM's timesteps. Timestep t takes the normal's mass between the midpoints of its
    ln σ and its neighbours' (t = 0 all below, t = T-1 all above)."""
    abar = alphas_cumprod.double()
    log_sigma = 0.5 * (torch.log1p(-abar) - torch.log(abar))
    edges = (log_sigma[1:] + log_sigma[:-1]) / 2  # increasing in t
    below = torch.distributions.Normal(P_mean, P_std).cdf(edges)
    return torch.cat([below, torch.ones(1, dtype=below.dtype)]).float()


class Objective(torch.nn.Module):
    """An objective as the training step calls it: `terms(net, x0)` draws the noise on x0's device (no host
    sync) and returns the loss's named terms, fp32 scalars; the loss is their sum (`loss`). A new term is
    one more entry in an objective's `terms`: the step sums it into the loss, and train.py prints and logs
    each term (the printed line, tensorboard's loss/NAME, run.json's final_loss_terms) where there are several.

    Each objective's own terms come from `draw_terms`; `terms` adds those of its `readers`, called after the
    network's forward call, each returning {name: term} (loss_terms.py's terms on a block's output).
    `noise_draws`: the unit noise of each image is the nearest of this many draws (nearest_noise; 1: one draw).
    """

    noise_draws = 1
    readers = ()

    # What the rest of the code asks of an objective, said once by each class:
    name = None  # its --objective word
    words = ""  # what the model card calls it
    called, run_words, sampler_words = "", "", ""  # its short name, "a ... run", and how a refusal names its samplers
    tag = ""  # the model card's tag
    time_inputs = ("timestep", "c_noise")  # the families' time inputs (model.Family.time_input) it can give
    samplers = ()  # its --sampler choices
    sampler_classes = ()  # the classes of the samplers `sampler` makes (sampled_by)
    default_sampler = None
    default_steps = 25  # --num_inference_steps when unset
    saves_pipeline = True  # a DDPMPipeline where the family saves one (else its network alone in unet/)
    discrete = False  # DDPM's discrete timesteps: the presets' DDPM settings apply
    ddpm_schedule = False  # DDPM's schedule flags (--prediction_type, --beta_schedule, ...) apply; refused where not
    shifts = False  # --objective NAME:SHIFT
    defaults = {}  # flags it fills where unset
    same = ()  # beside --objective, the run settings that a resume keeps and a guide must share (config.SETTINGS too)

    @classmethod
    def time_input(cls, kind):
        """fn(level, x) -> what a network of `kind` (model.Family.time_input) takes, for the batch `x`, at the noise
        level `level` the objective's sampler steps through (DDPM's t, EDM's c_noise, flow's t = 1000 σ)."""
        return lambda level, x: level

    @classmethod
    def timed(cls, net, kind):
        """`net` as this objective's samplers call it: net(x, level) gets its own time input (`kind`)."""
        return TimeInput(net, cls.time_input(kind)) if kind != cls.sampled_as else net

    sampled_as = "timestep"  # the time input the samplers step in: a network that takes it is called as it is

    @classmethod
    def card_words(cls, config):
        """The model card's objective row, for the run of train_config.json `config`."""
        return cls.words

    @classmethod
    def pipeline_words(cls, config):
        """The model card's lines under the code that loads its DDPMPipeline."""
        return []

    @classmethod
    def check(cls, args):
        """Its refusals of flags that are other objectives' (config.resolve); none by default."""

    @classmethod
    def check_steps(cls, steps, training_config):
        """Its refusal of `steps` sampling steps for a run of DDPMScheduler config `training_config`; none by default."""

    @classmethod
    def data_std(cls, args):
        """The standard deviation a latent run normalises its latents to: 1, EDM's σ_data for EDM."""
        return 1.0

    @classmethod
    def sigma_distribution(cls, config):
        """What resume compares of its noise-level draw beyond its flags (flow's); None."""
        return None

    def terms(self, net, x0):
        terms = self.draw_terms(net, x0)
        for read in self.readers:
            terms |= read()
        return terms

    def noise_like(self, x0):
        """The unit Gaussian noise paired with the batch `x0`: one draw, or nearest_noise of `noise_draws`."""
        return torch.randn_like(x0) if self.noise_draws == 1 else nearest_noise(x0, self.noise_draws)

    def loss(self, net, x0):
        return total_loss(self.terms(net, x0))

    forward = loss


def nearest_noise(x0, k):
    """For each image of `x0`, the nearest (L2 over the flattened image) of k unit Gaussian noise draws of its
    shape: immiscible diffusion's KNN coupling (Li et al. 2025, yhli123/Immiscible-Diffusion). argmin and gather
    on the device: no host sync, capturable. The distance is ‖n‖² - 2 n·x (‖x‖² is the same for every draw),
    in fp32 whatever the autocast."""
    draws = torch.randn((k, *x0.shape), device=x0.device, dtype=x0.dtype)
    flat = draws.flatten(2).float()
    with torch.autocast(x0.device.type, enabled=False):
        distance = flat.square().sum(-1) - 2 * torch.einsum("kbd,bd->kb", flat, x0.flatten(1).float())
    nearest = distance.argmin(0)
    return draws[nearest, torch.arange(len(x0), device=x0.device)]


def total_loss(terms):
    """The loss: the sum of an objective's terms (the one term itself where there is one)."""
    parts = list(terms.values())
    return sum(parts[1:], parts[0])


class DDPMObjective(Objective):
    """The DDPM objective as the training step calls it: `terms(net, x0)` draws the noise and
    the timesteps on x0's device (no host sync) and returns `ddpm_loss` as its one term, "ddpm".

    Timesteps are uniform (Ho et al. 2020), or with `timestep_sampling="lognormal"`
    drawn so that ln σ_t ~ N(P_mean, P_std²), as EDM draws σ: most training then
    goes to the middle noise levels, where shapes form, instead of the half of
    the uniform draws (linear betas) at σ > 3, which teach little more than
    the colour of the image. The draw inverts the CDF with `searchsorted`, so
    it is capturable in a CUDA graph.

    A module so that objectives with trained parts (EDM's learned loss
    weighting) go through the step alike; this one has none.
    """

    name, words, tag = "ddpm", "DDPM (Ho et al. 2020)", "ddpm"
    called, run_words, sampler_words = "DDPM", "a DDPM run", "DDPM's"
    time_inputs = ("timestep",)  # an EDM2 network's Fourier features take no DDPM timestep
    # DPM-Solver++'s stochastic form with 25 steps: fresh noise at each step corrects the errors earlier steps made,
    # at the cost of the deterministic solver (half of DDIM-50's); on the built-in shapes it scored better than
    # either (BENCHMARKS.md; docs/sampling.md: Samplers).
    samplers, default_sampler = DDPM_SAMPLERS, "dpmsolver_sde"
    sampler_classes = ("DDPMScheduler", "DDIMScheduler", "DPMSolverMultistepScheduler")  # make_scheduler's
    discrete = ddpm_schedule = True
    same = ("prediction_type", "beta_schedule", "num_train_timesteps", "zero_terminal_snr")

    @classmethod
    def from_args(cls, args, kind, noise_scheduler):
        """train.py's and the speed ladder's: from --snr_gamma, --timestep_sampling and --P_mean_std."""
        return cls(noise_scheduler, args.snr_gamma, args.timestep_sampling, *args.P_mean_std)

    @classmethod
    def noise_scheduler(cls, config):
        return make_noise_scheduler(run_setting(config, "num_train_timesteps", NUM_TRAIN_TIMESTEPS), config["beta_schedule"],
                                    config["prediction_type"], config.get("zero_terminal_snr", False),
                                    bool(config.get("vae")))  # fmt: skip

    @classmethod
    def reads(cls, scheduler, source):
        """What a saved diffusers scheduler config says of a DDPM training (None: not DDPM's); a schedule this
        project does not train is a ConfigError naming `source`."""
        steps, betas = scheduler.get("num_train_timesteps"), (scheduler.get("beta_start"), scheduler.get("beta_end"))
        schedule, name = scheduler.get("beta_schedule"), scheduler.get("_class_name")
        if (steps != NUM_TRAIN_TIMESTEPS or schedule not in BETA_SCHEDULES or scheduler.get("trained_betas")
                or any(b is not None and abs(b - d) > 1e-9 for b, d in zip(betas, DDPM_BETAS))):  # fmt: skip
            raise ConfigError(
                f"{source}: its scheduler ({name}: {steps} steps, {schedule} betas from {betas[0]} to "
                f"{betas[1]}) is not DDPM's 1000 steps of betas from 0.0001 to 0.02 that this project trains, nor flow's"
            )
        return dict(objective=cls.name, prediction_type=scheduler.get("prediction_type", "epsilon"),
                    beta_schedule=schedule, zero_terminal_snr=bool(scheduler.get("rescale_betas_zero_snr")))  # fmt: skip

    @classmethod
    def check(cls, args):
        cls.check_steps(args.num_inference_steps, dict(num_train_timesteps=args.num_train_timesteps))

    @classmethod
    def check_steps(cls, steps, training_config):
        if steps > training_config["num_train_timesteps"]:
            raise ConfigError(f"--num_inference_steps ({steps}) cannot exceed the model's "
                              f"{training_config['num_train_timesteps']} training timesteps")  # fmt: skip

    @classmethod
    def sampler(cls, objective, name, training_config, sigma_data, churn, clip):
        return make_scheduler(name, training_config, clip)

    def __init__(self, noise_scheduler, snr_gamma=None, timestep_sampling="uniform", P_mean=P_MEAN, P_std=P_STD):
        super().__init__()
        self.num_train_timesteps = noise_scheduler.config.num_train_timesteps
        self.prediction_type = noise_scheduler.config.prediction_type
        self.snr_gamma = snr_gamma
        self.register_buffer("alphas_cumprod", noise_scheduler.alphas_cumprod.clone(), persistent=False)
        cdf = lognormal_timestep_cdf(self.alphas_cumprod, P_mean, P_std) if timestep_sampling == "lognormal" else None
        self.register_buffer("timestep_cdf", cdf, persistent=False)

    def timesteps(self, n, device):
        if self.timestep_cdf is None:
            return torch.randint(0, self.num_train_timesteps, (n,), device=device)
        u = torch.rand(n, device=device)
        return torch.searchsorted(self.timestep_cdf, u, right=True).clamp_(max=self.num_train_timesteps - 1)

    def draw_terms(self, net, clean_images):
        noise = self.noise_like(clean_images)
        timesteps = self.timesteps(clean_images.shape[0], clean_images.device)
        return {"ddpm": self.loss_at(net, clean_images, timesteps, noise)}

    def loss_at(self, net, clean_images, timesteps, noise):
        """The loss at given timesteps (one per image) and noise."""
        return ddpm_loss(net, clean_images, noise, timesteps, self.alphas_cumprod, self.prediction_type, self.snr_gamma)


# DDPM's schedule as this project trains it (make_noise_scheduler): a saved scheduler of another is refused.
DDPM_BETAS = (0.0001, 0.02)
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid")


# --- the EDM objective (Karras et al. 2022, "EDM"; Karras et al. 2024, "EDM2") -------

LOSS_WEIGHTINGS = ("uncertainty", "edm")

# What a UNet2DModel gets as its timestep: UNET_C_NOISE_SCALE * c_noise, c_noise = ln(σ)/4.
# Its sinusoidal embedding was made for DDPM's t in [0, 1000): over the linear
# schedule, c_noise(σ_t) runs from -1.15 (t = 0, σ = 0.01) to 1.26 (t = 999, σ = 157),
# about 414 timesteps per unit of c_noise. 400 keeps that resolution, so the
# embedding tells noise levels apart as finely as it tells DDPM's timesteps apart
# (EDM's sampling range σ in [0.002, 80] then spans t from -620 to +440; a shift
# would change nothing, a sinusoid pair only rotates and the next linear layer
# absorbs that). Unscaled, c_noise spans 2.6 units: the lower half of the
# embedding's frequencies (periods of 100 to 10000 units) would barely move.
UNET_C_NOISE_SCALE = 400.0


class EDMObjective(Objective):
    """EDM's training loss, with EDM2's learned uncertainty weighting; `loss(net, x0)` is one step's loss,
    the sum of its terms: "edm", the weighted ‖D - y‖², and with the uncertainty weighting "edm_logvar", u(σ).

    σ: ln σ ~ N(P_mean, P_std²); y = x0, n ~ N(0, σ² I); D = edm_precondition(net, y + n, σ).
    λ(σ) = (σ² + σd²) / (σ σd)²                        (EDM Table 1: unit effective weight)
    weighting 'edm':         λ(σ) ‖D - y‖²             (EDM eq. 2 with Table 1's λ)
    weighting 'uncertainty': λ(σ) / e^u(σ) ‖D - y‖² + u(σ)   (EDM2 eq. 21)

    `c_noise_scale`: what c_noise is multiplied by before the network takes it: UNET_C_NOISE_SCALE for a family
    whose time input is a timestep (a UNet2DModel, a DiT), 1 for EDM2's networks (`from_args`, by the family's
    model.Family.time_input, not by the wrapper the step calls the network through).

    u(σ) is a magnitude-preserving Fourier-feature head on c_noise = ln(σ)/4, as
    NVlabs/edm2's Precond.logvar_fourier/logvar_linear; its optimum is
    e^u = λ(σ) E‖D - y‖²: it learns the loss's level at each σ and divides it out,
    so every σ contributes alike. Its parameters train with the network's
    (pass `objective.parameters()` to the optimizer), live in checkpoints (the
    module's state_dict) and never in the saved pipeline, which holds the network alone.

    ‖D - y‖² is the mean over pixels, as ddpm_loss's F.mse_loss. NVlabs sums over
    pixels (and adds u per pixel): that is C·H·W times this loss with the same
    minimiser e^u = λ·(pixel mean), a constant Adam does not see; the mean keeps
    --max_grad_norm meaning the same for both objectives.
    """

    def __init__(
        self, P_mean=P_MEAN, P_std=P_STD, sigma_data=SIGMA_DATA, weighting="uncertainty", c_noise_scale=1.0,
        logvar_channels=128,
    ):  # fmt: skip
        super().__init__()
        if weighting not in LOSS_WEIGHTINGS:
            raise ConfigError(f"unknown loss weighting '{weighting}': choose {' or '.join(LOSS_WEIGHTINGS)}")
        if not P_std > 0:
            raise ConfigError(f"--P_mean_std: P_std must be positive (got {P_std})")
        if not sigma_data > 0:
            raise ConfigError(f"sigma_data must be positive (got {sigma_data})")
        self.P_mean, self.P_std, self.sigma_data, self.weighting = P_mean, P_std, sigma_data, weighting
        self.c_noise_scale = c_noise_scale
        if weighting == "uncertainty":  # EDM2's magnitude-preserving pieces (edm2.py)
            self.logvar_fourier = edm2.MPFourier(logvar_channels)
            self.logvar_linear = edm2.MPConv(logvar_channels, 1, kernel=())

    name, words, tag = "edm", "EDM (Karras et al. 2022) with EDM2's loss weighting", "edm"
    called, run_words, sampler_words = "EDM", "an EDM run", "DDPM's"
    # --sampler is DDPM's and unused: its grids and sample.py sample with its Heun sampler (EDMHeunSampler)
    samplers, default_sampler = DDPMObjective.samplers, DDPMObjective.default_sampler
    default_steps = EDM_STEPS
    sampler_classes = ("EDMHeunSampler",)
    saves_pipeline = False  # no diffusers pipeline samples it
    ddpm_schedule = True  # its grids read a DDPMScheduler's config
    sampled_as = "c_noise"  # its sampler steps through c_noise = ln(σ)/4 (edm_precondition)

    @staticmethod
    def scale_for(kind):
        """What c_noise is multiplied by for a family whose time input is `kind`: UNET_C_NOISE_SCALE for a timestep."""
        return UNET_C_NOISE_SCALE if kind == "timestep" else 1.0

    @classmethod
    def time_input(cls, kind):
        scale = cls.scale_for(kind)
        return lambda c_noise, x: c_noise * scale

    @classmethod
    def from_args(cls, args, kind, noise_scheduler):
        return cls(*args.P_mean_std, args.sigma_data, args.loss_weighting, c_noise_scale=cls.scale_for(kind))

    @classmethod
    def noise_scheduler(cls, config):
        """DDPM's: an EDM run's grids read its config, and its sampler is its own."""
        return DDPMObjective.noise_scheduler(config)

    @classmethod
    def reads(cls, scheduler, source):
        return None  # its runs save no scheduler

    @classmethod
    def check(cls, args):
        if args.snr_gamma is not None or args.zero_terminal_snr:
            raise ConfigError("--snr_gamma and --zero_terminal_snr are DDPM's: EDM learns its loss weighting")
        if args.timestep_sampling not in (None, "uniform"):
            raise ConfigError("--timestep_sampling is DDPM's and flow's: EDM draws its noise levels by --P_mean_std")

    @classmethod
    def data_std(cls, args):
        return args.sigma_data

    @classmethod
    def sampler(cls, objective, name, training_config, sigma_data, churn, clip):
        return EDMHeunSampler(sigma_data, churn=churn, clip=clip)

    def weight(self, sigma):
        """λ(σ) = (σ² + σd²) / (σ σd)², EDM Table 1."""
        return (sigma**2 + self.sigma_data**2) / (sigma * self.sigma_data) ** 2

    def logvar(self, sigma):
        """u(σ), one value per entry of `sigma` (EDM2 eq. 21)."""
        c_noise = sigma.float().flatten().log() / 4
        return self.logvar_linear(self.logvar_fourier(c_noise)).float().flatten()

    def draw_terms(self, net, x0):
        """The batch means of the loss's terms at fresh σ and noise (drawn on x0's device)."""
        x0 = x0.float()
        sigma = (torch.randn(len(x0), device=x0.device) * self.P_std + self.P_mean).exp()
        noise = self.noise_like(x0)
        return self.terms_at(net, x0, sigma, noise)

    def terms_at(self, net, x0, sigma, noise):
        """The terms at given σ (one per image) and unit noise `noise` (scaled by σ here)."""
        x0, sigma = x0.float(), sigma.float().flatten()
        noisy = x0 + noise.float() * sigma.view(-1, 1, 1, 1)
        denoised = edm_precondition(net, noisy, sigma, self.sigma_data, self.c_noise_scale)
        per_image = ((denoised - x0) ** 2).mean(dim=tuple(range(1, x0.ndim)))
        if self.weighting == "edm":
            return {"edm": (self.weight(sigma) * per_image).mean()}
        u = self.logvar(sigma)
        return {"edm": (self.weight(sigma) / u.exp() * per_image).mean(), "edm_logvar": u.mean()}

    def loss_at(self, net, x0, sigma, noise):
        """The loss at given σ and noise: the sum of `terms_at`."""
        return total_loss(self.terms_at(net, x0, sigma, noise))


# --- flow matching ------------------------------------------------------------------------
# The rectified-flow objective of SiT (Ma et al. 2024) and SD3 (Esser et al. 2024), in diffusers'
# FlowMatchEulerDiscreteScheduler's convention: x_σ = (1 - σ) x0 + σ ε, the network predicts
# v = ε - x0 and takes t = σ · 1000.

FLOW_P_MEAN, FLOW_P_STD = 0.0, 1.0  # SD3's logit-normal(0, 1), its best-ranked formulation (Esser et al. 2024, Table 1)


def parse_objective(text):
    """'ddpm', 'edm', 'flow' or 'flow:SHIFT' -> (kind, shift); shift None but for flow (1 when not given)."""
    kind, _, shift = str(text).partition(":")
    if kind not in OBJECTIVES or (shift and not OBJECTIVES[kind].shifts):
        raise ConfigError(f"--objective {text}: choose ddpm, edm, flow or flow:SHIFT (SD3's timestep shift, e.g. flow:3)")
    if not OBJECTIVES[kind].shifts:
        return kind, None
    try:
        value = float(shift) if shift else 1.0
    except ValueError:
        value = float("nan")
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(f"--objective {text}: the shift must be a number greater than 0 (1 is no shift)")
    return kind, value


def recorded(objective):
    """An --objective value as a run recorded it: DDPM's for a run that recorded none (older runs, pipelines)."""
    return objective or "ddpm"


def of(objective):
    """The objective class (OBJECTIVES) of an --objective value (None: DDPM's, a run that did not record it)."""
    return OBJECTIVES[parse_objective(recorded(objective))[0]]


def from_scheduler(scheduler, source):
    """What the diffusers scheduler config `scheduler` a pipeline saved says of its training: {objective, and a
    DDPM run's prediction_type, beta_schedule, zero_terminal_snr}; None for no config. `source`, the words an
    error line starts with. One mapping for --init_from (init_from.py) and a pipeline outside its run (rundir.py)."""
    if scheduler is None:
        return None
    for kind in (FlowObjective, DDPMObjective):  # flow's by its class name; DDPM's by its betas, or refused
        read = kind.reads(scheduler, source)
        if read is not None:
            return read


def flow_shift(objective):
    """The SD3 shift of a flow --objective (1 for plain 'flow'); None for ddpm and edm."""
    return parse_objective(objective or "ddpm")[1]


def canonical_objective(objective):
    """'flow:3.0' -> 'flow:3', 'flow:1' -> 'flow': one spelling per meaning, as runs record and compare it."""
    kind, shift = parse_objective(objective)
    return kind if shift in (None, 1.0) else f"flow:{shift:g}"


def make_flow_scheduler(shift=1.0):
    """diffusers' FlowMatchEulerDiscreteScheduler for a flow run: its Euler sampler, and what a flow run's
    DDPMPipeline holds, so that `DDPMPipeline.from_pretrained(run)()` samples as train.py's grids do."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=shift)


class FlowObjective(Objective):
    """Flow matching (rectified flow): `loss(net, x0)` = ‖net(x_σ, 1000 σ) - (ε - x0)‖², mean over pixels,
    its one term "flow".

    σ is drawn logit-normal(P_mean, P_std) (SD3's default (0, 1)), or uniform in [0, 1) with
    `timestep_sampling="uniform"` (SiT's), then shifted by `shift` (shift_sigmas), as the
    sampler's schedule is. Drawn on x0's device, so the step needs no host sync.

    `c_noise`: the network takes an EDM2 network's c_noise = logit(σ)/4 instead of t = 1000 σ
    (flow_timestep). It is the bare network's family's time input (model.Family.time_input), decided when the
    objective is built, not from the wrapper the step calls the network through.
    """

    name, words, tag = "flow", "flow matching (rectified flow, as SiT and SD3)", "flow-matching"
    called, run_words, sampler_words = "flow matching", "a flow run", "a flow sampler"
    # its samplers: the ODE's, diffusers' Euler (what its pipeline holds) and Heun, and SiT's SDE, Euler-Maruyama
    # (FlowEulerMaruyama), the default: at 25 steps it scored ahead of Euler 25 on both seeds of the shapes
    # (BENCHMARKS.md, "Flow matching"), and Heun 25 behind it.
    samplers, default_sampler = FLOW_SAMPLERS, "euler_maruyama"
    sampler_classes = ("FlowMatchEulerDiscreteScheduler", "FlowMatchHeunDiscreteScheduler", "FlowEulerMaruyama")
    shifts = True  # --objective flow:SHIFT
    defaults = dict(timestep_sampling="lognormal", P_mean_std=[0.0, 1.0])  # SD3's logit-normal(0, 1) σ (FLOW_P_MEAN, FLOW_P_STD)
    schedulers = ("FlowMatchEulerDiscreteScheduler",)  # the scheduler class its pipeline saves

    @classmethod
    def time_input(cls, kind):
        """t = 1000 σ, its samplers' (a UNet2DModel's or a DiT's); EDM2's c_noise = logit(σ)/4 (flow_timestep)."""
        if kind == "timestep":
            return lambda t, x: t

        def c_noise(t, x):
            sigma = torch.as_tensor(t, dtype=torch.float32, device=x.device).reshape(-1) / NUM_TRAIN_TIMESTEPS
            return flow_timestep(sigma.expand(len(x)), c_noise=True)

        return c_noise

    @classmethod
    def from_args(cls, args, kind, noise_scheduler):
        return cls(flow_shift(args.objective), args.timestep_sampling, *args.P_mean_std, c_noise=kind == "c_noise")

    @classmethod
    def noise_scheduler(cls, config):
        return make_flow_scheduler(flow_shift(config["objective"]))

    @classmethod
    def reads(cls, scheduler, source):
        if scheduler.get("_class_name") in cls.schedulers:
            return dict(objective=canonical_objective(f"{cls.name}:{scheduler.get('shift', 1.0)}"))
        return None

    @classmethod
    def card_words(cls, config):
        shift = flow_shift(config["objective"])
        return (cls.words + (f", SD3's timestep shift {shift:g}" if shift != 1 else "")
                + f"; noise levels drawn {config.get('flow_sigmas')}; sampler {config.get('sampler')}")  # fmt: skip

    @classmethod
    def pipeline_words(cls, config):
        return [f"The pipeline's scheduler is `FlowMatchEulerDiscreteScheduler` (shift {flow_shift(config['objective']):g}): "
                "the network predicts noise - image at t = 1000 sigma.", ""]  # fmt: skip

    @classmethod
    def sigma_distribution(cls, config):
        """'uniform' or 'logit_normal(m,s)': what its σ draw is, as resume compares it. The shift is in --objective."""
        if config.get("timestep_sampling") == "uniform":
            return "uniform"
        mean, std = config.get("P_mean_std") or (FLOW_P_MEAN, FLOW_P_STD)
        return f"logit_normal({float(mean):g},{float(std):g})"

    @classmethod
    def sampler(cls, objective, name, training_config, sigma_data, churn, clip):
        return make_flow_sampler(name, training_config or cls.noise_scheduler(dict(objective=objective)).config)

    def __init__(self, shift=1.0, timestep_sampling="lognormal", P_mean=FLOW_P_MEAN, P_std=FLOW_P_STD, c_noise=False,
                 contrast=0.0):  # fmt: skip
        super().__init__()
        if timestep_sampling not in TIMESTEP_SAMPLINGS:
            raise ConfigError(f"unknown --timestep_sampling '{timestep_sampling}': choose {' or '.join(TIMESTEP_SAMPLINGS)}")
        self.shift, self.timestep_sampling, self.P_mean, self.P_std = shift, timestep_sampling, P_mean, P_std
        self.c_noise = c_noise
        self.contrast = contrast  # ΔFM's λ (loss_terms.py's deltafm): 0, no "deltafm" term

    def sigmas(self, n, device):
        if self.timestep_sampling == "uniform":
            sigma = torch.rand(n, device=device)
        else:
            sigma = torch.sigmoid(torch.randn(n, device=device) * self.P_std + self.P_mean)
        return shift_sigmas(sigma, self.shift)

    def draw_terms(self, net, x0):
        x0 = x0.float()
        sigma, noise = self.sigmas(len(x0), x0.device), self.noise_like(x0)
        if self.contrast:
            return self.terms_at(net, x0, sigma, noise)
        return {"flow": self.loss_at(net, x0, sigma, noise)}

    def predict(self, net, x0, sigma, noise):
        """The network's velocity at x_σ and its target noise - x0 (σ one per image), fp32."""
        x0, noise, sigma = x0.float(), noise.float(), sigma.float().flatten()
        s = sigma.view(-1, *([1] * (x0.ndim - 1)))
        prediction = net((1 - s) * x0 + s * noise, flow_timestep(sigma, self.c_noise), return_dict=False)[0]
        return prediction.float(), noise - x0

    def loss_at(self, net, x0, sigma, noise):
        """The loss at given σ (one per image) and noise."""
        return F.mse_loss(*self.predict(net, x0, sigma, noise))

    def terms_at(self, net, x0, sigma, noise):
        """"flow", and with `contrast` λ contrastive flow matching's "deltafm" (Stoica et al. 2025, ΔFM:
        gstoica27/DeltaFM): -λ ‖v - u_j‖², u_j the target of another image of the batch (the batch's targets
        rolled by one), so that flow + deltafm = ‖v - u_i‖² - λ ‖v - u_j‖²."""
        prediction, target = self.predict(net, x0, sigma, noise)
        terms = {"flow": F.mse_loss(prediction, target)}
        if self.contrast:
            terms["deltafm"] = -self.contrast * F.mse_loss(prediction, target.roll(1, 0))
        return terms


OBJECTIVES = {kind.name: kind for kind in (DDPMObjective, EDMObjective, FlowObjective)}


def saves_pipeline(config):
    """Whether a run (its train_config.json or flags) saves a diffusers DDPMPipeline, as its objective and its
    network's family both allow (a UNet2DModel with DDPM or flow), or its network alone in unet/ (a captioned
    run's too: a DDPMPipeline takes no words)."""
    return (of(config.get("objective")).saves_pipeline and models.family(config["model"])[0].saves_pipeline
            and not config.get("text_encoder"))  # fmt: skip


def sigma_distribution(config):
    """What a run's noise-level draw is, as resume compares it beyond its flags (Objective.sigma_distribution)."""
    return of(config.get("objective")).sigma_distribution(config)


# An EDM2 network takes c_noise = ln(σ_EDM) / 4 (EDM2 eq. 7). On the flow path x_σ / (1 - σ) = x0 + σ_EDM ε with
# σ_EDM = σ / (1 - σ), so a flow run gives it c_noise = logit(σ) / 4: the same noise level, the same input
# scale to its Fourier features. σ is held inside (FLOW_SIGMA_EDGE, 1 - FLOW_SIGMA_EDGE): σ = 1 (pure noise,
# the sampler's first step) would be an infinite σ_EDM; the edge is σ_EDM ≈ 10^4, past EDM's σ_max of 80.
FLOW_SIGMA_EDGE = 1e-4


def flow_timestep(sigma, c_noise=False):
    """What a network takes for a flow noise level σ: t = 1000 σ, as FlowMatchEulerDiscreteScheduler gives a
    UNet2DModel or a DiT; with `c_noise` (an EDM2 network's time input), c_noise = logit(σ) / 4."""
    if c_noise:
        sigma = sigma.clamp(FLOW_SIGMA_EDGE, 1 - FLOW_SIGMA_EDGE)
        return (sigma / (1 - sigma)).log() / 4
    return sigma * NUM_TRAIN_TIMESTEPS


class TimeInput(torch.nn.Module):
    """A network as an objective's sampler calls it, net(x, level): it gets `time(level)`, its own time input
    (Objective.timed). It keeps the network's config, so that what reads a network's config reads it through this."""

    def __init__(self, net, time):
        super().__init__()
        self.net, self.time, self.config = net, time, net.config

    def forward(self, x, t, return_dict=False, **kwargs):
        return self.net(x, self.time(t, x), return_dict=False, **kwargs)


# --- what a run samples with ------------------------------------------------------------


def make_sampler(objective, name, training_config=None, sigma_data=SIGMA_DATA, churn=EDM_CHURN, clip=True):
    """What samples a run trained with `objective` (its class's `sampler`): EDM's Heun sampler (stochastic with
    `churn` > 0), a flow run's make_flow_sampler `name`, DDPM's make_scheduler `name`. `clip` False: a latent
    run's, whose samples are latents, not images in [-1, 1]."""
    return of(objective).sampler(objective, name, training_config, sigma_data, churn, clip)


def sampled_by(scheduler):
    """The objective class whose samplers `scheduler` is one of (Objective.sampler_classes)."""
    return next(kind for kind in OBJECTIVES.values() if type(scheduler).__name__ in kind.sampler_classes)
