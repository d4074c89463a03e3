import argparse
import errno
import json
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F


from ddpm_train.data import sources
from ddpm_train.data import shapes
from ddpm_train.evaluation import metrics
from ddpm_train.training import rundir
import sample
from ddpm_train.evaluation import sampling
import train
from conftest import ROOT
from ddpm_train.errors import ConfigError


class TinyFeatures(torch.nn.Module):
    """A stand-in for Inception: a fixed random projection of 4x4-pooled colours (16 features)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("projection", torch.randn(48, 16, generator=torch.Generator().manual_seed(0)) / 4)

    def forward(self, images):
        assert images.dtype == torch.uint8  # what the real network takes
        return torch.tanh(F.adaptive_avg_pool2d(images.float() / 255, 4).flatten(1) @ self.projection)


@pytest.fixture(scope="module")
def images():
    return shapes.make_shapes(192, 16, seed=1)


def features_of(images, batch_size):
    return metrics.embed(TinyFeatures(), metrics.uint8_batches(images, batch_size), "cpu")


def textbook_fid(a, b):
    """||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^1/2), with scipy's matrix square root."""
    a, b = a.numpy(), b.numpy()
    mu, cov = (a.mean(0), b.mean(0)), (np.cov(a, rowvar=False), np.cov(b, rowvar=False))
    root = scipy.linalg.sqrtm(cov[0] @ cov[1]).real
    return float(((mu[0] - mu[1]) ** 2).sum() + np.trace(cov[0] + cov[1] - 2 * root))


def test_fid_and_kid_are_zero_for_a_set_against_itself_and_clearly_positive_for_a_shifted_set(images):
    reference = metrics.Reference.from_features(features_of(images, 32), key={})
    same = reference.scores(features_of(images, 32))
    shifted_images = (images.int() + 40).clamp(0, 255).to(torch.uint8)
    shifted = reference.scores(features_of(shifted_images, 32))

    assert abs(same["fid"]) < 1e-6 and shifted["fid"] > 0.1
    # KID's unbiased estimate is off by O(1/n) when both sides share the very same images
    assert abs(same["kid_mean"]) < 0.05 * shifted["kid_mean"]
    assert shifted["kid_mean"] > 5 * shifted["kid_std"]
    # the cached statistics give the textbook formula on the features
    assert shifted["fid"] == pytest.approx(textbook_fid(features_of(images, 32), features_of(shifted_images, 32)), rel=1e-6)


def test_scores_do_not_depend_on_the_batch_size(images, monkeypatch):
    monkeypatch.setattr(metrics, "KID_SUBSET_SIZE", 50)  # subsets smaller than the sets: a KID spread to compare
    half = len(images) // 2
    reference_a = metrics.Reference.from_features(features_of(images[:half], 5), key={})
    reference_b = metrics.Reference.from_features(features_of(images[:half], 96), key={})
    a = reference_a.scores(features_of(images[half:], 7))
    b = reference_b.scores(features_of(images[half:], 64))
    assert a["kid_std"] > 0.1 * a["kid_mean"] > 0
    for name in ("fid", "kid_mean", "kid_std"):
        assert a[name] == pytest.approx(b[name], rel=1e-4), name


