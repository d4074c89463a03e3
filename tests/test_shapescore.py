"""The offline shape score: the labels it learns from, how far it can be trusted, and its
place in train.py's and sample.py's FID/KID machinery."""

import hashlib

import torch

import data


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
        images, labels = data.make_shapes(n, size, seed=seed, with_labels=True)
        assert sha256(images) == digest == sha256(data.make_shapes(n, size, seed=seed))
        assert labels["count"].shape == (n,) and labels["shape_map"].shape == (n, size, size)


def test_labels_say_what_each_image_holds():
    images, labels = data.make_shapes(64, 32, seed=0, with_labels=True)
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
