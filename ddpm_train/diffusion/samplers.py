"""The samplers of each objective (DDPM's diffusers schedulers, EDM's Heun, flow's Euler, Heun and SDE) and the
noise-level maths they share with the objectives' losses (EDM's preconditioning, flow's shift).

The objectives (objectives.py) name theirs: `objectives.make_sampler(objective, name, ...)` is what a run samples with.
"""

import contextlib
import math
from types import SimpleNamespace

import torch

from ddpm_train.errors import ConfigError

NUM_TRAIN_TIMESTEPS = 1000  # DDPM's T (Ho et al. 2020, and every config here)
SIGMA_DATA = 0.5  # EDM Table 1: the data's standard deviation, for images in [-1, 1]
DDPM_SAMPLERS = ("ddpm", "ddim", "dpmsolver", "dpmsolver_sde")  # DDPMObjective's --sampler choices
FLOW_SAMPLERS = ("euler", "heun", "euler_maruyama")  # FlowObjective's
EDM_STEPS = 18  # EDM's CIFAR-10 setting: 18 Heun steps, 35 network evaluations


def edm_precondition(net, x, sigma, sigma_data=SIGMA_DATA, c_noise_scale=1.0):
    """The denoiser D(x; σ) = c_skip x + c_out F(c_in x; c_noise), EDM Table 1 / EDM2 eq. 7.

    c_skip = σd² / (σ² + σd²), c_out = σ σd / sqrt(σ² + σd²),
    c_in = 1 / sqrt(σ² + σd²), c_noise = ln(σ) / 4 (times `c_noise_scale` for the
    network). `sigma` is a number or one value per image. The skip and output
    arithmetic is fp32 whatever precision the network runs in (as EDM's Precond).
    """
    x = x.float()
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).reshape(-1, 1, 1, 1).expand(len(x), 1, 1, 1)
    c_skip = sigma_data**2 / (sigma**2 + sigma_data**2)
    c_out = sigma * sigma_data / (sigma**2 + sigma_data**2).sqrt()
    c_in = 1 / (sigma**2 + sigma_data**2).sqrt()
    c_noise = sigma.flatten().log() / 4
    F_x = net(c_in * x, c_noise * c_noise_scale, return_dict=False)[0]
    return c_skip * x + c_out * F_x.float()


def shift_sigmas(sigma, shift):
    """SD3's timestep shift (Esser et al. 2024, eq. 23): σ' = s σ / (1 + (s - 1) σ); s > 1 moves noise levels up."""
    return shift * sigma / (1 + (shift - 1) * sigma)


# --- DDPM's samplers: diffusers' schedulers ---------------------------------------------


def make_scheduler(name, training_config, clip=True):
    """The sampler `name` for a model trained with the DDPMScheduler config `training_config`.

    Every sampler clips its estimate of the clean image to [-1, 1] at each
    step. Without that, the estimate x0 = (x_t - sqrt(1 - abar) eps) / sqrt(abar)
    of a model early in training is far outside the data range at high noise
    (sqrt(abar) is 0.006 at t = 999), and the solver carries it into the
    image: on a tiny model after 150 steps, 92% of DPM-Solver++'s pixels and
    94% of DDIM's were saturated without clipping, 14% and 0.5% with it.
    DDPM and DDIM call this clip_sample; DPM-Solver++ calls it thresholding,
    which with sample_max_value=1 is plain clipping (diffusers recommends it
    for pixel-space models).

    Timesteps are "trailing" (Lin et al. 2024, "Common Diffusion Noise
    Schedules and Sample Steps are Flawed"): the first step is t = T-1, the
    noise level x_T ~ N(0, I) actually has. Set explicitly because
    `from_config` would otherwise carry DDPMScheduler's "leading" over.
    (diffusers' DDIM steps from t to t - T // steps; when the step count does
    not divide T that is up to one timestep off the trailing schedule, which
    is harmless.)

    `clip` False: no clipping, for a latent run (latents are not confined to [-1, 1]; LDM's
    samplers do not clip them).
    """
    from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler

    if name == "ddpm":
        # Ancestral sampling, Algorithm 2 of Ho et al. (2020): 1000 steps to be exact.
        return DDPMScheduler.from_config(training_config, clip_sample=clip, clip_sample_range=1.0)
    if name == "ddim":
        # eta = 0: deterministic, so a grid from the same noise changes only as the model does.
        return DDIMScheduler.from_config(
            training_config, clip_sample=clip, clip_sample_range=1.0, set_alpha_to_one=True, timestep_spacing="trailing"
        )
    if name in ("dpmsolver", "dpmsolver_sde"):
        return DPMSolverMultistepScheduler.from_config(
            training_config,
            # The SDE form adds fresh noise at each step (drawn from the per-image
            # generators, as DDPM's), which corrects the model's errors of earlier steps.
            algorithm_type="sde-dpmsolver++" if name == "dpmsolver_sde" else "dpmsolver++",
            solver_order=2,
            thresholding=clip,
            sample_max_value=1.0,
            timestep_spacing="trailing",
            lower_order_final=True,  # first order for the last steps when there are < 15: more stable
            final_sigmas_type="zero",  # the last step lands on the clean image
        )
    raise ConfigError(f"unknown --sampler '{name}': choose one of {', '.join(DDPM_SAMPLERS)}")


