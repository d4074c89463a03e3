"""A run's batches: a permutation of each epoch keyed by (seed, epoch), so a resumed run starts mid-epoch without
decoding what it skips; streamed by loader workers that ignore stop signals, or sliced from preloaded images; flips
and the scaling to [-1, 1] on the device."""

import torch

from ddpm_train.data.decoding import PreloadedImages, Unreadable, collate_decoded, refill
from ddpm_train.data.workers import iterate, loader_generator
from ddpm_train.errors import ConfigError


def epoch_batches(num_images, batch_size, seed, epoch, rank=0, world_size=1):
    """Index tensors of this process's batches in one epoch (the last partial batch is dropped).

    The order is a permutation that depends only on (seed, epoch), so every
    process agrees on it and a resumed run can start anywhere in the epoch.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(num_images, generator=g)
    per_step = batch_size * world_size
    steps = num_images // per_step
    return [order[s * per_step + rank * batch_size : s * per_step + (rank + 1) * batch_size] for s in range(steps)]


class _IndexBatches(torch.utils.data.Sampler):
    """The index lists of `batches`, each index as (epoch, index): what _EpochDraws and _EpochItems take."""

    def __init__(self, batches, epoch):
        self.batches, self.epoch = batches, epoch

    def __iter__(self):
        return iter([(self.epoch, i) for i in b.tolist()] for b in self.batches)

    def __len__(self):
        return len(self.batches)


class _EpochDraws(torch.utils.data.Dataset):
    """A drawn.LatentDataset for DataLoader workers: `__getitems__` draws a whole batch of (epoch, index)
    pairs with its `batch`, set to the epoch in the worker itself, so that a worker's batch is the one this
    process would draw, and one set of workers serves every epoch. A draw reads only its images' rows of the
    cache's array (a forked worker shares the array: nothing copies it)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitems__(self, pairs):
        self.dataset.set_epoch(pairs[0][0])
        return self.dataset.batch(torch.tensor([i for _, i in pairs], dtype=torch.long))

    def __getitem__(self, pair):
        return self.__getitems__([pair])[0]


def _item_seed(seed, epoch, index):
    """The seed of item `index`'s random transform (its random crop) in `epoch`."""
    return ((int(seed) * 1_000_003 + int(epoch)) * 1_000_000_007 + int(index)) & (2**63 - 1)


class _EpochItems(torch.utils.data.Dataset):
    """A streamed dataset for a DataLoader that serves every epoch: items are (epoch, index) pairs, each decoded
    with torch's CPU generator seeded by _item_seed, so that its random crop depends on (seed, epoch, index)
    alone: the same whichever worker (or this process) decodes it and wherever the epoch starts (a resume), and
    the workers keep no random state between epochs. The generator's state is put back after each item: in this
    process the training draws from it."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, pair):
        epoch, index = pair
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(_item_seed(self.seed, epoch, index))  # not CUDA's (torch.manual_seed)
            return self.dataset[index]


def _as_drawn(batch):
    """A DataLoader's collate_fn for _EpochDraws: the batch is drawn whole already."""
    return batch


