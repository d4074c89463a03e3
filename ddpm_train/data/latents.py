"""The latent cache: a dataset encoded once by a VAE (autoencoder.py), cached on disk by key, and drawn.

    cache_key(dataset, vae, image_size, center_crop=True, flips=True) -> dict    the key: the dataset's identity as
        the caller gives it, the VAE's (its class, config, dtype and a hash of its encoder's weights), size, crop, flips
    cache_root(root=None) -> Path   $DDPM_TRAIN_LATENT_CACHE, else $XDG_CACHE_HOME or ~/.cache, /ddpm-train/latents
    cached_latents(vae, images, key, ...) -> drawn.LatentCache   the cache of `key`, read when it is there (`images`
        not touched), else `images(start, stop)` encoded by pieces (pieces.py), by every process its share (`shares`),
        present in every node's folder (folders.py), published by rename, and read back (drawn.py: each epoch's
        latents drawn from it)

The array is (N, F, K, C, h, w) float32: F orientations (1, or 2 with flips: [original, flipped]; a flipped image's
latent is not the flipped latent, since a VAE's stride-2 downsamplers do not sample a mirror-symmetric grid), K = 2
(the posterior's mean and std, as EDM2 keeps them) for a KL VAE or 1 for a Tiny one. It is read into memory up to
`max_gib`, memory-mapped beyond. docs/latents.md ("The cache") says what is written where and why.
"""

import hashlib
import inspect
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ddpm_train import sizes
from ddpm_train.data import autoencoder, drawn, folders, pieces
from ddpm_train.errors import ConfigError

FORMAT = 1  # raise when what a cache holds, or how, changes
PROJECT = "ddpm-train"
CACHE_ENV = "DDPM_TRAIN_LATENT_CACHE"
_IN_PROGRESS = set()  # this process's folders.temporary folders being written


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

STATS_ROWS = 256  # images a chunk when the stats are summed over the assembled array: a fixed order, the same sums
PUBLISH_TRIES = 8  # looks at the final folder before publishing gives up (each a rename that lost a race)


def _remove_leftovers(final):
    """Remove folders.temporary folders of this key left by dead processes of this host (a killed encode, or a publisher
    killed while it removed the pieces it had renamed aside). The host in the name must be this host exactly:
    `node1` leaves `node1-b`'s and `node10`'s folders alone, and another container's of the same name (another PID
    namespace: its PIDs are not this one's)."""
    host = folders.this_host()
    for prefix in (f".{final.name}.tmp-", f".{pieces.partial_folder(final).name}.tmp-"):
        for tmp in final.parent.glob(f"{prefix}*"):
            parts = tmp.name[len(prefix) :].rsplit("-", 2)  # HOST-PID-TOKEN (HOST may hold dashes)
            if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
                continue  # another host's (a shared filesystem): it may be writing
            pid = int(parts[1])
            if str(tmp) in _IN_PROGRESS or (pid != os.getpid() and folders.alive(pid)):
                continue
            shutil.rmtree(tmp, ignore_errors=True)


