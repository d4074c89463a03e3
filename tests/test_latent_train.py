"""Latent runs end to end (issue 34): train.py --vae on a tiny random AutoencoderKL saved to a temporary
folder (latents.py itself: tests/test_latents.py). 16 built-in images at 16px, a VAE of factor 2:
the tiny network trains on 8x8x4 latents for a few steps, and samples in 1 step."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from ddpm_train import config as config_module
from ddpm_train.perf import flops
from ddpm_train.data import autoencoder
from ddpm_train.data import drawn
from ddpm_train.data import latents
from ddpm_train.data import pieces
from ddpm_train.networks import model as models
from ddpm_train.training import rundir
import sample
import train
from conftest import ROOT
from ddpm_train.errors import ConfigError
from test_latents import make_kl
from test_faults import Ranks, start_two_ranks
from test_train import TINY, run, tensors_of, visible

# On top of test_train's TINY: 16 images, 4 steps an epoch, 1 sampling step, 4 images a grid (2 by 2).
FEW = ["--shapes_num_images", 16, "--train_batch_size", 4, "--num_inference_steps", 1, "--logger", "none"]
GRID_SIDE = 2 * 16 + 3 * 2  # 2 by 2 decoded 16px images, 2px apart (torchvision's make_grid)


@pytest.fixture(autouse=True)
def _cache_and_threads(tmp_path, monkeypatch):
    """Every test's latent caches in a folder of its own, never ~/.cache; convolutions this small run
    faster on one thread than on two a busy 2-core machine shares."""
    monkeypatch.setenv(latents.CACHE_ENV, str(tmp_path / "latent-cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    """A tiny random AutoencoderKL (factor 2, 4 latent channels, scaling_factor 0.18215 in its config)."""
    return make_kl(tmp_path_factory.mktemp("vae") / "kl")


def train_latents(out, vae_flag, *flags):
    return run(out, *FEW, "--vae", vae_flag, *map(str, flags))


def cache_folders(tmp_path):
    return sorted(p.name for p in (tmp_path / "latent-cache").iterdir() if not p.name.startswith("."))


def pixels(path):
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def test_a_latent_run_writes_grids_and_a_model_that_sample_py_samples(tmp_path, vae, capsys):
    out = tmp_path / "run"
    config = train_latents(out, vae, "--max_train_steps", 4, "--save_images_epochs", 1)
    stdout = capsys.readouterr().out
    assert re.search(r"^encoded 16 images to latents in [\d.]+ s \([\d.]+ images/s, both flips, on cpu\); cached in ",
                     stdout, re.M), stdout  # fmt: skip
    assert "on 16 images at 16px as 8x8x4 latents" in stdout

    # the network takes the VAE's latents: 4 channels at 16px over the factor 2
    saved = json.loads((out / "train_config.json").read_text())
    assert (saved["latent_size"], saved["latent_channels"], saved["latent_normalization"]) == (8, 4, "vae")
    record = saved["latents"]
    assert record["vae"] == str(vae.resolve()) and record["factor"] == 2 and record["normalization"]["kind"] == "vae"
    assert record["normalization"]["scale"] == [0.18215] * 4 and record["cache"].startswith(str(tmp_path / "latent-cache"))
    unet = models.load_network(out / "unet")
    assert (unet.config.in_channels, unet.config.out_channels, unet.config.sample_size) == (4, 4, 8)
    from diffusers import DDPMScheduler

    assert not DDPMScheduler.from_pretrained(out / "scheduler").config.clip_sample  # latents are not images in [-1, 1]

    # the FLOPs line counts the denoiser's step at 8x8x4, a quarter of its pixel step at 16x16x3 (and a bit)
    latent = flops.step_flops("tiny", 8, 4, channels=4)["model_flops"]
    assert config["model_flops_per_step"] == latent < flops.step_flops("tiny", 16, 4)["model_flops"] / 3

    # the grid holds decoded images: 16px, 2 by 2
    assert [p.name for p in (out / "samples").iterdir()] == ["0000.png"]
    assert pixels(out / "samples" / "0000.png").shape == (GRID_SIDE, GRID_SIDE, 3)

    # sample.py RUN needs no flag for the VAE: the run recorded it; images are decoded to 16px RGB
    result = sample.main(sample.parse_args([str(out), "--num_images", "3", "--output", str(tmp_path / "s")]))
    assert result["num_images"] == 3
    images = [pixels(tmp_path / "s" / f"00000{i}.png") for i in range(3)]
    assert all(image.shape == (16, 16, 3) for image in images) and images[0].std() > 0
    # ... and the same seed gives the same images
    sample.main(sample.parse_args([str(out), "--num_images", "3", "--output", str(tmp_path / "again")]))
    assert all(np.array_equal(a, pixels(tmp_path / "again" / f"00000{i}.png")) for i, a in enumerate(images))
    # the pipeline alone, out of its run folder, does not say which VAE decodes it: one line says so
    shutil.copytree(out, tmp_path / "alone", ignore=shutil.ignore_patterns("train_config.json", "checkpoints"))
    with pytest.raises(SystemExit) as stopped:
        sample.main(sample.parse_args([str(tmp_path / "alone"), "--num_images", "1", "--output", str(tmp_path / "x")]))
    assert stopped.value.code == 2 and "a network of 4-channel latents, in no run folder" in capsys.readouterr().err

    # train_config.json read back with --config is the same configuration (what train.py derived is recomputed)
    argv = [*TINY, *map(str, FEW), "--vae", str(vae), "--max_train_steps", "4", "--save_images_epochs", "1",
            "--output_dir", str(out)]  # fmt: skip
    again = vars(config_module.resolve(config_module.parse_args(["--config", str(out / "train_config.json")])))
    first = vars(config_module.resolve(config_module.parse_args(argv)))
    assert again.pop("config") and first.pop("config") is None and again == first and again["latents"]["factor"] == 2


def test_resume_is_bit_identical(tmp_path, vae, capsys):
    # 6 steps straight (epochs of 4 steps: epoch 1 draws fresh latents), versus the checkpoint at step 3 resumed
    flags = ["--max_train_steps", 6, "--checkpointing_steps", 3, "--save_images_epochs", 100]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_latents(straight, vae, *flags)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "checkpoint-3", resumed / "checkpoints" / "checkpoint-3")
    capsys.readouterr()
    train_latents(resumed, vae, *flags)
    assert "resumed from" in capsys.readouterr().out

    for part in ("checkpoints/checkpoint-6", "unet"):
        a, a_ema = tensors_of(straight / part)
        b, b_ema = tensors_of(resumed / part)
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[key], b[key]) for key in a)
        if a_ema is not None:
            assert all(torch.equal(x, y) for x, y in zip(a_ema["shadow_params"], b_ema["shadow_params"]))


def test_a_run_stopped_while_encoding_encodes_only_the_rest_when_run_again(tmp_path, vae, capsys, monkeypatch):
    """Ctrl-C in the encode's second piece of three: one line, exit 130; the same command again reuses the first."""
    monkeypatch.setattr(pieces, "PIECE_IMAGES", 64)
    write, done = latents._write_piece, []

    def interrupted(*args):
        done.append(args[3].name)
        if len(done) == 2:
            raise KeyboardInterrupt
        return write(*args)

    flags = ["--shapes_num_images", 160, "--max_train_steps", 1, "--save_images_epochs", 100]
    with monkeypatch.context() as m:
        m.setattr(latents, "_write_piece", interrupted)
        with pytest.raises(SystemExit) as stopped:
            train_latents(tmp_path / "run", vae, *flags)
    assert stopped.value.code == 130 and visible(capsys.readouterr().err) == ["train.py: interrupted: stopped without saving"]
    train_latents(tmp_path / "run", vae, *flags)
    out = capsys.readouterr().out
    assert "encoded 96 images to latents in" in out and ", and reused 64 that another encode of this key had encoded (interrupted" in out, out
    assert done == [pieces.piece_name(a, b) for a, b in ((0, 64), (64, 128))]  # the first run's: one kept


