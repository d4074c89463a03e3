"""Images as they are (issue 64): the channels and bits a run trains on come from the data."""

import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from ddpm_train import config
from ddpm_train.data import data
from ddpm_train.data import batches
from ddpm_train.data import decoding
from ddpm_train.data import sources
from ddpm_train.data import pixels
from ddpm_train.evaluation import metrics
import sample
from ddpm_train.evaluation import sampling
import train
from test_latents import make_kl
from test_train import TINY


def write(folder, arrays, mode=None, suffix=".png"):
    """Each array as an image file in `folder` (PIL picks the mode from its shape and type unless `mode`)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, a in enumerate(arrays):
        im = Image.fromarray(a)
        (im.convert(mode) if mode else im).save(folder / f"{i:03d}{suffix}")
    return folder


def gray16(n, size=16, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 65536, (size, size), dtype=np.uint16) for _ in range(n)]


def rgb(n, size=16, seed=0, channels=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (size, size, channels), dtype=np.uint8) for _ in range(n)]


def surveyed(folder):
    return data.survey(sources.open_dataset(str(folder), 16))


@pytest.mark.parametrize(
    "arrays, mode, kind",
    [(lambda: rgb(2), "L", pixels.Pixels(1, 8)), (lambda: gray16(2), None, pixels.Pixels(1, 16)),
     (lambda: rgb(2, channels=4), None, pixels.Pixels(4, 8)), (lambda: rgb(2), None, pixels.Pixels(3, 8)),
     (lambda: rgb(2), "CMYK", pixels.Pixels(3, 8))],
)  # fmt: skip
def test_the_survey_takes_the_channels_and_bits_from_the_images(tmp_path, arrays, mode, kind):
    suffix = ".tif" if mode == "CMYK" else ".png"
    found = surveyed(write(tmp_path / "set", arrays(), mode, suffix))
    assert found.pixels == kind and not found.mixed and found.looked == found.count == 2


def test_a_palette_with_transparency_has_alpha(tmp_path):
    im = Image.new("P", (8, 8))
    im.info["transparency"] = 0
    (tmp_path / "set").mkdir()
    im.save(tmp_path / "set" / "a.png")
    assert surveyed(tmp_path / "set").pixels == pixels.Pixels(4, 8)


def test_a_mixed_set_trains_rgb_and_says_so(tmp_path):
    write(tmp_path / "set", rgb(1, seed=1), "L")
    write(tmp_path / "set" / "more", rgb(1))
    args = config.resolve(config.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--output_dir", str(tmp_path / "o")]))
    assert (args.image_channels, args.image_bits) == (3, 8)
    line = data.survey_lines(args)[0]
    assert "2 images: 1 L, 1 RGB;" in line and "trained as RGB at 8 bits (images of more than one kind)" in line


def test_a_float_image_is_refused_in_one_line(tmp_path, capsys):
    write(tmp_path / "set", [np.zeros((16, 16), np.float32)], suffix=".tif")
    with pytest.raises(SystemExit) as exit_info:
        train.main(train.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--output_dir", str(tmp_path / "o")]))
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and "mode F (32-bit float)" in err
    assert not (tmp_path / "o").exists()


def test_sixteen_bits_reach_the_batch(tmp_path):
    # 1,000 and 1,100 are both 4 at 8 bits (x / 257 rounded): kept apart only at 16 bits
    arrays = [np.full((16, 16), v, np.uint16) for v in (1000, 1100)]
    write(tmp_path / "set", arrays)
    for preload in ("--preload_data", "--no-preload_data"):
        args = config.resolve(config.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--train_batch_size", "2",
                                                 preload, "--output_dir", str(tmp_path / "o")]))  # fmt: skip
        images, _, _ = data.load_images(args, decoding.Unreadable(strict=True))
        batch = torch.stack([images[i] if isinstance(images, torch.Tensor) else images[i][0] for i in range(2)])
        assert batch.dtype == torch.uint16 and batch.shape == (2, 1, 16, 16)
        x = batches.to_model_input(batch, random_flip=False)
        assert torch.allclose(x[:, 0, 0, 0], torch.tensor([1000, 1100]) / 32767.5 - 1)


def test_the_preload_budget_counts_sixteen_bit_bytes(tmp_path):
    write(tmp_path / "set", gray16(4))
    # 4 images of 16x16 at 2 bytes: 2,048 bytes, over a budget of 1,536 (8 bits would fit)
    args = config.resolve(config.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--train_batch_size", "2",
                                             "--preload_data", str(1536 / 2**30), "--output_dir", str(tmp_path / "o")]))  # fmt: skip
    images, _, _ = data.load_images(args, decoding.Unreadable(strict=True))
    assert isinstance(images, sources.FileImages)


def test_inception_takes_each_kind_as_8_bit_rgb():
    gray = torch.tensor([[[[0, 65535]]]], dtype=torch.uint16)
    assert metrics.rgb8(gray).tolist() == [[[[0, 255]]] * 3]
    rgba = torch.tensor([200, 100, 50, 51], dtype=torch.uint8).view(1, 4, 1, 1)
    assert metrics.rgb8(rgba).flatten().tolist() == [40, 20, 10]  # over black: colour x alpha / 255


def test_pngs_are_written_in_the_data_s_own_mode(tmp_path):
    sampling.save_image(torch.full((1, 4, 4), 65535, dtype=torch.uint16), tmp_path / "a.png")
    sampling.save_grid(torch.zeros(4, 4, 4, 4, dtype=torch.uint8), tmp_path / "grid.png")
    sampling.save_grid(torch.zeros(4, 1, 4, 4, dtype=torch.uint16), tmp_path / "gray.png")
    with Image.open(tmp_path / "a.png") as a, Image.open(tmp_path / "grid.png") as g, Image.open(tmp_path / "gray.png") as l:
        assert (a.mode, np.asarray(a).max(), g.mode, l.mode) == ("I;16", 65535, "RGBA", "L")


def test_a_grayscale_set_trains_one_channel_end_to_end(tmp_path, capsys):
    write(tmp_path / "set", gray16(8))
    out = tmp_path / "run"
    train.main(train.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--output_dir", str(out), "--max_train_steps", "1",
                                 "--objective", "ddpm", "--eval_batch_size", "2"]))  # fmt: skip
    assert "data: 8 images: 8 I;16; width 16, height 16" in capsys.readouterr().out
    saved = json.loads((out / "train_config.json").read_text())
    assert (saved["image_channels"], saved["image_bits"]) == (1, 16)
    with Image.open(out / "samples" / "0000.png") as grid:
        assert grid.mode == "L"
    sample.main(sample.parse_args([str(out), "--num_images", "2", "--num_inference_steps", "2", "--output", str(tmp_path / "s")]))
    with Image.open(tmp_path / "s" / "000000.png") as image:
        assert image.mode == "I;16" and image.size == (16, 16)

    from diffusers import DDPMPipeline

    pipeline = DDPMPipeline.from_pretrained(str(out))
    pipeline.set_progress_bar_config(disable=True)
    assert pipeline(batch_size=1, num_inference_steps=2, output_type="np").images.shape == (1, 16, 16, 1)
    assert "at 16px, grayscale at 16 bits by" in (out / "README.md").read_text()  # the model card


def test_a_vae_refuses_alpha_before_encoding(tmp_path, capsys):
    write(tmp_path / "set", rgb(2, channels=4))
    vae = make_kl(tmp_path / "vae")
    with pytest.raises(SystemExit) as exit_info:
        train.main(train.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--vae", str(vae),
                                     "--output_dir", str(tmp_path / "o")]))  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and "these have an alpha channel" in err


def test_a_vae_takes_a_grayscale_set_as_rgb(tmp_path):
    write(tmp_path / "set", rgb(2), "L")
    args = config.resolve(config.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--vae", str(make_kl(tmp_path / "vae")),
                                             "--output_dir", str(tmp_path / "o")]))  # fmt: skip
    assert (args.image_channels, args.image_bits) == (3, 8) and "(a VAE encodes 8-bit RGB)" in data.survey_lines(args)[0]


def test_a_crop_that_loses_much_of_most_images_says_so(tmp_path):
    write(tmp_path / "set", [np.zeros((16, 48, 3), np.uint8)] * 2 + [np.zeros((16, 16, 3), np.uint8)])
    args = config.resolve(config.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--output_dir", str(tmp_path / "o")]))
    lines = data.survey_lines(args)
    assert len(lines) == 3 and "loses more than 25% of 2 of the 3 images" in lines[2]
    assert "aspect (width/height) 1.00-3.00" in lines[0]


def test_a_vae_of_other_than_rgb_images_is_refused(tmp_path):
    write(tmp_path / "set", rgb(2))
    vae = make_kl(tmp_path / "vae", in_channels=1, out_channels=1)
    with pytest.raises(config.ConfigError, match="encodes 1-channel images, and a run gives its VAE RGB images"):
        config.resolve(config.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--vae", str(vae),
                                          "--output_dir", str(tmp_path / "o")]))  # fmt: skip


def test_a_small_set_is_told_it_may_copy(tmp_path, monkeypatch):
    write(tmp_path / "set", rgb(3))
    args = config.resolve(config.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--output_dir", str(tmp_path / "o")]))
    assert "note: 3 images is a small set, whose samples may copy" in data.survey_lines(args)[1]
    monkeypatch.setattr(data, "SMALL_SET", 3)
    assert len(data.survey_lines(args)) == 1


def png16(path, array, exif=None):
    """A 16-bit colour PNG of `array` (H, W, 3 or 4) uint16, written by hand (PIL cannot write one), with `exif`'s
    bytes in an eXIf chunk."""
    import struct
    import zlib

    height, width, channels = array.shape
    rows = b"".join(b"\0" + row.astype(">u2").tobytes() for row in array)

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 16, {3: 2, 4: 6}[channels], 0, 0, 0)
    tagged = chunk(b"eXIf", exif.removeprefix(b"Exif\0\0")) if exif else b""
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + tagged + chunk(b"IDAT", zlib.compress(rows))
                     + chunk(b"IEND", b""))  # fmt: skip


@pytest.mark.parametrize("suffix", [".png", ".tif"])
def test_sixteen_bit_colour_reaches_the_batch_and_sample_py_writes_it_back(tmp_path, suffix):
    import tifffile

    # 1,000 and 1,100 are both 4 at 8 bits, as PIL reads a 16-bit colour file: kept apart only at 16 bits
    (tmp_path / "set").mkdir()
    for i, value in enumerate((1000, 1100)):
        array = np.full((16, 16, 3), value, np.uint16)
        png16(tmp_path / "set" / f"{i}.png", array) if suffix == ".png" else tifffile.imwrite(tmp_path / "set" / f"{i}.tif", array)
    args = config.resolve(config.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--train_batch_size", "2",
                                             "--output_dir", str(tmp_path / "o")]))  # fmt: skip
    assert (args.image_channels, args.image_bits) == (3, 16) and "2 RGB;16" in data.survey_lines(args)[0]
    images, _, _ = data.load_images(args, decoding.Unreadable(strict=True))
    assert images.dtype == torch.uint16 and images[:, :, 0, 0].tolist() == [[1000] * 3, [1100] * 3]
    written = sampling.save_image(images[1], tmp_path / "000000.png")
    assert written.name == "000000.tif" and tifffile.imread(written)[0, 0].tolist() == [1100] * 3


def test_sixteen_bit_colour_takes_the_run_s_channels():
    colour = torch.full((4, 2, 2), 1000.0)
    assert pixels.to_pixels(colour, pixels.Pixels(3, 16)).shape == (3, 2, 2)
    assert pixels.to_pixels(colour[:3], pixels.Pixels(4, 16))[3].eq(65535).all()  # made opaque
    gray = Image.fromarray(np.full((2, 2), 1000, np.uint16))
    assert pixels.to_pixels(gray, pixels.Pixels(3, 16)).eq(1000).all()  # 16-bit grayscale in a colour set: repeated
    assert np.asarray(pixels.to_pixels(colour, pixels.Pixels(3, 8))).max() == 4  # a VAE's run: rounded to 8 bits


def turned_by(orientation):
    """EXIF bytes that tag an image with `orientation` (1 to 8: how a viewer turns it upright)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def quadrants(height=16, width=24):
    """An image of four flat colours, so that a turn or flip of it shows, even through a JPEG."""
    a = np.zeros((height, width, 3), np.uint8)
    a[: height // 2, : width // 2], a[: height // 2, width // 2 :] = (255, 0, 0), (0, 255, 0)
    a[height // 2 :, : width // 2], a[height // 2 :, width // 2 :] = (0, 0, 255), (255, 255, 255)
    return a


@pytest.mark.parametrize("suffix", [".jpg", ".png"])
def test_a_photo_stored_sideways_trains_upright_and_says_so(tmp_path, suffix):
    # a phone stores a portrait or landscape photo as its sensor read it, and tags how to turn it (orientation 6:
    # turn it 90 degrees clockwise); `datasets` turns a Hub set's, and a folder's must train as a viewer shows it
    (tmp_path / "set").mkdir()
    upright = Image.fromarray(quadrants())
    upright.save(tmp_path / "set" / f"a{suffix}", quality=100)
    upright.transpose(Image.Transpose.ROTATE_90).save(tmp_path / "set" / f"b{suffix}", exif=turned_by(6), quality=100)
    args = config.resolve(config.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--image_size", "24x16",
                                             "--train_batch_size", "2", "--output_dir", str(tmp_path / "o")]))  # fmt: skip
    line = data.survey_lines(args)[0]
    assert "width 24, height 16 (1 turned upright by their EXIF orientation), aspect (width/height) 1.50;" in line
    images, _, _ = data.load_images(args, decoding.Unreadable(strict=True))
    assert (images[0].int() - images[1].int()).abs().max() <= 8  # the sideways file as the upright one
    # a cache of these images made before they were turned (latents, FID's statistics) is not read for them
    assert data.open_run_dataset(args).identity(args)["turned"] == 1
    (tmp_path / "set" / f"b{suffix}").unlink()
    args = config.resolve(config.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--output_dir", str(tmp_path / "o")]))
    assert "turned" not in data.open_run_dataset(args).identity(args)  # other sets' caches keep their keys


@pytest.mark.parametrize("orientation", range(1, 9))
def test_each_exif_orientation_turns_a_16_bit_tensor_as_pil_turns_an_image(orientation):
    im = Image.fromarray(np.random.default_rng(orientation).integers(0, 256, (3, 5, 3), dtype=np.uint8))
    im.getexif()[0x0112] = orientation
    expected = torch.from_numpy(np.array(ImageOps.exif_transpose(im))).permute(2, 0, 1)
    assert torch.equal(pixels.UPRIGHT[orientation](torch.from_numpy(np.array(im)).permute(2, 0, 1)), expected)


@pytest.mark.parametrize("orientation, turned", [(6, True), (9, False)])
def test_a_16_bit_colour_file_is_turned_by_its_orientation_and_a_bad_one_leaves_it(tmp_path, orientation, turned):
    array = (quadrants().astype(np.uint16) * 257)[:, :, :3]
    sideways = np.ascontiguousarray(np.rot90(array))  # stored turned 90 degrees anticlockwise
    png16(tmp_path / "a.png", sideways, exif=turned_by(orientation))
    image, error = sources.FileImages([tmp_path / "a.png"], pixels.image_transform("24x16" if turned else "16x24",
                                                                              pixels=pixels.Pixels(3, 16)))[0]  # fmt: skip
    assert error is None and torch.equal(image, torch.from_numpy(array if turned else sideways).permute(2, 0, 1))
    assert pixels.read_header(tmp_path / "a.png") == ("RGB;16", (24, 16) if turned else (16, 24), turned)


def test_the_survey_decodes_no_png(tmp_path, monkeypatch):
    from PIL import PngImagePlugin

    write(tmp_path / "set", rgb(1))
    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", lambda self: pytest.fail("the survey decoded a PNG"))
    assert pixels.read_header(tmp_path / "set" / "000.png") == ("RGB", (16, 16), False)


def test_an_iphone_s_heic_and_an_avif_train_upright(tmp_path):
    # pillow-heif turns a HEIC by its orientation as it opens it, so the run must not turn it again
    (tmp_path / "set").mkdir()
    upright = Image.fromarray(quadrants())
    upright.save(tmp_path / "set" / "a.avif", quality=100)
    upright.transpose(Image.Transpose.ROTATE_90).save(tmp_path / "set" / "b.heic", exif=turned_by(6), quality=100)
    args = config.resolve(config.parse_args([*TINY, "--dataset", str(tmp_path / "set"), "--image_size", "24x16",
                                             "--train_batch_size", "2", "--output_dir", str(tmp_path / "o")]))  # fmt: skip
    assert "2 images: 2 RGB; width 24, height 16, aspect" in data.survey_lines(args)[0]
    images, _, _ = data.load_images(args, decoding.Unreadable(strict=True))
    centres = lambda x: x[:, [4, 4, 12, 12], [6, 18, 6, 18]].int()  # noqa: E731  (lossy: each quadrant's middle)
    expected = centres(torch.from_numpy(quadrants()).permute(2, 0, 1))
    assert len(images) == 2 and all((centres(image) - expected).abs().max() <= 8 for image in images)


@pytest.mark.slow
def test_without_pillow_heif_a_folder_s_heic_files_are_not_looked_for():
    import subprocess
    import sys

    code = "import sys; sys.modules['pillow_heif'] = None; from ddpm_train.data import pixels; print(pixels.IMAGE_EXTENSIONS)"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert ".png" in found and ".heic" not in found


def test_a_set_of_images_smaller_than_the_run_says_they_are_scaled_up(tmp_path):
    write(tmp_path / "set", rgb(2, size=16) + rgb(1, size=40))
    lines = lambda size: data.survey_lines(config.resolve(config.parse_args(  # noqa: E731
        [*TINY, "--dataset", str(tmp_path / "set"), "--image_size", size, "--output_dir", str(tmp_path / "o")])))
    assert "warning: 2 of the 3 images looked at are smaller than 32x32 and are scaled up" in lines("32")[2]
    assert "warning: 2 of the 3 images looked at are smaller than 32x16" in lines("32x16")[2]  # the width binds
    assert not any("scaled up" in line for line in lines("16"))


@pytest.mark.parametrize("stored, turn, box", [((256, 192), 1, (16, 16)), ((800, 100), 6, (16, 96))])
def test_a_jpeg_is_decoded_no_larger_than_its_crop_needs(tmp_path, monkeypatch, stored, turn, box):
    # PIL's draft decodes a JPEG at 1/2, 1/4 or 1/8 of its size: the least that still covers the run's box once
    # turned upright (a sideways 800x100 file covers 96 wide only at full size), and alike to the full decode
    Image.fromarray(np.asarray(Image.fromarray(quadrants()).resize(stored))).save(tmp_path / "a.jpg", exif=turned_by(turn))
    decoded, covering = [], pixels.covering
    transform = pixels.image_transform(f"{box[1]}x{box[0]}")
    monkeypatch.setattr(pixels, "covering", lambda im, h, w: decoded.append(im.size) or covering(im, h, w))
    drafted, _ = sources.FileImages([tmp_path / "a.jpg"], transform, box=box)[0]
    whole, _ = sources.FileImages([tmp_path / "a.jpg"], transform)[0]
    upright = stored[::-1] if turn >= 5 else stored
    assert decoded[1] == upright and decoded[0][0] >= box[1] and decoded[0][1] >= box[0]
    assert (decoded[0] < upright) == (turn == 1)  # reduced where that still covers the box
    assert (drafted.float() - whole.float()).abs().mean() < 2
