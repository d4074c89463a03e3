import json
import math

import pytest
import torch

from ddpm_train.networks import model as models
from ddpm_train.errors import ConfigError
from ddpm_train.networks.edm2 import CONFIGS, EDM2UNet, MPConv, MPFourier, mp_cat, mp_silu, mp_sum

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: on a busy 2-core machine a second intra-op thread
    only waits (the file takes ~1 s of compute with one thread, 10x that with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# "Magnitude" is the paper's: the RMS, E[x^2]^(1/2) (SiLU's output has a mean).
TOL = 0.05


def mean_square(x):
    return x.double().square().mean().item()


def tiny(config, **overrides):
    torch.manual_seed(0)
    kwargs = dict(
        sample_size=16, channels=16, channel_mult=(1, 2), attention_levels=(1,), channels_per_head=8, dropout=0.1
    )
    return EDM2UNet(edm2_config=config, **{**kwargs, **overrides})


def row_norms(weight):
    return weight.detach().flatten(1).norm(dim=1)


# --- the magnitude-preserving pieces ------------------------------------------------


def test_mp_silu_keeps_unit_magnitude():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    assert mean_square(mp_silu(x)) == pytest.approx(1, rel=TOL)
    assert mean_square(torch.nn.functional.silu(x)) == pytest.approx(0.596**2, rel=TOL)  # what it corrects


@pytest.mark.parametrize("t", [0.3, 0.5])
def test_mp_sum_keeps_unit_magnitude(t):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(10_000, generator=g), torch.randn(10_000, generator=g)
    assert mean_square(mp_sum(a, b, t)) == pytest.approx(1, rel=TOL)
    assert mean_square(a + b) == pytest.approx(2, rel=TOL)


def test_mp_sum_takes_an_fp32_stream_and_a_bf16_branch():
    """Under CUDA autocast a block's residual is fp32 and its convolution's output bf16: the
    first eager forward (a sample grid) of an EDM2 run crashed in lerp (the first GPU run, BENCHMARKS.md)."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, generator=g), torch.randn(64, generator=g).bfloat16()
    out = mp_sum(a, b, 0.3)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, mp_sum(a, b.float(), 0.3))


@pytest.mark.parametrize("t", [0.3, 0.5])
def test_mp_cat_keeps_unit_magnitude_and_gives_b_its_share(t):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(100, 32, 2, 2, generator=g), torch.randn(100, 96, 2, 2, generator=g)  # 51,200 values
    y = mp_cat(a, b, t=t)
    assert y.shape == (100, 128, 2, 2)
    assert mean_square(y) == pytest.approx(1, rel=TOL)
    # b's share of the squared magnitude is t^2 / ((1-t)^2 + t^2), whatever the widths
    share = y[:, 32:].square().sum() / y.square().sum()
    assert share.item() == pytest.approx(t**2 / ((1 - t) ** 2 + t**2), rel=TOL)


@pytest.mark.parametrize("forced_weight_norm", [True, False])
@pytest.mark.parametrize("kernel", [(), (1, 1), (3, 3)])
def test_mp_conv_keeps_unit_variance(forced_weight_norm, kernel):
    torch.manual_seed(3)
    layer = MPConv(64, 32, kernel, forced_weight_norm)
    if kernel:
        x = torch.randn(16, 64, 10, 10)
        y = layer(x)[:, :, 1:-1, 1:-1]  # away from the zero padding
    else:
        x = torch.randn(10_000, 64)
        y = layer(x)
    assert y.var().item() == pytest.approx(1, rel=TOL)


def test_mp_conv_gain_scales_and_zero_gain_gives_zero():
    layer = MPConv(8, 4, (3, 3))
    x = torch.randn(2, 8, 6, 6)
    torch.testing.assert_close(layer(x, gain=2.5), 2.5 * layer(x))
    assert torch.count_nonzero(layer(x, gain=torch.zeros([]))) == 0


def test_mp_fourier_has_unit_magnitude():
    torch.manual_seed(4)
    c_noise = torch.randn(200) * 1.2 - 0.3  # ln(sigma)/4 for EDM's training sigmas, roughly
    assert mean_square(MPFourier(64, mp=True)(c_noise)) == pytest.approx(1, rel=TOL)  # 12,800 values
    assert mean_square(MPFourier(64, mp=False)(c_noise)) == pytest.approx(0.5, rel=TOL)


# --- forced weight normalisation ------------------------------------------------------


def test_forced_weight_norm_puts_rows_back_at_sqrt_fan_in_after_a_step():
    torch.manual_seed(5)
    layer = MPConv(8, 4, (3, 3), forced_weight_norm=True)
    fan_in = 8 * 3 * 3
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.3)
    x = torch.randn(4, 8, 6, 6)

    layer.train()
    layer(x).square().mean().backward()
    torch.testing.assert_close(row_norms(layer.weight), torch.full((4,), math.sqrt(fan_in)), rtol=1e-3, atol=0)
    optimizer.step()
    assert not torch.allclose(row_norms(layer.weight), torch.full((4,), math.sqrt(fan_in)), rtol=1e-2)

    layer(x)  # the training-mode forward pass re-normalises the stored weight
    torch.testing.assert_close(row_norms(layer.weight), torch.full((4,), math.sqrt(fan_in)), rtol=1e-3, atol=0)

    # an eval-mode forward pass leaves the stored weight alone
    layer(x).square().mean().backward()
    optimizer.step()
    before = layer.weight.detach().clone()
    layer.eval()
    layer(x)
    assert torch.equal(layer.weight, before)


@pytest.mark.parametrize("config", ["E", "G"])
def test_every_conv_and_linear_of_e_and_g_is_forced_back_after_a_step(config):
    net = tiny(config, dropout=0.0)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    x, t = torch.randn(2, 3, 16, 16), torch.randn(2)
    net(x, t).sample.square().mean().backward()
    optimizer.step()
    net(x, t)
    layers = [m for m in net.modules() if isinstance(m, MPConv)]
    assert len(layers) > 20
    for layer in layers:
        fan_in = layer.weight[0].numel()
        torch.testing.assert_close(
            row_norms(layer.weight), torch.full((layer.out_channels,), math.sqrt(fan_in)), rtol=1e-3, atol=0
        )


def test_config_c_weights_are_the_optimizers_alone():
    net = tiny("C", dropout=0.0)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    x, t = torch.randn(2, 3, 16, 16), torch.randn(2)
    net(x, t).sample.square().mean().backward()
    optimizer.step()
    after_step = {k: v.clone() for k, v in net.state_dict().items()}
    net(x, t)
    assert all(torch.equal(v, after_step[k]) for k, v in net.state_dict().items())


# --- the networks ----------------------------------------------------------------------


def test_configs_differ_only_in_their_switches():
    # C has every switch off (two embedding layers, no clipping); E and G add theirs
    assert not any(v for k, v in CONFIGS["C"].items() if k != "embedding_layers")
    assert {k for k in CONFIGS["E"] if CONFIGS["E"][k] != CONFIGS["C"][k]} == {"forced_weight_norm", "clip_act"}
    assert {k for k in CONFIGS["G"] if CONFIGS["G"][k] != CONFIGS["E"][k]} == {
        "pixel_norm",
        "mp_fixed_function",
        "zero_init_gains",
        "embedding_layers",
    }
    # an explicit switch overrides the config's, and the config records the result
    net = tiny("E", pixel_norm=True)
    assert net.config.pixel_norm is True and net.config.forced_weight_norm is True


@pytest.mark.parametrize("config", ["C", "E", "G"])
def test_each_config_runs_keeps_the_shape_and_backpropagates(config):
    net = tiny(config)
    x, t = torch.randn(2, 3, 16, 16), torch.randn(2)
    out = net(x, t)
    assert out.sample.shape == (2, 3, 16, 16)
    assert torch.isfinite(out.sample).all()
    out.sample.square().mean().backward()
    assert all(p.grad is not None for p in net.parameters())
    # return_dict=False gives a 1-tuple; a scalar or integer timestep is one c_noise for the batch
    net.eval()
    (y,) = net(x, torch.tensor(0.25), return_dict=False)
    torch.testing.assert_close(y, net(x, torch.full((2,), 0.25)).sample)
    torch.testing.assert_close(net(x, 0).sample, net(x, torch.zeros(2, dtype=torch.long)).sample)


@pytest.mark.parametrize("config", ["C", "E", "G"])
def test_no_biases_and_only_g_has_gains(config):
    net = tiny(config)
    names = [name for name, _ in net.named_parameters()]
    assert not [n for n in names if "bias" in n]
    scalars = [n for n, p in net.named_parameters() if p.ndim == 0]
    weights = [n for n, p in net.named_parameters() if p.ndim >= 2]
    assert len(scalars) + len(weights) == len(names)
    if config == "G":
        blocks = len(net.enc) - 1 + len(net.dec)
        assert sorted(scalars) == sorted(["out_gain"] + [n for n in names if n.endswith("emb_gain")])
        assert len(scalars) == blocks + 1
        assert all(p.item() == 0 for n, p in net.named_parameters() if p.ndim == 0)
    else:
        assert scalars == []


def test_g_output_starts_at_zero_and_c_e_do_not():
    x, t = torch.randn(2, 3, 16, 16), torch.randn(2)
    assert torch.count_nonzero(tiny("G")(x, t).sample) == 0
    assert tiny("C")(x, t).sample.abs().mean() > 0.05
    assert tiny("E")(x, t).sample.abs().mean() > 0.05
    g = tiny("G")
    with torch.no_grad():
        g.out_gain.fill_(1)
    assert g(x, t).sample.abs().mean() > 0.05


@pytest.mark.parametrize("config", ["C", "G"])
def test_save_pretrained_roundtrip_gives_identical_outputs(config, tmp_path):
    # C with G's pixel norm: an overridden switch must survive the roundtrip too
    net = tiny(config, **(dict(pixel_norm=True) if config == "C" else {}))
    with torch.no_grad():
        for p in net.parameters():
            if p.ndim == 0:
                p.fill_(0.7)  # G's gains away from zero, so the output shows the weights
    net.eval()
    x, t = torch.randn(2, 3, 16, 16), torch.randn(2)
    net.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["_class_name"] == "EDM2UNet"
    assert {k: saved[k] for k in CONFIGS["C"]} == {k: net.config[k] for k in CONFIGS["C"]}
    loaded = EDM2UNet.from_pretrained(tmp_path).eval()
    assert loaded.config.pixel_norm is True
    assert torch.equal(loaded(x, t).sample, net(x, t).sample)


def test_class_labels_as_integers_or_one_hot():
    net = tiny("G", num_classes=4).eval()
    with torch.no_grad():
        net.out_gain.fill_(1)
        for block in list(net.enc.values())[1:] + list(net.dec.values()):
            block.emb_gain.fill_(1)
    x, t, labels = torch.randn(2, 3, 16, 16), torch.randn(2), torch.tensor([0, 3])
    y = net(x, t, labels).sample
    torch.testing.assert_close(y, net(x, t, torch.nn.functional.one_hot(labels, 4).float()).sample)
    assert not torch.allclose(y, net(x, t, torch.tensor([1, 2])).sample)
    with pytest.raises(ValueError, match="class_labels"):
        net(x, t)


def test_gradient_checkpointing_gives_the_same_gradients():
    x, t = torch.randn(2, 3, 16, 16), torch.randn(2)
    grads = []
    for checkpointing in (False, True):
        net = tiny("E", dropout=0.0)
        if checkpointing:
            net.enable_gradient_checkpointing()
        calls = []
        for module in net.modules():
            module.register_forward_pre_hook(lambda *_: calls.append(1))
        output = net(x, t).sample
        forward = len(calls)
        output.square().mean().backward()
        assert (len(calls) > forward) == checkpointing, (forward, len(calls))  # checkpointed blocks run again
        grads.append([p.grad for p in net.parameters()])
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(plain, checkpointed)


# --- the presets -----------------------------------------------------------------------


def test_presets_have_the_seeds_cifar10_size():
    # FutureXiang/edm2 model/unet[CEG].py: 39,509,888 (C, E) and 39,542,685 (G)
    # parameters, plus our 128 for the learned weighting's u(sigma).
    counts = {}
    for name in ("edm2c", "edm2e", "edm2g"):
        net = models.build_network(name, 32, device="meta")
        assert isinstance(net, EDM2UNet)
        assert net.config.edm2_config == name[-1].upper()
        counts[name] = sum(p.numel() for p in net.parameters())
    assert counts == dict(edm2c=39_509_888, edm2e=39_509_888, edm2g=39_542_685)
    assert models.size_multiple("edm2g") == 8
    with pytest.raises(ConfigError, match="multiple of 8"):
        models.check_image_size("edm2c", 20)
    assert models.build_network("edm2e", 64, device="meta").config.sample_size == 64