def refused(out, capsys, *flags):
    """train.py's one-line refusal (exit code 2) of `flags` on `out`: the line."""
    with pytest.raises(SystemExit) as stopped:
        run(out, *FEW, *map(str, flags))
    err = visible(capsys.readouterr().err)
    assert stopped.value.code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_resume_refuses_another_vae_before_encoding_in_one_line(tmp_path, vae, capsys, monkeypatch):
    out = tmp_path / "run"
    train_latents(out, vae, "--max_train_steps", 1)
    written = (out / "train_config.json").read_text()
    # a second VAE in another folder, and other weights saved over the run's own VAE folder
    other = make_kl(tmp_path / "other", seed=1)
    overwritten = shutil.copytree(vae, tmp_path / "overwritten")
    train_latents(tmp_path / "run2", overwritten, "--max_train_steps", 1)
    make_kl(overwritten, seed=1)
    fresh = tmp_path / "fresh-cache"  # no cache: a resume that encoded first would fill it
    monkeypatch.setenv(latents.CACHE_ENV, str(fresh))
    capsys.readouterr()
    for folder, flag in ((out, other), (tmp_path / "run2", overwritten)):
        says = refused(folder, capsys, "--max_train_steps", 2, "--vae", flag)
        assert says.startswith("train.py: error: cannot resume") and "(--vae: another VAE (its encoder's weights: " in says
    assert not fresh.exists()  # refused before any image was encoded
    assert (out / "train_config.json").read_text() == written  # nor was the run's record written over
    # the normalisation, and pixels, are refused too
    assert "the latents' normalisation {'kind': 'vae', 'scaling_factor': 0.18215" in refused(
        out, capsys, "--max_train_steps", 2, "--vae", f"{vae},dataset")  # fmt: skip
    assert "(--vae: latents -> pixels)" in refused(out, capsys, "--max_train_steps", 2)


