"""Where the bare run's denoiser falls short: its one-pass error by noise level, and what sampling
from a real image noised to sigma gives back (SDEdit, Meng et al. 2021).

    python bench/results/cpu-quality-2026-11-25/longer-runs/denoiser-error.py RUN [RUN ...] --grids DIR

For each run: the mean squared error of the predicted clean image, x0_hat = sqrt(abar) x_t - sqrt(1 - abar) v,
over 256 held-out built-in images (seed 7, not the training seed) at each sigma (the same noise for every run),
and, with --grids, two PNGs: `NAME-x0.png` (rows: the images, then the noised image and x0_hat at sigma 0.25,
0.5, 1, 2, 4) and `NAME-sdedit.png` (rows: the images, then DDPM's ancestral sampler, 100 steps over the
1,000, run from each image noised to sigma 0.5, 1, 2, 4, 8, 16, 40).
"""
import argparse
import os
import sys
from pathlib import Path

import torch
import torchvision
from diffusers import DDPMScheduler, UNet2DModel

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository root, for data.py
from data import make_shapes  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("runs", nargs="+")
p.add_argument("--grids")
a = p.parse_args()
SIGMAS = [0.1, 0.25, 0.5, 1, 2, 4, 8, 16]
images = make_shapes(256, 32, seed=7).float() / 127.5 - 1
noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(0))
print("run | " + " | ".join(f"sigma {s}" for s in SIGMAS))
for run in a.runs:
    name = os.path.basename(run.rstrip("/"))
    net = UNet2DModel.from_pretrained(run, subfolder="unet").eval()
    sched = DDPMScheduler.from_pretrained(run, subfolder="scheduler")
    ab = sched.alphas_cumprod

    def timestep(sigma):
        return int(torch.searchsorted(1 - ab, torch.tensor(sigma**2 / (1 + sigma**2))))

    def x0_hat(x, t):
        with torch.no_grad():
            v = net(x, t).sample
        return ab[t].sqrt() * x - (1 - ab[t]).sqrt() * v

    errors = []
    for s in SIGMAS:
        t = timestep(s)
        xt = ab[t].sqrt() * images + (1 - ab[t]).sqrt() * noise
        errors.append(float(torch.cat([x0_hat(xt[i:i + 64], t) - images[i:i + 64] for i in range(0, 256, 64)]).square().mean()))
    print(name + " | " + " | ".join(f"{e:.4f}" for e in errors))
    if not a.grids:
        continue
    x0, z = images[:8], noise[:8]
    rows = [x0]
    for s in [0.25, 0.5, 1, 2, 4]:
        t = timestep(s)
        xt = ab[t].sqrt() * x0 + (1 - ab[t]).sqrt() * z
        rows += [(xt / ab[t].sqrt()).clamp(-1, 1), x0_hat(xt, t).clamp(-1, 1)]
    torchvision.utils.save_image(torch.cat(rows) / 2 + 0.5, f"{a.grids}/{name}-x0.png", nrow=8, padding=1)
    rows, g = [x0], torch.Generator().manual_seed(0)
    for s in [0.5, 1, 2, 4, 8, 16, 40]:
        sched.set_timesteps(100)
        ts = [t for t in sched.timesteps.tolist() if t <= timestep(s)]
        x = ab[ts[0]].sqrt() * x0 + (1 - ab[ts[0]]).sqrt() * torch.randn(x0.shape, generator=g)
        with torch.no_grad():
            for t in ts:
                x = sched.step(net(x, t).sample, t, x, generator=g).prev_sample
        rows.append(x.clamp(-1, 1))
    torchvision.utils.save_image(torch.cat(rows) / 2 + 0.5, f"{a.grids}/{name}-sdedit.png", nrow=8, padding=1)
