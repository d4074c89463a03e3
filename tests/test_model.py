from pathlib import Path

import pytest
import torch

from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.errors import ConfigError


def param_count(name):
    unet = models.build_network(name, models.PRESETS[name].image_size, device="meta")
    return sum(p.numel() for p in unet.parameters())


def test_reference_preset_is_exactly_the_diffusers_example_model():
    assert param_count("ref128") == 113_673_219
    config = models.PRESETS["ref128"].settings
    assert config["block_out_channels"] == (128, 128, 256, 256, 512, 512)
    assert config["down_block_types"][4] == "AttnDownBlock2D"
    assert config["up_block_types"][1] == "AttnUpBlock2D"
    assert sum("Attn" in b for b in config["down_block_types"] + config["up_block_types"]) == 2


def test_adm64_preset_shape():
    config = models.PRESETS["adm64"].settings
    assert config["block_out_channels"] == (64, 128, 192, 256)
    # attention at 16x16 and 8x8 of a 64px image: the 3rd and 4th levels
    assert config["down_block_types"] == ("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D")
    assert config["attention_head_dim"] == 32
    assert param_count("adm64") == 22_080_323  # as docs/training.md states


# The parameter counts the preset table states (docs/training.md; `python flops.py` counts them).
# Exact, so that a block or a layer more or less (an attention block moved, an argument left to
# its default) fails.
PARAMS = dict(
    small=1_063_651, tiny=177_427, small_deep=4_527_971, ddpm32=35_746_307, adm64=22_080_323, ref128=113_673_219,
    edm2c=39_509_888, edm2e=39_509_888, edm2g=39_542_685, edm2small=1_257_456, edm2tiny=189_947,
)  # fmt: skip
# The DiT presets as build_network makes them at their image size (RGB in and out, unconditional: one class).
# Their counts at the paper's configuration are tests/test_dit.py's; docs/dit.md's table states both.
PARAMS |= {
    "dit-s2": 32_472_204, "dit-s4": 32_499_888, "dit-s8": 32_610_624, "dit-b2": 129_530_124, "dit-b4": 129_585_456,
    "dit-b8": 129_806_784, "dit-l2": 456_793_100, "dit-l4": 456_866_864, "dit-l8": 457_161_920,
    "dit-xl2": 673_656_204, "dit-xl4": 673_739_184, "dit-xl8": 674_071_104, "dit-tiny": 50_092, "dit-small": 4_178_160,
}  # fmt: skip


@pytest.mark.slow
def test_the_docs_preset_table_is_generated_from_the_presets_and_every_count_is_known():
    """docs/training.md's table is flops.preset_table's (run `python flops.py --presets docs/training.md` after
    changing a preset), and every preset has the parameter count PARAMS states."""
    from ddpm_train.perf import flops

    page = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    assert flops.with_preset_table(page) == page, "run: python flops.py --presets docs/training.md"
    assert {name: param_count(name) for name in models.PRESETS} == PARAMS


def test_auto_model_follows_the_image_size():
    assert models.resolve_model_name("auto", 128) == "ref128"
    assert models.resolve_model_name("auto", 64) == "adm64"
    assert models.resolve_model_name("auto", 32) == "small"
    assert models.resolve_model_name("ddpm32", 128) == "ddpm32"


def test_unknown_preset_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="unknown --model 'big'.*ref128"):
        models.resolve_model_name("big", 32)


def test_image_size_the_model_cannot_take_is_refused_with_the_sizes_it_can():
    with pytest.raises(ConfigError, match="multiple of 32 \\(32, 64, 96, 128"):
        models.check_image_size("ref128", 100)
    with pytest.raises(ConfigError, match="multiple of 32"):
        models.check_image_size("ref128", 16)
    models.check_image_size("ref128", 96)  # a multiple of 32 works


@pytest.mark.parametrize("name", list(models.PRESETS))
def test_every_preset_runs_at_its_own_size(name):
    size = models.PRESETS[name].image_size
    unet = models.build_network(name, size, device="meta")
    out = unet(torch.empty(2, 3, size, size, device="meta"), torch.zeros(2, dtype=torch.long, device="meta"))
    assert out.sample.shape == (2, 3, size, size)


