"""An encode's pieces: each complete piece of PIECE_IMAGES items linked into a folder beside the cache, so that an
encode started again (after a kill or a preemption) reuses them, and encodes of one key at once share them (Claims)."""

import contextlib
import math
import uuid
import os
import re
import shutil
import threading
import time

import numpy as np

from ddpm_train.data.folders import alive, temporary, this_host


LATENTS_FILE, LABELS_FILE, META_FILE = "latents.npy", "labels.npy", "meta.json"
NPY_HEADER_BYTES = 256  # the .npy header, written before the data and filled in once the count is known


# Shares of the dataset begin at multiples of this: the decode batch of decoding.decoded_batches, so that a
# share's batches are the batches a one-process encode sees and the latents are the same bits.
SHARD_ALIGN = 64


def npy_header(shape, dtype=np.float32):
    """A .npy (version 1.0) header of exactly NPY_HEADER_BYTES bytes."""
    header = repr(dict(descr=np.lib.format.dtype_to_descr(np.dtype(dtype)), fortran_order=False, shape=tuple(shape)))
    room = NPY_HEADER_BYTES - len(np.lib.format.MAGIC_PREFIX) - 2 - 2
    return np.lib.format.magic(1, 0) + room.to_bytes(2, "little") + header.ljust(room - 1).encode("latin1") + b"\n"


def labels_file(file):
    return file.parent / LABELS_FILE if file.name == LATENTS_FILE else file.with_name(f"{file.stem}-labels.npy")


# Dataset items a piece of an encode. Each piece is encoded by one images(start, stop) call into the build folder
# and, once complete, hard-linked into the key's .NAME.partial folder; an encode of the key that starts again (a
# preempted job's next start) reuses every piece kept there that lies in its share. The most an encode loses is a
# piece a process (at 512px, ~20 images/s: ~7 minutes). Each call starts the decode's DataLoader afresh (0.15-0.3 s
# to its first batch with 2-4 workers on a 2-core machine, docs/latents.md): ~1% of a piece at 300 images/s.
PIECE_IMAGES = 8192


_PIECE = re.compile(r"piece-(\d{12})-(\d{12})\.npy")


def partial_folder(final):
    """The folder that keeps the complete pieces of an encode of `final`'s key until the cache is published."""
    return final.parent / f".{final.name}.partial"


def remove_pieces(partial):
    """The pieces of a published cache, no longer needed: renamed aside first, so that an encode beside this one
    sees them all or none (a piece gone from a folder still there it would encode again), then removed."""
    aside = temporary(partial)
    try:
        os.rename(partial, aside)
    except OSError:
        return  # none (a filesystem without hard links), or removed by another publisher
    shutil.rmtree(aside, ignore_errors=True)


def piece_name(a, b):
    return f"piece-{a:012d}-{b:012d}.npy"


def piece_info(file):
    """dict(images, shape, latents_bytes, labels_bytes) of the complete piece `file` (latents and, where there
    are any, labels), else None: a file that is not one this module wrote whole."""
    try:
        with open(file, "rb") as f:
            np.lib.format.read_magic(f)  # another version's header does not parse as 1.0's
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        size = file.stat().st_size
        beside = labels_file(file)
        labels = len(np.load(beside, mmap_mode="r")) if beside.is_file() else None
    except (OSError, ValueError):
        return None
    rows = shape[0] if shape else -1
    if fortran or dtype != np.dtype("<f4") or rows < 0 or size != NPY_HEADER_BYTES + 4 * math.prod(shape):
        return None
    if labels is not None and labels != rows:
        return None
    return dict(images=rows, shape=list(shape[1:]) if rows else None, latents_bytes=size,
                labels_bytes=beside.stat().st_size if labels is not None else 0)  # fmt: skip


def kept_pieces(partial, start, stop):
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


def plan(start, stop, kept):
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


def link(src, folder):
    """Hard-link `src` (and its labels, first) into `folder`, replacing what is there: False where it cannot."""
    labels = labels_file(src)
    for file in ([labels] if labels.is_file() else []) + [src]:
        link = folder / f".{file.name}.{os.getpid()}"
        try:
            os.link(file, link)
            os.replace(link, folder / file.name)
        except OSError:
            link.unlink(missing_ok=True)
            return False
    return True


def others_pieces(final, log):
    """Say what pieces of interrupted encodes of other keys `final`'s cache root holds: a dataset whose files
    changed since (fixed, or added to) is another key, and its old pieces are left for the user to remove."""
    folders = sorted(p for p in final.parent.glob(".*.partial") if p.name != partial_folder(final).name and any(p.glob("piece-*")))
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
        self.mark = f"{this_host()} {os.getpid()} {uuid.uuid4().hex[:8]}\n"
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
        if len(words) == 3 and words[0] == this_host() and words[1].isdigit() and not alive(int(words[1])):
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
