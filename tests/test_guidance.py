"""Classifier-free guidance and autoguidance (sampling.Guided), label dropout, class labels for sampling.

The combination is checked on a Gaussian toy whose exact denoisers are known:
data x0 ~ N(mu_c, s^2 I) for class c (and N(mu_null, s_null^2 I) for the null
label), whose EDM denoiser is D(x; sigma) = mu + s^2 / (s^2 + sigma^2) (x - mu).
"""

import json
import math
from pathlib import Path

import pytest
import torch

from ddpm_train.data import autoencoder

from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.diffusion import samplers
import sample
from ddpm_train.evaluation import sampling
from test_edm_train import same
from ddpm_train.errors import ConfigError


class GaussianDenoiser(torch.nn.Module):
    """An 'EDM network' F whose preconditioned denoiser c_skip x + c_out F is the exact
    denoiser of Gaussian data: per class `means[c]` and std `stds[c]` (the last entry
    is the null label's). Unconditional (no labels) with one entry."""

    def __init__(self, means, stds, size=4):
        super().__init__()
        self.register_buffer("means", torch.tensor(means, dtype=torch.float64))
        self.register_buffer("stds", torch.tensor(stds, dtype=torch.float64))
        classes = len(means) - 1
        self.config = dict(in_channels=1, sample_size=size, num_classes=classes, _class_name="EDM2UNet")  # takes c_noise

    def exact(self, x, sigma, labels=None):
        index = torch.zeros(len(x), dtype=torch.long) if labels is None else labels
        mu, s = self.means[index].view(-1, 1, 1, 1), self.stds[index].view(-1, 1, 1, 1)
        sigma = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1, 1, 1, 1)
        return mu + s**2 / (s**2 + sigma**2) * (x.double() - mu)

    def forward(self, x_in, c_noise, class_labels=None, return_dict=False):
        sigma = (4 * torch.as_tensor(c_noise, dtype=torch.float64)).exp().reshape(-1, 1, 1, 1).expand(len(x_in), 1, 1, 1)
        sd = objectives.SIGMA_DATA
        c_in = 1 / (sigma**2 + sd**2).sqrt()
        x = x_in.double() / c_in
        c_skip, c_out = sd**2 / (sigma**2 + sd**2), sigma * sd / (sigma**2 + sd**2).sqrt()
        return (((self.exact(x, sigma, class_labels) - c_skip * x) / c_out).float(),)


def denoise(net, x, sigma):
    return samplers.edm_precondition(net, x, sigma).double()


