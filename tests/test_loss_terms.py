"""--loss_terms (loss_terms.py, issue 66): each term's value against its formula, where each applies and the
one-line refusals elsewhere, LayerSync's stop-gradient, the immiscible coupling's nearest draw, the terms
alike eager and compiled (whole and regional, Dynamo's eager backend as in test_block_outputs.py), and a
tiny train.py run that logs its term and keeps it on resume."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ddpm_train.perf import compiling
from ddpm_train import config
from ddpm_train.diffusion import loss_terms
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.training import resume as rules
from ddpm_train.errors import ConfigError
from test_train import TINY, run, scalars

PRESETS = ("tiny", "edm2tiny", "dit-tiny")  # one network of each family


def objective_for(network, kind="flow"):
    """The objective `kind` as builder.build makes it for the bare `network`."""
    if kind == "ddpm":
        return objectives.DDPMObjective(objectives.make_noise_scheduler())
    args = SimpleNamespace(objective=kind, P_mean_std=[-1.2, 1.2], sigma_data=0.5, loss_weighting="uncertainty",
                           timestep_sampling="lognormal")  # fmt: skip
    return objectives.of(kind).from_args(args, models.family_of(network).time_input, None)


def with_terms(preset, text, kind="flow"):
    """A fresh network of `preset` (16px) and its objective `kind` with --loss_terms `text` attached."""
    network = models.build_network(preset, 16)
    objective = loss_terms.attach(objective_for(network, kind), network, models.family(preset)[0], loss_terms.parse(text))
    return network, objective


def images(network, n=4):
    return torch.rand(n, network.config.in_channels, 16, 16) * 2 - 1


# --- the flag ----------------------------------------------------------------------------


def test_the_flag_reads_names_and_values_in_one_spelling():
    assert loss_terms.parse(None) == loss_terms.parse("none") == loss_terms.parse("") == {}
    assert loss_terms.parse("immiscible:16, dispersive:0.5") == {"dispersive": 0.5, "immiscible": 16}  # METHODS' order
    assert loss_terms.parse("dispersive,layersync,deltafm,immiscible") == dict(dispersive=0.25, layersync=0.2,
                                                                               deltafm=0.05, immiscible=4)  # fmt: skip
    assert loss_terms.parse("immiscible", latents=True) == dict(immiscible=64)  # the authors' k for latents
    assert loss_terms.spell(loss_terms.parse("deltafm:0.050,dispersive")) == "dispersive:0.25,deltafm:0.05"
    assert loss_terms.spell({}) == "none"


@pytest.mark.parametrize("text, says", [
    ("dispersve:0.25", "unknown term 'dispersve'"),
    ("dispersive:0", "dispersive takes a weight, a finite number greater than 0 (got '0')"),
    ("dispersive:-1", "greater than 0"),
    ("dispersive:x", "greater than 0 (got 'x')"),
    ("layersync:inf", "greater than 0"),
    ("immiscible:1", "immiscible takes a number of noise draws, a whole number of at least 2"),
    ("immiscible:2.5", "whole number"),
    ("dispersive,dispersive:0.5", "dispersive is given twice"),
])  # fmt: skip
def test_a_bad_value_is_refused_in_one_line(text, says):
    with pytest.raises(ConfigError) as refused:
        loss_terms.parse(text)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def resolved(*flags):
    return config.resolve(config.parse_args([*TINY, "--output_dir", "unused", *map(str, flags)]))


@pytest.mark.parametrize("flags, says", [
    (["--loss_terms", "layersync"], "layersync applies to dit networks, not a unet: it aligns"),
    (["--model", "edm2tiny", "--loss_terms", "layersync"], "not a edm2"),
    (["--objective", "ddpm", "--loss_terms", "deltafm"], "deltafm applies to --objective flow, not ddpm"),
    (["--model", "edm2tiny", "--loss_terms", "deltafm"], "not edm"),
    (["--loss_terms", "dispersive", "--train_batch_size", 1], "at --train_batch_size 1 there is nothing to compare"),
    (["--objective", "flow", "--loss_terms", "deltafm", "--train_batch_size", 1], "at --train_batch_size 1"),
])  # fmt: skip
def test_a_term_where_it_does_not_apply_is_refused_in_one_line(flags, says):
    with pytest.raises(ConfigError) as refused:
        resolved(*flags)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_where_each_term_applies_it_resolves_to_its_spelling():
    assert resolved().loss_terms == "none"
    assert resolved("--loss_terms", "immiscible:8,dispersive", "--objective", "ddpm").loss_terms == "dispersive:0.25,immiscible:8"
    assert resolved("--model", "edm2tiny", "--loss_terms", "dispersive,immiscible").loss_terms == "dispersive:0.25,immiscible:4"
    assert resolved("--model", "dit-tiny", "--loss_terms", "layersync,deltafm").loss_terms == "layersync:0.2,deltafm:0.05"
    assert resolved("--loss_terms", "dispersive", "--train_batch_size", 2).loss_terms == "dispersive:0.25"


# --- the family's blocks ---------------------------------------------------------------------


def test_each_family_names_its_middle_block_and_layersyncs_blocks_scaled_to_its_depth():
    family = lambda preset: models.family(preset)[0]  # noqa: E731
    names = lambda preset: models.block_names(models.build_network(preset, 32))  # noqa: E731
    assert family("small").middle_block(names("small")) == "mid_block.resnets.1"  # the mid-block's output
    assert family("edm2small").middle_block(names("edm2small")) == "dec.8x8_in1"
    dit = [f"transformer_blocks.{i}" for i in range(28)]
    assert family("dit-small").middle_block(dit) == "transformer_blocks.13"  # the 14th of 28
    sync = family("dit-small").sync_blocks
    assert sync(dit) == ("transformer_blocks.7", "transformer_blocks.15")  # SiT-XL's 8 and 16 of 28
    assert sync(dit[:12]) == ("transformer_blocks.2", "transformer_blocks.6")
    assert sync(dit[:6]) == ("transformer_blocks.1", "transformer_blocks.2")
    assert sync(dit[:2]) == ("transformer_blocks.0", "transformer_blocks.1")
    with pytest.raises(ConfigError, match="needs two blocks"):
        sync(dit[:1])
    assert family("small").sync_blocks is None and family("edm2small").sync_blocks is None


# --- each term against its formula ---------------------------------------------------------------


def test_dispersive_is_the_log_mean_over_all_pairs():
    assert loss_terms.dispersive(torch.ones(3, 2, 4, 4)).item() == pytest.approx(0.0, abs=1e-6)  # log 1
    far = torch.zeros(2, 8)
    far[1] = 2.0  # ‖z_0 - z_1‖² / D = 4
    assert loss_terms.dispersive(far).item() == pytest.approx(math.log((2 + 2 * math.exp(-4)) / 4), rel=1e-6)
    assert loss_terms.dispersive(far, tau=2.0).item() == pytest.approx(math.log((2 + 2 * math.exp(-2)) / 4), rel=1e-6)
    torch.manual_seed(0)
    z = torch.randn(5, 3, 4, 4, dtype=torch.float64)
    flat = z.flatten(1)
    pairs = [math.exp(-((flat[i] - flat[j]) ** 2).sum().item() / flat.shape[1]) for i in range(5) for j in range(5)]
    assert loss_terms.dispersive(z).item() == pytest.approx(math.log(sum(pairs) / 25), rel=1e-5)
    z = z.float().requires_grad_()
    same = z.detach()[:1].expand(3, -1, -1, -1).clone().requires_grad_()
    loss_terms.dispersive(same).backward()  # identical points: a gradient, not a NaN (pdist's square root)
    assert torch.isfinite(same.grad).all()


def test_dispersive_and_the_nearest_noise_keep_fp32_under_autocast():
    """bf16's matmul would round ‖z_i‖² + ‖z_j‖² - 2 z_i·z_j (and ‖n‖² - 2 n·x) far past the differences they measure."""
    same = torch.full((3, 2048), math.sqrt(2050 / 2048))  # ‖z‖² = 2050; bf16 rounds z_i·z_j to 2048: 4 apart
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert loss_terms.dispersive(same).item() == pytest.approx(0.0, abs=1e-5)
    torch.manual_seed(0)
    draws = torch.randn(2, 16, 2048)  # two draws for each of 16 images, each image almost halfway between them
    x0 = (draws[0] + draws[1]) / 2 + 1e-4 * (draws[0] - draws[1])  # nearer the first, by 0.8 in 4,000
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(objectives.nearest_noise(x0, 2), draws[0])


