"""The offline shape score: the labels it learns from, how far it can be trusted, and its
place in train.py's and sample.py's FID/KID machinery."""

import hashlib
import json

import pytest
import torch


from ddpm_train.data import shapes
from ddpm_train.evaluation import metrics
from ddpm_train.diffusion import objectives
import sample
from ddpm_train.evaluation import sampling
from ddpm_train.evaluation import shapescore
import train
from bench import trust as trusttool
from ddpm_train.errors import ConfigError

# The images of these tests: 16px, the size of the tests' scorer (conftest.shape_scorer).
SIZE = 16
N = 512  # images per set when scoring


@pytest.fixture
def test_scorer(default_shape_scorer):
    """Every default scorer is the tests' (its short training), in the run's scorer folder."""
    return default_shape_scorer


# --- the labels ------------------------------------------------------------------------


def sha256(images):
    return hashlib.sha256(images.numpy().tobytes()).hexdigest()


def test_labels_leave_the_images_exactly_as_they_were():
    # Hashes of the images before make_shapes knew its labels: runs and tests depend on them.
    before = {
        (64, 32, 0): "fefcdf0c13f45b8dea307f3ec2e615621605951ed34b916e72cf7bef9214b7f5",
        (64, 16, 1): "ea9b45a4e66d59a72f0d41385128b94685b1b73512b501ca93d5b75a9ed081b9",
        (8, 48, 3): "389d76d17e45bcca69644e2ae4cb234729ceb1179b4e035f81febe019977d08f",
    }
    for (n, size, seed), digest in before.items():
        images, labels = shapes.make_shapes(n, size, seed=seed, with_labels=True)
        assert sha256(images) == digest == sha256(shapes.make_shapes(n, size, seed=seed))
        assert labels["count"].shape == (n,) and labels["shape_map"].shape == (n, size, size)


def test_labels_say_what_each_image_holds():
    images, labels = shapes.make_shapes(64, 32, seed=0, with_labels=True)
    drawn = labels["drawn"]
    assert torch.equal(drawn.sum(1), labels["count"]) and ((labels["kind"] >= 0) == drawn).all()
    assert (labels["visible_pixels"] <= labels["pixels"] + 1e-6).all() and (labels["pixels"][~drawn] == 0).all()
    # the last shape drawn is never drawn over
    last = labels["count"] - 1
    assert torch.allclose(labels["visible_pixels"].gather(1, last[:, None]), labels["pixels"].gather(1, last[:, None]))
    # the shape map agrees with the visible areas, and where it shows background, the pixels are the background colour
    shown = torch.stack([(labels["shape_map"] == j).flatten(1).sum(1) for j in range(3)], 1).float()
    assert (shown - labels["visible_pixels"]).abs().max() < 0.2 * labels["pixels"].max()
    # background pixels two pixels away from any shape's
    inside = torch.nn.functional.max_pool2d(labels["shape_map"][:, None].float(), 5, 1, padding=2)[:, 0] == -1
    assert inside.float().mean() > 0.3
    background = (labels["background"] * 255).round()[:, :, None, None].expand_as(images)
    difference = images.permute(1, 0, 2, 3)[:, inside].float() - background.permute(1, 0, 2, 3)[:, inside]
    assert difference.abs().max() <= 1


def test_targets_count_only_the_shapes_that_show():
    images, labels = shapes.make_shapes(512, 32, seed=0, with_labels=True)
    t = shapescore.targets(labels, 32)
    assert torch.allclose(t["count"].sum(1), torch.ones(512)) and t["cells"].shape == (512, 5, 8, 8)
    shown = labels["visible_pixels"] / labels["pixels"].clamp(min=1e-6)
    whole = ((shown > 0.99) | ~labels["drawn"]).all(1)  # nothing drawn over
    assert whole.sum() > 100
    assert torch.equal(t["count"][whole].argmax(1) + 1, labels["count"][whole]) and (t["count"][whole].amax(1) == 1).all()
    hidden = (labels["drawn"] & (shown < 0.1)).any(1) & ~((shown > 0.1) & (shown < 0.4)).any(1)
    assert hidden.any()  # a shape drawn over all but a sliver is not counted
    assert (t["count"][hidden].argmax(1) + 1 < labels["count"][hidden]).all()
    # cells: shares of background and kinds sum to 1; centres sum to the expected count
    assert torch.allclose(t["cells"][:, :4].sum(1), torch.ones(512, 8, 8))
    expected = (t["count"] * torch.arange(1, 4)).sum(1)
    assert torch.allclose(t["cells"][:, 4].sum((1, 2)), expected, atol=1.01)  # two centres may share a cell


