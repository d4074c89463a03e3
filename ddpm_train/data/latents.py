"""The latent cache: a dataset encoded once by a VAE (autoencoder.py), cached on disk by key, and drawn.

train.py, data.py and sample.py call it. The API:

    cache_key(dataset, vae, image_size, center_crop=True, flips=True) -> dict
        The cache's key. `dataset` is whatever identifies the images (JSON-able: name or path, config,
        split, column, a fingerprint of the file list, shapes' seed and count...): the caller's choice.
    cache_root(root=None) -> Path           where caches live (below)
    cached_latents(vae, images, key, root=None, max_gib=8.0, device=None, num_images=None,
                   progress=True, log=print) -> LatentCache
        The cache of `key`, read when it is there (one line says so; `images` is not touched), else
        `images` encoded, written, and read back. `images`: a callable images(start, stop) returning the
        batches of dataset items [start, stop) (`num_images` items in all), each batch (B, 3, S, S) uint8
        or in [-1, 1], or (images, labels) pairs; an unreadable item may be left out of its batch. For one
        process it may also be a callable with no argument returning such batches, or the batches
        themselves. Called only on a miss, so a hit decodes no image. With a torch.distributed process
        group of several processes it must be images(start, stop): each process encodes its share (below).
    shares(num_images, world_size) -> [(start, stop)]   each rank's share: contiguous, in rank order,
        starting at multiples of SHARD_ALIGN (64, decoding.decoded_batches' batch)
    LatentCache                             .num_images, .channels, .resolution, .labels, .stats, .meta,
                                            .path, .memmapped, .encode_seconds, .images_per_second
        .draw(indices, epoch, seed) -> (B, C, h, w) float32  raw latents, fresh per epoch (below)
    LatentDataset(cache, record=None, seed=0)   a torch Dataset of normalised draws: .set_epoch(epoch),
        [i] -> latent (or (latent, label)), .batch(indices) -> a batch of them, .epoch

What is stored, and why. For an AutoencoderKL the cache holds the posterior's mean and std of every
image (as EDM2 does), and each epoch draws a fresh z = mean + std * eps. With random flips on (the
`flips` of the key) it also holds the mean and std of the flipped image, and each epoch picks one of
the two orientations, because the latent of a flipped image is not the flipped latent. A convolutional
encoder commutes with flips only if every kernel is mirror-symmetric (learned ones are not) and every
downsampler samples a mirror-symmetric grid, and diffusers' KL downsamplers do not: a 3x3 stride-2
conv after padding the right and bottom edge (Downsample2D's pad (0, 1, 0, 1)) centres its outputs on
pixels 1, 3, 5, ... of its input, half an input pixel off the symmetric grid. Over SD's three halvings
the latent grid sits 3.5 image pixels off; the flipped image's latent is the flipped latent shifted
by 7 image pixels, nearly a latent pixel (the tests show a mirror-symmetric random encoder still
disagrees, and agrees once its downsampler is removed). A flipped latent is then a latent the encoder
never makes and the decoder was not trained on: training on flipped latents would teach the denoiser
samples outside what the decoder knows. Encoding both orientations costs a second
encoding, once per cache, and twice the disk, and is exact. Storing the two orientations' means alone
would lose EDM2's per-epoch posterior noise, so each orientation keeps both. So: mean and std, as
EDM2 does, and the flipped image encoded rather than the latent flipped; without flips (the cheaper
choice for a large dataset, as EDM2 trains ImageNet) one orientation is stored. An AutoencoderTiny is
deterministic: its latents alone are stored, and its draws differ between epochs only by orientation.

The array is (N, F, K, C, h, w) float32: F orientations (1, or 2 with flips: [original, flipped]), K
= 2 (mean, std) for a KL VAE or 1 (latents) for a Tiny one. A draw for image i in epoch e depends on
(seed, e, i) alone, so it does not depend on the batch an image lands in, the number of processes, or
where a run resumed: a resumed run draws bit-identical latents. A batch is drawn at once: its rows read
with one fancy index (ascending, for a memory map), its orientations and noise from a counter-based
generator in vectorised int64 ops (splitmix64 streams keyed by (seed, e, i), Box-Muller on 24-bit
uniforms: normals to 5.77 sigma), not a torch.Generator an image (keyed_random.py).

The key and where the cache lives. The key (`cache_key`) is the dataset's identity as the caller
gives it, the VAE's identity, the image size, the crop and the flips, with this file's FORMAT. The
VAE's identity is its class, its config (less the fields that leave the raw latents as they are:
scaling_factor, shift_factor, latents_mean, latents_std, force_upcast, private `_` ones), its dtype, and a
SHA-256 of its encoder's weights (the parameters and buffers the latents come from: `encoder.*`,
`quant_conv.*`), not its path or Hub id: the same weights in another folder give the same latents and
reuse the cache, and a VAE fine-tuned and saved over the same folder does not (hashing the
encoder of SD's VAE, 34M parameters, takes a fraction of a second). Its path is recorded in the
cache's meta.json. A fine-tuned decoder (sd-vae-ft-mse against ft-ema) shares the encoder's latents.
The normalisation is not in the key: the cache holds raw latents, normalised as they are drawn.

Caches live in `cache_root()`: `root` (the future `--latent_cache DIR`), else $DDPM_TRAIN_LATENT_CACHE,
else $XDG_CACHE_HOME/ddpm-train/latents, else ~/.cache/ddpm-train/latents: next to the user's other
caches (~/.cache/huggingface for `datasets`, ~/.cache/torch/hub for torch hub), shared by every run
and output folder. One folder per key, named by the key's hash: latents.npy, labels.npy (when the
images came with labels), meta.json (the full key, shape, stats, encoding time, what each process
encoded). It is written in a hidden temporary folder beside it (.NAME.tmp-HOST-PID-TOKEN) and renamed
into place when complete, so a killed encode leaves no cache that is later read; the next encode of
that key removes such leftovers of dead processes of this host (the HOST in the name matched exactly).
An encode goes by pieces of PIECE_IMAGES items (one images(start, stop) call each, when `images` takes a
range); each complete piece is hard-linked into .NAME.partial beside the cache, and an encode of the key that
starts again (after a kill, a preemption, a failure) reuses those that lie in its share and encodes the rest, the
same bits (pieces begin where decode batches do). The folder goes when the cache is published (renamed aside, then
removed); the pieces of another key (a dataset changed since) stay, named in one line by each encode, for the user
to remove. Encodes of one key at once (runs of a sweep started together) share the pieces: each claims a piece before
it encodes it (Claims), skips the pieces others hold and links them once complete; a one-process encode whose key
another publishes meanwhile stops and reads that cache.
A valid published cache is never deleted: a process that finds the final folder there when it
publishes reads it, and where it is a valid cache of the key (another run encoded it at the same time)
keeps it, discards its own and reads that one. Only an invalid or mismatched folder is replaced, and
it is first renamed aside atomically (a valid cache that appeared meanwhile is put back).

Several processes. With a torch.distributed process group of more than one process, one small
all_reduce on the default group tells whether every process's folder holds the cache; if so nobody
encodes. Else every process encodes its share of the items (`shares`: contiguous, the boundaries
multiples of SHARD_ALIGN, so each share's batches are the batches one process would see and the
latents the same bits on a CPU; on GPUs they are as deterministic as the encoder's kernels), on its
own device, into the temporary folder of its cache folder. Processes may share one cache folder (one
filesystem) or not (node-local caches: each process's `cache_root()` differs): each leaves a marker
named with a token of rank 0's in its cache root, and after a barrier the markers a process sees tell
which processes share its folder. The lowest rank of each folder receives the shares its folder lacks
through torch.distributed (gloo, TRANSFER_BYTES at a time, never the dataset in memory at once),
concatenates the shares in rank order, computes the stats from the assembled array (STATS_ROWS images
a chunk: the numbers one process computes), and publishes; then every process reads its folder's
cache, and each node ends with the full cache. Every wait of the build runs in a gloo group created
for it with the timeout ENCODE_WAIT (24 h), the longest being the wait for the slowest share, so that
the default group (NCCL's, of short timeout) is never held in a barrier during the encode. A share
that fails is told to every process at that wait, so all stop at once. One line says what each rank
encoded, another the "encoded N images" line (the main process prints them where log is
accelerator.print). A folder that already holds the cache while another lacks it is encoded again
all the same (its valid cache is kept at publishing).

Memory: latents.npy is a plain .npy. It is read into memory when its size is at most `max_gib` GiB
(the in-memory budget, train.py's --preload_data MAX_GIB), memory-mapped read-only (np.load(mmap_mode="r"))
when larger, so a cache of any size trains with the page cache holding what fits. The in-memory copy
is per process (8 processes of a node hold 8 copies: the budget is a process's); a memory-mapped one
shares the node's page cache.
"""

