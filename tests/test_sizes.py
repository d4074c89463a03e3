"""Any aspect ratio, one shape per run (issue 64, item 3): `--image_size WxH` through every family, on pixels
and latents: trained, sampled, evaluated and resumed bit-exactly."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode
from torchvision.transforms import v2 as T

from ddpm_train import config
from ddpm_train.data import data
from ddpm_train.data import pixels
from ddpm_train.data import shapes
from ddpm_train.perf import flops
from ddpm_train.data import autoencoder
from ddpm_train.data import latents
from ddpm_train.evaluation import metrics
from ddpm_train.networks import model as models
import sample
from ddpm_train.evaluation import sampling
from ddpm_train.evaluation import shapescore
from ddpm_train import sizes
from ddpm_train.errors import ConfigError
from test_latent_train import FEW
from test_latents import make_kl
from test_metrics import TinyFeatures, image_folder
from test_train import tensors_of
from test_train import run as train

WIDE = "24x16"  # width 24, height 16


def test_a_size_is_a_side_or_width_by_height():
    assert [sizes.parse(text) for text in ("64", "96x64", "64x64", " 96 X 64 ", 32)] == [64, "96x64", 64, "96x64", 32]
    assert sizes.height_width("96x64") == sizes.height_width([64, 96]) == (64, 96) and sizes.height_width(8) == (8, 8)
    assert sizes.sample_size("96x64") == [64, 96] and sizes.spelled("96x64") == "width 96, height 64"
    assert sizes.divided("96x64", 8) == "12x8" and sizes.times("12x8", 8) == "96x64" and sizes.divided(64, 8) == 8
    for bad, says in (("96by64", "give one side"), ("0x64", "from 8 to 8192"), ("96x64x3", "give one side")):
        with pytest.raises(ConfigError, match=says):
            sizes.parse(bad)


def test_auto_picks_by_the_area():
    assert models.resolve_model_name("auto", "256x64") == "ref128"  # the area of 128x128
    assert models.resolve_model_name("auto", "96x43") == "adm64"  # about 64x64's
    assert models.resolve_model_name("auto", "96x64") == "small"


def test_each_side_must_be_the_family_s_multiple():
    models.check_image_size("ref128", "96x64")
    with pytest.raises(ConfigError, match="--image_size 96x60: it halves its input 5 times, so each side must be a multiple of 32"):
        models.check_image_size("ref128", "96x60")
    with pytest.raises(ConfigError, match="not a multiple of the VAE's factor 8 .*: use 16 or 24x16"):
        autoencoder.check_image_size("20x16", 8)


def test_an_image_is_resized_to_cover_the_box_then_cropped():
    wide = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 90, 3), dtype=np.uint8))
    assert pixels.image_transform(WIDE)(wide).shape == (3, 16, 24)  # 90x30 -> 48x16, the middle 24 columns
    assert pixels.image_transform("16x24", center_crop=False)(wide).shape == (3, 24, 16)
    assert torch.equal(pixels.image_transform(WIDE)(wide), T.PILToTensor()(wide.resize((48, 16), Image.BILINEAR).crop((12, 0, 36, 16))))
    # a square box: torchvision's Resize(side) and CenterCrop(side), as before
    stock = T.Compose([T.Resize(16, antialias=True), T.CenterCrop(16), T.PILToTensor()])
    assert torch.equal(pixels.image_transform(16)(wide), stock(wide))


def test_the_built_in_shapes_keep_their_proportions_on_a_wide_canvas():
    images, labels = shapes.make_shapes(64, "48x24", seed=0, max_shapes=1, with_labels=True)
    assert images.shape == (64, 3, 24, 48) and labels["shape_map"].shape == (64, 24, 48)
    circles = labels["kind"][:, 0] == 0
    area = math.pi * (labels["radius"][circles, 0] * 24) ** 2  # the radius is a share of the shorter side
    assert torch.allclose(labels["pixels"][circles, 0], area, rtol=0.1)
    assert (labels["center"][..., 0] <= 2).all() and (labels["center"][..., 0] > 1).any()  # x reaches the right half
    square = shapes.make_shapes(4, 16, seed=3)
    assert torch.equal(square, shapes.make_shapes(4, "16x16", seed=3))


def test_the_shape_scorer_trains_on_a_wide_canvas():
    scorer = shapescore.train(WIDE, num_images=64, steps=2, log=lambda _: None)
    assert "24x16px" in scorer.name and scorer(shapes.make_shapes(2, WIDE)).shape == (2, 128)


@pytest.mark.parametrize("name", ["tiny", "edm2tiny", "dit-tiny"])
def test_flops_of_a_wide_step_are_the_counters(name):
    network = models.build_network(name, WIDE, device="meta")
    x, t = torch.empty(2, 3, 16, 24, device="meta"), torch.zeros(2, device="meta")
    with FlopCounterMode(display=False) as counter:
        network(x, t, return_dict=False)[0].float().square().mean().backward()
    assert flops.network_flops(name, WIDE, 2)["flops_fwdbwd"] == counter.get_total_flops() > 0


def test_a_wide_grid_has_fewer_columns(tmp_path):
    sampling.save_grid(torch.zeros(16, 3, 8, 32, dtype=torch.uint8), tmp_path / "grid.png")
    with Image.open(tmp_path / "grid.png") as grid:
        assert grid.size == (2 * 32 + 3 * 2, 8 * 8 + 9 * 2)  # 2 columns of 8 rows: about as wide as tall
    assert sampling.grid_labels(2, 16, "32x8").tolist() == [0, 0, 1, 1] * 4


def assert_same_weights(straight, resumed, *parts):
    for part in parts:
        a, _ = tensors_of(straight / part)
        b, _ = tensors_of(resumed / part)
        assert a.keys() == b.keys() and a and all(torch.equal(a[key], b[key]) for key in a), part


@pytest.fixture
def stand_in_inception(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "feature_extractor", lambda weights=None: (TinyFeatures(), "tiny-features"))
    monkeypatch.setattr(metrics, "FID_BATCH_SIZE", 4)
    (tmp_path / "inception.pth").touch()
    return tmp_path / "inception.pth"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "edm2tiny", "dit-tiny"])
def test_every_family_trains_samples_evaluates_and_resumes_bit_exactly_at_width_by_height(tmp_path, capsys, name,
                                                                                           stand_in_inception):
    flags = ["--model", name, "--image_size", WIDE, "--shapes_num_images", 16, "--train_batch_size", 4,
             "--max_train_steps", 4, "--checkpointing_steps", 2, "--eval_every_epochs", 1, "--eval_num_samples", 4,
             "--fid_weights", stand_in_inception, "--num_inference_steps", 2, "--save_images_epochs", 1]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, *flags)
    out = capsys.readouterr().out
    assert "images at width 24, height 16" in out and "eval epoch 0 step 4 | FID" in out
    assert json.loads((straight / "eval_results.json").read_text())[0]["fid"] > 0
    with Image.open(straight / "samples" / "0000.png") as grid:  # TINY's 4 samples: 2 by 2 cells of 24x16
        assert grid.size == (2 * 24 + 3 * 2, 2 * 16 + 3 * 2)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "checkpoint-2", resumed / "checkpoints" / "checkpoint-2")
    train(resumed, *flags)
    assert "resumed from" in capsys.readouterr().out
    assert_same_weights(straight, resumed, "checkpoints/checkpoint-4", "unet")
    sample.main(sample.parse_args([str(straight), "--num_images", "2", "--num_inference_steps", "2", "--no-copies",
                                   "--output", str(tmp_path / "s")]))  # fmt: skip
    with Image.open(tmp_path / "s" / "000000.png") as image:
        assert image.size == (24, 16)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "edm2tiny", "dit-tiny"])
def test_every_family_on_latents_trains_samples_and_resumes_bit_exactly_at_width_by_height(tmp_path, capsys, monkeypatch,
                                                                                           name):
    monkeypatch.setenv(latents.CACHE_ENV, str(tmp_path / "cache"))
    vae = make_kl(tmp_path / "vae")  # factor 2: 12x8 latents
    flags = [*FEW, "--model", name, "--vae", vae, "--image_size", WIDE, "--max_train_steps", 6, "--checkpointing_steps", 3,
             "--save_images_epochs", 1]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, *flags)
    assert "as 12x8x4 latents" in capsys.readouterr().out
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "checkpoint-3", resumed / "checkpoints" / "checkpoint-3")
    train(resumed, *flags)
    assert_same_weights(straight, resumed, "checkpoints/checkpoint-6", "unet")
    sample.main(sample.parse_args([str(straight), "--num_images", "1", "--num_inference_steps", "1", "--no-copies",
                                   "--output", str(tmp_path / "s")]))  # fmt: skip
    with Image.open(tmp_path / "s" / "000000.png") as image:
        assert image.size == (24, 16)


def test_the_crop_warning_measures_against_the_run_s_shape(tmp_path):
    from test_pixels import rgb, write

    write(tmp_path / "set", [a[:, :24] for a in rgb(3, size=36)])  # 24x36 portraits: width / height 2/3
    said = lambda size: data.survey_lines(config.resolve(config.parse_args(  # noqa: E731
        ["--dataset", str(tmp_path / "set"), "--image_size", size, "--output_dir", str(tmp_path / "o")])))
    assert not any(line.startswith("warning") for line in said("16x24"))
    assert said("16")[-1].startswith("warning: cropping to 16x16 loses more than 25%")
    assert "each resized to cover 16x24 (width x height)" in said("16x24")[0]


def test_a_wide_dit_places_each_patch_as_a_square_one_would():
    from ddpm_train.networks import dit

    wide, square = dit.positions(64, 2, 3)[0].view(2, 3, 64), dit.positions(64, 3, 3)[0].view(3, 3, 64)
    assert torch.equal(wide, square[:2])  # a patch's embedding is its row's and column's, whatever the grid


def test_an_edm2_source_starts_a_run_of_another_shape():
    from ddpm_train.networks import init_from

    source, target = models.build_network("edm2tiny", 16).state_dict(), models.build_network("edm2tiny", WIDE).state_dict()
    record = dict(out_channels=3, in_channels=3, num_classes=0)
    state, _ = init_from.adapt(source, target, record, 0, True)
    assert list(state) == list(target) and all(torch.equal(a, b) for a, b in zip(state.values(), source.values()))


@pytest.mark.parametrize("reopened", ["crop", "vae"])
def test_a_width_by_height_run_whose_images_the_copy_check_reopens_evaluates(tmp_path, capsys, monkeypatch, reopened,
                                                                             stand_in_inception):
    """Random crops and a VAE's latents are not what the copy check compares: it opens the images again from the
    flags, at the run's width by height."""
    monkeypatch.setenv(latents.CACHE_ENV, str(tmp_path / "cache"))
    if reopened == "crop":  # a folder streamed with random crops (a preloaded one is compared as it is)
        how = ["--dataset", image_folder(tmp_path / "images", size=32), "--no-preload_data", "--augment", "flip,crop"]
    else:
        how = ["--vae", make_kl(tmp_path / "vae")]
    train(tmp_path / "run", *FEW, *how, "--image_size", WIDE, "--max_train_steps", 4, "--eval_every_epochs", 1,
          "--eval_num_samples", 4, "--fid_weights", stand_in_inception)  # fmt: skip
    assert "eval epoch 0 step 4 | copies " in capsys.readouterr().out