@pytest.mark.slow
def test_generated_images_scored_a_batch_at_a_time_score_as_all_at_once(images, monkeypatch, shape_scorer, tmp_path):
    """Generated holds FID's sums, KID's first KID_MAX_IMAGES features and the shape scorer's answers, not every
    feature: batches of 7 score as the 96 images at once (the KID cut inside a batch; labels kept with theirs)."""
    monkeypatch.setattr(metrics, "KID_MAX_IMAGES", 50)
    monkeypatch.setattr(metrics, "KID_SUBSET_SIZE", 20)
    reference = metrics.Reference.from_features(features_of(images[:96], 32), key={})
    fake = features_of(images[96:], 32)
    generated = metrics.Generated()
    for part in fake.split(7):
        generated.add(part)
    assert generated.num_images == 96 and sum(len(k) for k in generated.kid) == 50
    whole, parts = reference.scores(fake), generated.scores(reference)
    assert parts == pytest.approx(whole, rel=1e-9) and whole["kid_std"] > 0

    drawn, kinds, _ = shapes.builtin_images(40, 16, 3, class_conditional=True)
    labels = torch.cat([kinds[:20], kinds[20:].roll(1)])  # half asked for another kind than each shows
    features = metrics.embed(shape_scorer, [drawn], "cpu")
    shapes_reference = metrics.Reference.from_features(features, key={})
    at_once = metrics.score(shapes_reference, shape_scorer, "s", features, labels=labels)
    generated = metrics.generated_by(shape_scorer)
    for part, asked in zip(features.split(6), labels.split(6)):
        generated.add(part, asked)
    batched = generated.scores(shapes_reference) | dict(extractor="s")
    assert batched == pytest.approx(at_once, rel=1e-9) and 0 < at_once["class_match"] < 1

    # a training run's evaluation: its batches of samples, each with its labels
    evaluator = object.__new__(metrics.TrainingEvaluator)  # its scorer, reference and folder, no run's flags
    evaluator.extractor, evaluator.extractor_name, evaluator.device = shape_scorer, "s", "cpu"
    evaluator.reference, evaluator.output_dir = shapes_reference, tmp_path
    evaluator.best = metrics.BestCheckpoint(tmp_path / "best")
    result = evaluator.evaluate(lambda w: drawn.split(6), [1.0], "euler", 2, 1, 2, lambda folder: None, labels=labels)
    assert {k: result[k] for k in at_once} == pytest.approx(at_once, rel=1e-5) and result["num_images"] == 40  # embedded by 6
    assert result["class_match"] == at_once["class_match"]


def test_reference_statistics_are_computed_once_and_recomputed_for_other_data(images, tmp_path):
    calls = []

    def get_images():
        calls.append(1)
        return images

    args = (TinyFeatures(), "cpu", 64)
    first = metrics.cached_reference(tmp_path, {"dataset": "a"}, get_images, *args, log=lambda _: None)
    again = metrics.cached_reference(tmp_path, {"dataset": "a"}, get_images, *args, log=lambda _: None)
    assert len(calls) == 1 and (tmp_path / metrics.REFERENCE_FILE).is_file()
    fake = features_of(images[:50], 50)
    assert again.scores(fake) == first.scores(fake)
    metrics.cached_reference(tmp_path, {"dataset": "b"}, get_images, *args, log=lambda _: None)
    assert len(calls) == 2


def test_the_reference_key_reads_crops_from_augment_or_an_older_runs_center_crop():
    """A run's flags (--augment) and an older run's train_config.json (center_crop, no --augment: before
    issue 33) key the same reference statistics when they crop alike, so a cached reference stays valid."""
    old = json.loads((ROOT / "tests" / "fixtures" / "before-issue-33" / "default" / "train_config.json").read_text())
    now = {k: v for k, v in old.items() if k not in ("center_crop", "random_flip")} | dict(augment="flip")
    assert "augment" not in old and old["center_crop"] is True
    centred = metrics.reference_key(now, 16, "x")
    assert centred == metrics.reference_key(old, 16, "x") and centred["center_crop"] is True
    cropped = metrics.reference_key(dict(now, augment="flip,crop"), 16, "x")
    assert cropped == metrics.reference_key(dict(old, center_crop=False), 16, "x") != centred


def folder_options(folder):
    return dict(dataset=str(folder), dataset_config=None, split="train", image_column=None, augment="none")