import contextlib
import hashlib
import inspect
import json
import math
import os
import re
import shutil
import socket
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from ddpm_train import sizes
from ddpm_train.data import autoencoder, keyed_random
from ddpm_train.errors import ConfigError, first_line

FORMAT = 1  # raise when what a cache holds, or how, changes
PROJECT = "ddpm-train"
CACHE_ENV = "DDPM_TRAIN_LATENT_CACHE"
LATENTS_FILE, LABELS_FILE, META_FILE = "latents.npy", "labels.npy", "meta.json"
NPY_HEADER_BYTES = 256  # the .npy header, written before the data and filled in once the count is known
_IN_PROGRESS = set()  # this process's temporary folders being written


# --- the VAE -------------------------------------------------------------------------------------


# --- the cache's key and place ------------------------------------------------------------------


def cache_key(dataset, vae, image_size, center_crop=True, flips=True):
    """The cache's key (JSON-able). With `center_crop` False each image is cached at the one random crop
    it had while encoding (random crops are not redrawn per epoch from a cache)."""
    return dict(
        format=FORMAT,
        dataset=json.loads(json.dumps(dataset, sort_keys=True, default=str)),
        vae=autoencoder.vae_identity(vae),
        image_size=sizes.parse(image_size),
        center_crop=bool(center_crop),
        flips=bool(flips),
    )


def key_hash(key):
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def cache_root(root=None):
    """root, else $DDPM_TRAIN_LATENT_CACHE, else $XDG_CACHE_HOME/ddpm-train/latents, else ~/.cache/…"""
    if root:
        return Path(root).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / PROJECT / "latents"


def cache_folder(key, root=None):
    return cache_root(root) / key_hash(key)[:32]


# --- writing -------------------------------------------------------------------------------------

# Shares of the dataset begin at multiples of this: the decode batch of decoding.decoded_batches, so that a
# share's batches are the batches a one-process encode sees and the latents are the same bits.
SHARD_ALIGN = 64
STATS_ROWS = 256  # images a chunk when the stats are summed over the assembled array: a fixed order, the same sums
TRANSFER_BYTES = 64 * 2**20  # a share a folder lacks travels through torch.distributed in chunks of this
PUBLISH_TRIES = 8  # looks at the final folder before publishing gives up (each a rename that lost a race)
# How long a process may wait for the slowest share (and for the shares and the cache to travel and be assembled), in
# a gloo group of its own: NCCL's default group keeps its short timeout. It fires only when a peer hangs (a peer that
# dies closes its connections and the wait fails at once), so it sits well above the longest encode of a share: an
# estimate, not a measurement, ImageNet's 1.28M images at 512px with flips on 2 GPUs at ~20 images/s each (two SD-VAE
# encodes an image) is ~9 h; 24 h leaves more than 2x and still ends a hung job within a day.
ENCODE_WAIT = timedelta(hours=24)