def shares(num_images, world_size):
    """[(start, stop)] of each rank's share of items [0, num_images): contiguous, in rank order, each starting at
    a multiple of pieces.SHARD_ALIGN, as even as that allows (a share may be empty when there are few images)."""
    blocks = -(-int(num_images) // pieces.SHARD_ALIGN)
    bounds = [min(int(num_images), -(-blocks * r // world_size) * pieces.SHARD_ALIGN) for r in range(world_size + 1)]
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
        f.write(b"\0" * pieces.NPY_HEADER_BYTES)
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
        f.write(pieces.npy_header((count, *(shape or ()))))
        f.flush()
        os.fsync(f.fileno())
    beside, labels_bytes = pieces.labels_file(file), 0
    if labels:
        labels = torch.cat(labels)
        if len(labels) != count:
            raise ValueError(f"{len(labels)} labels for {count} images")
        np.save(beside, labels.numpy())
        labels_bytes = beside.stat().st_size
    return dict(images=count, shape=list(shape) if shape else None, latents_bytes=file.stat().st_size,
                labels_bytes=labels_bytes)  # fmt: skip


# --- pieces: what a killed encode keeps ------------------------------------------------------------------


# --- two encodes of one key at once: they share its pieces --------------------------------------------------------


def _encode_share(vae, images, start, stop, key, tmp, partial, progress, published=None):
    """Encode items [start, stop) of `images(start, stop)` into pieces in `tmp`, each kept in `partial` once
    complete, the pieces `partial` already keeps linked instead of encoded (None: `images` takes no range, one piece
    of everything, nothing kept). A dict of the images, their shape (F, K, C, h, w) (None when none), the seconds,
    the images kept from an earlier encode, the pieces (their file names, images and sizes)."""
    from tqdm.auto import tqdm

    if partial is not None:
        partial.mkdir(exist_ok=True)
        todo = [(a, b) for a, b, _ in pieces.plan(start, stop, pieces.kept_pieces(partial, start, stop))]
    else:
        todo = [(None, None)]
    done, began = [], time.perf_counter()
    claims = pieces.Claims(partial) if partial is not None else None
    try:
        with tqdm(
            total=stop - start if partial is not None else stop, desc="encoding latents", unit="img",
            disable=not progress, leave=False, file=sys.stderr,
        ) as bar:  # fmt: skip
            while todo:
                held = []
                for a, b in todo:
                    if not _piece_of(vae, images, a, b, key, tmp, partial, claims, bar, done, published):
                        held.append((a, b))
                if held:  # pieces other encodes have claimed: linked once complete, or taken over from a dead one
                    bar.set_description("encoding latents (waiting for pieces another encode of this key holds)")
                    time.sleep(pieces.CLAIM_POLL_S)
                todo = held
    finally:
        if claims is not None:
            claims.close()
    done.sort(key=lambda p: p["file"])  # in item order (the names' 12 digits), however they were taken
    seconds = time.perf_counter() - began
    full = [p for p in done if p["images"]]
    if len({tuple(p["shape"]) for p in full}) > 1:
        raise ValueError(f"the pieces' latents differ in shape: {sorted({tuple(p['shape']) for p in full})}")
    if len({p["labels_bytes"] > 0 for p in full}) > 1:
        raise ValueError("some pieces came with labels, some without")
    return dict(images=sum(p["images"] for p in done), shape=full[0]["shape"] if full else None, seconds=seconds,
                kept=sum(p["images"] for p in done if p["kept"]), pieces=done)  # fmt: skip


class _PublishedMeanwhile(Exception):
    """Another encode of the key published the cache (and removed its pieces) while this one encoded."""


def _piece_of(vae, images, a, b, key, tmp, partial, claims, bar, done, published=None):
    """Items [a, b) into `tmp` as a piece, appended to `pieces`: linked from `partial` where another encode (an
    interrupted one, or one beside this) left it complete, else encoded where this encode can claim it (kept in
    `partial` once complete); False where another live encode holds it. `published()`: the cache, where it is
    there, asked where `partial` has gone (_PublishedMeanwhile with it: this encode is not needed)."""
    file = tmp / (pieces.piece_name(a, b) if partial is not None else "piece-all.npy")

    def linked():  # complete in `partial`: linked, not encoded (another job may have published and removed `partial`)
        piece = pieces.piece_info(partial / file.name) if partial is not None else None
        if piece is None or not pieces.link(partial / file.name, tmp):
            return False
        bar.update(piece["images"])
        done.append(dict(piece, file=file.name, kept=True))
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
        pieces.link(file, partial)  # best effort: a filesystem without hard links keeps nothing
        claims.release(file.name)
    done.append(dict(piece, file=file.name, kept=False))
    return True


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
    array = np.load(tmp / pieces.LATENTS_FILE, mmap_mode="r")
    count = len(array)
    seconds = max(r["seconds"] for r in ranks)  # the processes encode at once: the slowest share's time
    encoded = count - sum(r["kept"] for r in ranks)  # less the pieces an interrupted encode kept
    devices = sorted({r["device"] for r in ranks})
    meta = dict(
        key=key,
        vae_source=getattr(vae, "latents_source", None),
        shape=list(array.shape),
        layout="(N, orientations [original, flipped], [mean, std] or [latents], C, h, w)",
        stats=_stats(tmp / pieces.LATENTS_FILE),
        encode_seconds=seconds,
        images_per_second=encoded / seconds if seconds > 0 and encoded else None,
        encode_device=", ".join(devices) + (f" ({len(ranks)} processes)" if len(ranks) > 1 else ""),
        ranks=ranks,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    del array
    (tmp / pieces.META_FILE).write_text(json.dumps(meta, indent=1))
    return meta


def _publish(tmp, final, key, max_gib):
    """Rename the complete cache `tmp` into place as `final` and read it: (drawn.LatentCache, True). A valid cache of
    `key` already there (another process published it first) is kept and read instead: (it, False), and the
    caller discards `tmp`. Only an invalid or mismatched folder is replaced, renamed aside atomically first
    (never removed in place, which would race another publisher)."""
    for _ in range(PUBLISH_TRIES):
        try:
            os.rename(tmp, final)
        except OSError:
            pass  # `final` is there (a non-empty folder)
        else:
            return drawn.LatentCache(final, max_gib), True
        existing = drawn.read(final, key, max_gib)
        if existing is not None:
            return existing, False  # another process's valid cache of this key: keep it, never delete it
        aside = folders.temporary(final)
        try:
            os.rename(final, aside)  # an invalid folder: out of the way, atomically
        except OSError:
            continue  # gone or replaced meanwhile: look again
        if drawn.read(aside, key, max_gib) is not None:  # published between the look and the move: put it back
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
    """The drawn.LatentCache of `key`: read if it is there, else `images` encoded and cached (module doc). With a
    torch.distributed process group of several processes every process encodes its share (`images(start,
    stop)`, `num_images` items in all) and each cache folder is assembled once."""
    rank, world = folders.rank_and_world()
    if world > 1 or _takes_range(images):
        _check_images(images, num_images, world)
    final = cache_folder(key, root)
    cache = drawn.read(final, key, max_gib)
    if world > 1:
        if _everywhere(cache is not None):  # every process's folder holds it: nobody encodes
            log(_reuse_line(final, cache))
            return cache
        pieces.others_pieces(final, log)
        return _encode_shared(vae, images, key, final, rank, world, max_gib, device, num_images, progress, log)
    if cache is not None:
        log(_reuse_line(final, cache))
        return cache
    if device is not None:
        vae = vae.to(device)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(final)
    pieces.others_pieces(final, log)
    tmp = folders.temporary(final)
    tmp.mkdir()
    _IN_PROGRESS.add(str(tmp))
    partial = pieces.partial_folder(final) if _takes_range(images) else None
    try:
        try:
            share = _encode_share(vae, images, 0, num_images, key, tmp, partial, progress,
                                  published=lambda: drawn.read(final, key, max_gib))  # fmt: skip
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
            pieces.remove_pieces(partial)
    finally:
        _IN_PROGRESS.discard(str(tmp))
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(_encoded_line(meta, key, final, kept=not ours))
    return cache


# --- several processes -----------------------------------------------------------------------------


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
    with open(tmp / pieces.LATENTS_FILE, "wb") as f:
        f.write(pieces.npy_header((count, *shape)))
        for p in parts:
            with open(tmp / p["file"], "rb") as piece:
                piece.seek(pieces.NPY_HEADER_BYTES)
                shutil.copyfileobj(piece, f, folders.TRANSFER_BYTES)
        f.flush()
        os.fsync(f.fileno())
    if parts[0]["labels_bytes"]:
        np.save(tmp / pieces.LABELS_FILE, np.concatenate([np.load(pieces.labels_file(tmp / p["file"])) for p in parts]))
    for m in everyone:
        for p in m["pieces"]:
            for file in (tmp / p["file"], pieces.labels_file(tmp / p["file"])):
                file.unlink(missing_ok=True)


def _encode_shared(vae, images, key, final, rank, world, max_gib, device, num_images, progress, log):
    """Every process encodes its share into its folder's build; the lowest rank of each folder receives the
    shares its folder lacks, assembles and publishes the cache; every process reads it (module doc)."""
    import torch.distributed as dist

    if device is not None:
        vae = vae.to(device)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(final)
    group = dist.new_group(backend="gloo", timeout=folders.ENCODE_WAIT)  # the long waits: not the default (NCCL) group
    try:
        people, leaders = folders.meet(final, rank, world, group)
        token, leader = people[0][2], leaders[rank]
        tmp = folders.temporary(final, *people[leader][:2], token)  # named for its leader: whose death makes it a leftover
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
        mine |= _encode_share(vae, images, start, stop, key, tmp, pieces.partial_folder(final), progress)
    except Exception as e:  # told to every process below, so that none waits for this share
        failure, mine["error"] = e, folders.error_of(e)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)  # the wait for the slowest share (folders.ENCODE_WAIT)
    folders.raise_failed(everyone, failure, "encode its share")
    # The shares a folder lacks (encoded in another folder) travel to its leader, in chunks, in one fixed order.
    for m in everyone:
        for receiver in sorted(set(leaders) - {leaders[m["rank"]]}):
            for piece in m["pieces"]:
                name = piece["file"]
                for file, size in (tmp / name, piece["latents_bytes"]), (pieces.labels_file(tmp / name), piece["labels_bytes"]):
                    if size and piece["images"] and rank == m["rank"]:
                        folders.send_file(file, receiver, group)
                    elif size and piece["images"] and rank == receiver:
                        folders.recv_file(file, size, m["rank"], group)
    outcome, failure, cache = dict(rank=rank), None, None
    if rank == leaders[rank]:
        try:
            _assemble(tmp, everyone)
            fields = ("rank", "host", "device", "start", "stop", "images", "seconds", "kept")
            ranks = [{k: m[k] for k in fields} for m in everyone]
            outcome["meta"] = _finish(vae, key, tmp, ranks)  # this job's encode, told even if another's cache is kept
            cache, ours = _publish(tmp, final, key, max_gib)
            pieces.remove_pieces(pieces.partial_folder(final))
            outcome["kept"] = not ours
        except Exception as e:
            failure, outcome["error"] = e, folders.error_of(e)
    outcomes = [None] * world
    dist.all_gather_object(outcomes, outcome, group=group)  # the folders' caches published
    folders.raise_failed(outcomes, failure, "assemble the cache")
    cache = cache or drawn.read(final, key, max_gib)  # the leader read it as it published it
    if cache is None:
        raise RuntimeError(f"latents: rank {rank} cannot read the cache {final} that rank {leaders[rank]} published")
    in_folders = len(set(leaders))
    log(
        f"latents: {world} processes encoded a share each, "
        + ", ".join(f"rank {m['rank']} items [{m['start']}, {m['stop']}): {m['images']} images in {m['seconds']:.1f} s on "
                    f"{m['device']}" + (f" ({m['kept']} of them reused)" if m["kept"] else "") for m in everyone)
        + f"; assembled in {in_folders} cache folder{'s' if in_folders > 1 else ''}"
    )  # fmt: skip
    leader = outcomes[leaders[rank]]  # its folder's encode, and whether another job's cache was kept instead of it
    log(_encoded_line(leader["meta"], key, final, leader["kept"]))
    return cache


# --- reading and drawing ---------------------------------------------------------------------------


# --- normalisation and decoding -----------------------------------------------------------------


