"""Print the mean brightness of a folder's images and its spread (standard deviation) across the images: the real
faces and this record's immiscible:4 faces samples (/tmp/imk4), as the 2026-11-29-cpu-loss-matrix record's
brightness.py did for the default's and immiscible:64's (its brightness.txt)."""
import glob

import numpy as np
from PIL import Image

for d in ["/tmp/imk4/lt/fc/faces", "/tmp/imk4/lm/fd_immiscible4_s1-gen", "/tmp/imk4/lm/fd_immiscible4_s2-gen",
          "/tmp/imk4/lm/fs_immiscible4_s1-gen", "/tmp/imk4/lm/fs_immiscible4_s2-gen"]:
    files = [f for f in sorted(glob.glob(d + "/*.png")) if not f.endswith(("grid.png", "copies.png"))]
    if not files:
        continue
    m = np.array([np.asarray(Image.open(f).convert("L"), dtype=np.float32).mean() / 255 for f in files])
    print(f"{d}: {len(files)} images, mean brightness {m.mean():.3f}, its spread across the images {m.std():.3f}")
