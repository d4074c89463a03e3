"""Streamed images with random crops (--augment crop streams): the first batch of each epoch and each epoch's
time through data.Batches with 4 workers, 1,024 JPEGs (96x64, cropped to 64px), batch 64 (16 batches an epoch),
six epochs. Run from the root of the checkout to measure: python PATH/epoch_start.py"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.getcwd())
import data  # noqa: E402

torch.set_num_threads(1)
folder = Path(tempfile.mkdtemp())
rng = np.random.default_rng(0)
for i in range(1024):
    Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(folder / f"{i:05d}.jpg")
dataset = data.open_dataset(str(folder), image_size=64, center_crop=False)
print(f"torch {torch.__version__}, checkout {os.getcwd()}")
for workers in (0, 4):
    batches = data.Batches(dataset, 64, 0, torch.device("cpu"), num_workers=workers)
    firsts, epochs = [], []
    for epoch in range(6):
        start = time.perf_counter()
        for i, _ in enumerate(batches.epoch(epoch)):
            if i == 0:
                firsts.append(time.perf_counter() - start)
        epochs.append(time.perf_counter() - start)
    print(f"{workers} workers: first batch {' '.join(f'{t * 1e3:.0f}' for t in firsts)} ms, "
          f"epoch {' '.join(f'{t * 1e3:.0f}' for t in epochs)} ms; medians after the first epoch "
          f"{statistics.median(firsts[1:]) * 1e3:.0f} and {statistics.median(epochs[1:]) * 1e3:.0f} ms")