# --- how far to trust it ---------------------------------------------------------------


@pytest.fixture(scope="module")
def trust(shape_scorer):
    """Scores of known sets against N real images (seed 0): real of another seed, altered, noise."""
    scorer = shape_scorer
    reference = metrics.Reference.from_features(metrics.embed(scorer, [shapes.make_shapes(N, SIZE, seed=0)], "cpu"), key={})
    real = shapes.make_shapes(N, SIZE, seed=1)
    sets = {
        "real": real, "permuted": real[:, [2, 0, 1]], "blur 0.5": trusttool.blurred(real, 0.5),
        "blur 1": trusttool.blurred(real, 1), "blur 2": trusttool.blurred(real, 2),
        "shuffled": trusttool.shuffled_patches(real), "noise": trusttool.noise(N, SIZE),
        "shifted": (real.int() + 40).clamp(0, 255).to(torch.uint8),  # every colour 40/255 brighter
    }  # fmt: skip
    return {
        name: metrics.score(reference, scorer, scorer.name, metrics.embed(scorer, [images], "cpu")) for name, images in sets.items()
    }  # fmt: skip


@pytest.mark.slow
def test_real_images_of_another_seed_score_near_the_floor_and_damaged_ones_far_above(trust):
    floor = trust["real"]
    # Measured (16px, 512 images): real 0.06-0.66; blur of 1 px 20-25, patches shuffled 62-65,
    # noise ~400. A third of the smallest ratio is the margin: 10x the floor, 100x for noise.
    for name in ("blur 1", "blur 2", "shuffled"):
        assert trust[name]["fid"] > 10 * floor["fid"], name
        assert trust[name]["kid_mean"] > 10 * abs(floor["kid_mean"]) and trust[name]["kid_mean"] > 0.3, name
    assert trust["noise"]["fid"] > 100 * floor["fid"] and trust["noise"]["fid"] > 3 * trust["blur 1"]["fid"]
    # every colour 40/255 brighter: a milder change, since the data's backgrounds span a wide range of
    # brightness (measured 3.3 against a floor of 0.69)
    assert trust["shifted"]["fid"] > 3 * floor["fid"] and trust["shifted"]["kid_mean"] > 0
    # more damage, a worse score (measured 2-4, 20-25, 100-112: each 5x the last)
    assert floor["fid"] < trust["blur 0.5"]["fid"] < trust["blur 1"]["fid"] / 2 < trust["blur 2"]["fid"] / 4
    # a permutation of the colour channels maps this data onto itself (hues are uniform): it
    # is no damage, and scores as real images do (measured 1.03-1.08x the floor)
    assert trust["permuted"]["fid"] < 2 * floor["fid"]


def test_most_real_images_are_valid_and_no_noise_is(trust):
    # Real: sure as on 95% of held-out images and inside the real features' k-NN balls (~93%): measured 0.88-0.89.
    assert trust["real"]["valid_fraction"] > 0.8 and trust["permuted"]["valid_fraction"] > 0.8
    assert trust["noise"]["valid_fraction"] < 0.05  # measured 0
    assert trust["shuffled"]["valid_fraction"] < trust["real"]["valid_fraction"] - 0.05  # measured 0.64-0.72
    assert all(r["extractor"].startswith(f"shapescore-v{shapescore.VERSION}:16px") for r in trust.values())


def test_confidence_alone_would_call_noise_valid(test_scorer):
    features = metrics.embed(test_scorer, [trusttool.noise(N, SIZE)], "cpu")
    with torch.no_grad():
        assert test_scorer.sure(features).float().mean() > 0.2 and not test_scorer.looks_real(features).any()


# --- training and the cache ------------------------------------------------------------


def test_training_leaves_the_callers_random_stream_alone_and_is_reproducible():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    a = shapescore.train(8, seed=3, num_images=64, steps=3, log=lambda _: None)
    assert torch.equal(torch.rand(3), expected)
    b = shapescore.train(8, seed=3, num_images=64, steps=3, log=lambda _: None)
    images = shapes.make_shapes(8, 8, seed=9)
    with torch.no_grad():
        assert torch.equal(a(images), b(images))


