"""Why a blurred copy is not flagged: for a run's samples (sample.py --output GEN), each one's nearest and
second-nearest training image (with flips) and the distances; and for the training set itself, each image's
distance to its nearest other training image (its own mirror image excluded), the d2 a perfect copy of it
would meet. python nearest.py TRAIN_FOLDER GEN"""
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import copies  # noqa: E402


def read(paths):
    return torch.from_numpy(np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths])).permute(0, 3, 1, 2).contiguous()


train_paths = sorted(Path(sys.argv[1]).rglob("*.png"))
train = read(train_paths)
gen = read(sorted(p for p in Path(sys.argv[2]).glob("[0-9]*.png")))
x = train.flatten(1).double() / 255
xf = train.flip(3).flatten(1).double() / 255
d = torch.minimum(torch.cdist(x, x), torch.cdist(x, xf))
d.fill_diagonal_(float("inf"))
print(f"training set ({len(x)}): distance to nearest other image, median {d.min(1).values.median():.2f}, "
      f"min {d.min(1).values.min():.2f}, max {d.min(1).values.max():.2f}")
nearest = copies.search(gen, copies.TrainingImages(train), flips=True)
d1, d2 = nearest.distances.double().unbind(1)
r = nearest.ratios()
print(f"samples ({len(gen)}): d1 median {d1.median():.2f}, d2 median {d2.median():.2f}, ratio median {r.median():.3f}; "
      f"share with ratio < 1/3 {(r < 1/3).double().mean():.1%}, < 1/2 {(r < 0.5).double().mean():.1%}")
counts = np.bincount(nearest.indices[:, 0].numpy(), minlength=len(x))
if len(x) <= 16:
    print("samples whose nearest is each training image:", dict(zip([p.stem for p in train_paths], counts.tolist())))
