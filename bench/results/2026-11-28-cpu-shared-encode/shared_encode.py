"""Two runs encoding one key at once, against one alone: wall seconds and the pieces each encodes.

    python shared_encode.py REPO [IMAGES]

REPO: a checkout whose latents.py is measured. Each process computes on one thread; the two are started
together (a file barrier) and encode into one cache root, as two runs of a sweep on a new dataset do.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
import latents
from diffusers import AutoencoderKL
root, go, n, size = sys.argv[2], sys.argv[3], int(sys.argv[4]), 64
latents.PIECE_IMAGES = 64
torch.manual_seed(0)
vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                    block_out_channels=(32, 64, 64), layers_per_block=1, latent_channels=4, norm_num_groups=8)
x = torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(1)) * 2 - 1
calls = []
def images(start, stop):
    calls.append((start, stop))
    for i in range(start, stop, 64):
        yield x[i : min(i + 64, stop)]
key = latents.cache_key(dict(name="bench"), vae, size)
while not os.path.exists(go):
    time.sleep(0.01)
began = time.perf_counter()
lines = []
cache = latents.cached_latents(vae, images, key, root=root, num_images=n, progress=False, log=lines.append)
print(json.dumps(dict(seconds=time.perf_counter() - began, pieces=len(calls), images=cache.num_images, line=lines[-1])))
"""


def run(repo, count, n):
    folder = tempfile.mkdtemp()
    go = os.path.join(folder, "go")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, repo, os.path.join(folder, "cache"), go, str(n)],
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(count)]
    time.sleep(15)  # the imports and the VAE built, waiting at the barrier
    began = time.perf_counter()
    open(go, "w").close()
    results = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    return dict(processes=count, wall=time.perf_counter() - began, each=results)


if __name__ == "__main__":
    repo, n = os.path.abspath(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    for count in (1, 2):
        print(json.dumps(run(repo, count, n)))