class Recorder(torch.nn.Module):
    """Returns a fixed prediction and records its input."""

    def __init__(self, prediction):
        super().__init__()
        self.prediction = prediction

    def forward(self, x, t, return_dict=True):
        self.x, self.t = x, t
        return (self.prediction,)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_ddpm_loss_matches_the_scheduler(prediction_type):
    scheduler = objectives.make_noise_scheduler(1000, "linear", prediction_type)
    g = torch.Generator().manual_seed(0)
    clean = torch.rand(4, 3, 8, 8, generator=g) * 2 - 1
    noise = torch.randn(4, 3, 8, 8, generator=g)
    t = torch.tensor([0, 10, 500, 999])
    prediction = torch.randn(4, 3, 8, 8, generator=g)
    net = Recorder(prediction)

    loss = objectives.ddpm_loss(net, clean, noise, t, scheduler.alphas_cumprod, prediction_type)

    torch.testing.assert_close(net.x, scheduler.add_noise(clean, noise, t))
    target = {
        "epsilon": noise,
        "v_prediction": scheduler.get_velocity(clean, noise, t),
        "sample": clean,
    }[prediction_type]
    torch.testing.assert_close(loss, ((prediction - target) ** 2).mean())


def test_ddpm_loss_is_fp32_under_bf16_autocast():
    unet = models.build_network("tiny", 16)
    scheduler = objectives.make_noise_scheduler()
    clean, noise = torch.rand(2, 3, 16, 16) * 2 - 1, torch.randn(2, 3, 16, 16)
    t = torch.tensor([5, 700])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = objectives.ddpm_loss(unet, clean, noise, t, scheduler.alphas_cumprod)
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(p.grad is not None for p in unet.parameters() if p.requires_grad)


class Echo(torch.nn.Module):
    """A 'network' whose prediction is a fixed function of its input: the loss is known in closed form."""

    def forward(self, x, t, return_dict=False):
        return (0.5 * x,)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_min_snr_gamma_weights_each_image_by_its_snr(prediction_type):
    scheduler = objectives.make_noise_scheduler(prediction_type=prediction_type)
    abar = scheduler.alphas_cumprod
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)
    t = torch.tensor([0, 100, 500, 999])
    per_image = torch.stack([objectives.ddpm_loss(Echo(), x0[i : i + 1], noise[i : i + 1], t[i : i + 1], abar, prediction_type)
                             for i in range(4)])  # fmt: skip
    snr = abar[t] / (1 - abar[t])
    gamma = 5.0
    weight = {"epsilon": snr.clamp(max=gamma) / snr, "v_prediction": snr.clamp(max=gamma) / (snr + 1),
              "sample": snr.clamp(max=gamma)}[prediction_type]  # fmt: skip
    weighted = objectives.ddpm_loss(Echo(), x0, noise, t, abar, prediction_type, snr_gamma=gamma)
    torch.testing.assert_close(weighted, (per_image * weight).mean())
    assert weight.min() < 0.99 * weight.max()  # the weights differ: the check above could fail
    if prediction_type == "epsilon":  # gamma above every SNR: eps weights are all 1, the plain loss
        plain = objectives.ddpm_loss(Echo(), x0, noise, t, abar, prediction_type)
        torch.testing.assert_close(objectives.ddpm_loss(Echo(), x0, noise, t, abar, prediction_type, snr_gamma=1e9), plain)


def test_zero_terminal_snr_ends_in_pure_noise_and_trains_with_v_prediction():
    scheduler = objectives.make_noise_scheduler(prediction_type="v_prediction", zero_terminal_snr=True)
    assert scheduler.alphas_cumprod[-1] == 0 and objectives.make_noise_scheduler().alphas_cumprod[-1] > 0
    x0 = torch.randn(2, 3, 8, 8)
    loss = objectives.ddpm_loss(Echo(), x0, torch.randn_like(x0), torch.tensor([999, 999]), scheduler.alphas_cumprod,
                            "v_prediction", snr_gamma=5.0)  # fmt: skip
    assert torch.isfinite(loss)
    assert objectives.run_noise_scheduler(dict(num_train_timesteps=1000, beta_schedule="linear", prediction_type="v_prediction",
                                           zero_terminal_snr=True)).alphas_cumprod[-1] == 0  # fmt: skip