@pytest.mark.slow
def test_two_processes_encode_a_share_each_and_train_on_the_cache(tmp_path, vae, monkeypatch):
    """train.py --vae on two processes (gloo on the CPU): each encodes its share of a cold cache, the cache
    assembled is the one a single process makes, and both train on it."""
    out, images = tmp_path / "run", 80  # shares of whole 64-image blocks: [0, 64) and [64, 80)
    argv = [*TINY, *map(str, FEW), "--shapes_num_images", images, "--vae", vae, "--max_train_steps", 2,
            "--output_dir", out, "--save_images_epochs", 100]  # fmt: skip
    ranks = Ranks(start_two_ranks(argv))
    assert ranks.codes == [0, 0], ranks
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["num_processes"] == 2 and (out / "checkpoints" / "checkpoint-2").is_dir()
    two = drawn.LatentCache(saved["latents"]["cache"])
    assert [(r["rank"], r["images"]) for r in two.meta["ranks"]] == [(0, 64), (1, 16)]
    # one process, another cache folder: the same latents, byte for byte
    monkeypatch.setenv(latents.CACHE_ENV, str(tmp_path / "one-process"))
    train_latents(tmp_path / "one", vae, "--shapes_num_images", images, "--max_train_steps", 1)
    one = drawn.LatentCache(json.loads((tmp_path / "one" / "train_config.json").read_text())["latents"]["cache"])
    assert one.path != two.path and np.array_equal(one.array, two.array) and one.stats == two.stats


def test_the_same_vae_spelled_otherwise_resumes(tmp_path, vae, capsys, monkeypatch):
    """Its suffix, a relative path, another folder holding the same weights: the same latent space."""
    out = tmp_path / "run"
    train_latents(out, vae, "--max_train_steps", 1)
    copy = shutil.copytree(vae, tmp_path / "elsewhere" / "same-vae")
    monkeypatch.chdir(vae.parent)
    for step, flag in enumerate((f"{vae},vae", vae.name, copy), start=2):
        train_latents(out, flag, "--max_train_steps", step)
        assert f"resumed from {out / 'checkpoints' / f'checkpoint-{step - 1}'} at step {step - 1}" in capsys.readouterr().out
    assert (out / "checkpoints" / "checkpoint-4").is_dir()