@pytest.mark.parametrize("w", [0.0, 1.0, 2.5])
def test_classifier_free_guidance_combines_the_exact_denoisers(w):
    net = GaussianDenoiser(means=[-0.5, 0.7, 0.1], stds=[0.3, 0.4, 0.6])  # classes 0, 1; null 2
    x, sigma = torch.randn(6, 1, 4, 4), 1.3
    labels = torch.tensor([0, 1, 0, 1, 1, 0])
    guided = sampling.guided_network(net, labels, w)
    cond, uncond = net.exact(x, sigma, labels), net.exact(x, sigma, torch.full_like(labels, 2))
    torch.testing.assert_close(denoise(guided, x, sigma), uncond + w * (cond - uncond), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("w", [0.0, 1.0, 2.0])
def test_autoguidance_combines_the_exact_denoisers(w):
    main = GaussianDenoiser(means=[0.2], stds=[0.5])
    guide = GaussianDenoiser(means=[0.0], stds=[0.9])  # a worse model: too wide, off-centre
    x, sigma = torch.randn(5, 1, 4, 4), 0.7
    guided = sampling.guided_network(main, None, w, guide)
    expected = main.exact(x, sigma) * w + guide.exact(x, sigma) * (1 - w)
    torch.testing.assert_close(denoise(guided, x, sigma), expected, atol=1e-5, rtol=1e-5)


def test_autoguidance_pulls_samples_away_from_the_guide():
    """Sampled with EDM's Heun sampler, w = 1 reproduces the main model's spread; guided away from a
    wider guide (w = 2) the samples come out narrower, as autoguidance sharpens."""
    main, guide = GaussianDenoiser([0.0], [0.5], size=16), GaussianDenoiser([0.0], [1.0], size=16)
    seeds = list(range(8))
    spread = {}
    for w in (1.0, 2.0):
        images = sampling.generate(main, samplers.EDMHeunSampler(), seeds, 32, guidance_scale=w, guide=guide)
        spread[w] = (images.float() / 127.5 - 1).std().item()
    assert abs(spread[1.0] - 0.5) < 0.05, spread
    assert spread[2.0] < spread[1.0] - 0.05, spread


def tiny_conditional_unet(num_classes=3):
    torch.manual_seed(0)
    return models.build_network("tiny", 16, num_classes=num_classes).eval()


def test_ddpm_guidance_one_is_the_conditional_model_and_zero_the_unconditional():
    unet, seeds = tiny_conditional_unet(), [1, 2, 3, 4]
    labels = torch.tensor([0, 1, 2, 0])
    null = torch.full_like(labels, models.null_label(3))
    scheduler = samplers.make_scheduler("ddim", objectives.make_noise_scheduler().config)

    def run(labels, w):
        return sampling.generate(unet, scheduler, seeds, 4, labels=labels, guidance_scale=w)

    conditional, unconditional = run(labels, 1.0), run(null, 1.0)
    assert torch.equal(run(labels, 0.0), unconditional)
    assert not torch.equal(conditional, unconditional)  # the labels reach the network
    assert not torch.equal(run(labels, 3.0), conditional)


def test_the_null_label_of_an_edm2_network_is_the_all_zero_one_hot():
    torch.manual_seed(0)
    net = models.build_network("edm2tiny", 16, num_classes=3).eval()
    x, c_noise = torch.randn(2, 3, 16, 16), torch.zeros(2)
    with torch.no_grad():
        by_index = net(x, c_noise, class_labels=torch.tensor([3, 1]), return_dict=False)[0]
        by_vector = net(x, c_noise, class_labels=torch.tensor([[0.0, 0, 0], [0, 1, 0]]), return_dict=False)[0]
    torch.testing.assert_close(by_index, by_vector)
    assert models.num_classes_of(net) == 3 and models.num_classes_of(tiny_conditional_unet(4)) == 4


def test_label_dropout_replaces_labels_by_the_null_label_at_its_rate():
    from ddpm_train.training import step as steps

    labels = torch.randint(0, 5, (200_000,))
    for p in (0.0, 0.1, 0.5):
        trainer = steps.TrainStep.__new__(steps.TrainStep)
        trainer.label_dropout, trainer.null_label = p, 5
        dropped = trainer.drop_labels(labels)
        rate = (dropped == 5).float().mean().item()
        assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / len(labels)) + 1e-9, (p, rate)
        assert torch.equal(dropped[dropped != 5], labels[dropped != 5])


def test_class_labels_by_name_number_spread_and_as_in_the_data():
    config = dict(class_names=["circle", "square", "triangle"], class_counts=[10, 0, 30])
    by_name = sample.class_labels_for("triangle,0", config, 3, 5, seed=0, as_in_data=False)
    assert by_name.tolist() == [2, 0, 2, 0, 2]
    assert sample.class_labels_for(None, config, 3, 6, 0, as_in_data=False).tolist() == [0, 0, 1, 1, 2, 2]
    drawn = sample.class_labels_for(None, config, 3, 400, 0, as_in_data=True)
    assert 1 not in drawn.tolist() and 0.65 < (drawn == 2).float().mean() < 0.85
    with pytest.raises(ConfigError, match="no class 'hexagon'"):
        sample.class_labels_for("hexagon", config, 3, 4, 0, False)
    with pytest.raises(ConfigError, match="has an empty entry"):  # a typo, not a class left out quietly
        sample.class_labels_for("0,,1", config, 3, 4, 0, False)
    with pytest.raises(ConfigError, match="class-conditional"):
        sample.class_labels_for("0", {}, 0, 4, 0, False)
    assert sampling.grid_labels(3, 16).tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [0] * 4  # one row per class


def test_a_guide_must_match_the_run():
    main = dict(objective="ddpm", image_size=32, class_names=None, prediction_type="epsilon", beta_schedule="linear",
                num_train_timesteps=1000, zero_terminal_snr=False)  # fmt: skip
    sampling.check_guide(main, dict(main))
    for key, value in dict(image_size=16, objective="edm", prediction_type="v_prediction", class_names=["a", "b"]).items():
        with pytest.raises(ConfigError, match=key.replace("_", " ")):
            sampling.check_guide(main, main | {key: value})