def test_the_scorer_is_cached_by_size_seed_and_training(tmp_path, monkeypatch):
    monkeypatch.setenv(shapescore.CACHE_ENV, str(tmp_path))
    logs = []
    first = shapescore.load_or_train(8, num_images=64, steps=3, log=logs.append)
    assert shapescore.cache_path(8, num_images=64, steps=3).parent == tmp_path and len(list(tmp_path.iterdir())) == 1
    assert any("training the offline shape scorer" in line for line in logs)

    monkeypatch.setattr(shapescore, "train", lambda *a, **k: pytest.fail("trained again"))
    again = shapescore.load_or_train(8, num_images=64, steps=3, log=logs.append)
    images = shapes.make_shapes(8, 8, seed=9)
    with torch.no_grad():
        assert torch.equal(first(images), again(images)) and torch.equal(first.valid(first(images)), again.valid(again(images)))
    assert again.name == first.name and again.info == first.info
    for other in (dict(image_size=12), dict(image_size=8, seed=1), dict(image_size=8, steps=4)):
        assert shapescore.cache_path(**{"num_images": 64, "steps": 3, **other}) != shapescore.cache_path(8, num_images=64, steps=3)
    monkeypatch.delenv(shapescore.CACHE_ENV)
    assert shapescore.cache_dir() == __import__("pathlib").Path(torch.hub.get_dir()) / "shapescore"


def test_a_grid_png_reads_back_as_its_images(tmp_path):
    images = shapes.make_shapes(9, 16, seed=2)
    sampling.save_grid(images, tmp_path / "grid.png")
    assert torch.equal(trusttool.grid_images(tmp_path / "grid.png", 16), images)
    with pytest.raises(ConfigError, match="not a grid of 32px images"):
        trusttool.grid_images(tmp_path / "grid.png", 32)


# --- in the FID/KID machinery ------------------------------------------------------------


def test_the_built_in_shapes_are_scored_offline_and_other_data_by_inception(test_scorer, monkeypatch):
    from test_metrics import TinyFeatures

    monkeypatch.setattr(metrics, "feature_extractor", lambda weights=None: (TinyFeatures(), f"inception:{weights}"))
    scorer, name = metrics.extractor_for({"dataset": "shapes"}, SIZE)
    assert isinstance(scorer, shapescore.ShapeScorer) and name == test_scorer.name
    assert metrics.extractor_for({"dataset": "shapes"}, SIZE, "w.pth")[1] == "inception:w.pth"  # weights given: Inception
    assert metrics.extractor_for({"dataset": "some/folder"}, SIZE)[1] == "inception:None"
    # the cached reference statistics are keyed by the extractor: the two never mix
    options = {"dataset": "shapes", "shapes_num_images": 16, "seed": 0}
    assert metrics.reference_key(options, SIZE, name) != metrics.reference_key(options, SIZE, "inception:w.pth")


def test_scores_are_printed_as_a_shape_fd_with_the_valid_fraction():
    common = dict(fid=12.3456, kid_mean=0.01, kid_std=0.002, num_images=6, sampler="ddim", num_inference_steps=2, reference_images=16)
    assert metrics.format_scores(common).startswith("FID 12.346 | KID 0.01000 ± 0.00200 | 6 images")
    shape = metrics.format_scores(common | dict(valid_fraction=0.875, extractor="shapescore-v1"))
    assert shape.startswith("shape FD 12.346 | KID 0.01000 ± 0.00200 | valid 0.875 | 6 images")


TINY = [
    "--model", "tiny", "--image_size", str(SIZE), "--shapes_num_images", "16", "--train_batch_size", "8",
    "--num_inference_steps", "2", "--eval_batch_size", "4", "--lr_warmup_steps", "1", "--dataloader_num_workers", "0",
    "--save_images_epochs", "100", "--logging_steps", "2", "--checkpointing_steps", "100",
]  # fmt: skip


def test_a_run_on_the_shapes_is_scored_offline_during_training_and_by_sample_py(test_scorer, tmp_path, monkeypatch, capsys):
    from diffusers import DDPMPipeline

    # Inception cannot be had (an empty hub cache, a URL that refuses): none is needed
    monkeypatch.setattr(metrics, "INCEPTION_URL", "http://127.0.0.1:9/weights-inception.pth")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    out = tmp_path / "run"
    # 2 steps per epoch, 2 epochs, scored after each
    train.main(train.parse_args([*TINY, "--output_dir", str(out), "--max_train_steps", "4", "--eval_every_epochs", "1",
                                 "--eval_num_samples", "6"]))  # fmt: skip
    stdout = capsys.readouterr().out
    results = json.loads((out / metrics.RESULTS_FILE).read_text())
    assert [r["step"] for r in results] == [2, 4]
    for r in results:
        assert r["extractor"] == test_scorer.name and r["fid"] > 0 and 0 <= r["valid_fraction"] <= 1
        assert r["num_images"] == 6 and r["reference_images"] == 16 and {"kid_mean", "kid_std", "best"} <= set(r)
    lines = [line for line in stdout.splitlines() if line.startswith("eval epoch") and "| copies " not in line]
    assert [line.split(" | ")[1] for line in lines] == [f"shape FD {r['fid']:.3f}" for r in results]
    assert all(f"valid {r['valid_fraction']:.3f}" in line for r, line in zip(results, lines))
    best = json.loads((out / "best" / "eval.json").read_text())
    assert best["fid"] == min(r["fid"] for r in results) and best["extractor"] == test_scorer.name
    DDPMPipeline.from_pretrained(str(out / "best"))
    assert torch.load(out / metrics.REFERENCE_FILE, weights_only=True)["key"]["extractor"] == test_scorer.name

    # sample.py --fid scores the finished run the same way, from the statistics cached in training
    monkeypatch.setattr(metrics.Reference, "from_features", lambda *a: pytest.fail("recomputed the reference"))
    result = sample.main(sample.parse_args([str(out), "--fid", "--num_images", "6", "--num_inference_steps", "2", "--device", "cpu"]))
    assert result["extractor"] == test_scorer.name and 0 <= result["valid_fraction"] <= 1 and result["reference_images"] == 16
    assert f"shape FD {result['fid']:.3f} | KID" in capsys.readouterr().out