# --- EDM's sampler ----------------------------------------------------------------------
# Deterministic Heun, Algorithm 1 of Karras et al. (2022) with S_churn = 0 (as
# NVlabs/edm2 generate_images.py `edm_sampler`), on the probability-flow ODE
# dx/dσ = (x - D(x; σ)) / σ (their eq. 3 with σ(t) = t, s(t) = 1).

# S_churn of EDM's stochastic sampler (0: deterministic, EDM's CIFAR-10 setting). At 18 steps
# any value from 7.5 up gives the largest fresh noise per step (γ = √2 - 1: EDM eq. 7's
# min(S_churn / N, √2 - 1)). On the built-in shapes it scored better than the deterministic
# sampler (BENCHMARKS.md), as the SDE form of DPM-Solver++ did for DDPM.
EDM_CHURN = 20.0
SIGMA_MIN, SIGMA_MAX, RHO = 0.002, 80.0, 7.0  # EDM Table 1


CHURN_HELP = ("an EDM run: S_churn of EDM's stochastic Heun sampler (Karras et al. 2022, Algorithm 2), fresh noise "
              f"before each step; 0 is the deterministic sampler (default: {EDM_CHURN:g})")


def karras_sigmas(num_steps, sigma_min=SIGMA_MIN, sigma_max=SIGMA_MAX, rho=RHO):
    """EDM eq. 5: σ_i = (σ_max^(1/ρ) + i/(N-1) (σ_min^(1/ρ) - σ_max^(1/ρ)))^ρ for i < N, then σ_N = 0 (float64)."""
    ramp = torch.linspace(0, 1, num_steps, dtype=torch.float64)
    sigmas = (sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    return torch.cat([sigmas, sigmas.new_zeros(1)])


def heun_sample(denoise, noise, sigmas, euler=False, churn=0.0, generators=None):
    """Integrate the probability-flow ODE from x = noise σ_0 down `sigmas` (ending at 0) with D = denoise(x, σ).

    EDM Algorithm 1, lines 3-8 (deterministic): an Euler step, then the
    trapezoidal (Heun) correction except on the last step to σ = 0; `euler`
    skips every correction (for comparison). N steps cost 2N - 1 evaluations.

    `churn` > 0 is EDM's stochastic sampler (Algorithm 2, S_churn): before each
    step, fresh noise raises σ_i to σ̂ = (1 + γ) σ_i, γ = min(churn / N, √2 - 1),
    x̂ = x + √(σ̂² - σ_i²) ε (S_noise = 1), and the step runs from σ̂. The noise of
    image k comes from `generators[k]`, so that an image depends only on its own seed.
    """
    sigmas = [float(s) for s in sigmas]  # Python numbers: no device sync in the loop
    gamma = min(churn / (len(sigmas) - 1), math.sqrt(2) - 1)
    x = noise.float() * sigmas[0]
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        if gamma > 0:
            sigma_hat = sigma * (1 + gamma)
            x = x + math.sqrt(sigma_hat**2 - sigma**2) * image_noise(generators, x.shape[1:], x.device)
            sigma = sigma_hat
        d = (x - denoise(x, sigma)) / sigma
        x_next = x + (sigma_next - sigma) * d
        if not euler and sigma_next > 0:
            d_next = (x_next - denoise(x_next, sigma_next)) / sigma_next
            x_next = x + (sigma_next - sigma) * (d + d_next) / 2
        x = x_next
    return x


@torch.no_grad()
def edm_heun_sample(
    net, noise, num_steps=EDM_STEPS, sigma_min=SIGMA_MIN, sigma_max=SIGMA_MAX, rho=RHO, sigma_data=SIGMA_DATA,
    c_noise_scale=None, generator=None, device=None, euler=False, clip_denoised=True, autocast=contextlib.nullcontext,
    churn=0.0, generators=None,
):  # fmt: skip
    """Images in [-1, 1] from `net` (trained with the EDM objective) by EDM's deterministic Heun sampler.

    `noise`: unit Gaussian noise (N, C, H, W), or a shape to draw it for with
    `generator` on `device`. `clip_denoised` clips each estimate D(x; σ) of the
    clean image to [-1, 1], as the seed repository's sampler and every
    make_scheduler sampler do (it keeps an under-trained model out of saturation).
    `net` takes c_noise itself (Objective.timed: EDMObjective's time input), unless `c_noise_scale` scales it. `churn` > 0: EDM's stochastic
    sampler, its fresh noise from `generators` (one per image, required; heun_sample).
    """
    if not isinstance(noise, torch.Tensor):
        noise = torch.randn(tuple(noise), generator=generator, device=device or "cpu")
    scale = 1.0 if c_noise_scale is None else c_noise_scale

    def denoise(x, sigma):
        with autocast():
            denoised = edm_precondition(net, x, sigma, sigma_data, scale)
        return denoised.clamp(-1, 1) if clip_denoised else denoised

    sigmas = karras_sigmas(num_steps, sigma_min, sigma_max, rho)
    x = heun_sample(denoise, noise.to(network_device(net)), sigmas, euler, churn, generators)
    return x.clamp(-1, 1) if clip_denoised else x


class EDMHeunSampler:
    """EDM's Heun sampler in the place of a diffusers scheduler: `generate` calls `sample`.
    `clip`: clip each D(x; σ) to [-1, 1], the range of images (not of latents)."""

    def __init__(self, sigma_data=SIGMA_DATA, sigma_min=SIGMA_MIN, sigma_max=SIGMA_MAX, rho=RHO, churn=0.0,
                 clip=True):  # fmt: skip
        self.sigma_data, self.sigma_min, self.sigma_max, self.rho = sigma_data, sigma_min, sigma_max, rho
        self.churn, self.clip = churn, clip
        self.name = f"edm_heun_churn{churn:g}" if churn > 0 else "edm_heun"

    def sample(self, net, noise, num_steps, autocast=contextlib.nullcontext, generators=None):
        return edm_heun_sample(
            net, noise, num_steps, self.sigma_min, self.sigma_max, self.rho, self.sigma_data, autocast=autocast,
            churn=self.churn, generators=generators, clip_denoised=self.clip,
        )  # fmt: skip


# --- flow's SDE sampler: SiT's Euler-Maruyama ----------------------------------------------
# SiT (Ma et al. 2024, willisma/SiT transport/) samples the reverse SDE of the linear path whose marginals are the
# ODE's: in our σ (SiT's time is 1 - σ), with a diffusion coefficient w(σ),
#     dx = [-v + w(σ) ∇log p_σ(x)] d(-σ) + √(2 w(σ)) dW,    ∇log p_σ(x) = -(x + (1 - σ) v) / σ
# (the score of x_σ = (1 - σ) x0 + σ ε is -E[ε | x] / σ, and E[ε | x] = x + (1 - σ) v). Its sample.py and
# sample_ddp.py default (train_utils.parse_sde_args): diffusion form "sigma", w = norm · σ (SiT's path's σ_t)
# with norm 1; Euler-Maruyama on N - 1 equal steps from σ = 1 to σ = 0.04; then the "Mean" last step of 0.04,
# the SDE's drift without noise, to σ = 0. N network evaluations in all, as Euler's N steps.
SDE_DIFFUSION_NORM = 1.0
SDE_LAST_STEP_SIZE = 0.04


def flow_sde_sigmas(num_steps, shift=1.0, last_step_size=SDE_LAST_STEP_SIZE):
    """The Euler-Maruyama sampler's N noise levels, then 0 (float64): SiT's grid, N equally spaced levels from 1
    to `last_step_size` (1 alone for N = 1), each moved by SD3's shift (model.shift_sigmas) as training's σ
    draw is and as Euler's grid is."""
    sigmas = torch.linspace(1.0, last_step_size, num_steps, dtype=torch.float64)
    return torch.cat([shift_sigmas(sigmas, shift), sigmas.new_zeros(1)])


class FlowEulerMaruyama:
    """SiT's Euler-Maruyama sampler for a flow run, in the place of a diffusers scheduler (`generate` drives it
    as it drives FlowMatchEulerDiscreteScheduler: set_timesteps, then step per t in timesteps).

    From σ to the next level σ' (Δ = σ - σ' > 0), with the network's v at t = 1000 σ:
        w = norm · σ,    score = -(x + (1 - σ) v) / σ
        mean = x + Δ (-v + w · score)
        x' = mean + √(2 w Δ) z,   z ~ N(0, I) from image k's own generator
    and on the last step (σ' = 0) x' = mean: SiT's "Mean" last step. Fresh noise at each step makes the
    images depend on the seeds beyond the starting noise; `generate` passes the per-image generators.
    """

    name = "euler_maruyama"
    init_noise_sigma = 1.0  # starts from pure noise at σ = 1

    def __init__(self, shift=1.0, diffusion_norm=SDE_DIFFUSION_NORM, last_step_size=SDE_LAST_STEP_SIZE):
        self.shift, self.diffusion_norm, self.last_step_size = float(shift), diffusion_norm, last_step_size
        self.config = dict(shift=self.shift, diffusion_norm=diffusion_norm, last_step_size=last_step_size)
        self.timesteps = None

    def set_timesteps(self, num_inference_steps, device=None):
        self.sigmas = flow_sde_sigmas(num_inference_steps, self.shift, self.last_step_size)
        self.timesteps = (self.sigmas[:-1] * NUM_TRAIN_TIMESTEPS).to(device=device, dtype=torch.float32)
        self._levels = [float(s) for s in self.sigmas]  # Python numbers: no device sync in the loop
        self._index = 0

    def step(self, model_output, timestep, sample, generator=None, return_dict=True):
        sigma, sigma_next = self._levels[self._index], self._levels[self._index + 1]
        self._index += 1
        x, v = sample.float(), model_output.float()
        w = self.diffusion_norm * sigma
        score = -(x + (1 - sigma) * v) / sigma
        x = x + (sigma - sigma_next) * (-v + w * score)
        if sigma_next > 0:
            x = x + math.sqrt(2 * w * (sigma - sigma_next)) * step_noise(generator, x)
        return SimpleNamespace(prev_sample=x)


def step_noise(generator, like):
    """Unit Gaussian noise shaped as `like`: image k's from generators[k] (a list, as `generate` passes), or
    from one generator, or the global one for None."""
    if isinstance(generator, (list, tuple)):
        return image_noise(generator, like.shape[1:], like.device).to(like.dtype)
    if generator is None:
        return torch.randn_like(like)
    return torch.randn(like.shape, generator=generator, device=generator.device).to(like.device, like.dtype)


def make_flow_sampler(name, training_config):
    """A flow run's sampler `name` (FlowObjective.samplers) from its FlowMatchEulerDiscreteScheduler config (its shift).

    Euler and Heun integrate the network's velocity v = ε - x0 as dx/dσ = v on diffusers' grid: N noise levels
    from σ = 1 down to the shifted σ_min, each shifted (again, for the last: diffusers #13243), then 0. It is
    the grid DDPMPipeline.from_pretrained(run) samples on, so both give the same images. "euler_maruyama" is
    SiT's SDE sampler on SiT's grid with the same shift (FlowEulerMaruyama). No clipping: the estimate of x0
    is not in the loop.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler

    if name == "euler":
        return FlowMatchEulerDiscreteScheduler.from_config(training_config)
    if name == "heun":
        return FlowMatchHeunDiscreteScheduler.from_config(training_config)
    if name == "euler_maruyama":
        return FlowEulerMaruyama(shift=training_config.get("shift", 1.0))
    raise ConfigError(f"--sampler {name} is DDPM's: a flow run samples with {', '.join(FLOW_SAMPLERS)}")


def network_device(net):
    return next(iter([*net.parameters(), *net.buffers()])).device


def image_noise(generators, shape, device):
    """A batch of unit Gaussian noise of `shape` per image, image k's drawn from `generators[k]`."""
    return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(device)
