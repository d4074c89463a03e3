"""--objective flow: the objective's path, target and time, SD3's shift in training and sampling, the
flow samplers on an ODE they must solve exactly, the saved DDPMPipeline against sample.py, and the
refusals (DDPM's flags and samplers, a bad shift, a changed objective or σ draw on resume)."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from ddpm_train import config
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.diffusion import samplers
from ddpm_train.training import resume as rules
import sample
from ddpm_train.evaluation import sampling
from ddpm_train.errors import ConfigError
from test_resume import resolved, write_checkpoint
from test_train import TINY
from test_train import run as train


# --- the objective --------------------------------------------------------------------------


def test_the_loss_is_zero_for_the_true_velocity_at_t_1000_sigma():
    """The network is given x_σ = (1-σ) x0 + σ ε and t = 1000 σ, and trained toward v = ε - x0: a network
    that returns ε - x0 has loss 0, and one that returns another target (ε, or x0 - ε) does not."""
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)
    sigma = torch.tensor([0.1, 0.4, 0.7, 0.95])
    seen = []

    def network(target):
        def forward(x, t, return_dict=False):
            seen.append((x, t))
            return (target,)

        return forward

    objective = objectives.FlowObjective(shift=3.0)
    assert objective.loss_at(network(noise - x0), x0, sigma, noise).item() < 1e-10
    x, t = seen[0]
    s = sigma.view(-1, 1, 1, 1)
    assert torch.allclose(x, (1 - s) * x0 + s * noise, atol=1e-6) and torch.allclose(t, 1000 * sigma)
    for wrong in (noise, x0 - noise):
        assert objective.loss_at(network(wrong), x0, sigma, noise).item() > 0.1


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_sigma_is_logit_normal_then_shifted(shift):
    """logit(σ) ~ N(0, 1) has median 1/2; the shift moves it to s / (1 + s) (3 -> 0.75), as SD3's eq. 23."""
    torch.manual_seed(0)
    sigma = objectives.FlowObjective(shift=shift).sigmas(20000, "cpu")
    assert 0 < sigma.min() and sigma.max() < 1
    assert sigma.median().item() == pytest.approx(shift / (1 + shift), abs=0.01)
    uniform = objectives.FlowObjective(shift=1.0, timestep_sampling="uniform").sigmas(20000, "cpu")
    assert uniform.mean().item() == pytest.approx(0.5, abs=0.01) and uniform.std().item() == pytest.approx(12**-0.5, abs=0.01)


# --- the samplers ---------------------------------------------------------------------------