def test_layersync_is_the_mean_negative_cosine_and_no_gradient_reaches_the_deep_block():
    torch.manual_seed(0)
    shallow, deep = torch.randn(2, 5, 8, requires_grad=True), torch.randn(2, 5, 8, requires_grad=True)
    value = loss_terms.layersync(shallow, deep)
    expected = -(F.normalize(shallow, dim=-1) * F.normalize(deep, dim=-1)).sum(-1).mean()
    assert value.item() == pytest.approx(expected.item(), rel=1e-6)
    value.backward()
    assert shallow.grad.abs().sum() > 0 and deep.grad is None
    # in a DiT: the term's gradient reaches the shallow block and nothing past it
    network, objective = with_terms("dit-tiny", "layersync:0.2")
    terms = objective.terms(network, images(network))
    terms["layersync"].backward()
    shallow_block, deep_block = (dict(network.named_modules())[name] for name in objective.readers[0].names)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in shallow_block.parameters())
    shared = {id(p) for p in shallow_block.parameters()}  # the DiT's one timestep and class embedding (dit.py)
    deep_only = [p for p in deep_block.parameters() if id(p) not in shared]
    assert deep_only and all(p.grad is None or not p.grad.any() for p in deep_only)


def test_deltafm_is_the_flow_error_less_lambda_times_the_error_against_another_images_target():
    torch.manual_seed(0)
    x0, noise, sigma = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4), torch.rand(3)
    velocity = torch.randn(3, 2, 4, 4)
    net = lambda x, t, return_dict=False: (velocity,)  # noqa: E731
    terms = objectives.FlowObjective(contrast=0.05).terms_at(net, x0, sigma, noise)
    target = noise - x0
    assert terms["flow"].item() == pytest.approx(((velocity - target) ** 2).mean().item(), rel=1e-6)
    other = torch.stack([target[2], target[0], target[1]])  # each image's j: the one before it, the first's the last
    assert terms["deltafm"].item() == pytest.approx(-0.05 * ((velocity - other) ** 2).mean().item(), rel=1e-6)
    assert list(objectives.FlowObjective().terms_at(net, x0, sigma, noise)) == ["flow"]  # no contrast, no term


