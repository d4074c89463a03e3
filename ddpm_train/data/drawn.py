"""A published latent cache read (into memory, or memory-mapped above a size) and each epoch's latents drawn from it.

    read(folder, key, max_gib) -> LatentCache | None   the cache in `folder` if it is complete and made for `key`
    LatentCache.draw(indices, epoch, seed)   raw latents: each image's orientation and posterior noise keyed by
        (seed, epoch, index) alone (keyed_random.py), so a resumed run or another process count draws the same
    LatentDataset(cache, record, seed)   a torch Dataset of normalised draws
"""

import json
import math
from pathlib import Path

import numpy as np
import torch

from ddpm_train.data import autoencoder, keyed_random, pieces


def read(folder, key, max_gib):
    """The cache in `folder` if it is complete and made for `key`, else None."""
    meta_file = folder / pieces.META_FILE
    if not meta_file.is_file() or not (folder / pieces.LATENTS_FILE).is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        return None
    if json.dumps(meta.get("key"), sort_keys=True) != json.dumps(key, sort_keys=True, default=str):
        return None
    try:
        return LatentCache(folder, max_gib)
    except (OSError, ValueError):
        return None


class LatentCache:
    """A cache folder, read into memory or memory-mapped (above `max_gib` GiB)."""

    def __init__(self, folder, max_gib=8.0):
        self.path = Path(folder)
        self.meta = json.loads((self.path / pieces.META_FILE).read_text())
        file = self.path / pieces.LATENTS_FILE
        self.memmapped = file.stat().st_size > max_gib * 2**30
        self.array = np.load(file, mmap_mode="r" if self.memmapped else None)
        if list(self.array.shape) != self.meta["shape"]:
            raise ValueError(f"{file} holds {self.array.shape}, its meta.json says {self.meta['shape']}")
        labels = self.path / pieces.LABELS_FILE
        self.labels = torch.from_numpy(np.load(labels)) if labels.is_file() else None
        self.stats = self.meta["stats"]
        self.encode_seconds = self.meta.get("encode_seconds")
        self.images_per_second = self.meta.get("images_per_second")
        self.num_images, self.orientations, kinds, self.channels, self.resolution, _ = self.array.shape
        self.stochastic = kinds == 2  # (mean, std) of a KL VAE, else a Tiny VAE's latents

    def __len__(self):
        return self.num_images

    def draw(self, indices, epoch, seed):
        """Raw latents (B, C, h, w) of images `indices` for `epoch`: an orientation and the posterior noise each
        drawn from (seed, epoch, index) alone, the whole batch at once: its rows read with one fancy index (in
        ascending order, for a memory map), its random numbers from a counter-based generator (draw_keys)."""
        indices = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        keys = keyed_random.draw_keys(seed, epoch, indices)
        size = math.prod(self.array.shape[3:])  # C x h x w
        # word 0 of each stream picks the orientation, words 1... the noise
        words = keyed_random.words(keys, 1 + (-(-size // 2) if self.stochastic else 0))
        sides = keyed_random.shr(words[:, 0], 33) % self.orientations
        order = torch.argsort(indices)
        rows = self.array[indices[order].numpy(), sides[order].numpy()]  # (B, K, C, h, w), ascending rows
        stored = torch.empty(rows.shape)
        stored[order] = torch.from_numpy(np.ascontiguousarray(rows))
        if not self.stochastic:
            return stored[:, 0]
        eps = keyed_random.normals(words[:, 1:], size).view_as(stored[:, 0])
        return stored[:, 0] + stored[:, 1] * eps


class LatentDataset(torch.utils.data.Dataset):
    """Normalised latents drawn fresh each epoch: `set_epoch(e)`, then [i] or `batch(indices)`."""

    def __init__(self, cache, record=None, seed=0):
        self.cache, self.record, self.seed, self.epoch = cache, record, seed, 0
        self.labels = cache.labels

    def set_epoch(self, epoch):
        self.epoch = int(epoch)

    def __len__(self):
        return len(self.cache)

    def batch(self, indices):
        z = self.cache.draw(indices, self.epoch, self.seed)
        return autoencoder.normalize(z, self.record) if self.record is not None else z

    def __getitem__(self, i):
        z = self.batch([i])[0]
        return z if self.labels is None else (z, self.labels[i])
