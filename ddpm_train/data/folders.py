"""A folder that several processes fill: one per node or one shared, found by markers; each file a node's folder
lacks sent to it over gloo; one process's failure told to all; temporary names that say which host and process
write them."""

import os
import socket
import uuid
from datetime import timedelta

import torch

from ddpm_train.errors import ConfigError, first_line


TRANSFER_BYTES = 64 * 2**20  # a share a folder lacks travels through torch.distributed in chunks of this


# How long a process may wait for the slowest share (and for the shares and the cache to travel and be assembled), in
# a gloo group of its own: NCCL's default group keeps its short timeout. It fires only when a peer hangs (a peer that
# dies closes its connections and the wait fails at once), so it sits well above the longest encode of a share: an
# estimate, not a measurement, ImageNet's 1.28M images at 512px with flips on 2 GPUs at ~20 images/s each (two SD-VAE
# encodes an image) is ~9 h; 24 h leaves more than 2x and still ends a hung job within a day.
ENCODE_WAIT = timedelta(hours=24)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def this_host():
    """Where a process's PID means that process: the host name and, on Linux, its PID namespace (containers on one
    host may share its name, as Kubernetes' hostNetwork pods do, and not their PIDs)."""
    try:
        return f"{socket.gethostname()}~{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return socket.gethostname()


def temporary(final, host=None, pid=None, token=None):
    """A hidden folder beside `final`: .NAME.tmp-HOST-PID-TOKEN, HOST (host) and PID those of the process that owns it."""
    host = this_host() if host is None else host
    pid = os.getpid() if pid is None else pid
    return final.parent / f".{final.name}.tmp-{host}-{pid}-{token or uuid.uuid4().hex[:8]}"


def rank_and_world():
    """(rank, world size) of the torch.distributed process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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


def meet(final, rank, world, group):
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
            failure, outcome["error"] = e, error_of(e)
        everyone = [None] * world
        dist.all_gather_object(everyone, outcome, group=group)
        raise_failed(everyone, failure, what)
        _, leaders = meet(folder, rank, world, group)
        sizes = {n: (folder / n).stat().st_size for n in names if (folder / n).is_file()}
        held = [None] * world
        dist.all_gather_object(held, sizes, group=group)
        for name in names:  # in one fixed order on every process
            sender = min(r for r in range(world) if name in held[r])
            for receiver in sorted({leaders[r] for r in range(world) if name not in held[leaders[r]]}):
                if rank == sender:
                    send_file(folder / name, receiver, group)
                elif rank == receiver:
                    tmp = folder / f".{name}.{uuid.uuid4().hex[:8]}"
                    recv_file(tmp, held[sender][name], sender, group)
                    os.replace(tmp, folder / name)
        dist.barrier(group=group)  # every folder whole
        return made
    finally:
        dist.destroy_process_group(group)


def send_file(file, dst, group):
    import torch.distributed as dist

    with open(file, "rb") as f:
        while chunk := f.read(TRANSFER_BYTES):
            dist.send(torch.frombuffer(bytearray(chunk), dtype=torch.uint8), dst, group=group)


def recv_file(file, size, src, group):
    import torch.distributed as dist

    with open(file, "wb") as f:
        while size > 0:
            chunk = torch.empty(min(size, TRANSFER_BYTES), dtype=torch.uint8)
            dist.recv(chunk, src, group=group)
            f.write(chunk.numpy().tobytes())
            size -= len(chunk)


def error_of(e):
    return "ConfigError" if isinstance(e, ConfigError) else type(e).__name__, first_line(e, 300)


def raise_failed(everyone, failure, what):
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
