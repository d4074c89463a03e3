"""Print the mean brightness of a folder's images and its spread (standard deviation) across the images: the real
faces, the default's faces-small and 4x faces-dit samples (the loss-curves record's runs, /tmp/lc) and the terms'
(/tmp/lm)."""
import glob

import numpy as np
from PIL import Image

for d in ["/tmp/lt/fc/faces", "/tmp/lc/fs_none_s1-gen", "/tmp/lc/fs_none_s2-gen", "/tmp/lm/fs_immiscible_s1-gen",
          "/tmp/lm/fs_immiscible_s2-gen", "/tmp/lm/fs_dispersive_s1-gen", "/tmp/lm/fs_dispersive_s2-gen",
          "/tmp/lc/fc_none_s1-at2560", "/tmp/lc/fc_none_s2-at2560", "/tmp/lm/fc4_immiscible_s1-gen", "/tmp/lm/fc4_immiscible_s2-gen"]:
    files = [f for f in sorted(glob.glob(d + "/*.png")) if not f.endswith(("grid.png", "copies.png"))]
    m = np.array([np.asarray(Image.open(f).convert("L"), dtype=np.float32).mean() / 255 for f in files])
    print(f"{d}: {len(files)} images, mean brightness {m.mean():.3f}, its spread across the images {m.std():.3f}")
