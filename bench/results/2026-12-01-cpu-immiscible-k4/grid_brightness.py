"""The faces' brightness spread where only seed 1's grid is kept: each grid is the first 64 of its 400 samples
(8 x 8 cells of 32px, 2px apart from (2, 2); checked against this record's PNGs), all sampled with --seed 0, so
the same 64 noises. For the faces with `dit-small` at 640 steps, whose default and k = 64 runs kept no brightness."""
import numpy as np
from PIL import Image

B = "/work/main/bench/results/"
for name in ["2026-11-28-cpu-loss-terms/faces_dit_none_s1-samples-grid.png",
             "2026-11-28-cpu-loss-terms/faces_dit_immiscible_s1-samples-grid.png",
             "2026-12-01-cpu-immiscible-k4/fd_immiscible4_s1-samples-grid.png",
             "2026-11-29-cpu-loss-curves/fs_none_s1-samples-grid.png",
             "2026-11-29-cpu-loss-matrix/fs_immiscible_s1-samples-grid.png",
             "2026-12-01-cpu-immiscible-k4/fs_immiscible4_s1-samples-grid.png"]:
    g = np.asarray(Image.open(B + name).convert("L"), dtype=np.float32) / 255
    m = np.array([g[2 + 34 * r:34 + 34 * r, 2 + 34 * c:34 + 34 * c].mean() for r in range(8) for c in range(8)])
    print(f"{name}: 64 images, mean brightness {m.mean():.3f}, its spread across the images {m.std():.3f}")