class PointVelocity(torch.nn.Module):
    """The exact velocity field of data that is one image c: v(x, σ) = (x - c) / σ. Its ODE paths are
    straight lines, so Euler and Heun land on c from any noise on any grid."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.config = dict(sample_size=c.shape[-1], in_channels=c.shape[0], _class_name="UNet2DModel")  # takes t
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x, t, return_dict=False):
        sigma = torch.as_tensor(t, dtype=torch.float32).reshape(-1)[:1] / 1000
        return ((x - self.c) / sigma.clamp(min=1e-6).view(-1, 1, 1, 1),)


@pytest.mark.parametrize("name", ["euler", "heun"])  # the ODE's (the SDE's: test_euler_maruyama_*)
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_the_flow_samplers_solve_a_straight_ode_exactly(name, shift):
    c = torch.linspace(-0.9, 0.9, 3 * 4 * 4).view(3, 4, 4)
    scheduler = samplers.make_flow_sampler(name, objectives.make_flow_scheduler(shift).config)
    images = sampling.generate(PointVelocity(c), scheduler, [0, 1], 5)
    assert (images.float() - sampling.to_pixels(c[None]).float()).abs().max() <= 1


def euler_maruyama_ends(c, seeds, steps, shift=1.0):
    """The float samples (before uint8) of SiT's Euler-Maruyama on PointVelocity(c), through sampling.generate."""
    ends = []
    scheduler = samplers.make_flow_sampler("euler_maruyama", objectives.make_flow_scheduler(shift).config)
    sampling.generate(PointVelocity(c), scheduler, seeds, steps, decode=lambda x: ends.append(x) or x)
    return ends[0]


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_euler_maruyama_lands_near_the_one_image_as_steps_grow(shift):
    """SiT's reverse SDE on one-image data: each step pulls x back onto the path and adds fresh noise, and
    the noise-free last step from σ_L (SiT's 0.04, shifted) to 0 ends at x0 - σ_L ε̂. So the error falls
    with the steps to σ_L times unit noise: 0.04 rms, 0.111 with shift 3. A wrong score, noise scale, time
    or grid misses that, and the end forgets the starting noise (the fresh noise replaced it)."""
    c = torch.linspace(-0.9, 0.9, 3 * 8 * 8).view(3, 8, 8)
    seeds = list(range(16))
    rms = {n: (euler_maruyama_ends(c, seeds, n, shift) - c).pow(2).mean().sqrt().item() for n in (3, 10, 200)}
    last = samplers.shift_sigmas(samplers.SDE_LAST_STEP_SIZE, shift)
    assert rms[3] > rms[10] > rms[200] and rms[200] == pytest.approx(last, rel=0.15), rms
    error = (euler_maruyama_ends(c, seeds, 200, shift) - c).flatten()
    start = torch.stack([torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(s)) for s in seeds]).flatten()
    assert abs(torch.corrcoef(torch.stack([error, start]))[0, 1].item()) < 0.2
    scheduler = samplers.make_flow_sampler("euler_maruyama", objectives.make_flow_scheduler(shift).config)
    scheduler.set_timesteps(5)  # SiT's grid 1, 0.76, 0.52, 0.28, 0.04, shifted as Euler's and training's σ
    grid = samplers.shift_sigmas(torch.tensor([1.0, 0.76, 0.52, 0.28, 0.04]), shift)
    assert torch.allclose(scheduler.timesteps, 1000 * grid) and scheduler.sigmas[-1] == 0


def test_euler_maruyama_draws_its_noise_from_the_seeds():
    """Same seeds, same images; other seeds, other images; image i's noise (the start and every step's)
    from its own seed, whatever else is in the batch."""
    c = torch.linspace(-0.9, 0.9, 3 * 4 * 4).view(3, 4, 4)
    scheduler = samplers.make_flow_sampler("euler_maruyama", objectives.make_flow_scheduler().config)
    images = sampling.generate(PointVelocity(c), scheduler, [0, 1, 2], 4)
    assert torch.equal(images, sampling.generate(PointVelocity(c), scheduler, [0, 1, 2], 4))
    assert not torch.equal(images, sampling.generate(PointVelocity(c), scheduler, [3, 4, 5], 4))
    split = [sampling.generate(PointVelocity(c), scheduler, part, 4) for part in ([0], [1, 2])]
    assert torch.equal(images, torch.cat(split))


# --- a run, its pipeline, its refusals -------------------------------------------------------


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("flow")
    train(out, "--objective", "flow:3", "--max_train_steps", 4, "--checkpointing_steps", 2)
    return out


def test_a_flow_pipeline_outside_its_run_samples_as_flow_and_guides_only_flow(flow_run, tmp_path, capsys):
    """A pipeline folder with no train_config.json (uploaded, or copied out of its run): its saved scheduler
    says flow, with the run's shift, so sample.py samples it with a flow sampler, and a DDPM run cannot be
    guided by it (nor it by a DDPM run)."""
    import shutil

    alone = tmp_path / "alone"
    alone.mkdir()
    for name in ("model_index.json", "scheduler", "unet"):
        (shutil.copytree if (flow_run / name).is_dir() else shutil.copyfile)(flow_run / name, alone / name)
    assert sample.RunDir(alone).config is None and sample.RunDir(alone).objective == "flow:3"
    result = sample.main(sample.parse_args([str(alone), "--num_images", "1", "--num_inference_steps", "2",
                                            "--output", str(tmp_path / "s")]))  # fmt: skip
    assert result["sampler"] == objectives.FlowObjective.default_sampler
    ddpm = tmp_path / "ddpm"
    train(ddpm, "--max_train_steps", 1, "--checkpointing_steps", 1)
    for model, guide in ((ddpm, alone), (alone, ddpm)):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            sample.main(sample.parse_args([str(model), "--num_images", "1", "--guide", str(guide), "--guidance_scale",
                                           "2", "--output", str(tmp_path / "g")]))  # fmt: skip
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and "does not match the model" in line, line


