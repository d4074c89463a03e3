"""How varied the backgrounds of generated shape images are, against the built-in data's.

    python sample.py RUN --num_images 128 --batch_size 64 --output /tmp/RUN-samples
    python bench/results/cpu-quality-2026-11-25/variations-and-equal-images/background-colours.py /tmp/RUN-samples ...

An image's background colour is the per-channel median of its four corner 3x3
patches (the shapes seldom reach a corner). Printed per folder: the mean and
spread of the background's value (max channel) and saturation, and the spread
of background colours across images (per-channel std, averaged): the number
behind "greyer backgrounds than the data's".
"""

import glob
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository root, for data.py
import data  # noqa: E402


def stats(images):
    """uint8 (N, 3, H, W) -> one line of background statistics."""
    x = images.float() / 255
    corners = torch.cat([x[:, :, :3, :3], x[:, :, :3, -3:], x[:, :, -3:, :3], x[:, :, -3:, -3:]], dim=2)
    colour = corners.flatten(2).median(2).values  # (N, 3)
    value, low = colour.max(1).values, colour.min(1).values
    saturation = (value - low) / value.clamp(min=1e-6)
    return (
        f"bg value mean {value.mean():.3f} std {value.std():.3f} | bg saturation mean {saturation.mean():.3f} "
        f"std {saturation.std():.3f} | bg colour std across images {colour.std(0).mean():.3f}"
    )


if __name__ == "__main__":
    print("real (512 built-in images, seed 0)", stats(data.make_shapes(512, 32, seed=0)))
    for folder in sys.argv[1:]:
        files = sorted(glob.glob(f"{folder}/0*.png"))
        images = torch.stack([torch.from_numpy(np.array(Image.open(f).convert("RGB"))).permute(2, 0, 1) for f in files])
        print(folder, len(images), stats(images))