@pytest.mark.slow
def test_the_cache_is_reused_and_rebuilt_for_another_vae_or_image_size(tmp_path, vae, capsys, monkeypatch):
    encoded = []
    encode_batch = latents._encode_batch
    monkeypatch.setattr(latents, "_encode_batch", lambda v, x: encoded.append(len(x)) or encode_batch(v, x))

    def lines(out, vae_flag, *flags):
        train_latents(tmp_path / out, vae_flag, "--max_train_steps", 1, "--save_images_epochs", 100, *flags)
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("encoded ", "latents: "))]
        return said, encoded.copy()

    said, _ = lines("first", vae)
    assert len(said) == 1 and said[0].startswith("encoded 16 images to latents") and sum(encoded) == 2 * 16  # both flips
    # the same data and VAE, another output folder: nothing encoded, and one line says so
    encoded.clear()
    said, calls = lines("second", vae)
    assert calls == [] and len(said) == 1 and said[0].startswith("latents: reusing the cache") and "encoding nothing" in said[0]
    assert cache_folders(tmp_path) == [cache_name(said[0])]
    # the same VAE's weights in another folder: the same latents, the same cache
    shutil.copytree(vae, tmp_path / "copy")
    said, calls = lines("copied", tmp_path / "copy")
    assert calls == [] and "encoding nothing" in said[0]
    # another VAE, another image size, no flips: each encodes afresh into a cache of its own
    for out, vae_flag, flags in (("other_vae", make_kl(tmp_path / "other", seed=1), []), ("size", vae, ["--image_size", 32]),
                                 ("no_flips", vae, ["--augment", "none"])):  # fmt: skip
        encoded.clear()
        said, calls = lines(out, vae_flag, *flags)
        assert sum(calls) == (16 if out == "no_flips" else 32) and said[0].startswith("encoded 16 images"), out
    assert len(cache_folders(tmp_path)) == 4
    # a cache larger than the in-memory budget (here: no budget) is memory-mapped
    encoded.clear()
    said, calls = lines("streamed", vae, "--no-preload_data")
    assert calls == [] and json.loads((tmp_path / "streamed" / "train_config.json").read_text())["latents"]["memmapped"]


def cache_name(line):
    """The cache folder's name in a 'reusing the cache FOLDER (...)' line."""
    return line.split("reusing the cache ", 1)[1].split(" ", 1)[0].rsplit("/", 1)[1]


def test_a_class_conditional_latent_run_samples_by_class_with_guidance_and_fid(tmp_path, vae, default_shape_scorer):
    out = tmp_path / "run"
    train_latents(out, vae, "--class_conditional", "--max_train_steps", 4, "--guidance_scale", "1,2",
                  "--eval_every_epochs", 1, "--eval_num_samples", 6)  # fmt: skip
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["class_names"] == ["circle", "square", "triangle"] and saved["num_classes"] == 3
    # the labels were cached with the latents: the kind of each image's one shape
    cached = drawn.LatentCache(saved["latents"]["cache"])
    _, kinds, _ = train.shapes.builtin_images(16, 16, 0, class_conditional=True)
    assert torch.equal(cached.labels, kinds) and saved["class_counts"] == torch.bincount(kinds, minlength=3).tolist()
    # evaluated at each guidance scale on decoded images, against the training images (not their latents)
    (result,) = json.loads((out / "eval_results.json").read_text())
    assert [s["guidance_scale"] for s in result["scales"]] == [1.0, 2.0] and np.isfinite(result["fid"])
    assert result["reference_images"] == 16

    def by_class(labels, folder, scale="2"):
        sample.main(sample.parse_args([str(out), "--num_images", "2", "--class_labels", labels, "--guidance_scale", scale,
                                       "--output", str(tmp_path / folder)]))  # fmt: skip
        return [pixels(tmp_path / folder / f"00000{i}.png") for i in range(2)]

    circles, squares = by_class("circle", "circles"), by_class("square", "squares")
    assert all(image.shape == (16, 16, 3) for image in circles + squares)
    # the same noise (seeds) under another label gives other images: the labels reach the network
    assert not np.array_equal(circles[0], squares[0]) and np.array_equal(circles[0], by_class("circle", "again")[0])


def test_a_latent_runs_fid_statistics_are_keyed_by_what_its_folder_holds_as_sample_py_keys_them(tmp_path, vae, monkeypatch):
    from ddpm_train.evaluation import metrics
    from test_metrics import TinyFeatures, folder_options, image_folder

    monkeypatch.setattr(metrics, "feature_extractor", lambda weights=None: (TinyFeatures(), "tiny-features"))
    (tmp_path / "w.pth").touch()
    out, images = tmp_path / "run", image_folder(tmp_path / "images")
    train_latents(out, vae, "--dataset", images, "--max_train_steps", 1, "--eval_every_epochs", 1, "--eval_num_samples", 2,
                  "--fid_weights", tmp_path / "w.pth")  # fmt: skip
    key = torch.load(out / metrics.REFERENCE_FILE, weights_only=True)["key"]
    assert key["contents"] == metrics.dataset_contents(folder_options(images), 16) and key["contents"]["files"] == 16