def test_a_guide_must_be_of_the_same_latent_space_however_its_vae_is_spelled():
    """The rule resume applies (autoencoder.latent_space): the encoder's weights and the normalisation, not --vae's text;
    a run of before latent_space says it through its latents record."""
    norm = dict(kind="vae", scaling_factor=0.18215, shift_factor=None, shift=[0.0] * 4, scale=[0.18215] * 4)
    record = dict(vae="/a/vae", encoder_sha256="ab" * 32, normalization=norm)
    main = dict(objective="edm", image_size=32, class_names=None, vae="/a/vae",
                latent_space=autoencoder.latent_space(record["encoder_sha256"], norm), latents=record)  # fmt: skip
    sampling.check_guide(main, main | dict(vae="../a/vae,vae", latents=record | dict(vae="/b/vae")))  # spelled otherwise
    sampling.check_guide(main, {k: v for k, v in main.items() if k != "latent_space"})  # an older run's record says it
    other_weights = main | dict(latent_space=autoencoder.latent_space("cd" * 32, norm))
    with pytest.raises(ConfigError, match=r"another latent space \(--vae: another VAE \(its encoder's weights"):
        sampling.check_guide(main, other_weights)
    with pytest.raises(ConfigError, match="another latent space .the latents' normalisation"):
        sampling.check_guide(main, main | dict(latent_space=autoencoder.latent_space("ab" * 32, dict(kind="dataset"))))
    with pytest.raises(ConfigError, match=r"\(--vae: pixels -> latents\)"):
        sampling.check_guide(main, dict(main, latent_space=None, latents=None))


# --- a conditional run through train.py and sample.py -------------------------------------------

TINY_RUN = [
    "--model", "tiny", "--image_size", "16", "--shapes_num_images", "48", "--train_batch_size", "8",
    "--num_inference_steps", "3", "--eval_batch_size", "9", "--lr_warmup_steps", "2",
    "--dataloader_num_workers", "0", "--class_conditional",
    "--max_train_steps", "8", "--checkpointing_steps", "4", "--save_images_epochs", "100",
]  # fmt: skip


def conditional_run(output_dir, *flags):
    import train

    args = train.parse_args([*TINY_RUN, "--output_dir", str(output_dir), *map(str, flags)])
    args.timing_warmup_steps = 1  # a config.SETTINGS (train.py: 5): runs this short leave only their first step out
    return train.main(args)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["ddpm", "edm"])
