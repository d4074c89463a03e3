"""How far a run's samples are from grey: per pixel, the largest minus the smallest of its
channels (0 for every pixel of an 'L' file or of the RGB training files), over a folder's PNGs."""
import sys
from pathlib import Path

import numpy as np
from PIL import Image

for folder in sys.argv[1:]:
    paths = sorted(p for p in Path(folder).glob("*.png") if p.name != "grid.png")
    modes = {Image.open(p).mode for p in paths}
    a = np.stack([np.asarray(Image.open(p).convert("RGB")).astype(int) for p in paths])
    spread = a.max(-1) - a.min(-1)
    print(f"{folder}: {len(paths)} images, modes {sorted(modes)}; channel spread mean {spread.mean():.2f}, "
          f"pixels with spread > 8: {100 * (spread > 8).mean():.1f}%, max {spread.max()}")