def test_reference_statistics_are_shared_between_runs_and_recomputed_when_the_images_change(tmp_path, monkeypatch):
    """A second run on the same images reads the statistics the first computed (the shared cache, copied into
    its folder); an image added to the folder makes them again."""
    options, calls, lines = folder_options(image_folder(tmp_path / "images", 5)), [], []

    def reference(run):
        key = metrics.reference_key(options, 8, "tiny", metrics.dataset_contents(options, 8))
        get_images = lambda: calls.append(run) or metrics.reference_images(options, 8)  # noqa: E731
        return metrics.cached_reference(tmp_path / run, key, get_images, TinyFeatures(), "cpu", 2, log=lines.append)

    first, second = reference("a"), reference("b")
    assert calls == ["a"] and first.num_images == second.num_images == 5
    assert (tmp_path / "a" / metrics.REFERENCE_FILE).stat().st_nlink == 3  # one file: the shared one, a's and b's
    assert "computing" in lines[0] and "read from" in lines[1] and (tmp_path / "b" / metrics.REFERENCE_FILE).is_file()
    assert torch.equal(first.fid_state["real_features_cov_sum"], second.fid_state["real_features_cov_sum"])
    shared = metrics.shared_reference_path(first.key)
    assert (tmp_path / "b" / metrics.REFERENCE_FILE).stat().st_ino == shared.stat().st_ino  # a hard link, not a copy
    image_folder(tmp_path / "images", 6)
    again = reference("b")
    assert again.num_images == 6 and calls == ["a", "b"]

    def no_links(src, dst):  # the run folder on another filesystem
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    assert reference("c").num_images == 6 and calls == ["a", "b"] and "read from" in lines[-1]  # a copy
    copy, shared = tmp_path / "c" / metrics.REFERENCE_FILE, metrics.shared_reference_path(again.key)
    assert torch.equal(metrics.Reference.load(copy, again.key).kid_features, again.kid_features)
    assert copy.stat().st_ino != shared.stat().st_ino
    assert sorted(p.name for p in copy.parent.iterdir()) == [metrics.REFERENCE_FILE]


