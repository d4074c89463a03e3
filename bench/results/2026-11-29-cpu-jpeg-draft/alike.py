"""How far the drafted decode is from the whole one: for each size, the mean and largest absolute difference over
every pixel of the images of FOLDER (0-255), and their PSNR in dB."""

import math
import sys

import torch

sys.path.insert(0, ".")
import data  # noqa: E402

folder = sys.argv[1]
for size in (64, 256, 512):
    drafted = data.open_dataset(folder, size)
    whole = data.open_dataset(folder, size)
    whole.box = None
    a = torch.stack([drafted[i][0] for i in range(len(drafted))]).float()
    b = torch.stack([whole[i][0] for i in range(len(whole))]).float()
    d = (a - b).abs()
    psnr = 10 * math.log10(255**2 / (d**2).mean().item())
    print(f"{size}px: mean |difference| {d.mean():.3f}, largest {d.max():.0f}, PSNR {psnr:.1f} dB over {len(a)} images")