def _npy_header(shape, dtype=np.float32):
    """A .npy (version 1.0) header of exactly NPY_HEADER_BYTES bytes."""
    header = repr(dict(descr=np.lib.format.dtype_to_descr(np.dtype(dtype)), fortran_order=False, shape=tuple(shape)))
    room = NPY_HEADER_BYTES - len(np.lib.format.MAGIC_PREFIX) - 2 - 2
    return np.lib.format.magic(1, 0) + room.to_bytes(2, "little") + header.ljust(room - 1).encode("latin1") + b"\n"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host():
    """Where a process's PID means that process: the host name and, on Linux, its PID namespace (containers on one
    host may share its name, as Kubernetes' hostNetwork pods do, and not their PIDs)."""
    try:
        return f"{socket.gethostname()}~{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return socket.gethostname()


def temporary(final, host=None, pid=None, token=None):
    """A hidden folder beside `final`: .NAME.tmp-HOST-PID-TOKEN, HOST (_host) and PID those of the process that owns it."""
    host = _host() if host is None else host
    pid = os.getpid() if pid is None else pid
    return final.parent / f".{final.name}.tmp-{host}-{pid}-{token or uuid.uuid4().hex[:8]}"


def _remove_leftovers(final):
    """Remove temporary folders of this key left by dead processes of this host (a killed encode, or a publisher
    killed while it removed the pieces it had renamed aside). The host in the name must be this host exactly:
    `node1` leaves `node1-b`'s and `node10`'s folders alone, and another container's of the same name (another PID
    namespace: its PIDs are not this one's)."""
    host = _host()
    for prefix in (f".{final.name}.tmp-", f".{_partial(final).name}.tmp-"):
        for tmp in final.parent.glob(f"{prefix}*"):
            parts = tmp.name[len(prefix) :].rsplit("-", 2)  # HOST-PID-TOKEN (HOST may hold dashes)
            if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
                continue  # another host's (a shared filesystem): it may be writing
            pid = int(parts[1])
            if str(tmp) in _IN_PROGRESS or (pid != os.getpid() and _alive(pid)):
                continue
            shutil.rmtree(tmp, ignore_errors=True)


