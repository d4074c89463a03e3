"""What a piece of a latent encode costs the decode: data.decoded_batches over a folder of 2,048 JPEGs (256px),
once whole, then as calls of 512 items (a piece each), with 2 and 4 workers; the first batch's wait of a call.
Run from the repository root: python bench/results/2026-11-28-cpu-encode-pieces/piece_start.py"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision import transforms

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import data  # noqa: E402

folder = Path(tempfile.mkdtemp())
rng = np.random.default_rng(0)
for i in range(2048):
    Image.fromarray((rng.random((256, 256, 3)) * 255).astype("uint8")).save(folder / f"{i:05d}.jpg")
to_tensor = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(256), transforms.PILToTensor()])
dataset = data.FileImages(sorted(folder.iterdir()), to_tensor)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, 2,048 JPEGs of 256px")
for workers in (2, 4):
    for round in range(2):
        firsts = []
        start = time.perf_counter()
        for _ in data.decoded_batches(dataset, workers):
            pass
        whole = time.perf_counter() - start
        start = time.perf_counter()
        for a in range(0, 2048, 512):
            began = time.perf_counter()
            for i, _ in enumerate(data.decoded_batches(torch.utils.data.Subset(dataset, range(a, a + 512)), workers)):
                if i == 0:
                    firsts.append(time.perf_counter() - began)
        pieces = time.perf_counter() - start
        print(f"{workers} workers, round {round}: whole {whole:.2f} s, 4 calls of 512 {pieces:.2f} s "
              f"(+{pieces - whole:.2f} s), first batch of a call {statistics.median(firsts):.3f} s median "
              f"({min(firsts):.3f}-{max(firsts):.3f})")
