"""latents.cached_latents on two CPU processes (gloo on localhost): each encodes its share, the cache is the
one-process cache bit for bit, two "nodes" (two cache folders) both end with it; and two independent runs
racing to publish one key both read a valid cache that is never removed under them. Each test's processes
start torch afresh: a few seconds each."""

import json
import os
import shutil
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpm_train.data import autoencoder, latents, pieces
from test_latents import _one_thread  # noqa: F401  (autouse: convolutions this small run on one thread)

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
N, LEFT_OUT = 200, 130  # shares [0, 128) and [128, 200) on two processes; item 130 unreadable




def dataset():
    g = torch.Generator().manual_seed(0)
    from test_latents import SIZE

    return torch.randint(0, 256, (N, 3, SIZE, SIZE), dtype=torch.uint8, generator=g), torch.arange(N) % 5


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def file_barrier(folder, name, rank, world, timeout=60):
    """Wait until every one of `world` processes reached `name` (a file each in `folder`)."""
    (Path(folder) / f"{name}-{rank}").touch()
    deadline = time.monotonic() + timeout
    while not all((Path(folder) / f"{name}-{r}").exists() for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: not every process came")
        time.sleep(0.01)


def launch(mode, world, out, **spec):
    """Run `worker` on `world` processes forked from this one (torch and diffusers already imported: a fresh
    interpreter takes 30 s to import them on a busy 2-core machine); each writes out/rank{r}.json, or its
    traceback to out/rank{r}.err. Returns their results."""
    import multiprocessing

    port, context = free_port(), multiprocessing.get_context("fork")
    specs = [json.dumps(dict(spec, mode=mode, rank=r, world=world, port=port, out=str(out))) for r in range(world)]
    procs = [context.Process(target=_child, args=(s,)) for s in specs]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    for p in procs:
        p.join(max(1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for r, p in enumerate(procs):
        err = Path(out) / f"rank{r}.err"
        assert p.exitcode == 0, err.read_text()[-3000:] if err.exists() else f"rank {r}: exit code {p.exitcode}"
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]


def _child(spec):
    import traceback

    try:
        worker(spec)
    except BaseException:
        Path(json.loads(spec)["out"], f"rank{json.loads(spec)['rank']}.err").write_text(traceback.format_exc())
        raise


def worker(spec):
    spec = json.loads(spec)
    torch.set_num_threads(1)
    from test_latents import count_encodes, ranged

    rank, world, out = spec["rank"], spec["world"], Path(spec["out"])
    vae = count_encodes(autoencoder.load_vae(spec["vae"]))
    x, labels = dataset()
    results = {}

    def run(name, root, dataset="toy", images=None, **kw):
        key = latents.cache_key(dict(name=dataset), vae, x.shape[-1])
        lines, calls, start = [], vae.encode_calls, time.monotonic()
        images = images or ranged(x, labels, left_out={LEFT_OUT})
        try:
            cache = latents.cached_latents(vae, images, key, root=root, num_images=N, progress=False, log=lines.append, **kw)
        except Exception as e:
            results[name] = dict(error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - start)
            return None
        results[name] = dict(path=str(cache.path), lines=lines, encodes=vae.encode_calls - calls, meta=cache.meta,
                             labels=cache.labels.tolist(), memmapped=cache.memmapped,
                             inode=os.stat(cache.path / pieces.LATENTS_FILE).st_ino)  # fmt: skip
        return cache

    if spec["mode"] == "distributed":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))  # fmt: skip
        run("shared", out / "shared")
        # another job publishes this key while these two encode it: rank 0, the folder's leader, finds it there
        publish, theirs = latents._publish, Path(results["shared"]["path"])

        def another_job_first(tmp, final, key, max_gib):
            shutil.copytree(theirs, final)
            meta = json.loads((final / pieces.META_FILE).read_text())
            meta.update(encode_seconds=999.0, encode_device="another job's devices")
            (final / pieces.META_FILE).write_text(json.dumps(meta))
            return publish(tmp, final, key, max_gib)

        latents._publish = another_job_first
        run("lost", out / "lost")
        latents._publish = publish
        os.environ[latents.CACHE_ENV] = str(out / f"node{rank}")  # two "nodes": each process its own folder
        run("nodes", None)
        run("again", None)

        def failing(start, stop):
            if rank == 1:
                raise ValueError("an image that cannot be decoded")
            return ranged(x, labels, left_out={LEFT_OUT})(start, stop)

        run("failure", out / "shared", dataset="failing", images=failing)
        dist.barrier()  # each process has removed its temporary folder (a listing meanwhile could race its removal)
        results["after_failure"] = {p.name: sorted(q.name for q in p.iterdir()) for p in (out / "shared").iterdir()}
        run("other", out / "shared", dataset="other")  # another key's encode: told of the failed one's pieces
        run("resumed", out / "shared", dataset="failing")  # rank 0's share was encoded before rank 1 failed
        results["listing"] = {p.name: sorted(q.name for q in p.iterdir()) for p in out.iterdir() if p.is_dir()}
        dist.destroy_process_group()
    else:  # two independent runs (no process group) encode one key at once, and race to publish it
        race = out / "race"
        race.mkdir(exist_ok=True)
        pieces.PIECE_IMAGES, pieces.CLAIM_POLL_S = 64, 0.01  # 4 pieces, each one batch; the other's looked for often
        first = [True]

        def together(start, stop):
            if first[0]:  # both missed the cache and each holds a piece before either encodes one
                first[0] = False
                file_barrier(race, "encoding", rank, world)
            return ranged(x, labels)(start, stop)

        cache = run("race", out / "cache", images=together, max_gib=0.0)
        file_barrier(race, "published", rank, world)  # both have published (or kept or read the other's)
        if cache is not None:
            results["race"]["inode_after"] = os.stat(cache.path / pieces.LATENTS_FILE).st_ino
            results["race"]["sum"] = float(np.asarray(cache.array, dtype=np.float64).sum())  # the memory map still reads
        results["listing"] = sorted(p.name for p in (out / "cache").iterdir())
    (out / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The distributed scenarios once on two processes, and the one-process cache they must equal."""
    from test_latents import make_kl, ranged

    folder = tmp_path_factory.mktemp("dist")
    vae_folder = make_kl(folder / "vae")
    vae = autoencoder.load_vae(vae_folder)
    x, labels = dataset()
    key = latents.cache_key(dict(name="toy"), vae, x.shape[-1])
    reference = latents.cached_latents(vae, ranged(x, labels, left_out={LEFT_OUT}), key, root=folder / "one",
                                       num_images=N, progress=False, log=print)  # fmt: skip
    out = folder / "out"
    out.mkdir()
    return reference, launch("distributed", 2, out, vae=str(vae_folder)), out


def test_each_process_encodes_its_share(two_processes):
    reference, ranks, _ = two_processes
    for r, result in enumerate(ranks):
        shared = result["shared"]
        assert shared["meta"]["ranks"] == [
            dict(rank=0, host=socket.gethostname(), device="cpu", start=0, stop=128, images=128, seconds=shared["meta"]["ranks"][0]["seconds"], kept=0),
            dict(rank=1, host=socket.gethostname(), device="cpu", start=128, stop=200, images=71, seconds=shared["meta"]["ranks"][1]["seconds"], kept=0),
        ]  # fmt: skip
        assert shared["encodes"] == 2  # its own two batches of 64 (both flips in one call), not the other's
        summary, encoded = shared["lines"]
        assert "rank 0 items [0, 128): 128 images" in summary and "rank 1 items [128, 200): 71 images" in summary
        assert "assembled in 1 cache folder" in summary
        assert encoded.startswith("encoded 199 images to latents") and "(2 processes)" in encoded
    assert ranks[0]["shared"]["path"] == ranks[1]["shared"]["path"]
    assert ranks[0]["shared"]["inode"] == ranks[1]["shared"]["inode"]  # one folder, assembled once


def test_the_assembled_cache_is_the_one_process_cache_bit_for_bit(two_processes):
    reference, ranks, _ = two_processes
    expected = (reference.path / pieces.LATENTS_FILE).read_bytes()
    for result in ranks:
        for scenario in ("shared", "nodes", "resumed"):
            path = Path(result[scenario]["path"])
            assert (path / pieces.LATENTS_FILE).read_bytes() == expected, scenario
            assert (path / pieces.LABELS_FILE).read_bytes() == (reference.path / pieces.LABELS_FILE).read_bytes()
            assert result[scenario]["labels"] == reference.labels.tolist()
            assert result[scenario]["meta"]["stats"] == reference.meta["stats"]  # the same sums, not per share


def test_a_job_that_lost_the_race_to_publish_says_its_own_encode_on_every_process(two_processes):
    _, ranks, _ = two_processes
    for result in ranks:
        assert result["lost"]["meta"]["encode_device"] == "another job's devices"  # it reads the other job's cache
        line = result["lost"]["lines"][-1]
        assert line.startswith("encoded 199 images") and "(2 processes)" in line and "in 999" not in line, line  # not the other job's 999 s (its rate may hold 999)
        assert line.endswith("(another process published this key first: reading its cache)")


def test_two_nodes_each_end_with_the_full_cache_and_a_second_call_encodes_nothing(two_processes):
    _, ranks, out = two_processes
    paths = [Path(r["nodes"]["path"]) for r in ranks]
    assert paths[0].parent == out / "node0" and paths[1].parent == out / "node1"
    for r, result in enumerate(ranks):
        assert result["nodes"]["encodes"] == 2  # its share, once: the other's came through torch.distributed
        assert "assembled in 2 cache folders" in result["nodes"]["lines"][0]
        assert result["again"]["encodes"] == 0 and len(result["again"]["lines"]) == 1
        assert "reusing the cache" in result["again"]["lines"][0]
        # nothing left behind: no share, marker or temporary folder
        assert result["listing"][f"node{r}"] == [paths[r].name]
    caches = {Path(ranks[0][scenario]["path"]).name for scenario in ("shared", "other", "resumed")}
    assert sorted(ranks[0]["listing"]["shared"]) == sorted(caches)  # the pieces of the failed encode: gone with it


def test_a_failed_encode_keeps_its_finished_pieces_and_the_next_encodes_only_the_rest(two_processes):
    _, ranks, _ = two_processes
    failing = Path(ranks[0]["resumed"]["path"]).name
    kept = ranks[0]["after_failure"][f".{failing}.partial"]  # rank 0's share was done when rank 1 failed
    assert kept == ["piece-000000000000-000000000128-labels.npy", "piece-000000000000-000000000128.npy"]
    for result in ranks:
        assert result["other"]["lines"][0].startswith(f"latents: {Path(result['other']['path']).parent} holds the pieces "
                                                      f"of 1 interrupted encode(s) of other datasets or VAEs (0.00 GiB: .{failing}.partial)")  # fmt: skip
    assert [r["resumed"]["encodes"] for r in ranks] == [0, 2]  # rank 0 reused its share, rank 1 encoded its own
    for result in ranks:
        summary, encoded = result["resumed"]["lines"]
        assert "rank 0 items [0, 128): 128 images in" in summary and "(128 of them reused)" in summary
        assert "rank 1 items [128, 200): 71 images in" in summary and "reused" not in summary.split("rank 1")[1]
        assert encoded.startswith("encoded 71 images to latents"), encoded
        assert ", and reused 128 that another encode of this key had encoded (interrupted, or beside this one); cached in" in encoded
        assert [m["kept"] for m in result["resumed"]["meta"]["ranks"]] == [128, 0]


def test_a_share_that_fails_fails_every_process_at_once(two_processes):
    _, ranks, _ = two_processes
    assert ranks[1]["failure"]["error"] == "ValueError: an image that cannot be decoded"
    assert ranks[0]["failure"]["error"].startswith("RuntimeError: latents: rank 1 could not encode its share: ValueError")
    assert ranks[0]["failure"]["seconds"] < 30  # not the encode wait's timeout


@pytest.mark.slow
def test_independent_runs_racing_to_publish_one_key_both_read_a_cache_never_removed(tmp_path):
    from test_latents import make_kl

    vae_folder = make_kl(tmp_path / "vae")
    out = tmp_path / "out"
    out.mkdir()
    ranks = launch("race", 2, out, vae=str(vae_folder))
    for result in ranks:
        race = result["race"]
        assert "error" not in race, race
        assert race["encodes"] >= 1 and race["memmapped"]  # each encoded a piece of the 4 (a batch each)
        assert race["inode_after"] == race["inode"]  # the cache it read was never replaced under it
    assert ranks[0]["race"]["encodes"] + ranks[1]["race"]["encodes"] == 4  # each piece once: claimed, then linked
    assert ranks[0]["race"]["inode"] == ranks[1]["race"]["inode"]  # both read the one published first
    assert ranks[0]["race"]["sum"] == ranks[1]["race"]["sum"]
    kept = [r for r in ranks if "another process published this key" in r["race"]["lines"][-1]]
    assert len(kept) == 1
    assert ranks[0]["listing"] == [Path(ranks[0]["race"]["path"]).name]  # the loser's folder discarded
