"""Writes 24 photo-sized JPEGs (4032x3024, a 12MP phone photo's size, quality 90) to FOLDER: LFW face crops (the
wheel of scikit-image ships them) scaled up with grain, so that the decoder meets photo-like detail. Every fourth
is stored sideways with EXIF orientation 6, as a phone stores a portrait."""

import sys
from pathlib import Path

import numpy as np
from PIL import Image
from skimage.data import lfw_subset

folder = Path(sys.argv[1])
folder.mkdir(parents=True, exist_ok=True)
rng = np.random.default_rng(0)
exif = Image.Exif()
exif[0x0112] = 6
for i, face in enumerate(lfw_subset()[:24]):
    gray = Image.fromarray((face * 255).astype(np.uint8)).resize((4032, 3024), Image.BICUBIC)
    tint = np.asarray(gray, np.int16)[..., None] * np.array([1.0, 0.9, 0.8]) + rng.normal(0, 12, (3024, 4032, 3))
    photo = Image.fromarray(np.clip(tint, 0, 255).astype(np.uint8))
    if i % 4 == 0:
        photo.transpose(Image.Transpose.ROTATE_90).save(folder / f"{i:02d}.jpg", quality=90, exif=exif.tobytes())
    else:
        photo.save(folder / f"{i:02d}.jpg", quality=90)
