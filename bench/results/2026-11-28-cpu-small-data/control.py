"""The criterion's floor: real crops no run trained on (the first 20 held-apart crops of each class,
200 images, bench.labelled's held split) searched, like a sample, against each training set of part A
with flips. A model that made new images of the photos as well as the held crops would score this."""
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import copies  # noqa: E402


def read(paths):
    return torch.from_numpy(np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths])).permute(0, 3, 1, 2).contiguous()


held = sorted(Path("/tmp/sd/lab/held").iterdir())
held = read([p for c in held for p in sorted(c.iterdir())[:20]])
sets = {16: sorted(Path("/tmp/sd/flat16").iterdir()), 200: sorted(Path("/tmp/sd/flat200").iterdir()),
        2000: sorted(Path("/tmp/sd/lab/train").rglob("*.png"))}
for n, paths in sets.items():
    found = copies.measure(held, copies.TrainingImages(read(paths)), flips=True)
    print(f"held-apart crops against {n}: " + copies.format_line(found, True))
