"""The EDM objective (model.py) and EDM's Heun sampler (sample.py)."""

import json
import math

import pytest
import torch

from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.diffusion import samplers
import sample
from ddpm_train.evaluation import sampling
from ddpm_train.errors import ConfigError


def gaussian_denoiser(s):
    """The exact denoiser of data N(0, s²): E[x0 | x0 + σ n = x] = x s² / (s² + σ²)."""
    return lambda x, sigma: x * s**2 / (s**2 + sigma**2)


# --- the sampler ---------------------------------------------------------------------


def test_karras_sigmas_follow_eq_5_and_match_diffusers():
    from diffusers import EDMEulerScheduler

    sigmas = samplers.karras_sigmas(18)
    assert len(sigmas) == 19 and sigmas[-1] == 0
    assert sigmas[0].item() == pytest.approx(80) and sigmas[17].item() == pytest.approx(0.002)
    i = 5  # one entry by hand: (80^(1/7) + 5/17 (0.002^(1/7) - 80^(1/7)))^7
    assert sigmas[i].item() == pytest.approx((80 ** (1 / 7) + i / 17 * (0.002 ** (1 / 7) - 80 ** (1 / 7))) ** 7)
    reference = EDMEulerScheduler(sigma_min=0.002, sigma_max=80.0, rho=7.0, final_sigmas_type="zero")
    reference.set_timesteps(18)
    torch.testing.assert_close(sigmas.float(), reference.sigmas, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("s", [0.5, 2.0])
def test_heun_turns_noise_into_gaussian_data_with_the_right_std_and_beats_euler(s):
    """Data N(0, s²): the exact ODE maps σ_max n to (nearly) s n; Heun gets there, to second order.

    18 steps of the ρ = 7 grid leave Heun 5.5% (s = 0.5) and 3.6% (s = 2) high,
    Euler 15% and 13% low; the error is the integrator's: a quarter of it at 36 steps.
    """
    noise = torch.randn(20000, 1, 1, 1, generator=torch.Generator().manual_seed(0))

    def std_error(num_steps, euler=False):
        x = samplers.heun_sample(gaussian_denoiser(s), noise, samplers.karras_sigmas(num_steps), euler)
        return x.std().item() / (s * noise.std().item()) - 1  # relative to this noise's own std: no sampling error

    heun, euler = std_error(18), std_error(18, euler=True)
    assert abs(heun) < 0.07
    heun_samples = samplers.heun_sample(gaussian_denoiser(s), noise, samplers.karras_sigmas(18))
    assert heun_samples.std().item() == pytest.approx(s, rel=0.07)
    assert abs(heun) < abs(euler) / 2, (heun, euler)
    assert abs(std_error(36)) < abs(heun) / 3  # second order: halving the step quarters the error
    assert abs(std_error(36, euler=True)) > abs(euler) / 3  # first order: it only halves
    assert abs(std_error(72)) < 0.005


def test_stochastic_heun_forgets_a_wrong_start_and_each_image_has_its_own_noise():
    """EDM Algorithm 2 (S_churn): fresh noise before each step corrects the errors of earlier
    steps. Started from twice the right noise, the ODE carries the error to the end (std 2.03 s
    at 36 steps); with churn the samples come out within a few percent of s (1.03 s)."""
    s = 0.5
    noise = 2 * torch.randn(4000, 1, 1, 1, generator=torch.Generator().manual_seed(0))

    def run(churn, seeds):
        generators = [torch.Generator().manual_seed(k) for k in seeds]
        return samplers.heun_sample(gaussian_denoiser(s), noise[: len(seeds)], samplers.karras_sigmas(36), churn=churn,
                                  generators=generators)  # fmt: skip

    seeds = range(100, 4100)
    assert run(0, seeds).std().item() / s == pytest.approx(2.0, rel=0.05)
    stochastic = run(10, seeds)
    assert stochastic.std().item() / s == pytest.approx(1.0, rel=0.06)
    # image k depends on its own generator only: the first two, sampled alone, come out the same
    torch.testing.assert_close(run(10, seeds[:2]), stochastic[:2])


def test_heun_costs_2n_minus_1_evaluations():
    calls = []

    def denoise(x, sigma):
        calls.append(sigma)
        return x * 0

    samplers.heun_sample(denoise, torch.randn(2, 3, 4, 4), samplers.karras_sigmas(18))
    assert len(calls) == 35 and min(calls) > 0  # the last step (to σ = 0) is Euler's: D is never asked at σ = 0


class Recorder(torch.nn.Module):
    """A network stub: returns `prediction` and records its input."""

    def __init__(self, prediction):
        super().__init__()
        self.prediction = prediction
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # a parameter, so the samplers find a device

    def forward(self, x, t, return_dict=True):
        self.x, self.t = x, t
        return (self.prediction + 0 * self.anchor,)


# --- the objective -------------------------------------------------------------------


def test_preconditioning_matches_edm_table_1():
    g = torch.Generator().manual_seed(0)
    x, F_x = torch.randn(3, 3, 4, 4, generator=g), torch.randn(3, 3, 4, 4, generator=g)
    sigma = torch.tensor([0.01, 0.5, 20.0])
    net = Recorder(F_x)
    D = samplers.edm_precondition(net, x, sigma, sigma_data=0.5, c_noise_scale=1.0)
    for i, s in enumerate(sigma.tolist()):  # by hand, in float64
        c_skip = 0.25 / (s * s + 0.25)
        c_out = s * 0.5 / math.sqrt(s * s + 0.25)
        c_in = 1 / math.sqrt(s * s + 0.25)
        torch.testing.assert_close(net.x[i], (c_in * x[i].double()).float())
        torch.testing.assert_close(D[i], (c_skip * x[i].double() + c_out * F_x[i].double()).float())
        assert net.t[i].item() == pytest.approx(math.log(s) / 4)
    samplers.edm_precondition(net, x, 0.5, c_noise_scale=400.0)  # a number: one σ for all
    torch.testing.assert_close(net.t, torch.full((3,), 400 * math.log(0.5) / 4))


def test_c_noise_scale_is_the_objectives_choice_by_network():
    unet = models.build_network("tiny", 16)
    takes = [models.family_of(models.build_network(name, 16)).time_input for name in ("tiny", "dit-tiny", "edm2tiny")]
    assert takes == ["timestep", "timestep", "c_noise"]
    c_noise, x = torch.tensor([0.25]), torch.zeros(1)
    assert [objectives.EDMObjective.time_input(kind)(c_noise, x).item() for kind in ("timestep", "c_noise")] == [100, 0.25]
    with pytest.raises(ConfigError, match="belongs to no network family"):  # a class of no family: not a guess
        models.family_of(Recorder(torch.zeros(1)))
    net, zeros = Recorder(torch.zeros(2, 3, 4, 4)), torch.zeros(2, 3, 4, 4)
    objective = objectives.EDMObjective(weighting="edm", c_noise_scale=7.0)
    objective.loss_at(net, zeros, torch.ones(2), zeros)
    assert torch.equal(net.t, torch.zeros(2))  # ln(1) = 0 whatever the scale
    objective.loss_at(net, zeros, torch.full((2,), math.e), zeros)
    torch.testing.assert_close(net.t, torch.full((2,), 7.0 / 4))


def test_edm_weighted_loss_on_fixed_numbers():
    g = torch.Generator().manual_seed(1)
    x0, noise, F_x = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    sigma = torch.tensor([0.3, 3.0])
    objective = objectives.EDMObjective(weighting="edm")
    loss = objective.loss_at(Recorder(F_x), x0, sigma, noise)
    expected = 0
    for i, s in enumerate(sigma.tolist()):
        y, n = x0[i].double(), noise[i].double()
        D = 0.25 / (s * s + 0.25) * (y + s * n) + s * 0.5 / math.sqrt(s * s + 0.25) * F_x[i].double()
        lam = (s * s + 0.25) / (s * 0.5) ** 2
        expected += lam * ((D - y) ** 2).mean().item() / 2
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(expected, rel=1e-5)
    assert not list(objective.parameters())  # 'edm' learns nothing besides the network


def test_uncertainty_loss_is_eq_21_on_fixed_numbers():
    g = torch.Generator().manual_seed(2)
    x0, noise, F_x = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    sigma = torch.tensor([0.3, 3.0])
    objective = objectives.EDMObjective(weighting="uncertainty")
    edm = objectives.EDMObjective(weighting="edm")
    per_image = [edm.loss_at(Recorder(F_x[i : i + 1]), x0[i : i + 1], sigma[i : i + 1], noise[i : i + 1]) for i in range(2)]
    u = objective.logvar(sigma)
    expected = sum(L / u[i].exp() + u[i] for i, L in enumerate(per_image)) / 2
    torch.testing.assert_close(objective.loss_at(Recorder(F_x), x0, sigma, noise), expected)


def test_uncertainty_head_learns_its_optimum_e_u_equals_lambda_times_loss():
    """min over u of λ/e^u L + u is at e^u = λ L: the head learns the loss level at each σ (EDM2 eq. 21)."""
    torch.manual_seed(0)
    objective = objectives.EDMObjective(weighting="uncertainty", logvar_channels=32)
    sigma = torch.tensor([0.01, 0.1, 1.0, 10.0])
    # A fixed per-σ loss: with y = 0 and no noise, D = c_out F, so L = c_out² F² for a constant F per image.
    F_x = torch.tensor([3.0, 1.0, 0.5, 0.2]).view(4, 1, 1, 1).expand(4, 1, 2, 2)
    zeros = torch.zeros(4, 1, 2, 2)
    L = (sigma * 0.5 / (sigma**2 + 0.25).sqrt()) ** 2 * F_x[:, 0, 0, 0] ** 2
    optimizer = torch.optim.Adam(objective.parameters(), lr=0.05)
    for _ in range(400):
        loss = objective.loss_at(Recorder(F_x), zeros, sigma, zeros)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.testing.assert_close(objective.logvar(sigma).exp(), objective.weight(sigma) * L, rtol=0.05, atol=0)


def test_objective_validates_its_options():
    # the weighting is no flag now (config.SETTINGS: uncertainty); P_std is --P_mean_std's second number
    with pytest.raises(ConfigError, match="unknown loss weighting 'sum': choose uncertainty or edm"):
        objectives.EDMObjective(weighting="sum")
    with pytest.raises(ConfigError, match="--P_mean_std: P_std must be positive"):
        objectives.EDMObjective(P_std=0)


def test_sigma_is_drawn_log_normal():
    net = Recorder(torch.zeros(4000, 1, 1, 1))
    torch.manual_seed(0)
    objectives.EDMObjective(P_mean=-0.8, P_std=1.6, weighting="edm", c_noise_scale=1.0).loss(net, torch.zeros(4000, 1, 1, 1))
    ln_sigma = net.t * 4  # c_noise = ln(σ)/4
    assert ln_sigma.mean().item() == pytest.approx(-0.8, abs=0.08)
    assert ln_sigma.std().item() == pytest.approx(1.6, rel=0.05)


# --- on a tiny UNet2DModel -----------------------------------------------------------


def test_tiny_unet_trains_with_the_objective_and_samples_with_heun():
    torch.manual_seed(0)
    unet = models.build_network("tiny", 16)
    objective = objectives.EDMObjective(c_noise_scale=objectives.UNET_C_NOISE_SCALE)
    head = [p.clone() for p in objective.parameters()]
    optimizer = torch.optim.AdamW([*unet.parameters(), *objective.parameters()], lr=2e-3)
    x0 = torch.rand(8, 3, 16, 16) * 2 - 1
    losses = []
    for _ in range(5):
        loss = objective.loss(unet, x0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and loss.dtype == torch.float32
    assert any(not torch.equal(a, b) for a, b in zip(head, objective.parameters()))  # the head trained too
    # The head travels in the objective's state_dict (checkpoints), never in the network.
    state = objective.state_dict()
    assert {"logvar_linear.weight", "logvar_fourier.freqs", "logvar_fourier.phases"} <= set(state)
    assert not any("logvar" in k for k in unet.state_dict())
    again = objectives.EDMObjective()
    again.load_state_dict(state)
    torch.testing.assert_close(again.logvar(torch.tensor([0.5])), objective.logvar(torch.tensor([0.5])))

    unet.eval()
    images = samplers.edm_heun_sample(unet, (2, 3, 16, 16), num_steps=3, generator=torch.Generator().manual_seed(0),
                                        c_noise_scale=objectives.UNET_C_NOISE_SCALE)  # fmt: skip
    assert images.shape == (2, 3, 16, 16) and images.min() >= -1 and images.max() <= 1
    assert images.std() > 0.01
    seeds = sampling.image_seeds(0, 2)
    uint8 = sampling.generate(unet, objectives.make_sampler("edm", "dpmsolver"), seeds, 3)
    assert uint8.shape == (2, 3, 16, 16) and uint8.dtype == torch.uint8
    assert torch.equal(uint8, sampling.generate(unet, objectives.make_sampler("edm", "dpmsolver"), seeds, 3))


def test_load_network_reads_a_saved_unet(tmp_path):
    torch.manual_seed(0)
    unet = models.build_network("tiny", 16)
    unet.save_pretrained(str(tmp_path / "unet"))
    loaded = models.load_network(tmp_path / "unet")
    assert type(loaded) is type(unet) and not loaded.training
    assert all(torch.equal(a, b) for a, b in zip(unet.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(ConfigError, match="no config.json"):
        models.load_network(tmp_path)