def test_a_flow_run_saves_a_pipeline_that_diffusers_samples_as_train_py_does(flow_run):
    """DDPMPipeline.from_pretrained(run) holds a FlowMatchEulerDiscreteScheduler with the run's shift,
    and from the same noise gives sample.py's Euler images: with a shift of 3 the two agree only if both
    use diffusers' grid (its set_timesteps shifts again: diffusers #13243)."""
    from diffusers import DDPMPipeline

    recorded = json.loads((flow_run / "train_config.json").read_text())
    assert recorded["objective"] == "flow:3" and recorded["flow_sigmas"] == "logit_normal(0,1)"
    pipeline = DDPMPipeline.from_pretrained(str(flow_run))
    assert type(pipeline.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and pipeline.scheduler.config.shift == 3
    seeds = [5, 6, 7]
    theirs = pipeline(batch_size=3, generator=[torch.Generator().manual_seed(s) for s in seeds], num_inference_steps=6,
                      output_type="np").images  # fmt: skip
    scheduler = samplers.make_flow_sampler("euler", pipeline.scheduler.config)
    ours = sampling.generate(pipeline.unet, scheduler, seeds, 6).permute(0, 2, 3, 1).numpy()
    assert np.abs(np.round(theirs * 255) - ours.astype(np.float64)).max() <= 1
    assert ours.std() > 5  # images, not a constant


def test_sample_py_samples_a_flow_run_with_each_flow_sampler(flow_run, tmp_path):
    def images(name, folder, *flags):
        sample.main(sample.parse_args([str(flow_run), "--num_images", "2", "--num_inference_steps", "3",
                                       "--sampler", name, "--output", str(tmp_path / folder), *flags]))  # fmt: skip
        return np.asarray(Image.open(tmp_path / folder / "000001.png"))

    first = [images(name, name) for name in objectives.FlowObjective.samplers]
    assert objectives.FlowObjective.samplers == ("euler", "heun", "euler_maruyama")
    assert all(not np.array_equal(a, b) for i, a in enumerate(first) for b in first[i + 1 :])  # each its own sampler
    assert np.array_equal(images("euler_maruyama", "again"), first[2])  # the SDE's noise: the seed's
    assert not np.array_equal(images("euler_maruyama", "seed1", "--seed", "1"), first[2])
    with pytest.raises(SystemExit) as stopped:
        sample.main(sample.parse_args([str(flow_run), "--num_images", "2", "--sampler", "ddim"]))
    assert stopped.value.code == 2


@pytest.mark.parametrize("name", objectives.FlowObjective.samplers)
def test_sample_py_refuses_a_flow_sampler_for_a_ddpm_run_in_one_line(tmp_path, capsys, name):
    from diffusers import DDPMPipeline

    DDPMPipeline(unet=models.build_network("tiny", 16), scheduler=objectives.make_noise_scheduler()).save_pretrained(tmp_path / "ddpm")
    with pytest.raises(SystemExit) as stopped:
        sample.main(sample.parse_args([str(tmp_path / "ddpm"), "--sampler", name, "--output", str(tmp_path / "out")]))
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and f"--sampler {name} samples a flow run" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_flow_run_resumed_with_another_shift_is_one_line_and_exit_2(flow_run, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        train(flow_run, "--objective", "flow", "--max_train_steps", 6, "--checkpointing_steps", 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and "--objective 'flow:3' -> 'flow'" in err[0], err


@pytest.mark.parametrize("before, after, words", [
    (["--objective", "flow"], ["--objective", "ddpm"], "--objective 'flow' -> 'ddpm'"),
    (["--objective", "flow"], ["--objective", "flow:2"], "--objective 'flow' -> 'flow:2'"),
    (["--objective", "flow"], ["--objective", "flow", "--timestep_sampling", "uniform"], "'logit_normal(0,1)' -> 'uniform'"),
    (["--objective", "flow"], ["--objective", "flow", "--P_mean_std", "-0.5,1"], "'logit_normal(0,1)' -> 'logit_normal(-0.5,1)'"),
])  # fmt: skip
def test_resume_refuses_a_changed_objective_shift_or_sigma_draw(tmp_path, before, after, words):
    write_checkpoint(tmp_path, rules.run_identity(resolved(*before)))
    with pytest.raises(ConfigError) as refused:
        rules.choose_start(tmp_path, resolved(*after), True, None, False)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_a_ddpm_run_may_still_change_its_noise_draw_on_resume(tmp_path):
    write_checkpoint(tmp_path, rules.run_identity(resolved()))
    assert rules.choose_start(tmp_path, resolved("--timestep_sampling", "lognormal"), True, None, False) is not None


@pytest.mark.parametrize("flags, says", [
    (["--objective", "flow", "--prediction_type", "v_prediction"], "--prediction_type is DDPM's"),
    (["--objective", "flow", "--beta_schedule", "linear"], "--beta_schedule is DDPM's"),
    (["--objective", "flow", "--snr_gamma", "5"], "--snr_gamma is DDPM's"),
    (["--objective", "flow", "--zero_terminal_snr"], "--zero_terminal_snr is DDPM's"),
    (["--objective", "flow", "--sampler", "dpmsolver"], "--sampler dpmsolver is DDPM's"),
    (["--objective", "ddpm", "--sampler", "euler"], "--sampler euler is a flow sampler"),
    (["--objective", "ddpm", "--sampler", "euler_maruyama"], "--sampler euler_maruyama is a flow sampler"),
    # flow by default on a dataset of the user's: DDPM's flags say how to ask for DDPM
    (["--dataset", "photos/", "--prediction_type", "v_prediction"],
     "--prediction_type is DDPM's; tiny trains flow matching unless told: add --objective ddpm"),
    (["--dataset", "photos/", "--sampler", "dpmsolver"], "--sampler dpmsolver is DDPM's; tiny trains flow matching unless told"),
    (["--objective", "edm", "--sampler", "euler_maruyama"], "--sampler euler_maruyama is a flow sampler"),
    (["--objective", "ddpm", "--model", "edm2tiny"], "trained with --objective edm or flow"),
    (["--objective", "flow:0"], "greater than 0"),
    (["--objective", "flow:-2"], "greater than 0"),
    (["--objective", "flow:x"], "greater than 0"),
    (["--objective", "ddpm:3"], "choose ddpm, edm, flow or flow:SHIFT"),
])  # fmt: skip
def test_bad_flow_flags_are_one_line_and_exit_2(tmp_path, capsys, flags, says):
    import train as trainer

    with pytest.raises(SystemExit) as stopped:
        trainer.main(trainer.parse_args([*TINY, "--output_dir", str(tmp_path), *flags]))
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "train_config.json").exists()


def test_the_shift_is_spelled_one_way():
    assert [objectives.canonical_objective(x) for x in ("flow", "flow:1", "flow:3.0", "flow:0.5")] == ["flow", "flow", "flow:3", "flow:0.5"]
    args = config.resolve(config.parse_args([*TINY, "--output_dir", "unused", "--objective", "flow:3.0"]))
    assert args.objective == "flow:3" and args.sampler == objectives.FlowObjective.default_sampler and args.prediction_type is None
    assert config.resolve(args) is args and args.objective == "flow:3"  # idempotent


def test_a_class_conditional_latent_flow_run_guides_evaluates_and_samples_by_class(tmp_path, monkeypatch, default_shape_scorer):
    """Flow on a VAE's latents with class labels, sampled with SiT's Euler-Maruyama (the SDE sampler, its noise
    from each image's seed; Euler has the other runs): the grids at two guidance scales, FID/KID on decoded
    images, sample.py by class name, and autoguidance through the same Guided path."""
    from ddpm_train.data import latents
    from test_latents import make_kl

    monkeypatch.setenv(latents.CACHE_ENV, str(tmp_path / "latent-cache"))
    out = tmp_path / "run"
    train(out, "--vae", make_kl(tmp_path / "kl"), "--objective", "flow:2", "--class_conditional", "--max_train_steps", 4,
          "--shapes_num_images", 16, "--train_batch_size", 4, "--guidance_scale", "1,2", "--eval_every_epochs", 1,
          "--eval_num_samples", 6, "--logger", "none", "--sampler", "euler_maruyama")  # fmt: skip
    (result,) = json.loads((out / "eval_results.json").read_text())
    assert [s["guidance_scale"] for s in result["scales"]] == [1.0, 2.0] and np.isfinite(result["fid"])
    assert result["sampler"] == "euler_maruyama" and list((out / "samples").glob("*.png"))

    def by_class(labels, folder, *flags):
        sample.main(sample.parse_args([str(out), "--num_images", "2", "--class_labels", labels, "--output",
                                       str(tmp_path / folder), "--num_inference_steps", "3",
                                       "--sampler", "euler_maruyama", *flags]))  # fmt: skip
        return np.asarray(Image.open(tmp_path / folder / "000000.png"))

    circle, square = by_class("circle", "c", "--guidance_scale", "2"), by_class("square", "s", "--guidance_scale", "2")
    assert circle.shape == (16, 16, 3) and not np.array_equal(circle, square)
    # autoguidance by the run itself is the run alone: D_guide + w (D - D_guide) = D
    assert np.array_equal(by_class("circle", "g", "--guide", str(out), "--guidance_scale", "2"), by_class("circle", "u"))


def test_the_output_folder_is_a_model_repository_with_a_card(flow_run):
    """README.md is a model card ModelCard reads: diffusers' metadata, the objective, the FLOPs, a grid
    that is there, and the lines that load the pipeline."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(flow_run / "README.md")
    assert card.data.library_name == "diffusers" and card.data.pipeline_tag == "unconditional-image-generation"
    assert "flow-matching" in card.data.tags and "SD3's timestep shift 3" in card.text
    recorded = json.loads((flow_run / "train_config.json").read_text())
    assert f"{recorded['model_flops_per_step'] / 1e12:.4g} TFLOP per step" in card.text
    grid = card.text.split("![samples after training](")[1].split(")")[0]
    assert (flow_run / grid).is_file() and "DDPMPipeline.from_pretrained" in card.text and "hf upload" in card.text


def test_an_edm2_network_trains_with_flow_on_its_own_noise_conditioning(tmp_path, capsys):
    """EDM2's networks take c_noise = logit(σ)/4 from a flow run (σ_EDM = σ / (1 - σ) on the flow path), also
    at σ = 1, the sampler's first step; the run saves unet/ (no diffusers pipeline samples an EDM2 network),
    which sample.py samples with the flow sampler, and the grids come out finite."""
    from ddpm_train.networks.edm2 import EDM2UNet

    sigma = torch.tensor([0.0, 0.5, 1 - 1 / 81, 1.0])
    network = models.build_network("edm2tiny", 16)
    assert isinstance(network, EDM2UNet)
    assert models.family_of(network).time_input == "c_noise"
    c_noise = objectives.flow_timestep(sigma, c_noise=True)
    assert torch.isfinite(c_noise).all() and c_noise[1] == 0 and c_noise[2].item() == pytest.approx(np.log(80) / 4)
    out = tmp_path / "run"
    train(out, "--model", "edm2tiny", "--objective", "flow", "--max_train_steps", 4, "--save_images_epochs", 1)
    assert (out / "unet" / "config.json").is_file() and not (out / "model_index.json").exists()
    assert "DDPMPipeline" not in (out / "README.md").read_text()  # the card offers no pipeline that is not there
    grids = sorted((out / "samples").glob("*.png"))
    assert grids and all(np.asarray(Image.open(g)).std() > 0 for g in grids)  # not one colour, as NaN samples give
    result = sample.main(sample.parse_args([str(out), "--num_images", "2", "--num_inference_steps", "3",
                                            "--output", str(tmp_path / "s")]))  # fmt: skip
    image = np.asarray(Image.open(tmp_path / "s" / "000000.png"))
    assert result["num_images"] == 2 and image.std() > 0


def test_a_flow_run_with_the_power_ema_reconstructs_a_flow_pipeline(tmp_path):
    """ema.py reconstruct of a flow run saves the flow pipeline: FlowMatchEulerDiscreteScheduler with the run's shift."""
    from ddpm_train.training import ema
    from diffusers import DDPMPipeline

    out = tmp_path / "run"
    train(out, "--objective", "flow:2", "--ema", "power", "--ema_snapshot_every", 2, "--max_train_steps", 4)
    folder = ema.main(ema.parse_args(["reconstruct", str(out), "--std", "0.07"]))
    scheduler = DDPMPipeline.from_pretrained(str(folder)).scheduler
    assert type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and scheduler.config.shift == 2


# Run by each rank instead of train.py (test_faults.start_two_ranks' `script`): each flow loss records the σ it
# drew, a checksum of the images it was given and of the network's weights as they were, and each save of the
# network records the rank that made it, one JSON line per event in RECORD/rank<R>.jsonl.
RECORD_EACH_RANK = """
import json, os, sys
sys.path.insert(0, {root!r})
import torch
from ddpm_train.networks import model
from ddpm_train.diffusion import objectives
from ddpm_train.training import rundir
import train
log = open(os.path.join({record!r}, "rank" + os.environ["RANK"] + ".jsonl"), "a", buffering=1)
sigmas, loss_at, save_network = objectives.FlowObjective.sigmas, objectives.FlowObjective.loss_at, rundir.save_network
def drawn(self, n, device):
    sigma = sigmas(self, n, device)
    log.write(json.dumps(dict(sigma=sigma.tolist())) + "\\n")
    return sigma
def loss(self, net, x0, sigma, noise):
    called = getattr(net, "func", net)  # a conditional run's partial (step.TrainStep): the network it calls
    weights = sum(p.double().sum().item() for p in called.parameters())  # DDP's wrapper: the same parameters
    log.write(json.dumps(dict(images=x0.double().sum().item(), weights=weights)) + "\\n")
    return loss_at(self, net, x0, sigma, noise)
def saved(*args, **kwargs):
    log.write(json.dumps(dict(saved=True)) + "\\n")
    return save_network(*args, **kwargs)
objectives.FlowObjective.sigmas, objectives.FlowObjective.loss_at, rundir.save_network = drawn, loss, saved
train.main(train.parse_args(sys.argv[1:]))
"""


def two_flow_ranks(tmp_path, argv):
    """Two ranks of train.py `argv` (test_faults.start_two_ranks), each recorded by RECORD_EACH_RANK: their
    Ranks and, per rank, the events in order."""
    from conftest import ROOT
    from test_faults import Ranks, start_two_ranks

    record = tmp_path / "record"
    record.mkdir()
    ranks = Ranks(start_two_ranks(argv, RECORD_EACH_RANK.format(root=str(ROOT), record=str(record))))
    events = [[json.loads(line) for line in (record / f"rank{r}.jsonl").read_text().splitlines()] if
              (record / f"rank{r}.jsonl").exists() else [] for r in (0, 1)]  # fmt: skip
    return ranks, events


def assert_trained_as_one(events, steps):
    """Each rank drew its own σ and had its own images at every step, while the weights each step starts from
    are the same in both (the gradients averaged: unaveraged, each rank's own would part them after the first
    step that moves them; the learning rate's warm-up starts at 0), and they moved; rank 0 alone saved the network
    (once, at the end)."""
    per_rank = [[[e[k] for e in rank if k in e] for k in ("sigma", "images", "weights")] for rank in events]
    (sigma0, images0, weights0), (sigma1, images1, weights1) = per_rank
    assert len(sigma0) == len(sigma1) == len(weights0) == len(weights1) == steps, events
    assert all(a != b for a, b in zip(sigma0, sigma1)) and all(a != b for a, b in zip(images0, images1)), events
    assert weights0 == weights1 and weights0[-1] != weights0[0], (weights0, weights1)
    assert sum("saved" in e for e in events[0]) == 1 and not any("saved" in e for e in events[1]), events


@pytest.mark.slow
def test_two_processes_train_a_flow_run_as_one_and_save_its_pipeline_once(tmp_path):
    """Two gloo processes: the flow objective draws each process's own σ and noise, the step averages the
    gradients, and rank 0 alone writes the flow pipeline."""
    out = tmp_path / "run"
    ranks, events = two_flow_ranks(tmp_path, [*TINY, "--objective", "flow:2", "--max_train_steps", 3, "--output_dir",
                                              out, "--save_images_epochs", 100, "--logger", "none"])  # fmt: skip
    assert ranks.codes == [0, 0], ranks
    assert_trained_as_one(events, steps=3)
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["num_processes"] == 2 and saved["objective"] == "flow:2"
    scheduler = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "FlowMatchEulerDiscreteScheduler" and scheduler["shift"] == 2