class Batches:
    """uint8 batches on `device`, from a preloaded tensor (or PreloadedImages) or streamed through a
    DataLoader; or a latent run's float latents, drawn from a drawn.LatentDataset for each epoch (with
    `num_workers`, drawn ahead by that many DataLoader workers: the same batches).

    With `labels` (a LongTensor, one per index of `source`: the labels that
    `load_images` returns, which for a streamed dataset are its `labels`) each
    batch is (images, labels), the labels on `device` too. The order of the
    batches is the same with labels or without.
    """

    def __init__(
        self, source, batch_size, seed, device, rank=0, world_size=1, num_workers=0, unreadable=None, labels=None,
    ):  # fmt: skip
        self.source, self.batch_size, self.seed = source, batch_size, seed
        self.device, self.rank, self.world_size, self.num_workers = device, rank, world_size, num_workers
        self.preloaded = isinstance(source, (torch.Tensor, PreloadedImages))
        self.drawn = hasattr(source, "set_epoch") and hasattr(source, "batch")  # drawn.LatentDataset
        # Streamed images are decoded every epoch; one that fails is left out, and readable images of its batch
        # take its place (`epoch`; a PreloadedImages' unreadable likewise, reported when it was preloaded).
        self.unreadable = Unreadable() if unreadable is None else unreadable
        if labels is not None and len(labels) != len(source):
            raise ValueError(f"{len(labels)} labels for {len(source)} images")
        # Preloaded labels sit where the images do, so that one index picks both; a captioned run's captions are
        # drawn and looked up on the host (captions.Draws), each batch's rows then moved.
        self.labels = labels.to(source.device) if isinstance(labels, torch.Tensor) and self.preloaded else labels
        self.loader = None  # streamed images' or a latent run's draws' DataLoader, made once for every epoch

    def __len__(self):
        return len(self.source)

    def batches_per_epoch(self):
        return len(self.source) // (self.batch_size * self.world_size)

    def _epoch_loader(self, dataset, collate, batches, epoch):
        """The batches of `dataset` (whose items are (epoch, index) pairs) through the one DataLoader of every
        epoch, made at the first: its workers start once (forked anew each epoch, they kept its first step
        waiting: 0.15-0.3 s a start here) and keep nothing random (each item's draw or crop is its own); pinned
        on CUDA; their base seeds from a generator of its own (loader_generator), not the global one."""
        if self.loader is None:
            self.loader = torch.utils.data.DataLoader(
                dataset, batch_sampler=_IndexBatches([], epoch), num_workers=self.num_workers, collate_fn=collate,
                pin_memory=self.device.type == "cuda", persistent_workers=self.num_workers > 0,
                generator=loader_generator(self.seed, 0),
            )  # fmt: skip
        self.loader.batch_sampler.batches, self.loader.batch_sampler.epoch = batches, epoch
        return iterate(self.loader)

    def _labels(self, indices, epoch):
        """The labels of the images at host `indices`, on the device."""
        if isinstance(self.labels, torch.Tensor):
            return self.labels[indices].to(self.device, non_blocking=True)
        return self.labels.batch(indices, epoch, self.device)  # captions.Draws

    def epoch(self, epoch, start=0):
        """The epoch's batches from batch index `start` on."""
        batches = epoch_batches(len(self.source), self.batch_size, self.seed, epoch, self.rank, self.world_size)
        batches = batches[start:]
        if self.drawn:  # a latent run's: each image's latent drawn for this epoch (drawn.LatentDataset)
            if self.num_workers and batches:
                # Drawn ahead by worker processes, batch for batch the same as in this process (_EpochDraws);
                # forked, they share the cache's array.
                draws = self._epoch_loader(_EpochDraws(self.source), _as_drawn, batches, epoch)
            else:
                self.source.set_epoch(epoch)
                draws = map(self.source.batch, batches)
            for index, latents in zip(batches, draws):
                latents = latents.to(self.device, non_blocking=True)
                yield latents if self.labels is None else (latents, self._labels(index, epoch))
            return
        if self.preloaded:
            # picks: the indices each batch takes; rows: where their images lie. A PreloadedImages' unreadable
            # images have no row: their places go to readable images of their batch, as a stream fills them.
            images, picks, rows, failure = self.source, batches, batches, None
            if isinstance(images, PreloadedImages):
                picks, failure = images.filled(batches)
                images, rows = images.images, [images.rows[pick] for pick in picks]
            # The epoch's order goes to the images' device in one copy: a blocking
            # copy per batch would make the host wait for the GPU at every step.
            order = torch.stack(rows).to(images.device) if rows else []
            taken = order  # where the labels lie: at the indices, where a PreloadedImages' rows are not
            if picks is not rows and picks and isinstance(self.labels, torch.Tensor):
                taken = torch.stack(picks).to(images.device)
            for step, index in enumerate(order):
                batch = images[index].to(self.device, non_blocking=True)
                if self.labels is None:
                    yield batch
                elif isinstance(self.labels, torch.Tensor):
                    yield batch, self.labels[taken[step]].to(self.device, non_blocking=True)
                else:
                    yield batch, self._labels(picks[step], epoch)
            if failure is not None:
                raise ConfigError(failure)
            return
        loader = self._epoch_loader(_EpochItems(self.source, self.seed), collate_decoded, batches, epoch)
        for index, (images, errors, decoded) in zip(batches, loader):
            self.unreadable.report(errors)
            if images is None:
                raise ConfigError(f"every image of a batch was unreadable ({errors[0]}): check the dataset")
            taken = index[decoded]
            if len(images) < len(index):
                # The batch's readable images, from its first on, again in the places of the unreadable: a
                # captured or compiled step's static shapes need the full batch, and what repeats depends
                # only on which images failed, so the same seed still gives the same batches.
                fill = refill(len(images), len(index))
                images, taken = images[fill], taken[fill]
            images = images.to(self.device, non_blocking=True)
            yield images if self.labels is None else (images, self._labels(taken, epoch))


def to_model_input(images, random_flip=True):
    """uint8 or uint16 (B, C, S, S) -> float in [-1, 1], each image flipped left-right with probability 1/2.
    A float batch is a latent run's, drawn already (its orientation too: drawn.LatentCache.draw): as it is."""
    if images.is_floating_point():
        return images
    x = images.float().div_((65535 if images.dtype == torch.uint16 else 255) / 2).sub_(1)
    if random_flip:
        flip = torch.rand(x.shape[0], device=x.device) < 0.5
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
    return x
