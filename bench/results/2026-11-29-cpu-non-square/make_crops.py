"""3:2 crops of scikit-image's colour photos, written as 48x32 PNGs (width 48, height 32): the non-square set of
issue 64's measurement. Each photo is scaled to a shorter side of 96 px; each crop is a 3:2 window of 48 to 96 px
wide at a random place, resized to 48x32. Deterministic: python make_crops.py DIR [COUNT [SEED]] (seed 0 the training
set; seed 1, 300 crops: the real images the samples' FD is set beside)."""

import sys
from pathlib import Path

import numpy as np
from PIL import Image
from skimage import data

PHOTOS = ["astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field", "brick"]  # bench/labelled.py's, shipped


def photo(name):
    image = getattr(data, name)()
    image = Image.fromarray(image[..., :3] if image.ndim == 3 else np.stack([image] * 3, -1))
    w, h = image.size
    scale = 96 / min(w, h)
    return image.resize((round(w * scale), round(h * scale)), Image.BICUBIC)


def main(folder, count=2100, seed=0):
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    photos = [photo(name) for name in PHOTOS]
    for i in range(count):
        image = photos[i % len(photos)]
        w = int(rng.integers(48, 97))
        h = w * 2 // 3
        x, y = int(rng.integers(0, image.size[0] - w + 1)), int(rng.integers(0, image.size[1] - h + 1))
        image.crop((x, y, x + w, y + h)).resize((48, 32), Image.BICUBIC).save(folder / f"{i:05d}.png")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