def test_edm_with_an_edm2_preset_on_latents_normalised_by_the_data(tmp_path, vae):
    out = tmp_path / "run"
    train_latents(out, f"{vae},dataset", "--model", "edm2tiny", "--max_train_steps", 2)
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["objective"] == "edm" and saved["latent_normalization"] == "dataset"
    norm = saved["latents"]["normalization"]
    # EDM's data has std sigma_data = 0.5: each channel of the drawn latents is scaled to it
    assert norm["kind"] == "dataset" and norm["target_std"] == 0.5 and norm["normalized_std"] == pytest.approx([0.5] * 4)
    unet = models.load_network(out / "unet")
    assert type(unet).__name__ == "EDM2UNet" and (unet.config.in_channels, unet.config.sample_size) == (4, 8)
    result = sample.main(sample.parse_args([str(out), "--num_images", "2", "--num_inference_steps", "2",
                                            "--output", str(tmp_path / "s")]))  # fmt: skip
    assert result["sampler"].startswith("edm_heun") and pixels(tmp_path / "s" / "000001.png").shape == (16, 16, 3)


def test_the_step_trains_on_each_epochs_draws_as_drawn(tmp_path, vae):
    """batches.Batches of a LatentDataset: the epoch's batches (batches.epoch_batches' order) hold that epoch's draws,
    with their labels, and the step takes them as they are (flips were drawn with them)."""
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    labels = torch.arange(8) % 3
    loaded = autoencoder.load_vae(vae)
    key = latents.cache_key(dict(name="unit"), loaded, 16)
    cache = latents.cached_latents(loaded, lambda: [(images, labels)], key, progress=False, log=lambda line: None)
    record = autoencoder.normalization(cache, loaded, "dataset")
    dataset = drawn.LatentDataset(cache, record, seed=3)
    batches = train.batches.Batches(dataset, 4, 3, torch.device("cpu"), labels=cache.labels)
    for epoch in (0, 1):
        order = train.batches.epoch_batches(8, 4, 3, epoch)
        got = list(batches.epoch(epoch, start=1))  # a resumed epoch starts mid-way
        assert len(got) == 1
        (z, y), index = got[0], order[1]
        assert torch.equal(z, autoencoder.normalize(cache.draw(index, epoch, 3), record)) and torch.equal(y, labels[index])
        assert train.batches.to_model_input(z) is z
    assert not torch.equal(list(batches.epoch(0))[0][0], list(batches.epoch(1))[0][0])


def test_the_vae_flag_and_what_its_config_says_before_any_weights_load(tmp_path, vae):
    from test_latents import make_tiny

    assert autoencoder.parse_vae_flag("org/vae") == ("org/vae", None)
    assert autoencoder.parse_vae_flag("some/folder,dataset") == ("some/folder", "dataset")
    assert autoencoder.parse_vae_flag("a,b/vae,vae") == ("a,b/vae", "vae") and autoencoder.parse_vae_flag("a,b") == ("a,b", None)
    found = autoencoder.vae_settings(vae)
    assert (found["cls"], found["factor"], found["channels"], found["scaling_factor"]) == ("AutoencoderKL", 2, 4, True)
    tiny = autoencoder.vae_settings(make_tiny(tmp_path / "tiny"))
    assert (tiny["cls"], tiny["factor"]) == ("AutoencoderTiny", autoencoder.vae_factor(autoencoder.load_vae(tmp_path / "tiny")))
    assert autoencoder.normalization_kind(found) == "vae" and autoencoder.normalization_kind(found, "dataset") == "dataset"
    # a config.json without a scaling_factor: the dataset's by default, and ",vae" is one line
    config = json.loads((vae / "config.json").read_text())
    del config["scaling_factor"]
    shutil.copytree(vae, tmp_path / "unscaled")
    (tmp_path / "unscaled" / "config.json").write_text(json.dumps(config))
    unscaled = autoencoder.vae_settings(tmp_path / "unscaled")
    assert autoencoder.normalization_kind(unscaled) == "dataset"
    with pytest.raises(ConfigError, match="sets no scaling_factor to normalise by: use --vae .*,dataset"):
        autoencoder.normalization_kind(unscaled, "vae")