def test_a_conditional_run_trains_resumes_bit_identically_and_samples_by_class_name(tmp_path, objective, request, capsys):
    import shutil

    from safetensors.torch import load_file

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ema = ["--ema", "power", "--ema_snapshot_every", "4"] if objective == "ddpm" else []  # post-hoc EMA too
    scales = [2]  # the grids' guidance scale
    if objective == "ddpm":  # evaluated at two guidance scales: one table, the best picks best/
        request.getfixturevalue("default_shape_scorer")  # scored by the tests' shape scorer
        ema += ["--eval_every_epochs", "1", "--eval_num_samples", "6"]
        scales = [2, 1]  # the grids take the first, evaluation scores each
    guidance = ["--guidance_scale", ",".join(map(str, scales))]
    config = conditional_run(straight, "--objective", objective, *guidance, *ema)
    assert config["class_names"] == ["circle", "square", "triangle"] and sum(config["class_counts"]) == 48
    if objective == "ddpm":
        evals = json.loads((straight / "eval_results.json").read_text())
        for e in evals:
            assert [s["guidance_scale"] for s in e["scales"]] == [2.0, 1.0]
            assert e["fid"] == min(s["fid"] for s in e["scales"]) and "class_match" in e
            assert e["guidance_scale"] == min(e["scales"], key=lambda s: s["fid"])["guidance_scale"]
        assert json.loads((straight / "best" / "eval.json").read_text())["fid"] == min(e["fid"] for e in evals)
        assert evals[0]["scales"][0]["fid"] != evals[0]["scales"][1]["fid"]  # the scales did sample differently
    assert config["params"] == sum(p.numel() for p in models.build_network("tiny", 16, num_classes=3).parameters())
    grid = sorted((straight / "samples").glob("*.png"))
    assert grid, "no per-class grid written"

    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "checkpoint-4", resumed / "checkpoints" / "checkpoint-4")
    capsys.readouterr()
    conditional_run(resumed, "--objective", objective, *guidance, *ema)  # --resume (the default): the newest
    assert "checkpoint-4 at step 4" in capsys.readouterr().out  # "resumed from .../checkpoint-4 at step 4"
    a = load_file(str(straight / "checkpoints" / "checkpoint-8" / "model.safetensors"))
    b = load_file(str(resumed / "checkpoints" / "checkpoint-8" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any("class_embedding" in k or "emb_label" in k for k in a)  # the labels reach the network
    pickles = sorted(p.name for p in (straight / "checkpoints" / "checkpoint-8").glob("custom_checkpoint_*.pkl"))
    for name in pickles:  # the LR schedule, the EMA (power: its two averages), EDM's u(sigma)
        assert same(*(torch.load(run / "checkpoints" / "checkpoint-8" / name, weights_only=False)
                      for run in (straight, resumed))), name  # fmt: skip
    saved = [load_file(str(run / "unet" / "diffusion_pytorch_model.safetensors")) for run in (straight, resumed)]
    assert same(*saved) and saved[0]  # the saved network: the EMA's weights, which the grids and sample.py use

    out = tmp_path / "gen"
    args = [str(straight), "--num_images", "4", "--num_inference_steps", "2", "--class_labels", "square,triangle",
            "--guidance_scale", "3", "--output", str(out)]  # fmt: skip
    result = sample.main(sample.parse_args(args))
    assert result["guidance_scale"] == 3.0 and (out / "000003.png").is_file()
    # by name or by number: the same images
    again = tmp_path / "again"
    args[args.index("square,triangle")] = "1,2"
    sample.main(sample.parse_args([*args[:-1], str(again)]))
    assert (out / "000003.png").read_bytes() == (again / "000003.png").read_bytes()
    # autoguidance through sample.py: the resumed run (the same classes) guides the straight one
    guided = sample.main(sample.parse_args([str(straight), "--num_images", "2", "--num_inference_steps", "2",
                                            "--guide", str(resumed), "--guidance_scale", "2",
                                            "--output", str(tmp_path / "auto")]))  # fmt: skip
    assert guided["guide"] == str(resumed) and (tmp_path / "auto" / "000001.png").is_file()
    sample.main(sample.parse_args([str(straight), "--num_images", "2", "--num_inference_steps", "2",
                                   "--guidance_scale", "1", "--output", str(tmp_path / "unguided")]))  # fmt: skip
    # The resumed run's weights are the straight run's, so that guide changes nothing; the run's own
    # earlier checkpoint (the README's recipe) is a weaker model, and guiding by it changes the images.
    early = straight / "checkpoints" / "checkpoint-4"
    sample.main(sample.parse_args([str(straight), "--num_images", "2", "--num_inference_steps", "2", "--guide", str(early),
                                   "--guidance_scale", "2", "--output", str(tmp_path / "early")]))  # fmt: skip
    assert (tmp_path / "early" / "000001.png").read_bytes() != (tmp_path / "auto" / "000001.png").read_bytes()
    assert (tmp_path / "unguided" / "000001.png").read_bytes() == (tmp_path / "auto" / "000001.png").read_bytes()
    if ema:  # a post-hoc EMA of a conditional run samples by class too
        from ddpm_train.training import ema as posthoc_ema

        rebuilt = posthoc_ema.main(posthoc_ema.parse_args(["reconstruct", str(straight), "--std", "0.08"]))
        for kind in ("circle", "square"):
            sample.main(sample.parse_args([str(rebuilt), "--num_images", "1", "--num_inference_steps", "2",
                                           "--class_labels", kind, "--output", str(tmp_path / kind)]))  # fmt: skip
        assert (tmp_path / "circle" / "000000.png").read_bytes() != (tmp_path / "square" / "000000.png").read_bytes()


def test_a_conditional_run_on_data_without_labels_is_one_line(tmp_path, capsys):
    from PIL import Image

    folder = tmp_path / "flat"
    folder.mkdir()
    for i in range(8):
        Image.new("RGB", (16, 16), (30 * i, 0, 0)).save(folder / f"{i}.png")
    with pytest.raises(SystemExit) as stop:
        conditional_run(tmp_path / "run", "--dataset", str(folder))
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "ImageFolder" in err[0] and "ClassLabel" in err[0]


def test_guidance_without_labels_or_a_guide_is_one_line(tmp_path, capsys):
    import train

    with pytest.raises(SystemExit):
        train.main(train.parse_args(["--guidance_scale", "2", "--dry_run"]))
    assert "--guidance_scale guides a --class_conditional or --text_encoder run" in capsys.readouterr().err
    for bad in ("1,x", "-1", ",", "2,-1"):
        with pytest.raises(SystemExit):
            train.main(train.parse_args(["--class_conditional", "--guidance_scale", bad, "--dry_run"]))
        assert "--guidance_scale takes numbers of at least 0" in capsys.readouterr().err


def test_a_guide_leaves_the_trained_network_as_it_was(tmp_path):
    """--guide changes the grids and the evaluation only: loading it (a checkpoint's network is built, drawing
    random numbers) must not move the run's random stream, so the same --seed trains the same weights."""
    from safetensors.torch import load_file

    short = ["--max_train_steps", "2", "--checkpointing_steps", "2"]
    conditional_run(tmp_path / "guide", *short)
    conditional_run(tmp_path / "alone", *short)
    conditional_run(tmp_path / "guided", *short, "--guide", str(tmp_path / "guide" / "checkpoints" / "checkpoint-2"),
                    "--guidance_scale", "2")  # fmt: skip
    alone, guided = (load_file(str(tmp_path / r / "checkpoints" / "checkpoint-2" / "model.safetensors")) for r in ("alone", "guided"))
    assert alone.keys() == guided.keys() and all(torch.equal(alone[k], guided[k]) for k in alone)


def test_class_match_has_a_baseline_of_samples_blind_to_their_labels():
    from ddpm_train.evaluation import metrics

    kinds, labels = torch.tensor([0, 0, 1, -1]), torch.tensor([0, 1, 1, 2])  # -1: no single kind recognised
    assert metrics.chance_match(kinds, labels) == pytest.approx(0.25 * 0.5 + 0.5 * 0.25)
    labels = torch.arange(300) % 3
    assert metrics.chance_match(labels, labels) == pytest.approx(1 / 3)  # a perfect match, against a third by chance
    assert metrics.chance_match(labels[torch.randperm(300)], labels) == pytest.approx(1 / 3)


# A conditional model that has learned the shapes' kinds takes minutes of training, past this
# suite's budget, so the test samples a model that train.py trained once and the repository keeps
# (tests/fixtures/shapes-conditional/README.md has the command and what it scored); what is tested
# is sample.py's path from a saved run: labels drawn as in the data, classifier-free guidance, the
# shape scorer's class match. Training with labels: test_a_conditional_run_trains_resumes_..., above.
CONDITIONAL_MODEL = Path(__file__).parent / "fixtures" / "shapes-conditional"
# The 32px scorer that scores it (at 16px the kinds blur), kept too: its training is most of a minute
# and more on 2 cores (tests/fixtures/shape-scorer-32px/README.md). Its training is tested in test_shapescore.py.
SCORER_32PX = Path(__file__).parent / "fixtures" / "shape-scorer-32px" / "v1-32px-seed1000003-2048images-800steps.pt"
SAMPLES, STEPS = 64, 10  # each scored, unguided and at w = 3


@pytest.mark.slow
def test_samples_asked_for_a_class_show_it_more_often_than_chance_and_more_with_guidance(tmp_path, monkeypatch):
    import shutil

    from ddpm_train.evaluation import shapescore

    run = tmp_path / "run"
    shutil.copytree(CONDITIONAL_MODEL, run)  # sample.py caches the reference statistics in the run
    monkeypatch.setattr(shapescore, "TRAIN_IMAGES", 2048)
    monkeypatch.setattr(shapescore, "TRAIN_STEPS", 800)
    cached = shapescore.cache_path(32)  # where sample.py looks for it: the run's scorer folder (conftest.shape_scorer_dir)
    assert cached.name == SCORER_32PX.name, f"the kept scorer is stale: train it again ({SCORER_32PX.parent}/README.md)"
    shutil.copyfile(SCORER_32PX, cached)
    result = sample.main(sample.parse_args([str(run), "--fid", "--num_images", str(SAMPLES), "--batch_size", str(SAMPLES),
                                            "--num_inference_steps", str(STEPS), "--guidance_scale", "1,3"]))  # fmt: skip
    unguided, guided = result["scales"]
    assert unguided["extractor"] == guided["extractor"] == "shapescore-v1:32px:seed1000003:2048images:800steps"
    # Measured with this model, scorer and seeds (the fixtures' READMEs; the class-label runs' record is in
    # BENCHMARKS.md): 73% unguided and 89% at w = 3, against 30% for samples blind to their labels (15 steps:
    # 81% and 97%). The margins leave room for another CPU's rounding to change a few samples.
    assert unguided["class_match"] > unguided["class_match_chance"] + 0.3, unguided
    assert guided["class_match"] > unguided["class_match"] + 0.06, (guided, unguided)
    assert guided["guidance_scale"] == 3 and unguided["guidance_scale"] == 1