def test_a_shared_cache_that_cannot_be_written_is_a_warning_and_the_run_folder_keeps_its_statistics(images, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(metrics.REFERENCE_CACHE_ENV, str(tmp_path / "file" / "fid"))  # below a file: no folder there
    lines = []
    metrics.cached_reference(tmp_path / "run", {"dataset": "a"}, lambda: images, TinyFeatures(), "cpu", 64, log=lines.append)
    assert lines[-1].startswith("warning: cannot write") and metrics.REFERENCE_CACHE_ENV in lines[-1]
    assert metrics.Reference.load(tmp_path / "run" / metrics.REFERENCE_FILE, {"dataset": "a"}).num_images == len(images)


def test_an_unreadable_reference_file_is_computed_again_and_a_failed_write_leaves_no_file(images, tmp_path, monkeypatch):
    path = tmp_path / metrics.REFERENCE_FILE
    path.write_bytes(b"not a torch file")
    with pytest.warns(UserWarning, match="cannot be read as FID reference statistics"):
        reference = metrics.cached_reference(tmp_path, {"dataset": "a"}, lambda: images, TinyFeatures(), "cpu", 64, log=print)
    assert metrics.Reference.load(path, {"dataset": "a"}).num_images == reference.num_images == len(images)

    def torn(state, file):  # a write that fails half way (a full disk)
        Path(file).write_bytes(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(OSError):
        reference.save(tmp_path / "other.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [metrics.REFERENCE_FILE]


def test_statistics_made_batch_by_batch_are_those_of_all_features_at_once(tmp_path, monkeypatch, capsys):
    """Reference.of_images holds FID's sums and KID's subset, never every feature: the same statistics as
    from_features on the readable images' features, whatever the batches, an unreadable image left out."""
    monkeypatch.setattr(metrics, "KID_MAX_IMAGES", 4)  # a subset of the 7 items
    folder = image_folder(tmp_path / "images", 6)
    (folder / "03b.png").write_bytes(b"not a png")  # item 4 of 7, in sorted order
    dataset = sources.open_dataset(str(folder), 8)
    readable = torch.stack([image for image, _ in (dataset[i] for i in range(len(dataset))) if image is not None])
    keep = torch.randperm(7, generator=torch.Generator().manual_seed(0))[:4].sort().values  # of the 7 items
    features = features_of(readable, 6)
    made = [metrics.Reference.of_images(dataset, TinyFeatures(), "cpu", batch, key={}) for batch in (2, 3, 7)]
    for reference in made:
        assert reference.num_images == 6
        for name, value in metrics.Reference.from_features(features, key={}).fid_state.items():
            torch.testing.assert_close(reference.fid_state[name], value, rtol=1e-6, atol=1e-6)  # float32 features
        # KID's subset: the kept items that decoded, by their index among the 7
        expected = [i - (i > 4) for i in keep.tolist() if i != 4]
        torch.testing.assert_close(reference.kid_features, features[expected].float(), rtol=1e-6, atol=1e-6)
    assert "03b.png" in capsys.readouterr().err


def test_statistics_summed_over_processes_of_which_none_read_an_image_are_one_line(tmp_path):
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        statistics = metrics._Statistics(4)
        statistics.sum_to_first(None)
    finally:
        torch.distributed.destroy_process_group()
    with pytest.raises(ConfigError, match="FID needs at least 2 reference images"):
        statistics.reference({})


def test_sample_py_scores_against_the_statistics_of_the_images_the_run_trained_on(tmp_path, monkeypatch):
    """A run's own training set (here trained on the relative `images`): its folder's statistics, though the
    images changed since, or seen from a directory without them; --dataset naming the folder: the images there
    now, kept out of the run's folder; another folder of that name: its own statistics."""
    monkeypatch.setattr(metrics, "feature_extractor", lambda weights=None: (TinyFeatures(), "tiny-features"))
    folder = image_folder(tmp_path / "images", 5)
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(dataset=None, dataset_config=None, split=None, image_column=None, fid_weights="w",
                              device="cpu", batch_size=2)  # fmt: skip

    def reference(args):  # sample.py's: found, else made
        evaluation = metrics.SampleEvaluation(run, run, folder_options("images"), args, 8, log=lambda _: None)
        if evaluation.reference is None:
            sample.make_reference(evaluation, evaluation.options, args, 8, 0, 1, None)
        return evaluation.reference.num_images

    assert reference(args) == 5
    (folder / "00.png").unlink()
    assert reference(args) == 5
    opened, open_images = [], metrics.reference_images
    monkeypatch.setattr(metrics, "reference_images", lambda *a: opened.append(a) or open_images(*a))
    assert reference(argparse.Namespace(**vars(args) | dict(dataset=str(folder)))) == 4
    assert len(opened) == 1  # the folder listed once: for the statistics' key, then embedded
    assert reference(args) == 5  # the run's folder still holds its own
    monkeypatch.chdir(run)  # no `images` here
    assert reference(args) == 5
    monkeypatch.chdir(image_folder(tmp_path / "other" / "images", 3).parent)
    assert reference(args) == 3


def test_runs_started_together_make_the_statistics_once(tmp_path, monkeypatch):
    """A run that finds another live run's claim waits, then reads the statistics that run kept; a dead run's
    claim (its process gone) is taken at once, and given up with close()."""
    from ddpm_train.data import folders
    from ddpm_train.data import pieces
    from test_latents import dead_pid

    options = folder_options(image_folder(tmp_path / "images", 4))
    key = metrics.reference_key(options, 8, "tiny", metrics.dataset_contents(options, 8))
    shared, lines = metrics.shared_reference_path(key), []
    shared.parent.mkdir(parents=True, exist_ok=True)
    other = pieces.Claims(shared.parent)
    assert other.take(shared.name)

    def other_run_keeps_them(seconds):  # while this run waits
        made = metrics.Reference.of_images(metrics.reference_images(options, 8), TinyFeatures(), "cpu", 2, key)
        metrics.kept_reference(made, tmp_path / "other", log=print)
        other.close()

    monkeypatch.setattr(metrics.time, "sleep", other_run_keeps_them)
    reference, claims = metrics.claimed_reference(tmp_path / "run", key, log=lines.append)
    assert claims is None and reference.num_images == 4 and len(lines) == 2
    assert lines[0] == f"waiting for another run making the FID reference statistics of these images ({shared})"
    assert "read from" in lines[1]

    shared.unlink()
    claim = shared.parent / f".claim-{shared.name}"
    claim.write_text(f"{folders.this_host()} {dead_pid()} token\n")
    reference, claims = metrics.claimed_reference(tmp_path / "run2", key, log=lines.append)
    assert reference is None and claims.held and claim.read_text() == claims.mark and len(lines) == 2  # no wait
    claims.close()
    assert not claim.exists()


def test_a_folder_given_relative_absolute_or_through_a_link_has_one_key(tmp_path, monkeypatch):
    images = image_folder(tmp_path / "images", 2)
    (tmp_path / "link").symlink_to(images)
    monkeypatch.chdir(tmp_path)
    keys = [metrics.reference_key(folder_options(name), 8, "x") for name in ("images", images, "link", "./images/")]
    assert all(key == keys[0] for key in keys) and keys[0]["dataset"] == str(images.resolve())
    assert metrics.reference_key(folder_options("org/name"), 8, "x")["dataset"] == "org/name"  # a Hub id as given
    (tmp_path / "shapes").mkdir()
    assert metrics.reference_key(folder_options("shapes"), 8, "x")["dataset"] == "shapes"  # the built-in set, not a folder


def test_best_checkpoint_keeps_the_lowest_fid_and_remembers_it(tmp_path):
    def save_marker(fid):
        return lambda folder: (folder / "marker.txt").write_text(str(fid))

    best = metrics.BestCheckpoint(tmp_path / "best")
    kept = [best.offer({"fid": fid, "step": i}, save_marker(fid)) for i, fid in enumerate([3.0, 2.0, 2.5, math.nan, 1.5, 1.7])]
    assert kept == [True, True, False, False, True, False]
    assert (tmp_path / "best" / "marker.txt").read_text() == "1.5"
    assert json.loads((tmp_path / "best" / "eval.json").read_text()) == {"fid": 1.5, "step": 4}
    assert not list(tmp_path.glob(".tmp-*"))

    resumed = metrics.BestCheckpoint(tmp_path / "best")  # a restarted run
    assert not resumed.offer({"fid": 1.6}, save_marker(1.6)) and resumed.offer({"fid": 1.4}, save_marker(1.4))
    assert (tmp_path / "best" / "marker.txt").read_text() == "1.4"


# --- the Inception weights -----------------------------------------------------------


@pytest.fixture
def no_weights_anywhere(tmp_path, monkeypatch):
    """An empty torch hub cache and a download URL that refuses at once (port 9 on this machine)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    monkeypatch.setattr(metrics, "INCEPTION_URL", "http://127.0.0.1:9/weights-inception.pth")


def test_missing_inception_weights_are_one_line_naming_fid_weights(no_weights_anywhere):
    with pytest.raises(ConfigError, match=r"could not be downloaded .* pass --fid_weights PATH"):
        metrics.inception_weights()
    with pytest.raises(ConfigError, match="--fid_weights /no/such/file: no such file"):
        metrics.inception_weights("/no/such/file")


def test_inception_url_is_the_one_torch_fidelity_uses():
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    assert metrics.INCEPTION_URL == URL_INCEPTION_V3


def test_a_weights_file_loads_the_inception_network_offline(tmp_path, no_weights_anywhere, monkeypatch):
    from torchmetrics.image.fid import NoTrainInceptionV3

    # A weights file with the real architecture's keys (random values): build the
    # network once without loading anything, then save its state.
    torch.save({}, tmp_path / "empty.pth")
    with monkeypatch.context() as m:
        m.setattr(torch.nn.Module, "load_state_dict", lambda self, state, *a, **k: None)
        network = NoTrainInceptionV3(name="inception-v3-compat", features_list=["2048"], feature_extractor_weights_path=str(tmp_path / "empty.pth"))
    torch.save(network.state_dict(), tmp_path / "weights.pth")

    extractor, name = metrics.feature_extractor(str(tmp_path / "weights.pth"))
    features = metrics.embed(extractor, [shapes.make_shapes(2, 16)], "cpu")
    assert features.shape == (2, 2048) and name.startswith("inception-v3-compat:2048")

    (tmp_path / "broken.pth").write_bytes(b"not a weights file")
    with pytest.raises(ConfigError, match="cannot load Inception weights"):
        metrics.feature_extractor(str(tmp_path / "broken.pth"))


# --- during training -----------------------------------------------------------------

TINY = [
    "--model", "tiny", "--image_size", "16", "--shapes_num_images", "16", "--train_batch_size", "8",
    "--num_inference_steps", "2", "--eval_batch_size", "4", "--lr_warmup_steps", "1", "--dataloader_num_workers", "0",
    "--save_images_epochs", "100", "--logging_steps", "2", "--checkpointing_steps", "100",
]  # fmt: skip


def run(output_dir, *flags):
    args = train.parse_args([*TINY, "--output_dir", str(output_dir), *map(str, flags)])
    args.timing_warmup_steps = 1  # a config.SETTINGS (train.py: 5): runs this short leave only their first step out
    return train.main(args)


def test_training_reports_fid_and_kid_and_keeps_the_best_pipeline(tmp_path, monkeypatch, capsys):
    from diffusers import DDPMPipeline
    from test_train import scalars

    embedded = []

    class CountingFeatures(TinyFeatures):
        def forward(self, images):
            embedded.append(len(images))
            return super().forward(images)

    monkeypatch.setattr(metrics, "feature_extractor", lambda weights=None: (CountingFeatures(), "tiny-features"))
    # Inception weights given: the built-in shapes are scored by "Inception" (the stand-in), not the shape scorer
    weights = tmp_path / "inception.pth"
    weights.touch()
    out = tmp_path / "run"
    # FID samples and embeds max(metrics.FID_BATCH_SIZE, --eval_batch_size) images at a time: with the floor at 2
    # (64 in train.py), --eval_batch_size's 4, so that the 16 training images and each 6 generated take several
    # batches, the last one short
    monkeypatch.setattr(metrics, "FID_BATCH_SIZE", 2)
    # 2 steps per epoch, 3 epochs, FID every 2 epochs and at the end: after epochs 1 and 2
    run(out, "--max_train_steps", 6, "--eval_every_epochs", 2, "--eval_num_samples", 6, "--fid_weights", weights)
    stdout = capsys.readouterr().out

    results = json.loads((out / "eval_results.json").read_text())
    assert [(r["epoch"], r["step"]) for r in results] == [(1, 4), (2, 6)]
    assert all(r["fid"] > 0 and r["num_images"] == 6 and r["reference_images"] == 16 for r in results)
    assert all(r["extractor"] == "tiny-features" and "valid_fraction" not in r for r in results)
    lines = [line for line in stdout.splitlines() if line.startswith("eval epoch") and "| copies " not in line]
    assert [line.split(" | ")[1] for line in lines] == [f"FID {r['fid']:.3f}" for r in results]
    logged = scalars(out)
    assert [step for step, _ in logged["fid"]] == [4, 6] and [step for step, _ in logged["kid_mean"]] == [4, 6]
    # the copy check of each evaluation's samples (6) against the 16 training images: its line, numbers and picture
    assert [line.split(" | ")[1].split(" (")[0][:6] for line in stdout.splitlines() if "| copies " in line] == ["copies"] * 2
    assert [step for step, _ in logged["copies/copy_share"]] == [4, 6]
    checked = json.loads((out / "run.json").read_text())["copy_check"]
    assert (checked["step"], checked["copy_samples"], checked["training_images"]) == (6, 6, 16)
    assert (out / "copies" / "0002.png").is_file()
    assert logged["fid"][1][1] == pytest.approx(results[1]["fid"], rel=1e-5)

    best = json.loads((out / "best" / "eval.json").read_text())
    assert best["fid"] == min(r["fid"] for r in results)
    assert "FID's reference" in json.loads((out / "run.json").read_text())["startup_s"]  # a part of the startup
    DDPMPipeline.from_pretrained(str(out / "best"))
    assert sum(embedded) == 16 + 2 * 6  # the training set once, then the generated images
    assert embedded == [4] * 4 + [4, 2] * 2  # in batches of --eval_batch_size (over FID_BATCH_SIZE)

    # a second run started afresh in the same folder reads the cached reference statistics
    embedded.clear()
    run(out, "--max_train_steps", 2, "--eval_every_epochs", 1, "--eval_num_samples", 6, "--overwrite_output_dir", "--fid_weights", weights)
    assert sum(embedded) == 6


@pytest.mark.parametrize("preload", ["--preload_data", "--no-preload_data"])
def test_a_runs_reference_statistics_are_keyed_by_what_its_folder_holds_as_sample_py_keys_them(tmp_path, monkeypatch, preload):
    """Preloaded (the folder opened again for what it holds) or streamed (read from the dataset the run streams)."""
    monkeypatch.setattr(metrics, "feature_extractor", lambda weights=None: (TinyFeatures(), "tiny-features"))
    (tmp_path / "inception.pth").touch()
    out, images = tmp_path / "run", image_folder(tmp_path / "images")
    run(out, "--dataset", images, preload, "--max_train_steps", 1, "--eval_every_epochs", 1, "--eval_num_samples", 2,
        "--fid_weights", tmp_path / "inception.pth")  # fmt: skip
    key = torch.load(out / metrics.REFERENCE_FILE, weights_only=True)["key"]
    assert key["contents"] == metrics.dataset_contents(folder_options(images), 16) and key["contents"]["files"] == 16
    assert metrics.shared_reference_path(key).is_file()


@pytest.mark.slow
@pytest.mark.parametrize("during", ["grid", "evaluation"])
def test_a_stop_signal_during_the_grid_or_an_evaluation_leaves_it_and_keeps_the_step(tmp_path, monkeypatch, capsys, during):
    """SIGTERM while the epoch's grid or its FID samples are drawn (an evaluation may take hours, a preemption's
    grace a minute): no batch of samples after it, the step saved, exit 143; the same command goes on."""
    import sample

    monkeypatch.setattr(metrics, "feature_extractor", lambda weights=None: (TinyFeatures(), "tiny-features"))
    monkeypatch.setattr(metrics, "FID_BATCH_SIZE", 2)
    weights = tmp_path / "inception.pth"
    weights.touch()
    generated, generate = [], sampling.generate
    signal_at = 1 if during == "grid" else 2  # epoch 0's grid is the first call, its evaluation's batches next

    def signalled(*args, **kwargs):
        generated.append(1)
        if len(generated) == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return generate(*args, **kwargs)

    monkeypatch.setattr(sampling, "generate", signalled)
    out, flags = tmp_path / "run", ("--max_train_steps", 6, "--eval_every_epochs", 1, "--eval_num_samples", 6,
                                    "--fid_weights", weights)  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        run(out, *flags)
    assert stopped.value.code == 143 and len(generated) == signal_at  # nothing drawn after the signal
    stdout = capsys.readouterr().out
    assert "the evaluation after epoch 0 is left unfinished, for SIGTERM" in stdout
    assert "stopped by SIGTERM at step 2: saved" in stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-2"]
    assert (out / "samples" / "0000.png").is_file() and not (out / "eval_results.json").exists()
    monkeypatch.setattr(sampling, "generate", generate)
    run(out, *flags)  # the same command: on from step 2, the evaluations of epochs 1 and 2
    assert "resumed from" in capsys.readouterr().out
    assert [r["step"] for r in json.loads((out / "eval_results.json").read_text())] == [4, 6]


def test_best_holds_the_weights_of_the_evaluation_that_won(tmp_path, monkeypatch):
    """best/ is the network that was scored lowest, weight for weight: here the second of three
    evaluations (their FIDs scripted), neither the first nor the last; the EMA weights that the
    checkpoint of its step holds."""
    import sample

    monkeypatch.setattr(metrics, "feature_extractor", lambda weights=None: (TinyFeatures(), "tiny-features"))
    fids, real_scores = iter([3.0, 1.0, 2.0]), metrics.Generated.scores
    monkeypatch.setattr(metrics.Generated, "scores", lambda *args, **kwargs: {**real_scores(*args, **kwargs), "fid": next(fids)})
    weights = tmp_path / "inception.pth"
    weights.touch()
    out = tmp_path / "run"
    # 2 steps per epoch, scored after each of 3, a checkpoint at each
    run(out, "--max_train_steps", 6, "--eval_every_epochs", 1, "--eval_num_samples", 4, "--fid_weights", weights,
        "--checkpointing_steps", 2)  # fmt: skip
    results = json.loads((out / "eval_results.json").read_text())
    assert [(r["step"], r["fid"], r["best"]) for r in results] == [(2, 3.0, True), (4, 1.0, True), (6, 2.0, False)]
    assert json.loads((out / "best" / "eval.json").read_text())["step"] == 4
    best = rundir.load_model(out / "best")[0].state_dict()
    at = {step: rundir.load_model(out / "checkpoints" / f"checkpoint-{step}", ema=True)[0].state_dict() for step in (2, 4, 6)}
    assert best.keys() == at[4].keys() and all(torch.equal(best[name], at[4][name]) for name in best)
    for step in (2, 6):  # the weights did change between evaluations
        assert not all(torch.equal(best[name], at[step][name]) for name in best), step


def image_folder(folder, n=16, size=16):
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(shapes.make_shapes(n, size)):
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{i:02d}.png")
    return folder


def test_missing_weights_stop_training_at_start_up(tmp_path, no_weights_anywhere, capsys):
    # (on images of one's own: the built-in shapes need no Inception, tests/test_shapescore.py)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run(out, "--dataset", image_folder(tmp_path / "images"), "--max_train_steps", 4, "--eval_every_epochs", 1)
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "--fid_weights PATH" in err[0], err
    assert not (out / "train_config.json").exists()  # nothing was trained


EVAL_ERRORS = [
    (["--eval_every_epochs", "0"], "--eval_every_epochs must be at least 1"),
    (["--eval_num_samples", "1"], "--eval_num_samples must be at least 2"),
    (["--fid_weights", "/no/such/weights.pth", "--eval_every_epochs", "1"], "--fid_weights /no/such/weights.pth: no such file"),
]


@pytest.mark.parametrize("flags, message", EVAL_ERRORS, ids=[m for _, m in EVAL_ERRORS])
def test_bad_eval_flags_are_one_line_and_exit_code_2(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        run(tmp_path, *flags)
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and message in err[0], err


def test_a_streamed_reference_skips_an_unreadable_image_with_a_warning(tmp_path, capsys):
    from PIL import Image

    for i in range(3):
        Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / f"{i}.png")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    dataset = sources.open_dataset(str(tmp_path), 8)
    batches = list(metrics.uint8_batches(dataset, 2))
    assert sum(len(b) for b in batches) == 3
    assert "broken.png" in capsys.readouterr().err
