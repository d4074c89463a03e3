"""Time copies.search on this machine: 1,000 samples of 32x32x3 against 10k and 20k training images
(random pixels: the search's time does not depend on what the images show), without and with flips.
Run from the repository root: python bench/results/2026-11-28-copy-search/search_time.py"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import copies  # noqa: E402

torch.manual_seed(0)
samples = torch.randint(0, 256, (1000, 3, 32, 32), dtype=torch.uint8)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, block {copies.BLOCK_FLOATS} floats")
for num_training in (10_000, 20_000):
    training = copies.TrainingImages(torch.randint(0, 256, (num_training, 3, 32, 32), dtype=torch.uint8))
    for flips in (False, True):
        copies.search(samples[:100], training, flips)  # warm-up
        start = time.perf_counter()
        copies.search(samples, training, flips)
        seconds = time.perf_counter() - start
        flop = 2 * len(samples) * num_training * 3072 * (2 if flips else 1)
        print(f"{len(samples)} samples x {num_training} training images, flips {flips}: {seconds:.2f} s, "
              f"{flop / 1e9:.1f} GFLOP of matmul, {flop / seconds / 1e9:.1f} GFLOP/s achieved")