def test_the_trust_table_scores_known_sets_and_a_grid(test_scorer, tmp_path, capsys):
    sampling.save_grid(shapes.make_shapes(4, SIZE, seed=7), tmp_path / "grid.png")
    rows = trusttool.main(trusttool.parse_args([str(tmp_path / "grid.png"), "--image_size", str(SIZE), "--num_images", "64"]))
    names = [name for name, _, _ in rows]
    assert names[0] == "real, another seed" and names[-2:] == ["real, 4 images", "grid.png"] and "uniform noise" in names
    table = capsys.readouterr().out
    assert test_scorer.name in table and "| grid.png | 4 |" in table
    with pytest.raises(SystemExit) as exit_info:
        trusttool.main(trusttool.parse_args([str(tmp_path / "grid.png"), "--image_size", "32"]))
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "is not a grid of 32px images" in err[0], err


# --- a minute of training, scored --------------------------------------------------------------

QUALITY_RUN = [*TINY[:6], "--shapes_num_images", "512", "--train_batch_size", "32", "--max_train_steps", "{steps}",
               "--num_epochs", "100", "--eval_every_epochs", "{every}", "--eval_num_samples", "{samples}",
               "--lr_warmup_steps", "20", "--dataloader_num_workers", "0",
               "--save_images_epochs", "1000", "--checkpointing_steps", "1000", "--logging_steps", "50"]  # fmt: skip


def untrained_score(run_dir, scorer, samples):
    """The score of the run's network before its first step (the same seed builds it), sampled and
    scored as the run's evaluation does."""
    from ddpm_train.networks import model as models

    config = json.loads((run_dir / "train_config.json").read_text())
    torch.manual_seed(config["seed"])
    network = models.build_network(config["model"], config["image_size"]).eval()
    scheduler = objectives.make_sampler(config["objective"], config["sampler"], objectives.run_noise_scheduler(config).config)
    batches = sampling.generate_batches(network, scheduler, samples, 64, config["seed"], config["num_inference_steps"])
    reference = metrics.Reference.from_features(
        metrics.embed(scorer, [shapes.make_shapes(config["shapes_num_images"], SIZE, seed=config["seed"])], "cpu"), key={}
    )  # fmt: skip
    return metrics.score(reference, scorer, scorer.name, metrics.embed(scorer, batches, "cpu"))


@pytest.mark.slow
def test_a_minute_of_training_beats_the_untrained_network_by_far_and_improves_along_the_way(test_scorer, tmp_path):
    steps, every, samples = 160, 5, 96  # 16 steps an epoch: scored after 80 and 160 steps
    out = tmp_path / "run"
    flags = [f.format(steps=steps, every=every, samples=samples) for f in QUALITY_RUN]
    train.main(train.parse_args([*flags, "--output_dir", str(out)]))
    scores = [r["fid"] for r in json.loads((out / metrics.RESULTS_FILE).read_text())]
    untrained = untrained_score(out, test_scorer, samples)["fid"]
    print(f"shape FD: untrained {untrained:.1f}, along the run {[round(s, 1) for s in scores]}")
    # Measured: untrained 933, then 545 after 80 steps and 388 after 160 (256 after 240). Half
    # the untrained network's distance is the margin: the two are 2.4x apart, and a run that
    # learned nothing would score near the untrained network (the floor at 96 images is a few units).
    assert scores[-1] < scores[0] and scores[-1] < untrained / 2, (untrained, scores)