def test_immiscible_gives_each_image_the_nearest_of_its_draws():
    torch.manual_seed(0)
    draws = torch.randn(8, 3, 2, 4, 4)  # nearest_noise's draw of k = 8 for 3 images
    chosen = [5, 0, 7]
    x0 = torch.stack([draws[j, b] for b, j in enumerate(chosen)]) + 0.01  # each image next to one of its draws
    torch.manual_seed(0)
    assert torch.equal(objectives.nearest_noise(x0, 8), torch.stack([draws[j, b] for b, j in enumerate(chosen)]))
    x0 = torch.randn(3, 2, 4, 4)
    torch.manual_seed(0)
    picked = objectives.nearest_noise(x0, 8)
    distance = ((draws - x0) ** 2).flatten(2).sum(-1)  # [k, B]
    assert torch.equal(picked, draws[distance.argmin(0), torch.arange(3)])
    # on the device, no host sync: one graph, no break
    compiled = torch.compile(objectives.nearest_noise, backend="eager", fullgraph=True)
    assert compiled(x0, 8).shape == x0.shape


@pytest.mark.parametrize("kind", ["ddpm", "edm", "flow"])
def test_immiscible_is_the_noise_each_objective_trains_on(kind):
    network, objective = with_terms("tiny" if kind != "edm" else "edm2tiny", "immiscible:4", kind)
    assert objective.noise_draws == 4 and not objective.readers
    x0 = images(network)
    torch.manual_seed(3)
    expected = objectives.nearest_noise(x0.float(), 4)
    torch.manual_seed(3)
    assert torch.equal(objective.noise_like(x0.float()), expected)
    seen = []
    objective.noise_like = lambda x: seen.append(x) or expected  # what draw_terms asks for
    objective.terms(network, x0)
    assert len(seen) == 1


# --- the terms in the objective -----------------------------------------------------------------


