import argparse

import numpy as np
import pytest
import torch
from PIL import Image

from ddpm_train.evaluation import copies
from ddpm_train.data import decoding
from ddpm_train.data import sources
from ddpm_train.data import shapes
from ddpm_train.errors import ConfigError


def random_images(count, size=8, seed=0):
    return torch.randint(0, 256, (count, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def found(samples, training, flips=False):
    return copies.search(samples, copies.TrainingImages(training), flips)


def test_a_sample_equal_to_a_training_image_or_with_flips_its_mirror_image_is_a_copy():
    training = random_images(50)
    samples = torch.stack([training[3], training[7].flip(-1), random_images(1, seed=1)[0]])
    nearest = found(samples, training, flips=True)
    assert nearest.copies().tolist() == [True, True, False]
    assert nearest.indices[:2, 0].tolist() == [3, 7] and nearest.flipped[:2, 0].tolist() == [False, True]
    assert nearest.distances[0, 0] == 0 and nearest.ratios()[0] == 0  # measured directly: an exact copy is at 0
    # without flips the mirror image is one more image far from every training image (random pixels)
    assert found(samples, training).copies().tolist() == [True, False, False]


def test_a_sample_far_from_all_is_not_a_copy_and_one_of_an_image_held_twice_is():
    training = random_images(40)
    nearest = found(random_images(20, seed=1), training, flips=True)
    assert not nearest.copies().any() and (nearest.ratios() > 0.8).all()  # random pixels: all about as far
    training[9] = training[4]  # the set holds image 4 twice: nearest and second nearest both at 0
    nearest = found(training[4:5], training)
    assert nearest.distances.tolist() == [[0, 0]] and nearest.copies().tolist() == [True]
    # a sample between two training images, nearer one but not three times nearer: not a copy
    between = (training[0].float() * 0.6 + training[1].float() * 0.4).round().to(torch.uint8)
    nearest = found(between[None], training)
    assert nearest.indices[0].tolist() == [0, 1] and 0.5 < nearest.ratios()[0] < 1 and not nearest.copies()[0]


class Items(torch.utils.data.Dataset):
    """A streamed dataset as sources.FileImages' items are: (image, None), or (None, error) for an unreadable one."""

    def __init__(self, images, unreadable=()):
        self.images, self.unreadable = images, set(unreadable)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return (None, f"cannot read image {i}") if i in self.unreadable else (self.images[i], None)


@pytest.mark.parametrize("flips", [False, True])
def test_the_chunked_search_equals_brute_force_cdist(monkeypatch, flips):
    training, samples = random_images(300), random_images(70, seed=1)
    monkeypatch.setattr(copies, "BLOCK_FLOATS", 5 * 192 * 32)  # chunks and blocks of 32 images: 10 x 3 of them
    nearest = found(samples, training, flips)
    x, t = samples.flatten(1).double() / 255, training.double() / 255
    distances = torch.cdist(x, t.flatten(1))
    if flips:
        distances = torch.minimum(distances, torch.cdist(x, t.flip(3).flatten(1)))
    expected = distances.topk(2, dim=1, largest=False)
    assert torch.equal(nearest.indices, expected.indices) and nearest.num_training == 300
    torch.testing.assert_close(nearest.distances.double(), expected.values, rtol=1e-5, atol=1e-5)
    # a streamed dataset: the same, its unreadable image (one no sample found) left out (searched: 299)
    unreadable = next(i for i in range(300) if i not in nearest.indices)
    streamed = copies.search(samples, copies.TrainingImages(Items(training, unreadable=[unreadable])), flips)
    assert torch.equal(streamed.indices, nearest.indices) and streamed.num_training == 299


def test_the_picture_shows_the_most_copy_like_samples_beside_their_nearest(tmp_path):
    training = random_images(30)
    samples = torch.cat([random_images(5, seed=1), training[11:12].flip(-1)])
    training_images = copies.TrainingImages(training)
    nearest = copies.search(samples, training_images, flips=True)
    path = copies.save_pairs(samples, training_images, nearest, tmp_path / "pairs" / "copies.png")
    with Image.open(path) as picture:
        # 6 pairs, 4 a row: 8 images across, 2 rows, 2-pixel gaps
        assert picture.size == (8 * 8 + 9 * 2, 2 * 8 + 3 * 2)
        cells = torch.from_numpy(np.array(picture.convert("RGB"))).permute(2, 0, 1)
    first, match = cells[:, 2:10, 2:10], cells[:, 2:10, 12:20]
    assert torch.equal(first, samples[5]) and torch.equal(match, samples[5])  # the copy first; its match shown mirrored


def test_what_cannot_be_checked_is_one_line():
    training = random_images(10)
    with pytest.raises(ConfigError, match="at least 2 training images"):
        found(training[:1], training[:1])
    with pytest.raises(ConfigError, match=r"samples of \(3, 16, 16\) with training images of \(3, 8, 8\)"):
        found(random_images(2, size=16), training)
    with pytest.raises(ConfigError, match="at least one sample"):
        found(training[:0], training)


def test_the_runs_training_images_and_flips():
    images = random_images(6)
    preloaded = decoding.PreloadedImages(images[:5], torch.tensor([True] * 5 + [False]), {5: "unreadable"})
    assert copies.run_training_images({}, 8, images).images is images
    assert copies.run_training_images({}, 8, preloaded).images is preloaded.images
    streamed = sources.FileImages([], None)
    assert copies.run_training_images(dict(augment="flip"), 8, streamed).images is streamed
    drawn = dict(dataset=shapes.BUILTIN, shapes_num_images=12, seed=3, augment="flip,crop")
    expected = shapes.builtin_images(12, 8, 3)[0]
    for given in (None, torch.zeros(12, 4, 2, 2), streamed):  # nothing, a latent run's latents, random crops: opened
        assert torch.equal(copies.run_training_images(drawn, 8, given).images, expected)
    assert [copies.trained_with_flips(o) for o in (dict(augment="none"), dict(augment="flip,crop"), {},
                                                   dict(random_flip=False))] == [False, True, True, False]  # fmt: skip


def test_check_takes_what_train_py_has_and_writes_the_pairs(tmp_path):
    args = argparse.Namespace(dataset=shapes.BUILTIN, shapes_num_images=24, seed=0, augment="flip", image_size=16,
                              class_conditional=False)  # fmt: skip
    images = shapes.builtin_images(24, 16, 0)[0]
    samples = torch.cat([images[:3], random_images(1, size=16, seed=5)])
    for given in (images, None):  # the run's preloaded images, or opened from its flags
        result = copies.check(samples, given, args, tmp_path / "copies.png")
        assert result == dict(copy_share=0.75, copies=3, median_ratio=0.0, copy_samples=4, training_images=24)
    assert (tmp_path / "copies.png").is_file()
    line = copies.format_line(result, True, tmp_path / "copies.png")
    assert line.startswith("copies 75.0% (3 of 4 samples nearer one of 24 training images and their mirror images")