@pytest.mark.parametrize("zero_terminal_snr", [False, True])
def test_lognormal_timesteps_give_edms_noise_levels(zero_terminal_snr):
    scheduler = objectives.make_noise_scheduler(prediction_type="v_prediction", zero_terminal_snr=zero_terminal_snr)
    torch.manual_seed(0)
    drawn = {}
    for sampling in ("uniform", "lognormal"):
        objective = objectives.DDPMObjective(scheduler, timestep_sampling=sampling, P_mean=-0.5, P_std=0.8)
        t = objective.timesteps(50_000, "cpu")
        assert t.dtype == torch.long and 0 <= t.min() and t.max() <= 999
        abar = scheduler.alphas_cumprod[t].double()
        drawn[sampling] = (t, 0.5 * (torch.log1p(-abar) - abar.log()))
    t, log_sigma = drawn["lognormal"]
    assert abs(log_sigma.mean() - -0.5) < 0.03 and abs(log_sigma.std() - 0.8) < 0.03  # ln sigma_t ~ N(P_mean, P_std^2)
    t, _ = drawn["uniform"]
    assert abs(t.float().mean() - 499.5) < 5 and abs(t.float().std() - 288.7) < 5  # uniform, as before


def test_the_presets_ddpm_settings_fill_what_is_unset():
    from ddpm_train import config

    def settings(*flags):
        args = config.resolve(config.parse_args(["--objective", "ddpm", *flags]))  # the presets' DDPM (flow is the default)
        return (args.prediction_type, args.timestep_sampling, *args.P_mean_std, args.train_batch_size,
                args.num_epochs, args.ema != "none")  # fmt: skip

    assert settings() == ("v_prediction", "lognormal", -1.2, 1.2, 4, 12, False)  # the bare run: the small preset's
    assert settings("--model", "tiny", "--image_size", "16") == ("epsilon", "uniform", -1.2, 1.2, 16, 8, True)  # Ho et al.'s
    assert settings("--ema", "standard")[-1] is True and settings("--ema", "power")[-1] is True  # asking for an EMA keeps one
    assert settings("--train_batch_size", "32", "--num_epochs", "2")[4:6] == (32, 2)
    assert settings("--prediction_type", "epsilon", "--timestep_sampling", "uniform", "--P_mean_std", "-0.5,0.8")[:4] == (
        "epsilon", "uniform", -0.5, 0.8)  # typed flags win
    assert settings("--objective", "edm")[:2] == ("epsilon", "uniform")  # EDM ignores both; --timestep_sampling is refused
    # a class-conditional DDPM run predicts v where the preset says nothing (config.CONDITIONAL_FALLBACKS); typed flags win
    tiny_labelled = ("--model", "tiny", "--image_size", "16", "--class_conditional")
    assert settings(*tiny_labelled)[:2] == ("v_prediction", "uniform")
    assert settings(*tiny_labelled, "--prediction_type", "epsilon")[0] == "epsilon"
    assert settings(*tiny_labelled, "--objective", "edm")[0] == "epsilon"


@pytest.mark.parametrize("flags, message", [
    (["--objective", "ddpm", "--zero_terminal_snr", "--prediction_type", "epsilon"], "--zero_terminal_snr needs --prediction_type v_prediction"),
    (["--objective", "edm", "--timestep_sampling", "lognormal"], "--timestep_sampling is DDPM's"),
    (["--model", "edm2tiny", "--image_size", "16", "--snr_gamma", "5"], "are DDPM's"),
    (["--snr_gamma", "0"], "--snr_gamma must be a finite number greater than 0"),
])  # fmt: skip
def test_the_loss_weighting_flags_refuse_what_they_cannot_do(flags, message):
    from ddpm_train import config

    with pytest.raises(ConfigError, match=message):
        config.resolve(config.parse_args(flags))