def shares(num_images, world_size):
    """[(start, stop)] of each rank's share of items [0, num_images): contiguous, in rank order, each starting at
    a multiple of SHARD_ALIGN, as even as that allows (a share may be empty when there are few images)."""
    blocks = -(-int(num_images) // SHARD_ALIGN)
    bounds = [min(int(num_images), -(-blocks * r // world_size) * SHARD_ALIGN) for r in range(world_size + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _takes_range(images):
    """Whether `images` is called as images(start, stop)."""
    if not callable(images):
        return False
    try:
        params = list(inspect.signature(images).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _check_images(images, num_images, world):
    ranged = _takes_range(images)
    if world > 1 and not ranged:
        raise ConfigError(
            f"latents: {world} processes encode a share each: `images` must be a callable images(start, stop) "
            "returning the batches of dataset items [start, stop)"
        )
    if ranged and (num_images is None or int(num_images) < 0):
        raise ConfigError("latents: `images(start, stop)` needs num_images, the number of dataset items")


def _batches(images, start, stop):
    if _takes_range(images):
        return images(start, stop)
    return images() if callable(images) else images


def _as_input(batch):
    if batch.dtype == torch.uint8:
        return batch.float().div(127.5).sub(1)
    return batch.float()


def _encode_batch(vae, x):
    """(B, K, C, h, w) float32: posterior mean and std (KL) or the latents (Tiny)."""
    x = x.to(device=next(vae.parameters()).device, dtype=next(vae.parameters()).dtype)
    with torch.no_grad(), autoencoder.no_cudnn_benchmark():
        if autoencoder.is_tiny(vae):
            return vae.encode(x).latents.float()[:, None]
        dist = vae.encode(x).latent_dist
        return torch.stack([dist.mean, dist.std], 1).float()


def _write_piece(vae, batches, key, file, bar):
    """Encode `batches` into the .npy `file` (and `file`-labels.npy when they come with labels), fsynced: a dict
    of the images encoded, their shape (F, K, C, h, w) (None when none), the files' sizes in bytes."""
    flips, size = key["flips"], key["image_size"]
    labels, count, shape = [], 0, None
    with open(file, "wb") as f:
        f.write(b"\0" * NPY_HEADER_BYTES)
        for batch in batches:
            if isinstance(batch, (tuple, list)):
                batch, batch_labels = batch
                labels.append(torch.as_tensor(batch_labels).long().cpu().reshape(-1))
            if len(batch) == 0:
                continue  # a batch of unreadable items only: the encoder takes no empty batch
            x = _as_input(batch)
            if x.shape[-2:] != sizes.height_width(size):
                raise ValueError(f"images of {tuple(x.shape[-2:])} pixels (height, width) for a cache of {size}")
            x = torch.cat([x, x.flip(3)]) if flips else x
            z = torch.cat([_encode_batch(vae, part) for part in x.split(max(1, autoencoder.ENCODE_PIXELS // sizes.pixels(size)))])
            z = (torch.stack(z.chunk(2), 1) if flips else z[:, None]).cpu()  # (B, orientations, K, C, h, w)
            shape = tuple(z.shape[1:])
            f.write(np.ascontiguousarray(z.numpy(), dtype="<f4").tobytes())
            count += len(z)
            bar.update(len(z))
        f.seek(0)
        f.write(_npy_header((count, *(shape or ()))))
        f.flush()
        os.fsync(f.fileno())
    labels_file, labels_bytes = _labels_file(file), 0
    if labels:
        labels = torch.cat(labels)
        if len(labels) != count:
            raise ValueError(f"{len(labels)} labels for {count} images")
        np.save(labels_file, labels.numpy())
        labels_bytes = labels_file.stat().st_size
    return dict(images=count, shape=list(shape) if shape else None, latents_bytes=file.stat().st_size,
                labels_bytes=labels_bytes)  # fmt: skip


# --- pieces: what a killed encode keeps ------------------------------------------------------------------

# Dataset items a piece of an encode. Each piece is encoded by one images(start, stop) call into the build folder
# and, once complete, hard-linked into the key's .NAME.partial folder; an encode of the key that starts again (a
# preempted job's next start) reuses every piece kept there that lies in its share. The most an encode loses is a
# piece a process (at 512px, ~20 images/s: ~7 minutes). Each call starts the decode's DataLoader afresh (0.15-0.3 s
# to its first batch with 2-4 workers on a 2-core machine, docs/latents.md): ~1% of a piece at 300 images/s.
PIECE_IMAGES = 8192
_PIECE = re.compile(r"piece-(\d{12})-(\d{12})\.npy")


def _partial(final):
    """The folder that keeps the complete pieces of an encode of `final`'s key until the cache is published."""
    return final.parent / f".{final.name}.partial"


def _remove_pieces(partial):
    """The pieces of a published cache, no longer needed: renamed aside first, so that an encode beside this one
    sees them all or none (a piece gone from a folder still there it would encode again), then removed."""
    aside = temporary(partial)
    try:
        os.rename(partial, aside)
    except OSError:
        return  # none (a filesystem without hard links), or removed by another publisher
    shutil.rmtree(aside, ignore_errors=True)


def _piece_name(a, b):
    return f"piece-{a:012d}-{b:012d}.npy"


def _piece_info(file):
    """dict(images, shape, latents_bytes, labels_bytes) of the complete piece `file` (latents and, where there
    are any, labels), else None: a file that is not one this module wrote whole."""
    try:
        with open(file, "rb") as f:
            np.lib.format.read_magic(f)  # another version's header does not parse as 1.0's
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        size = file.stat().st_size
        labels_file = _labels_file(file)
        labels = len(np.load(labels_file, mmap_mode="r")) if labels_file.is_file() else None
    except (OSError, ValueError):
        return None
    rows = shape[0] if shape else -1
    if fortran or dtype != np.dtype("<f4") or rows < 0 or size != NPY_HEADER_BYTES + 4 * math.prod(shape):
        return None
    if labels is not None and labels != rows:
        return None
    return dict(images=rows, shape=list(shape[1:]) if rows else None, latents_bytes=size,
                labels_bytes=labels_file.stat().st_size if labels is not None else 0)  # fmt: skip


def _kept_pieces(partial, start, stop):
    """The item ranges (a, b) of the pieces `partial` keeps that lie in [start, stop) and begin where a decode
    batch does (so that what is encoded after them is the same batches)."""
    found = []
    for file in partial.glob("piece-*.npy") if partial.is_dir() else ():
        m = _PIECE.fullmatch(file.name)
        if m:
            a, b = int(m[1]), int(m[2])
            if start <= a < b <= stop and a % SHARD_ALIGN == 0 and (b % SHARD_ALIGN == 0 or b == stop):
                found.append((a, b))
    return found


def _plan(start, stop, kept):
    """[(a, b, kept)]: items [start, stop) in order, as the `kept` ranges inside it (those that do not overlap an
    earlier one) and the rest, to encode, cut at multiples of PIECE_IMAGES."""
    plan, at = [], start
    for a, b in sorted(kept) + [(stop, stop)]:
        if a < at:
            continue  # overlaps a range already planned
        while at < a:
            cut = min(a, (at // PIECE_IMAGES + 1) * PIECE_IMAGES)
            plan.append((at, cut, False))
            at = cut
        if b > a:
            plan.append((a, b, True))
            at = b
    return plan


def _link(src, folder):
    """Hard-link `src` (and its labels, first) into `folder`, replacing what is there: False where it cannot."""
    labels = _labels_file(src)
    for file in ([labels] if labels.is_file() else []) + [src]:
        link = folder / f".{file.name}.{os.getpid()}"
        try:
            os.link(file, link)
            os.replace(link, folder / file.name)
        except OSError:
            link.unlink(missing_ok=True)
            return False
    return True


def _others_pieces(final, log):
    """Say what pieces of interrupted encodes of other keys `final`'s cache root holds: a dataset whose files
    changed since (fixed, or added to) is another key, and its old pieces are left for the user to remove."""
    folders = sorted(p for p in final.parent.glob(".*.partial") if p.name != _partial(final).name and any(p.glob("piece-*")))
    size = 0
    for file in (f for folder in folders for f in folder.iterdir()):
        with contextlib.suppress(OSError):  # removed meanwhile: that encode finished
            size += file.stat().st_size
    if folders:
        log(
            f"latents: {final.parent} holds the pieces of {len(folders)} interrupted encode(s) of other datasets or VAEs "
            f"({size / 2**30:.2f} GiB: {', '.join(p.name for p in folders[:3])}{', ...' if len(folders) > 3 else ''}), "
            "kept for their next start: remove them if those runs will not come again"
        )


# --- two encodes of one key at once: they share its pieces --------------------------------------------------------

# Runs started together on a new dataset (a sweep) encode the same key. Each process claims a piece before it encodes
# it (.claim-PIECE in .NAME.partial, made with O_EXCL, holding its host, PID and a token), skips the pieces another
# live encode has claimed, and links them once they are complete: two jobs take turns piece by piece instead of each
# encoding everything. A claim is a dead encode's when its process is gone (this host, its PID namespace) or it has not
# been touched for CLAIM_STALE_S, timed by this process's own clock (a live encode touches its claims every
# CLAIM_BEAT_S from a thread of its own, whatever its batches take): its piece is then claimed anew and encoded.
CLAIM_BEAT_S = 20.0
CLAIM_STALE_S = 120.0
CLAIM_POLL_S = 0.5  # how often an encode that waits for other encodes' pieces looks for them


class Claims:
    """The pieces this encode has claimed in `partial`, touched every CLAIM_BEAT_S until `close`, which releases them."""

    def __init__(self, partial):
        self.partial, self.held, self.seen = partial, set(), {}
        self.mark = f"{_host()} {os.getpid()} {uuid.uuid4().hex[:8]}\n"
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="latent piece claims", daemon=True)
        self.thread.start()

    def _beat(self):
        while not self.stopped.wait(CLAIM_BEAT_S):
            for path in list(self.held):
                with contextlib.suppress(OSError):
                    os.utime(path)

    def take(self, name):
        """Claim the piece `name`: True, else False (another live encode holds it). Where `partial` takes no claims
        (gone: another job published the cache) the piece is this encode's alone: True."""
        path = self.partial / f".claim-{name}"
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if not self._dead(path):
                    return False
                path.unlink(missing_ok=True)  # a dead encode's: claimed anew
                continue
            except OSError:
                return True
            with os.fdopen(fd, "w") as f:
                f.write(self.mark)
            self.held.add(path)
            return True
        return False

    def _dead(self, path):
        try:
            stat, words = path.stat(), path.read_text().split()
        except OSError:
            return False  # released meanwhile: its piece is complete, or free at the next look
        if len(words) == 3 and words[0] == _host() and words[1].isdigit() and not _alive(int(words[1])):
            return True
        touched, since = self.seen.get(path, (None, None))
        if touched != stat.st_mtime_ns:
            self.seen[path] = (stat.st_mtime_ns, time.monotonic())
            return False
        return time.monotonic() - since > CLAIM_STALE_S

    def release(self, name):
        path = self.partial / f".claim-{name}"
        if path in self.held:
            self.held.discard(path)
            path.unlink(missing_ok=True)

    def close(self):
        self.stopped.set()
        self.thread.join()
        for path in self.held:
            path.unlink(missing_ok=True)
        self.held.clear()


def _encode_share(vae, images, start, stop, key, tmp, partial, progress, published=None):
    """Encode items [start, stop) of `images(start, stop)` into pieces in `tmp`, each kept in `partial` once
    complete, the pieces `partial` already keeps linked instead of encoded (None: `images` takes no range, one piece
    of everything, nothing kept). A dict of the images, their shape (F, K, C, h, w) (None when none), the seconds,
    the images kept from an earlier encode, the pieces (their file names, images and sizes)."""
    from tqdm.auto import tqdm

    if partial is not None:
        partial.mkdir(exist_ok=True)
        todo = [(a, b) for a, b, _ in _plan(start, stop, _kept_pieces(partial, start, stop))]
    else:
        todo = [(None, None)]
    pieces, began = [], time.perf_counter()
    claims = Claims(partial) if partial is not None else None
    try:
        with tqdm(
            total=stop - start if partial is not None else stop, desc="encoding latents", unit="img",
            disable=not progress, leave=False, file=sys.stderr,
        ) as bar:  # fmt: skip
            while todo:
                held = []
                for a, b in todo:
                    if not _piece_of(vae, images, a, b, key, tmp, partial, claims, bar, pieces, published):
                        held.append((a, b))
                if held:  # pieces other encodes have claimed: linked once complete, or taken over from a dead one
                    bar.set_description("encoding latents (waiting for pieces another encode of this key holds)")
                    time.sleep(CLAIM_POLL_S)
                todo = held
    finally:
        if claims is not None:
            claims.close()
    pieces.sort(key=lambda p: p["file"])  # in item order (the names' 12 digits), however they were taken
    seconds = time.perf_counter() - began
    full = [p for p in pieces if p["images"]]
    if len({tuple(p["shape"]) for p in full}) > 1:
        raise ValueError(f"the pieces' latents differ in shape: {sorted({tuple(p['shape']) for p in full})}")
    if len({p["labels_bytes"] > 0 for p in full}) > 1:
        raise ValueError("some pieces came with labels, some without")
    return dict(images=sum(p["images"] for p in pieces), shape=full[0]["shape"] if full else None, seconds=seconds,
                kept=sum(p["images"] for p in pieces if p["kept"]), pieces=pieces)  # fmt: skip


class _PublishedMeanwhile(Exception):
    """Another encode of the key published the cache (and removed its pieces) while this one encoded."""


def _piece_of(vae, images, a, b, key, tmp, partial, claims, bar, pieces, published=None):
    """Items [a, b) into `tmp` as a piece, appended to `pieces`: linked from `partial` where another encode (an
    interrupted one, or one beside this) left it complete, else encoded where this encode can claim it (kept in
    `partial` once complete); False where another live encode holds it. `published()`: the cache, where it is
    there, asked where `partial` has gone (_PublishedMeanwhile with it: this encode is not needed)."""
    file = tmp / (_piece_name(a, b) if partial is not None else "piece-all.npy")

    def linked():  # complete in `partial`: linked, not encoded (another job may have published and removed `partial`)
        piece = _piece_info(partial / file.name) if partial is not None else None
        if piece is None or not _link(partial / file.name, tmp):
            return False
        bar.update(piece["images"])
        pieces.append(dict(piece, file=file.name, kept=True))
        return True

    if linked():  # listed at the start, or completed since
        return True
    if claims is not None and not claims.take(file.name):
        return False
    if claims is not None:
        if linked():  # completed by its claimer between the look above and the claim
            claims.release(file.name)
            return True
        cache = published() if published is not None and not partial.is_dir() else None
        if cache is not None:
            raise _PublishedMeanwhile(cache)
    piece = _write_piece(vae, images(a, b) if partial is not None else _batches(images, 0, None), key, file, bar)
    if partial is not None:
        _link(file, partial)  # best effort: a filesystem without hard links keeps nothing
        claims.release(file.name)
    pieces.append(dict(piece, file=file.name, kept=False))
    return True


def _labels_file(file):
    return file.parent / LABELS_FILE if file.name == LATENTS_FILE else file.with_name(f"{file.stem}-labels.npy")


def _stats(file):
    """Per-channel mean and std of the latents as drawn (both orientations, the posterior noise: mean^2 + std^2
    is E[z^2] of a draw), summed over the array in chunks of STATS_ROWS images: the same numbers however the
    array was encoded."""
    array = np.load(file, mmap_mode="r")
    sums = torch.zeros(3, array.shape[3], dtype=torch.float64)
    for i in range(0, len(array), STATS_ROWS):
        z = torch.from_numpy(np.array(array[i : i + STATS_ROWS]))
        mean = z[:, :, 0].double().transpose(0, 2).flatten(1)  # (C, B*F*h*w)
        square = mean.square()
        if z.shape[2] == 2:
            square = square + z[:, :, 1].double().transpose(0, 2).flatten(1).square()
        sums += torch.stack([mean.sum(1), square.sum(1), torch.full_like(mean[:, 0], mean.shape[1])])
    mean = sums[0] / sums[2]
    std = (sums[1] / sums[2] - mean.square()).clamp(min=0).sqrt()
    return dict(mean=mean.tolist(), std=std.tolist())


def _finish(vae, key, tmp, ranks):
    """Write meta.json of the complete latents.npy (and labels.npy) in `tmp`; returns the meta dict. `ranks`:
    what each process encoded (its rank, host, device, items [start, stop), images, seconds, images kept)."""
    array = np.load(tmp / LATENTS_FILE, mmap_mode="r")
    count = len(array)
    seconds = max(r["seconds"] for r in ranks)  # the processes encode at once: the slowest share's time
    encoded = count - sum(r["kept"] for r in ranks)  # less the pieces an interrupted encode kept
    devices = sorted({r["device"] for r in ranks})
    meta = dict(
        key=key,
        vae_source=getattr(vae, "latents_source", None),
        shape=list(array.shape),
        layout="(N, orientations [original, flipped], [mean, std] or [latents], C, h, w)",
        stats=_stats(tmp / LATENTS_FILE),
        encode_seconds=seconds,
        images_per_second=encoded / seconds if seconds > 0 and encoded else None,
        encode_device=", ".join(devices) + (f" ({len(ranks)} processes)" if len(ranks) > 1 else ""),
        ranks=ranks,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    del array
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    return meta


def _publish(tmp, final, key, max_gib):
    """Rename the complete cache `tmp` into place as `final` and read it: (LatentCache, True). A valid cache of
    `key` already there (another process published it first) is kept and read instead: (it, False), and the
    caller discards `tmp`. Only an invalid or mismatched folder is replaced, renamed aside atomically first
    (never removed in place, which would race another publisher)."""
    for _ in range(PUBLISH_TRIES):
        try:
            os.rename(tmp, final)
        except OSError:
            pass  # `final` is there (a non-empty folder)
        else:
            return LatentCache(final, max_gib), True
        existing = _read(final, key, max_gib)
        if existing is not None:
            return existing, False  # another process's valid cache of this key: keep it, never delete it
        aside = temporary(final)
        try:
            os.rename(final, aside)  # an invalid folder: out of the way, atomically
        except OSError:
            continue  # gone or replaced meanwhile: look again
        if _read(aside, key, max_gib) is not None:  # published between the look and the move: put it back
            try:
                os.rename(aside, final)
            except OSError:  # yet another took its place: that one is looked at next, this one is our candidate
                shutil.rmtree(tmp, ignore_errors=True)
                os.rename(aside, tmp)
            continue
        shutil.rmtree(aside, ignore_errors=True)
    raise RuntimeError(
        f"latents: could not publish the cache {final} in {PUBLISH_TRIES} tries (other processes kept replacing it)"
    )


def rank_and_world():
    """(rank, world size) of the torch.distributed process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _everywhere(flag):
    """Whether `flag` holds on every process: one all_reduce of one number on the default group (on the
    device its backend takes: CUDA for NCCL)."""
    import torch.distributed as dist

    backend = str(dist.get_backend())
    cpu = "gloo" in backend or "mpi" in backend or not torch.cuda.is_available()
    flag = torch.tensor([int(bool(flag))], device="cpu" if cpu else torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _reuse_line(final, cache):
    return (
        f"latents: reusing the cache {final} ({cache.num_images} images, encoded once at "
        f"{cache.images_per_second or 0:.1f} images/s): encoding nothing"
    )


def _encoded_line(meta, key, final, kept):
    count, seconds = meta["shape"][0], meta["encode_seconds"]
    reused = sum(r["kept"] for r in meta["ranks"])  # pieces an interrupted encode of the key left
    return (
        f"encoded {count - reused} images to latents in {seconds:.1f} s ({(count - reused) / max(seconds, 1e-9):.1f} "
        f"images/s{', both flips' if key['flips'] else ''}, on {meta['encode_device']})"
        + (f", and reused {reused} that another encode of this key had encoded (interrupted, or beside this one)"
           if reused else "")
        + f"; cached in {final}"
        + (" (another process published this key first: reading its cache)" if kept else "")
    )


def cached_latents(vae, images, key, root=None, max_gib=8.0, device=None, num_images=None, progress=True, log=print):
    """The LatentCache of `key`: read if it is there, else `images` encoded and cached (module doc). With a
    torch.distributed process group of several processes every process encodes its share (`images(start,
    stop)`, `num_images` items in all) and each cache folder is assembled once."""
    rank, world = rank_and_world()
    if world > 1 or _takes_range(images):
        _check_images(images, num_images, world)
    final = cache_folder(key, root)
    cache = _read(final, key, max_gib)
    if world > 1:
        if _everywhere(cache is not None):  # every process's folder holds it: nobody encodes
            log(_reuse_line(final, cache))
            return cache
        _others_pieces(final, log)
        return _encode_shared(vae, images, key, final, rank, world, max_gib, device, num_images, progress, log)
    if cache is not None:
        log(_reuse_line(final, cache))
        return cache
    if device is not None:
        vae = vae.to(device)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(final)
    _others_pieces(final, log)
    tmp = temporary(final)
    tmp.mkdir()
    _IN_PROGRESS.add(str(tmp))
    partial = _partial(final) if _takes_range(images) else None
    try:
        try:
            share = _encode_share(vae, images, 0, num_images, key, tmp, partial, progress,
                                  published=lambda: _read(final, key, max_gib))  # fmt: skip
        except _PublishedMeanwhile as published:
            cache = published.args[0]
            log(f"latents: another process published this key's cache while this one encoded its pieces: reading "
                f"{final} ({cache.num_images} images)")  # fmt: skip
            return cache
        mine = dict(rank=0, host=socket.gethostname(), device=str(next(vae.parameters()).device), start=0,
                    stop=share["images"] if num_images is None else int(num_images), images=share["images"],
                    seconds=share["seconds"], kept=share["kept"])  # fmt: skip
        _assemble(tmp, [dict(mine, pieces=share["pieces"])])
        meta = _finish(vae, key, tmp, [mine])
        cache, ours = _publish(tmp, final, key, max_gib)
        if partial is not None:
            _remove_pieces(partial)
    finally:
        _IN_PROGRESS.discard(str(tmp))
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(_encoded_line(meta, key, final, kept=not ours))
    return cache


# --- several processes -----------------------------------------------------------------------------


def _folder_leaders(seen):
    """The lowest rank of each rank's folder: `seen[r]`, the ranks whose markers rank r saw, joined into
    groups (seeing a marker proves the same folder; a listing that missed one only splits nothing)."""
    leader = list(range(len(seen)))

    def find(r):
        while leader[r] != r:
            r = leader[r]
        return r

    for r, ranks in enumerate(seen):
        for s in ranks:
            a, b = find(r), find(s)
            leader[max(a, b)] = min(a, b)
    return [find(r) for r in range(len(seen))]


def _folders(final, rank, world, group):
    """(people, leaders): each process's (host, pid, token) and the lowest rank that sees its folder of `final`
    (several nodes each have a folder of their own). Each process leaves a marker beside `final`, and after a
    barrier lists the markers it sees; rank 0's token names this meeting."""
    import torch.distributed as dist

    people = [None] * world
    dist.all_gather_object(people, (socket.gethostname(), os.getpid(), uuid.uuid4().hex[:12]), group=group)
    token = people[0][2]
    final.parent.mkdir(parents=True, exist_ok=True)
    marker = final.parent / f".{final.name}.mark-{token}-{rank}"
    try:
        marker.touch()
        dist.barrier(group=group)
        mine = {int(p.name.rsplit("-", 1)[1]) for p in final.parent.glob(f".{final.name}.mark-{token}-*")}
        seen = [None] * world
        dist.all_gather_object(seen, sorted(mine | {rank}), group=group)  # every listing done before a marker goes
    finally:
        marker.unlink(missing_ok=True)
    return people, _folder_leaders(seen)


def in_every_folder(folder, names, make, what):
    """With several processes (a torch.distributed group), each runs `make()`, which writes some of the files
    `names` into `folder` (each whole, under its final name), then every process's `folder` holds all of them:
    where processes do not share one folder (a node's own disk), each file a folder lacks travels to it from a
    process that has it. The waits are in a gloo group of ENCODE_WAIT; a failure of `make` on any process stops
    every process (that one with its error). Returns what `make` returned here."""
    import torch.distributed as dist

    rank, world = rank_and_world()
    group = dist.new_group(backend="gloo", timeout=ENCODE_WAIT)
    try:
        outcome, failure, made = dict(rank=rank), None, None
        try:
            made = make()
        except Exception as e:  # told to every process below, so that none waits for this one
            failure, outcome["error"] = e, _error(e)
        everyone = [None] * world
        dist.all_gather_object(everyone, outcome, group=group)
        _raise_failed(everyone, failure, what)
        _, leaders = _folders(folder, rank, world, group)
        sizes = {n: (folder / n).stat().st_size for n in names if (folder / n).is_file()}
        held = [None] * world
        dist.all_gather_object(held, sizes, group=group)
        for name in names:  # in one fixed order on every process
            sender = min(r for r in range(world) if name in held[r])
            for receiver in sorted({leaders[r] for r in range(world) if name not in held[leaders[r]]}):
                if rank == sender:
                    _send_file(folder / name, receiver, group)
                elif rank == receiver:
                    tmp = folder / f".{name}.{uuid.uuid4().hex[:8]}"
                    _recv_file(tmp, held[sender][name], sender, group)
                    os.replace(tmp, folder / name)
        dist.barrier(group=group)  # every folder whole
        return made
    finally:
        dist.destroy_process_group(group)


def _send_file(file, dst, group):
    import torch.distributed as dist

    with open(file, "rb") as f:
        while chunk := f.read(TRANSFER_BYTES):
            dist.send(torch.frombuffer(bytearray(chunk), dtype=torch.uint8), dst, group=group)


def _recv_file(file, size, src, group):
    import torch.distributed as dist

    with open(file, "wb") as f:
        while size > 0:
            chunk = torch.empty(min(size, TRANSFER_BYTES), dtype=torch.uint8)
            dist.recv(chunk, src, group=group)
            f.write(chunk.numpy().tobytes())
            size -= len(chunk)


def _assemble(tmp, everyone):
    """latents.npy (and labels.npy) in `tmp`: every rank's pieces (`everyone[r]["pieces"]`, files in `tmp`)
    concatenated in rank order, then removed."""
    parts = [p for m in everyone for p in m["pieces"] if p["images"]]
    if not parts:  # with several processes or pieces no call saw the whole dataset, to say it
        raise ConfigError("latents: none of the dataset's images could be read, nothing to encode: point --dataset "
                          "at readable images")  # fmt: skip
    shape = parts[0]["shape"]
    if any(p["shape"] != shape for p in parts):
        raise ValueError(f"the shares' latents differ in shape: {sorted({tuple(p['shape']) for p in parts})}")
    if len({p["labels_bytes"] > 0 for p in parts}) > 1:
        raise ValueError("some shares came with labels, some without")
    count = sum(p["images"] for p in parts)
    with open(tmp / LATENTS_FILE, "wb") as f:
        f.write(_npy_header((count, *shape)))
        for p in parts:
            with open(tmp / p["file"], "rb") as piece:
                piece.seek(NPY_HEADER_BYTES)
                shutil.copyfileobj(piece, f, TRANSFER_BYTES)
        f.flush()
        os.fsync(f.fileno())
    if parts[0]["labels_bytes"]:
        np.save(tmp / LABELS_FILE, np.concatenate([np.load(_labels_file(tmp / p["file"])) for p in parts]))
    for m in everyone:
        for p in m["pieces"]:
            for file in (tmp / p["file"], _labels_file(tmp / p["file"])):
                file.unlink(missing_ok=True)


def _error(e):
    return "ConfigError" if isinstance(e, ConfigError) else type(e).__name__, first_line(e, 300)


def _raise_failed(everyone, failure, what):
    failed = [m for m in everyone if m.get("error")]
    if not failed:
        return
    if failure is not None:
        raise failure
    m = failed[0]
    kind, message = m["error"]
    if kind == "ConfigError":
        raise ConfigError(f"{message} (rank {m['rank']})")
    raise RuntimeError(f"latents: rank {m['rank']} could not {what}: {kind}: {message}")


def _encode_shared(vae, images, key, final, rank, world, max_gib, device, num_images, progress, log):
    """Every process encodes its share into its folder's build; the lowest rank of each folder receives the
    shares its folder lacks, assembles and publishes the cache; every process reads it (module doc)."""
    import torch.distributed as dist

    if device is not None:
        vae = vae.to(device)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(final)
    group = dist.new_group(backend="gloo", timeout=ENCODE_WAIT)  # the long waits: not the default (NCCL) group
    try:
        people, leaders = _folders(final, rank, world, group)
        token, leader = people[0][2], leaders[rank]
        tmp = temporary(final, *people[leader][:2], token)  # named for its leader: whose death makes it a leftover
        tmp.mkdir(exist_ok=True)
        _IN_PROGRESS.add(str(tmp))
        try:
            return _build_shared(vae, images, key, final, tmp, rank, world, leaders, people, group, max_gib,
                                 num_images, progress, log)  # fmt: skip
        finally:
            _IN_PROGRESS.discard(str(tmp))
            if rank == leader and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        dist.destroy_process_group(group)


def _build_shared(vae, images, key, final, tmp, rank, world, leaders, people, group, max_gib, num_images, progress, log):
    import torch.distributed as dist

    start, stop = shares(num_images, world)[rank]
    mine = dict(rank=rank, host=people[rank][0], device=str(next(vae.parameters()).device), start=start, stop=stop)
    failure = None
    try:  # an empty share (few images) opens no images
        mine |= _encode_share(vae, images, start, stop, key, tmp, _partial(final), progress)
    except Exception as e:  # told to every process below, so that none waits for this share
        failure, mine["error"] = e, _error(e)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)  # the wait for the slowest share (ENCODE_WAIT)
    _raise_failed(everyone, failure, "encode its share")
    # The shares a folder lacks (encoded in another folder) travel to its leader, in chunks, in one fixed order.
    for m in everyone:
        for receiver in sorted(set(leaders) - {leaders[m["rank"]]}):
            for piece in m["pieces"]:
                name = piece["file"]
                for file, size in (tmp / name, piece["latents_bytes"]), (_labels_file(tmp / name), piece["labels_bytes"]):
                    if size and piece["images"] and rank == m["rank"]:
                        _send_file(file, receiver, group)
                    elif size and piece["images"] and rank == receiver:
                        _recv_file(file, size, m["rank"], group)
    outcome, failure, cache = dict(rank=rank), None, None
    if rank == leaders[rank]:
        try:
            _assemble(tmp, everyone)
            fields = ("rank", "host", "device", "start", "stop", "images", "seconds", "kept")
            ranks = [{k: m[k] for k in fields} for m in everyone]
            outcome["meta"] = _finish(vae, key, tmp, ranks)  # this job's encode, told even if another's cache is kept
            cache, ours = _publish(tmp, final, key, max_gib)
            _remove_pieces(_partial(final))
            outcome["kept"] = not ours
        except Exception as e:
            failure, outcome["error"] = e, _error(e)
    outcomes = [None] * world
    dist.all_gather_object(outcomes, outcome, group=group)  # the folders' caches published
    _raise_failed(outcomes, failure, "assemble the cache")
    cache = cache or _read(final, key, max_gib)  # the leader read it as it published it
    if cache is None:
        raise RuntimeError(f"latents: rank {rank} cannot read the cache {final} that rank {leaders[rank]} published")
    folders = len(set(leaders))
    log(
        f"latents: {world} processes encoded a share each, "
        + ", ".join(f"rank {m['rank']} items [{m['start']}, {m['stop']}): {m['images']} images in {m['seconds']:.1f} s on "
                    f"{m['device']}" + (f" ({m['kept']} of them reused)" if m["kept"] else "") for m in everyone)
        + f"; assembled in {folders} cache folder{'s' if folders > 1 else ''}"
    )  # fmt: skip
    leader = outcomes[leaders[rank]]  # its folder's encode, and whether another job's cache was kept instead of it
    log(_encoded_line(leader["meta"], key, final, leader["kept"]))
    return cache


# --- reading and drawing ---------------------------------------------------------------------------


def _read(folder, key, max_gib):
    """The cache in `folder` if it is complete and made for `key`, else None."""
    meta_file = folder / META_FILE
    if not meta_file.is_file() or not (folder / LATENTS_FILE).is_file():
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
        self.meta = json.loads((self.path / META_FILE).read_text())
        file = self.path / LATENTS_FILE
        self.memmapped = file.stat().st_size > max_gib * 2**30
        self.array = np.load(file, mmap_mode="r" if self.memmapped else None)
        if list(self.array.shape) != self.meta["shape"]:
            raise ValueError(f"{file} holds {self.array.shape}, its meta.json says {self.meta['shape']}")
        labels = self.path / LABELS_FILE
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


# --- normalisation and decoding -----------------------------------------------------------------


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
