"""Draws per second of latents.LatentDataset.batch: a 32x32x4 KL cache with flips, (N, 2, 2, 4, 32, 32)
float32 of random numbers written as a cache folder (no VAE needed to draw), batches of 16 random indices.

    python bench/results/2026-11-25-cpu-latent-draws/bench_draws.py [--images 2048] [--batch 16] [--seconds 5]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import latents  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--images", type=int, default=2048)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--seconds", type=float, default=5.0)
parser.add_argument("--threads", type=int, default=1)
args = parser.parse_args()
torch.set_num_threads(args.threads)

with tempfile.TemporaryDirectory() as tmp:
    folder = Path(tmp) / "cache"
    folder.mkdir()
    rng = np.random.default_rng(0)
    array = rng.standard_normal((args.images, 2, 2, 4, 32, 32), dtype=np.float32)
    array[:, :, 1] = np.abs(array[:, :, 1]) * 0.1  # the posterior's std
    np.save(folder / latents.LATENTS_FILE, array)
    meta = dict(key=None, shape=list(array.shape), stats=dict(mean=[0.0] * 4, std=[1.0] * 4))
    (folder / latents.META_FILE).write_text(json.dumps(meta))
    record = dict(shift=[0.1] * 4, scale=[0.5] * 4)
    print(f"torch {torch.__version__}, numpy {np.__version__}, {torch.get_num_threads()} thread(s); "
          f"{args.images} images of (2 flips, mean/std, 4, 32, 32); batch {args.batch}")
    for mapped in (False, True):
        cache = latents.LatentCache(folder, max_gib=0.0 if mapped else 8.0)
        dataset = latents.LatentDataset(cache, record, seed=0)
        g = torch.Generator().manual_seed(0)
        for _ in range(20):  # warm-up (and the page cache)
            dataset.batch(torch.randint(args.images, (args.batch,), generator=g))
        times, epoch = [], 0
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            epoch += 1
            dataset.set_epoch(epoch)
            indices = torch.randint(args.images, (args.batch,), generator=g)
            start = time.perf_counter()
            dataset.batch(indices)
            times.append(time.perf_counter() - start)
        median = float(np.median(times))
        print(f"{'memory-mapped' if mapped else 'in memory':14s}: {len(times)} batches, median {median * 1e3:.3f} ms a batch "
              f"= {args.batch / median:,.0f} images/s (mean {np.mean(times) * 1e3:.3f} ms)")
