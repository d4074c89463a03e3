"""Time to the first batch of each epoch, and the epoch's draws, of a latent run's data.Batches: workers or not."""
import statistics, sys, time, tempfile
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]; sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "tests"))
import torch
import latents, data
from test_latents import make_kl, ranged
torch.set_num_threads(1)
folder = Path(tempfile.mkdtemp())
vae = latents.load_vae(make_kl(folder / "vae"))
side = 64  # 8x8 latents from this toy VAE; the draw's cost grows with the latent's size
N = 1024
x = torch.randint(0, 256, (N, 3, side, side), dtype=torch.uint8)
key = latents.cache_key(dict(name="epoch-cost"), vae, side)
cache = latents.cached_latents(vae, ranged(x), key, root=folder / "cache", num_images=N, progress=False, log=lambda s: None)
dataset = latents.LatentDataset(cache)
print(f"cache {cache.num_images} x {cache.channels}x{cache.resolution}^2")
for workers in (0, 4, 0, 4):
    b = data.Batches(dataset, 64, 0, torch.device("cpu"), num_workers=workers)
    first, whole = [], []
    for epoch in range(6):
        t0 = time.perf_counter()
        it = b.epoch(epoch)
        next(it)
        first.append(time.perf_counter() - t0)
        for _ in it:
            pass
        whole.append(time.perf_counter() - t0)
    print(f"workers {workers}: first batch of an epoch median {statistics.median(first[1:]) * 1e3:.1f} ms, "
          f"an epoch of 16 batches {statistics.median(whole[1:]) * 1e3:.1f} ms ({[round(f * 1e3) for f in first]})")