@pytest.mark.parametrize("preset, kind, text, names", [
    ("tiny", "flow", "dispersive,deltafm,immiscible:4", ["flow", "deltafm", "dispersive"]),
    ("tiny", "ddpm", "dispersive", ["ddpm", "dispersive"]),
    ("edm2tiny", "edm", "dispersive:0.5", ["edm", "edm_logvar", "dispersive"]),
    ("edm2tiny", "flow", "dispersive,deltafm", ["flow", "deltafm", "dispersive"]),
    ("dit-tiny", "flow", "dispersive,layersync,deltafm", ["flow", "deltafm", "dispersive", "layersync"]),
])  # fmt: skip
def test_each_term_is_named_in_the_terms_and_sums_into_the_loss(preset, kind, text, names):
    network, objective = with_terms(preset, text, kind)
    x0 = images(network)
    torch.manual_seed(1)
    terms = objective.terms(network, x0)
    assert list(terms) == names and all(t.dtype == torch.float32 and t.ndim == 0 for t in terms.values())
    torch.manual_seed(1)
    assert objective.loss(network, x0).item() == pytest.approx(sum(t.item() for t in terms.values()), rel=1e-6)
    if "dispersive" in terms:  # the weight times the formula on the middle block's output, read once
        reader = objective.readers[0]
        kept = {}
        hook = dict(network.named_modules())[reader.names[0]].register_forward_hook(
            lambda module, args, output: kept.update(z=output[0] if isinstance(output, tuple) else output))
        torch.manual_seed(1)
        terms = objective.terms(network, x0)
        hook.remove()
        weight = loss_terms.parse(text)["dispersive"]
        assert terms["dispersive"].item() == pytest.approx(weight * loss_terms.dispersive(kept["z"]).item(), rel=1e-5)
        assert not reader.blocks.outputs


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_the_terms_are_alike_eager_and_compiled_whole_or_by_block(preset, monkeypatch):
    text = "dispersive,layersync,deltafm,immiscible:4" if preset == "dit-tiny" else "dispersive,deltafm,immiscible:4"
    torch.compiler.reset()
    real = torch.compile
    results = {}
    for scope in ("eager", "whole", "regional"):
        torch.manual_seed(0)
        network, objective = with_terms(preset, text)
        with monkeypatch.context() as m:
            m.setattr(torch, "compile", lambda fn, mode=None, dynamic=None: real(fn, backend="eager", dynamic=dynamic))
            net = {"eager": network, "whole": torch.compile(network), "regional": compiling.RegionalNetwork(network)}[scope]
            torch.manual_seed(1)
            terms = objective.terms(net, images(network))
        objectives.total_loss(terms).backward()
        first = next(p for p in network.parameters() if p.grad is not None)
        results[scope] = {name: term.item() for name, term in terms.items()}, first.grad.clone()
    for scope in ("whole", "regional"):
        assert results[scope][0] == pytest.approx(results["eager"][0], rel=1e-5), scope
        torch.testing.assert_close(results[scope][1], results["eager"][1], rtol=1e-4, atol=1e-6)


# --- through train.py ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_logs_its_term_and_a_resume_keeps_it_or_refuses_another(tmp_path, capsys):
    out = tmp_path / "run"
    steps = ["--max_train_steps", 2, "--logging_steps", 1, "--checkpointing_steps", 2, "--save_images_epochs", 100]
    config = run(out, "--loss_terms", "dispersive:0.25", *steps)
    assert config["loss_terms"] == "dispersive:0.25"
    final = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("final: "))
    record = json.loads((out / "run.json").read_text())
    terms = record["final_loss_terms"]
    assert list(terms) == ["ddpm", "dispersive"] and f"dispersive {terms['dispersive']:.4f}" in final
    assert math.isclose(sum(terms.values()), record["final_loss"], rel_tol=1e-5, abs_tol=1e-6)
    assert {"loss/ddpm", "loss/dispersive"} <= set(scalars(out))
    # a resume that names no terms keeps the run's; one that names others is refused, in one line
    again = run(out, *steps[:1], 3, *steps[2:])
    assert again["loss_terms"] == "dispersive:0.25"
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run(out, "--loss_terms", "none", *steps[:1], 4, *steps[2:])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--loss_terms 'dispersive:0.25' -> 'none'" in err, err


def test_a_checkpoint_of_before_the_flag_had_no_terms(tmp_path):
    """A run that recorded no loss_terms trained without any: resuming it with some is refused, without is not."""
    from test_resume import BASE, refusal, resume, write_checkpoint
    from test_resume import resolved as resume_config

    run_dir = tmp_path / "run"
    write_checkpoint(run_dir, {key: value for key, value in BASE.items() if key in rules.RUN_IDENTITY
                               and key != "loss_terms"})  # fmt: skip
    assert "--loss_terms 'none' -> 'dispersive:0.25'" in refusal(run_dir, resume_config("--loss_terms", "dispersive"))
    assert resume(run_dir, BASE) is not None


def test_a_bad_term_on_the_command_line_exits_2_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        run(tmp_path / "run", "--loss_terms", "dispersive:0.25,repa:1", "--max_train_steps", 1)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and len(err.strip().splitlines()) == 1 and "unknown term 'repa'" in err
    assert "Traceback" not in err
