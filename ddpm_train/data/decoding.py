"""A dataset decoded: in batches for an encoding pass, or once into memory (preloading), its unreadable images
skipped and said, or refused."""

import copy
import sys

import torch

from ddpm_train.data.workers import iterate, loader_generator
from ddpm_train.errors import ConfigError


ENCODE_BATCH = 64  # images a batch of decoding (preload) and of a latent run's encoding pass (images_to_encode)


def collate_decoded(items):
    """(stacked images that decoded, errors of those that did not, a bool tensor of which items decoded).

    The last tells which labels go with the images. Runs in the loader's worker
    processes, so it reports instead of raising.
    """
    images = [image for image, _ in items if image is not None]
    errors = [error for _, error in items if error is not None]
    decoded = torch.tensor([image is not None for image, _ in items])
    return (torch.stack(images) if images else None), errors, decoded


class Unreadable:
    """Images that could not be decoded: skipped with a warning that names each, and counted.

    With `strict` the first one stops the run instead. `verbose=False` keeps
    the other processes of a multi-process run quiet (they see the same files).
    """

    def __init__(self, strict=False, verbose=True):
        self.strict, self.verbose = strict, verbose
        self.messages = []

    def report(self, errors):
        for error in errors:
            if self.strict:
                raise ConfigError(f"{error}: remove or replace the file (or skip it: --on_fault skip)")
            if error not in self.messages:
                self.messages.append(error)
                if self.verbose:  # above a progress bar, not inside its line
                    from tqdm.auto import tqdm

                    tqdm.write(f"warning: skipping {error}", file=sys.stderr)

    def __len__(self):
        return len(self.messages)


def check_readable(dataset, unreadable):
    """Decode images until one works: a dataset with no readable image fails before training."""
    for i in range(len(dataset)):
        image, error = dataset[i]
        if image is not None:
            return
        unreadable.report([error])
    raise ConfigError(f"none of the {len(dataset)} images could be read: point --dataset at readable images")


def _decoding(dataset, num_workers, progress, unreadable, batch_size, require_readable):
    """(images that decoded or None, errors, a bool tensor of which items decoded) of each batch of
    `dataset`, in order, the errors reported to `unreadable` (default strict); none readable is an
    error with `require_readable` (decoded_batches)."""
    from tqdm.auto import tqdm

    unreadable = Unreadable(strict=True) if unreadable is None else unreadable
    loader = iterate(torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                                 collate_fn=collate_decoded, generator=loader_generator(0, 0)))  # fmt: skip
    found = False
    # position 0: a bar left open (a generator an error stopped, its frame kept by the traceback) would push it down
    with tqdm(total=len(dataset), desc="decoding images", unit="img", disable=not progress, leave=False, position=0) as bar:
        for images, errors, decoded in loader:
            unreadable.report(errors)
            found = found or images is not None
            yield images, errors, decoded
            bar.update(len(decoded))
    if not found and require_readable:
        raise ConfigError(f"none of the {len(dataset)} images could be read: point --dataset at readable images")


def decoded_batches(dataset, num_workers=0, progress=False, unreadable=None, labels=None, batch_size=ENCODE_BATCH,
                    require_readable=True):  # fmt: skip
    """Every readable image of `dataset` once, in order: batches (B, C, S, S), or with `labels` (one
    per item of `dataset`) (images, their labels). Unreadable images are passed to `unreadable` (default:
    strict, the first one is an error) and left out; none readable is an error (with `require_readable`,
    else no batch: a part of a dataset may hold only unreadable images)."""
    start = 0
    for images, _, decoded in _decoding(dataset, num_workers, progress, unreadable, batch_size, require_readable):
        if images is not None:
            yield images if labels is None else (images, labels[start : start + len(decoded)][decoded])
        start += len(decoded)


def preload(dataset, num_workers=0, progress=False, unreadable=None):
    """Decode every image once into one tensor (N, C, S, S) (decoded_batches: the unreadable
    left out)."""
    return torch.cat(list(decoded_batches(dataset, num_workers, progress, unreadable)))


class PreloadedImages(torch.utils.data.Dataset):
    """A preloaded dataset some of whose images are unreadable, each item at its index, as a streamed
    dataset has them: `images` (K, C, S, S) holds the K readable images in order, `rows[i]` the row of
    item i, -1 where it is unreadable, and `errors[i]` why. An item is (image, None) or (None, error),
    as FileImages' are; Batches fills the places of the unreadable as it does for a stream (`filled`)."""

    def __init__(self, images, readable, errors):
        self.images, self.errors = images, errors
        self.rows = torch.where(readable, readable.long().cumsum(0) - 1, -1)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = int(self.rows[i])
        return (self.images[row], None) if row >= 0 else (None, self.errors[i])

    @property
    def device(self):
        return self.images.device

    def to(self, device):
        """The same items, their images on `device`."""
        moved = copy.copy(self)
        moved.images = self.images.to(device)
        return moved

    def filled(self, batches):
        """(picks, failure): for each batch of indices the indices it takes, the places of its unreadable
        images filled as Batches fills a streamed batch's (`refill`), up to the first batch with no
        readable image; `failure` is then the error that batch raises when streamed, else None."""
        picks = []
        for index in batches:
            readable = index[self.rows[index] >= 0]
            if not len(readable):
                error = self.errors[int(index[0])]
                return picks, f"every image of a batch was unreadable ({error}): check the dataset"
            picks.append(readable[refill(len(readable), len(index))])
        return picks, None


def preload_in_place(dataset, num_workers=0, progress=False, unreadable=None):
    """Decode every image once, each keeping its index: a tensor (N, C, S, S) when all N are
    readable, else a PreloadedImages of the N, which remembers the unreadable (reported to `unreadable`,
    default strict). So a preloaded dataset has the images, the steps per epoch and the batches of the
    same dataset streamed. None readable is an error."""
    parts, readable, errors, start = [], [], {}, 0
    for images, failed, decoded in _decoding(dataset, num_workers, progress, unreadable, ENCODE_BATCH, True):
        if images is not None:
            parts.append(images)
        errors |= dict(zip((start + (~decoded).nonzero()[:, 0]).tolist(), failed))
        readable.append(decoded)
        start += len(decoded)
    images = torch.cat(parts)
    return PreloadedImages(images, torch.cat(readable), errors) if errors else images


def refill(readable, size):
    """Which of a batch's `readable` images (in its order) fill its `size` places: the readable from the
    first on, again in the places of the unreadable. Streamed and preloaded batches both fill so."""
    return torch.arange(size) % readable