def test_immiscible_alone_takes_the_authors_k_for_latents(vae):
    argv = [*TINY, "--vae", str(vae), "--loss_terms", "immiscible"]
    assert config_module.resolve(config_module.parse_args(argv)).loss_terms == "immiscible:64"  # 4 on pixels


def test_the_encoder_takes_a_bounded_number_of_pixels_at_once(tmp_path, vae, monkeypatch):
    """A batch of 64 images and their flips at 256px through SD's VAE at once held 21 GiB: the encoder gets
    ENCODE_PIXELS at a time, and the latents are the same."""
    images = torch.rand(6, 3, 16, 16) * 2 - 1
    loaded = autoencoder.load_vae(vae)
    whole = latents.cached_latents(loaded, lambda: [images], latents.cache_key({}, loaded, 16), root=tmp_path / "a",
                                   progress=False, log=lambda line: None)  # fmt: skip
    sizes = []
    encode_batch = latents._encode_batch
    monkeypatch.setattr(latents, "_encode_batch", lambda v, x: sizes.append(len(x)) or encode_batch(v, x))
    monkeypatch.setattr(autoencoder, "ENCODE_PIXELS", 5 * 16 * 16)
    parts = latents.cached_latents(loaded, lambda: [images], latents.cache_key({}, loaded, 16), root=tmp_path / "b",
                                   progress=False, log=lambda line: None)  # fmt: skip
    assert sizes == [5, 5, 2]  # 6 images and their 6 flips
    assert np.allclose(np.asarray(whole.array), np.asarray(parts.array), atol=1e-6)


@pytest.mark.slow
def test_every_preset_builds_for_latents():
    """At 256px, SD's VAE gives 32x32x4 latents: every preset takes them and gives them back."""
    for name in models.PRESETS:
        models.check_image_size(name, 256, 8)
        net = models.build_network(name, 32, device="meta", channels=4)
        with torch.no_grad():
            out = net(torch.empty(2, 4, 32, 32, device="meta"), torch.zeros(2, device="meta"), return_dict=False)[0]
        assert out.shape == (2, 4, 32, 32), name


BAD_INPUTS = {
    "no folder": (["--vae", "{tmp}/no/such/vae"], "no such folder"),
    "empty folder": (["--vae", "{tmp}/empty"], "holds no VAE"),
    "a unet": (["--vae", "{tmp}/unet"], "holds no VAE ({tmp}/unet/config.json is a UNet2DModel"),
    "size": (["--vae", "{vae}", "--image_size", "17"], "--image_size 17 is not a multiple of the VAE's factor 2"),
    "hub offline": (["--vae", "some-org/some-vae"], "hf download some-org/some-vae --local-dir DIR"),  # HF_HUB_OFFLINE=1
    "random crops": (["--vae", "{vae}", "--augment", "flip,crop"], "--augment crop draws a new random crop"),
}


@pytest.mark.parametrize("flags, message", BAD_INPUTS.values(), ids=BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, vae, capsys, flags, message):
    (tmp_path / "empty").mkdir()
    models.build_network("tiny", 16).save_pretrained(tmp_path / "unet")
    flags = [f.format(tmp=tmp_path, vae=vae) for f in flags]
    with pytest.raises(SystemExit) as stopped:
        run(tmp_path / "out", *FEW, *flags)
    assert stopped.value.code == 2
    err = visible(capsys.readouterr().err)
    assert len(err) == 1 and message.format(tmp=tmp_path) in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "out").exists() and not (tmp_path / "latent-cache").exists()


LATENT_CONFIGS = sorted((ROOT / "configs").glob("*latent*.yaml"))


def test_the_tests_read_no_users_hugging_face_cache():
    """conftest points the Hub's and datasets' caches at a folder of the test run's own: a user's cache holding
    SD's VAE would otherwise let the offline dry run below find it (and a Hub id load in other tests)."""
    import datasets.config
    import huggingface_hub.constants as hub
    from conftest import HF_HOME

    for cache in (hub.HF_HUB_CACHE, datasets.config.HF_DATASETS_CACHE):
        assert Path(cache).is_relative_to(HF_HOME), cache


