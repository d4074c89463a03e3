"""bench/faces.py: scikit-image's LFW crops as a train.py folder, and the faces FD that scores
a run on them. The score must see what a run gets wrong (grain, blur, the wrong images) and
not the sampling error of the real images."""

import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT))
from bench import faces  # noqa: E402


def test_the_crops_come_from_the_wheel_and_land_as_a_32px_rgb_folder(tmp_path):
    crops = faces.lfw_subset()
    assert crops.shape == (200, 25, 25) and 0 <= crops.min() < crops.max() <= 1
    assert faces.write(tmp_path, crops[:3]) == 3
    from PIL import Image

    image = Image.open(tmp_path / "001.png")
    assert image.size == (32, 32) and image.mode == "RGB"
    back = faces.read_grey(tmp_path)
    assert back.shape == (3, 32 * 32)
    assert abs(back[1].mean() - crops[1].mean()) < 0.02  # the same picture, resized


def test_the_gray_write_gives_L_files_of_the_rgb_writes_first_channel(tmp_path):
    from PIL import Image

    crops = faces.lfw_subset()[:3]
    faces.write(tmp_path / "rgb", crops)
    assert faces.main(["write", str(tmp_path / "gray"), "--gray"]) == 0  # the CLI flag: all 200
    faces.write(tmp_path / "gray3", crops, gray=True)
    for i in range(3):
        rgb, gray = Image.open(tmp_path / "rgb" / f"{i:03d}.png"), Image.open(tmp_path / "gray3" / f"{i:03d}.png")
        assert rgb.mode == "RGB" and gray.mode == "L" and gray.size == (32, 32)
        assert np.array_equal(np.asarray(gray), np.asarray(rgb)[..., 0])
        assert np.array_equal(np.asarray(Image.open(tmp_path / "gray" / f"{i:03d}.png")), np.asarray(gray))
    assert len(list((tmp_path / "gray").glob("*.png"))) == 200


@pytest.fixture(scope="module")
def real():
    return faces.to_vectors(faces.lfw_subset())


def test_the_score_sees_grain_blur_and_other_images_above_its_sampling_error(real):
    rows = dict(faces.trust_table(real))
    floor = rows["half of them, with mirrors (sampling error at half the count)"]
    assert abs(rows["the real images (the floor: 0 by construction)"]) < 1e-6
    assert rows["grain: Gaussian noise of std 0.15"] > 10 * floor
    assert rows["blurred, sigma 2 px"] > 3 * floor
    assert rows["faces only (the first 100), with mirrors"] > 10 * floor
    assert rows["uniform noise"] > rows["grain: Gaussian noise of std 0.15"]


def test_score_reads_a_folder_and_refuses_an_empty_one_in_one_line(tmp_path, capsys):
    ref, gen, empty = tmp_path / "real", tmp_path / "gen", tmp_path / "empty"
    crops = faces.lfw_subset()[::4]
    faces.write(ref, crops)
    faces.write(gen, np.clip(crops + np.random.default_rng(0).normal(0, 0.3, crops.shape), 0, 1))
    empty.mkdir()

    def score(folder):
        assert faces.main(["score", str(ref), str(folder)]) == 0
        line = capsys.readouterr().out.strip()
        assert line.startswith("faces FD ") and line.endswith("(50 images, 20 components)"), line
        return float(line.split()[2])

    assert score(gen) > 4 * score(ref)  # the same images unmirrored: only their left-right asymmetry
    with pytest.raises(SystemExit) as refused:  # SystemExit(str): that one line on stderr, exit 1
        faces.main(["score", str(ref), str(empty)])
    assert refused.value.code == f"error: no PNG or JPEG images in {empty}: give a folder of images (sample.py --output)"


def test_the_pictures_sample_py_writes_beside_its_samples_are_not_read_as_samples(tmp_path):
    from PIL import Image

    for name in ("000000.png", "000001.png", "grid.png", "copies.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / name)
    assert len(faces.read_grey(tmp_path)) == 2