@pytest.mark.slow
@pytest.mark.parametrize("path", LATENT_CONFIGS, ids=[p.name for p in LATENT_CONFIGS])
def test_the_latent_configs_describe_a_256px_run_on_32x32x4_latents(tmp_path, path, capsys):
    """Offline (HF_HUB_OFFLINE=1) the dry run cannot read the VAE's config.json: it says it assumes SD's 8x, 4-channel
    VAE, and counts the denoiser's FLOPs there."""
    assert {yaml.safe_load(p.read_text())["model"] for p in LATENT_CONFIGS} == {"edm2g", "ddpm32", "dit-xl2"}  # G, a UNet2DModel, SiT-XL/2
    config = train.main(train.parse_args(["--config", str(path), "--dry_run", "--output_dir", str(tmp_path / "x")]))
    assert (config["image_size"], config["latent_size"], config["latent_channels"]) == (256, 32, 4)
    assert "assumes Stable Diffusion's 8x, 4-channel VAE" in capsys.readouterr().out
    per_image = flops.step_flops(config["model"], 32, 1, channels=4)["model_flops"]
    assert config["model_flops_per_step"] == per_image * config["train_batch_size"]
    assert yaml.safe_load(path.read_text())["vae"] == config["vae"]


def test_ema_py_reconstructs_a_latent_ddpm_run_at_its_latent_size(tmp_path, vae):
    """ema.py builds a latent run's network at its latents' size and channels (not the image's), and
    sample.py samples the reconstruction through the run's VAE."""
    from ddpm_train.training import ema as posthoc_ema

    out = tmp_path / "run"
    train_latents(out, str(vae), "--max_train_steps", 4, "--ema", "power", "--ema_stds", "0.05,0.1",
                  "--ema_snapshot_every", 2)  # fmt: skip
    rebuilt = posthoc_ema.main(posthoc_ema.parse_args(["reconstruct", str(out), "--std", "0.07"]))
    network, _ = rundir.RunDir(rebuilt).load()
    assert network.config.in_channels == 4 and network.config.sample_size == 8  # 8x8x4 latents of 16px images
    samples = tmp_path / "samples"
    sample.main(sample.parse_args([str(rebuilt), "--num_images", "2", "--output", str(samples), "--num_inference_steps", "1"]))
    assert pixels(samples / "000000.png").shape == (16, 16, 3)  # decoded through the run's VAE


def test_a_file_in_the_latent_caches_place_is_one_line_before_any_encode(tmp_path, vae, capsys, monkeypatch):
    (tmp_path / "a_file").touch()
    monkeypatch.setenv(latents.CACHE_ENV, str(tmp_path / "a_file" / "cache"))
    says = refused(tmp_path / "run", capsys, "--max_train_steps", 1, "--vae", vae)
    assert says == (f"train.py: error: ${latents.CACHE_ENV} {tmp_path / 'a_file' / 'cache'}: {tmp_path / 'a_file'} "
                    f"is a file, not a folder; choose another ${latents.CACHE_ENV}")  # fmt: skip


@pytest.mark.slow
def test_a_stop_signal_to_every_process_of_the_job_saves_the_checkpoint_with_draw_workers(tmp_path, vae, monkeypatch, capsys):
    """A cluster's preemption sends SIGTERM to every process of the job (a terminal's Ctrl-C, SIGINT, to the
    whole process group): the draw workers died of it and the main process failed at its next batch ("DataLoader
    worker ... is killed by signal: Terminated") before saving. The workers leave it to the main process, which
    saves the step's checkpoint, exits 143 and ends them."""
    import multiprocessing
    import os
    import signal
    import subprocess

    done = flops.StepTimer.step_done

    def step_done(self):
        done(self)
        if self.steps_seen == 3:  # the job's processes signalled by another (a worker takes its parent's as a stop)
            subprocess.run(["kill", "-TERM", *(str(w.pid) for w in multiprocessing.active_children())], check=True)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(flops.StepTimer, "step_done", step_done)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        train_latents(out, vae, "--dataloader_num_workers", 2, "--max_train_steps", 40, "--save_images_epochs", 100)
    assert stopped.value.code == 143, capsys.readouterr().err[-2000:]
    assert (out / "checkpoints" / "checkpoint-3").is_dir() and "stopped by SIGTERM at step 3" in capsys.readouterr().out
    assert multiprocessing.active_children() == []  # its workers ended with it (workers.stop_workers)
