"""latents.py on tiny randomly initialised VAEs saved to temporary folders (seconds on a CPU)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import forked
from ddpm_train.data import autoencoder
from ddpm_train.data import drawn, folders, keyed_random, latents, pieces
from ddpm_train.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SIZE = 16


@pytest.fixture(autouse=True)
def _one_thread():
    """Convolutions this small run 100x slower on threads that a busy 2-core machine oversubscribes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_kl(folder, seed=0, **config):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    config = dict(
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=SIZE,
    ) | config  # fmt: skip
    vae = AutoencoderKL(**config)
    vae.save_pretrained(folder)
    return folder


def make_tiny(folder, seed=0):
    from diffusers import AutoencoderTiny

    torch.manual_seed(seed)
    AutoencoderTiny(
        encoder_block_out_channels=(8, 8, 8), decoder_block_out_channels=(8, 8, 8), num_encoder_blocks=(1, 1, 1),
        num_decoder_blocks=(1, 1, 1), latent_channels=4,
    ).save_pretrained(folder)  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def kl_folder(tmp_path_factory):
    return make_kl(tmp_path_factory.mktemp("vae") / "kl")


def images(n=10, size=SIZE, seed=0):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def batches(x, batch_size=4, labels=None):
    for i in range(0, len(x), batch_size):
        yield x[i : i + batch_size] if labels is None else (x[i : i + batch_size], labels[i : i + batch_size])


def count_encodes(vae):
    """Wraps vae.encode to count its calls: vae.encode_calls."""
    encode = vae.encode
    vae.encode_calls = 0

    def counted(*args, **kwargs):
        vae.encode_calls += 1
        return encode(*args, **kwargs)

    vae.encode = counted
    return vae


def one_line_error(call, *match):
    with pytest.raises(ConfigError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message, message
    for m in match:
        assert m in message, message
    return message


def encode(vae, x, tmp_path, dataset="toy", lines=None, **kw):
    key = latents.cache_key(dict(name=dataset), vae, x.shape[-1], flips=kw.pop("flips", True))
    log = (lines if lines is not None else []).append
    labels = kw.pop("labels", None)
    return latents.cached_latents(vae, lambda: batches(x, labels=labels), key,
                                  root=tmp_path / "cache", progress=False, log=log, **kw)  # fmt: skip


# --- loading ----------------------------------------------------------------------------------


def test_load_vae_from_a_folder_a_pipeline_layout_and_a_tiny_folder(tmp_path, kl_folder):
    from diffusers import AutoencoderKL, AutoencoderTiny

    vae = autoencoder.load_vae(kl_folder)
    assert type(vae) is AutoencoderKL and vae.latents_source == {"vae": str(kl_folder), "subfolder": None}
    assert autoencoder.vae_factor(vae) == 2 and autoencoder.latent_channels(vae) == 4
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())
    saved = AutoencoderKL.from_pretrained(kl_folder)
    assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), saved.state_dict().values()))

    pipeline = tmp_path / "pipeline"
    make_kl(pipeline / "vae", seed=3)
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    vae = autoencoder.load_vae(str(pipeline))
    assert type(vae) is AutoencoderKL and vae.latents_source["subfolder"] == "vae"
    saved = AutoencoderKL.from_pretrained(pipeline / "vae")
    assert torch.equal(vae.encoder.conv_in.weight, saved.encoder.conv_in.weight)
    assert autoencoder.load_vae(pipeline, subfolder="vae").latents_source["subfolder"] == "vae"

    tiny = autoencoder.load_vae(make_tiny(tmp_path / "tiny"))
    assert type(tiny) is AutoencoderTiny
    assert autoencoder.vae_factor(tiny) == 4 and autoencoder.latent_channels(tiny) == 4
    assert tiny.encode(images(1)).latents.shape[-1] == SIZE // 4  # the factor is the encoder's


def test_bad_vae_inputs_are_one_line_errors(tmp_path, kl_folder, monkeypatch):
    one_line_error(lambda: autoencoder.load_vae(tmp_path / "missing"), "no such folder", str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    one_line_error(lambda: autoencoder.load_vae(tmp_path / "empty"), "holds no VAE", "pipeline folder with vae/")
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    one_line_error(lambda: autoencoder.load_vae(tmp_path / "unet"), "holds no VAE", "is a UNet2DModel")
    one_line_error(lambda: autoencoder.load_vae(kl_folder / "config.json"), "is a file")
    broken = tmp_path / "no_weights"
    broken.mkdir()
    (broken / "config.json").write_text((kl_folder / "config.json").read_text())
    one_line_error(lambda: autoencoder.load_vae(broken), "cannot load the AutoencoderKL")

    # A Hub id, offline and with an empty Hub cache: what to download, and where to point --vae.
    import huggingface_hub.constants as hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    one_line_error(
        lambda: autoencoder.load_vae("stabilityai/sd-vae-ft-mse"),
        "stabilityai/sd-vae-ft-mse", "hf download stabilityai/sd-vae-ft-mse --local-dir DIR", "--vae DIR",
    )  # fmt: skip


def test_image_size_must_be_a_multiple_of_the_factor():
    one_line_error(lambda: autoencoder.check_image_size(20, 8), "--image_size 20", "factor 8", "use 16 or 24")
    one_line_error(lambda: autoencoder.latent_size(4, 8), "use 8")
    autoencoder.check_image_size(256, 8)
    assert autoencoder.latent_size(256, 8) == 32


# --- the cache --------------------------------------------------------------------------------


def test_what_is_stored_is_the_posterior_of_each_image_and_of_its_flip(tmp_path, kl_folder):
    vae = autoencoder.load_vae(kl_folder)
    x = images()
    cache = encode(vae, x, tmp_path)
    assert cache.array.shape == (10, 2, 2, 4, SIZE // 2, SIZE // 2)
    assert (cache.num_images, cache.channels, cache.resolution, cache.orientations) == (10, 4, 8, 2)
    with torch.no_grad():
        dist, flipped = vae.encode(x).latent_dist, vae.encode(x.flip(3)).latent_dist
    stored = torch.from_numpy(np.array(cache.array))
    torch.testing.assert_close(stored[:, 0, 0], dist.mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stored[:, 0, 1], dist.std, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stored[:, 1, 0], flipped.mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stored[:, 1, 1], flipped.std, atol=1e-5, rtol=1e-5)
    # Why both orientations are encoded: the latent of the flipped image is not the flipped latent ...
    assert (flipped.mean - dist.mean.flip(3)).abs().mean() > 0.3 * dist.mean.abs().mean()
    # ... not even with mirror-symmetric kernels: the downsamplers' sampling grid is not mirror-symmetric.
    symmetric = autoencoder.load_vae(kl_folder)
    with torch.no_grad():
        for conv in (m for m in symmetric.modules() if isinstance(m, torch.nn.Conv2d)):
            conv.weight.copy_((conv.weight + conv.weight.flip(-1)) / 2)
        a, b = symmetric.encode(x).latent_dist.mean, symmetric.encode(x.flip(3)).latent_dist.mean
        assert (b - a.flip(3)).abs().mean() > 0.3 * a.abs().mean()
        symmetric.encoder.down_blocks[0].downsamplers = None
        a = symmetric.encode(x).latent_dist.mean
        torch.testing.assert_close(symmetric.encode(x.flip(3)).latent_dist.mean, a.flip(3), atol=1e-5, rtol=1e-4)
    # The dataset's statistics are those of the latents as drawn: both orientations, posterior noise.
    means, stds = stored[:, :, 0].double(), stored[:, :, 1].double()
    mean = means.mean((0, 1, 3, 4))
    var = (means.square() + stds.square()).mean((0, 1, 3, 4)) - mean.square()
    assert cache.stats["mean"] == pytest.approx(mean.tolist(), abs=1e-6)
    assert cache.stats["std"] == pytest.approx(var.sqrt().tolist(), abs=1e-6)

    unflipped = encode(vae, x, tmp_path, flips=False)
    assert unflipped.array.shape == (10, 1, 2, 4, 8, 8)
    assert torch.equal(torch.from_numpy(np.array(unflipped.array[:, 0])), stored[:, 0])


def test_a_second_call_reads_the_cache_encodes_nothing_and_says_so(tmp_path, kl_folder):
    vae = count_encodes(autoencoder.load_vae(kl_folder))
    x, lines = images(), []
    first = encode(vae, x, tmp_path, lines=lines)
    assert vae.encode_calls == 3  # 10 images in batches of 4, both orientations in one call
    assert len(lines) == 1 and "encoded 10 images" in lines[0] and "images/s" in lines[0], lines
    assert first.meta["images_per_second"] > 0 and first.encode_seconds > 0

    opened = []
    lines.clear()
    again = latents.cached_latents(
        vae, lambda: opened.append(1), latents.cache_key(dict(name="toy"), vae, SIZE), root=tmp_path / "cache",
        progress=False, log=lines.append,
    )  # fmt: skip
    assert vae.encode_calls == 3 and not opened  # nothing encoded, the images not even opened
    assert len(lines) == 1 and "reusing the cache" in lines[0] and "encoding nothing" in lines[0], lines
    assert again.path == first.path and np.array_equal(again.array, first.array)
    # A VAE loaded afresh (another run, a resume) has the same key.
    assert latents.cache_key(dict(name="toy"), autoencoder.load_vae(kl_folder), SIZE) == latents.cache_key(
        dict(name="toy"), vae, SIZE
    )


def test_another_vae_image_size_dataset_or_flip_setting_encodes_afresh(tmp_path, kl_folder):
    vae = autoencoder.load_vae(kl_folder)
    first = encode(vae, images(), tmp_path)

    def encodes(vae, x, **kw):
        vae = count_encodes(vae)
        cache = encode(vae, x, tmp_path, **kw)
        return vae.encode_calls > 0, cache

    other_weights = autoencoder.load_vae(make_kl(tmp_path / "other", seed=1))
    fresh, cache = encodes(other_weights, images())
    assert fresh and cache.path != first.path and not np.array_equal(cache.array, first.array)
    other_config = autoencoder.load_vae(make_kl(tmp_path / "wider", seed=0, latent_channels=8))
    assert encodes(other_config, images())[0]
    fresh, cache = encodes(autoencoder.load_vae(kl_folder), images(size=32))
    assert fresh and cache.resolution == 16
    assert encodes(autoencoder.load_vae(kl_folder), images(), dataset="another")[0]
    assert encodes(autoencoder.load_vae(kl_folder), images(), flips=False)[0]
    key = latents.cache_key(dict(name="toy"), vae, SIZE)
    assert latents.cache_key(dict(name="toy"), vae, SIZE, center_crop=False) != key

    # The same weights in another folder give the same latents: the cache is reused. So is a VAE whose
    # normalisation constants alone differ (the cache holds raw latents).
    import shutil

    shutil.copytree(kl_folder, tmp_path / "copy")
    assert not encodes(autoencoder.load_vae(tmp_path / "copy"), images())[0]
    config = json.loads((tmp_path / "copy" / "config.json").read_text())
    (tmp_path / "copy" / "config.json").write_text(json.dumps(config | {"scaling_factor": 0.5, "shift_factor": 0.1}))
    assert not encodes(autoencoder.load_vae(tmp_path / "copy"), images())[0]


def test_cache_root_honours_the_flag_then_its_variable_then_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv(latents.CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert latents.cache_root() == tmp_path / "home" / ".cache" / "ddpm-train" / "latents"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert latents.cache_root() == tmp_path / "xdg" / "ddpm-train" / "latents"
    monkeypatch.setenv(latents.CACHE_ENV, str(tmp_path / "env"))
    assert latents.cache_root() == tmp_path / "env"
    assert latents.cache_root(tmp_path / "flag") == tmp_path / "flag"


def test_labels_are_cached_with_their_latents(tmp_path, kl_folder):
    vae = autoencoder.load_vae(kl_folder)
    labels = torch.arange(10) % 3
    cache = encode(vae, images(), tmp_path, labels=labels)
    assert torch.equal(cache.labels, labels)
    again = encode(vae, images(), tmp_path)  # a hit: the labels come from the cache
    assert torch.equal(again.labels, labels)
    z, label = drawn.LatentDataset(again)[7]
    assert z.shape == (4, 8, 8) and label == 1


def test_the_cache_is_memory_mapped_above_the_budget(tmp_path, kl_folder):
    vae = autoencoder.load_vae(kl_folder)
    in_memory = encode(vae, images(), tmp_path, max_gib=1.0)
    assert not in_memory.memmapped and not isinstance(in_memory.array, np.memmap)
    size = (in_memory.path / pieces.LATENTS_FILE).stat().st_size
    mapped = encode(vae, images(), tmp_path, max_gib=size / 2**30 * 0.99)
    assert mapped.memmapped and isinstance(mapped.array, np.memmap) and mapped.array.mode == "r"
    exactly = drawn.LatentCache(in_memory.path, max_gib=size / 2**30)
    assert not exactly.memmapped
    assert np.array_equal(mapped.array, in_memory.array)
    assert torch.equal(mapped.draw([1, 5], epoch=2, seed=3), in_memory.draw([1, 5], epoch=2, seed=3))


def test_a_failed_or_killed_encode_leaves_no_cache_that_is_read(tmp_path, kl_folder, monkeypatch):
    vae = count_encodes(autoencoder.load_vae(kl_folder))
    x = images()
    key = latents.cache_key(dict(name="toy"), vae, SIZE)
    folder = latents.cache_folder(key, tmp_path / "cache")

    def failing():
        yield x[:4]
        yield x[4:8]
        raise OSError("disk full")

    def run(images):
        return latents.cached_latents(vae, images, key, root=tmp_path / "cache", progress=False, log=print)

    with pytest.raises(OSError, match="disk full"):
        run(failing)
    assert not folder.exists() and list(folder.parent.iterdir()) == []  # the partial file is gone too

    # Killed before cleaning up (the temporary folder stays, half written): not read, then removed.
    import shutil

    with monkeypatch.context() as m:
        m.setattr(shutil, "rmtree", lambda *a, **k: None)
        with pytest.raises(OSError):
            run(failing)
    left = list(folder.parent.iterdir())
    assert len(left) == 1 and left[0].name.startswith(f".{folder.name}.tmp-") and any(left[0].glob("*.npy"))
    calls = vae.encode_calls
    cache = run(lambda: batches(x))
    assert vae.encode_calls == calls + 3 and cache.num_images == 10  # encoded afresh
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # the leftover removed


@pytest.mark.slow
def test_a_sigkilled_encode_is_not_read(tmp_path, kl_folder):
    """A real SIGKILL mid-encode: the next call encodes afresh and removes the dead process's folder."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        torch.set_num_threads(1)
        sys.path.insert(0, {str(ROOT)!r})
        from ddpm_train.data import autoencoder
        from ddpm_train.data import latents
        from ddpm_train.data import folders
        from ddpm_train.data import pieces
        vae = autoencoder.load_vae({str(kl_folder)!r})
        x = torch.zeros(4, 3, {SIZE}, {SIZE})
        def batches():
            yield x
            yield x
            os.kill(os.getpid(), signal.SIGKILL)
        key = latents.cache_key(dict(name="toy"), vae, {SIZE})
        latents.cached_latents(vae, batches, key, root={str(tmp_path / "cache")!r}, progress=False)
        """
    )
    done = forked.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    (left,) = list((tmp_path / "cache").iterdir())
    assert ".tmp-" in left.name
    vae = count_encodes(autoencoder.load_vae(kl_folder))
    cache = encode(vae, images(), tmp_path)
    assert vae.encode_calls == 3 and cache.num_images == 10
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [cache.path.name]


@pytest.mark.slow
def test_a_killed_encode_keeps_its_finished_pieces_and_the_next_encodes_only_the_rest(tmp_path, kl_folder):
    """A real SIGKILL in the third piece of four: the next encode decodes and encodes the rest alone, and its
    cache is the uninterrupted encode's bit for bit; a torn piece is encoded again."""
    x, labels, cache_root = images(200), torch.arange(200) % 3, tmp_path / "cache"
    script = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        torch.set_num_threads(1)
        sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / "tests")!r})
        from ddpm_train.data import autoencoder
        from ddpm_train.data import latents, pieces
        from test_latents import images, ranged
        pieces.PIECE_IMAGES = 64
        vae = autoencoder.load_vae({str(kl_folder)!r})
        x, labels = images(200), torch.arange(200) % 3
        def killed(start, stop):
            if start >= 128:
                os.kill(os.getpid(), signal.SIGKILL)
            return ranged(x, labels, left_out={{5}})(start, stop)
        key = latents.cache_key(dict(name="toy"), vae, {SIZE})
        latents.cached_latents(vae, killed, key, root={str(cache_root)!r}, num_images=200, progress=False)
        """
    )
    done = forked.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    vae = count_encodes(autoencoder.load_vae(kl_folder))
    key = latents.cache_key(dict(name="toy"), vae, SIZE)
    partial = pieces.partial_folder(latents.cache_folder(key, cache_root))
    assert sorted(p.name for p in partial.glob("piece-*[0-9].npy")) == [pieces.piece_name(0, 64), pieces.piece_name(64, 128)]

    calls, lines = [], []

    def counted(start, stop):
        calls.append((start, stop))
        return ranged(x, labels, left_out={5})(start, stop)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(pieces, "PIECE_IMAGES", 64)
        cache = latents.cached_latents(vae, counted, key, root=cache_root, num_images=200, progress=False, log=lines.append)
        assert calls == [(128, 192), (192, 200)] and vae.encode_calls == 2
        (line,) = lines
        assert line.startswith("encoded 72 images to latents") and ", and reused 127 that another encode of this key had encoded (interrupted" in line
        assert cache.meta["ranks"][0]["kept"] == 127 and cache.meta["images_per_second"] == 72 / cache.encode_seconds
        assert [p.name for p in cache_root.iterdir()] == [cache.path.name]  # the pieces and the dead build: gone
        whole = latents.cached_latents(vae, ranged(x, labels, left_out={5}), key, root=tmp_path / "whole",
                                       num_images=200, progress=False, log=print)  # fmt: skip
        assert (cache.path / "latents.npy").read_bytes() == (whole.path / "latents.npy").read_bytes()
        assert torch.equal(cache.labels, whole.labels) and cache.stats == whole.stats

        # A piece cut short (not one this module wrote whole) is encoded again, and the others reused.
        shutil.rmtree(cache.path)
        calls.clear()
        with m.context() as fail:
            fail.setattr(latents, "_publish", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
            with pytest.raises(OSError, match="disk full"):
                latents.cached_latents(vae, counted, key, root=cache_root, num_images=200, progress=False)
        assert not list(partial.glob(".claim-*"))  # the failed encode's claims released: the next takes its pieces
        piece = partial / pieces.piece_name(64, 128)
        piece.write_bytes(piece.read_bytes()[:-4])
        calls.clear()
        again = latents.cached_latents(vae, counted, key, root=cache_root, num_images=200, progress=False, log=print)
        assert calls == [(64, 128)] and again.meta["ranks"][0]["kept"] == 135  # 199 images less the 64 of [64, 128)
        assert (again.path / "latents.npy").read_bytes() == (whole.path / "latents.npy").read_bytes()


def test_a_dataset_of_unreadable_images_only_is_a_one_line_error_in_pieces_too(tmp_path, kl_folder, monkeypatch):
    vae = autoencoder.load_vae(kl_folder)
    key = latents.cache_key(dict(name="toy"), vae, SIZE)
    monkeypatch.setattr(pieces, "PIECE_IMAGES", 64)  # no call sees the whole dataset (--on_fault skip left all out)
    one_line_error(lambda: latents.cached_latents(vae, ranged(images(100), left_out=range(100)), key, root=tmp_path,
                                                  num_images=100, progress=False), "none of the dataset's images")  # fmt: skip


def test_an_encode_says_what_pieces_of_other_keys_the_cache_root_holds(tmp_path, kl_folder):
    vae = autoencoder.load_vae(kl_folder)
    key = latents.cache_key(dict(name="toy"), vae, SIZE)
    for name in ("0123abcd", "4567cdef"):  # an encode of a dataset whose files changed since, and another's
        (tmp_path / f".{name}.partial").mkdir()
        with open(tmp_path / f".{name}.partial" / pieces.piece_name(0, 64), "wb") as f:
            f.truncate(2**29)  # sparse: its size without the writing
    pieces.partial_folder(latents.cache_folder(key, tmp_path)).mkdir()  # this key's own (from an earlier try)
    (tmp_path / ".89abcdef.partial").mkdir()  # an encode that failed before its first piece: nothing to say
    lines = []
    latents.cached_latents(vae, ranged(images(10)), key, root=tmp_path, num_images=10, progress=False, log=lines.append)
    assert lines[0] == (
        f"latents: {tmp_path} holds the pieces of 2 interrupted encode(s) of other datasets or VAEs (1.00 GiB: "
        ".0123abcd.partial, .4567cdef.partial), kept for their next start: remove them if those runs will not come again"
    )
    assert lines[1].startswith("encoded 10 images") and len(lines) == 2
    assert (tmp_path / ".0123abcd.partial").is_dir()  # kept: the user's to remove


def test_a_piece_is_read_only_when_written_whole_and_where_a_decode_batch_begins(tmp_path):
    piece = tmp_path / pieces.piece_name(0, 64)
    with open(piece, "wb") as f:
        f.write(pieces.npy_header((3, 2, 2, 4, 2, 2)))
        f.write(np.zeros((3, 2, 2, 4, 2, 2), "<f4").tobytes())
    np.save(pieces.labels_file(piece), np.arange(3))
    assert pieces.piece_info(piece) == dict(images=3, shape=[2, 2, 4, 2, 2], latents_bytes=256 + 3 * 64 * 4,
                                              labels_bytes=pieces.labels_file(piece).stat().st_size)  # fmt: skip
    np.save(pieces.labels_file(piece), np.arange(2))
    assert pieces.piece_info(piece) is None  # labels of another count
    pieces.labels_file(piece).unlink()
    assert pieces.piece_info(piece)["labels_bytes"] == 0
    for foreign in (np.zeros((3, 2), "<f8"), np.zeros((3, 2), "<f4").T):  # another dtype, Fortran order
        np.save(piece, foreign)
        assert pieces.piece_info(piece) is None
    header = pieces.npy_header((3, 2))
    for foreign in (pieces.npy_header((3, 2), ">f4"), header.replace(b"False", b"True ")):  # the size of a piece
        piece.write_bytes(foreign + bytes(24))
        assert pieces.piece_info(piece) is None
    piece.write_bytes(header + bytes(24))
    assert pieces.piece_info(piece)["images"] == 3
    piece.write_bytes(pieces.npy_header(()) + bytes(4))  # one number, no rows
    assert pieces.piece_info(piece) is None
    with open(piece, "wb") as f:  # another version of the format
        np.lib.format.write_array(f, np.zeros((3, 2), "<f4"), version=(2, 0))
    assert pieces.piece_info(piece) is None
    piece.write_bytes(b"not a piece")
    assert pieces.piece_info(piece) is None
    with open(piece, "wb") as f:  # a piece of no images (a range of unreadable items only)
        f.write(pieces.npy_header((0,)))
    assert pieces.piece_info(piece) == dict(images=0, shape=None, latents_bytes=256, labels_bytes=0)

    for a, b in ((0, 64), (64, 100), (32, 64), (128, 200), (192, 256), (64, 128)):
        (tmp_path / pieces.piece_name(a, b)).touch()
    (tmp_path / "piece-64-128.npy").touch()  # not a name this module writes
    # in [64, 200): begins on a batch and ends on one or at the range's end
    assert sorted(pieces.kept_pieces(tmp_path, 64, 200)) == [(64, 128), (128, 200)]
    assert pieces.kept_pieces(tmp_path / "none", 0, 200) == []


def test_the_plan_reuses_kept_pieces_and_cuts_the_rest_at_piece_boundaries(monkeypatch):
    monkeypatch.setattr(pieces, "PIECE_IMAGES", 128)
    assert pieces.plan(64, 400, []) == [(64, 128, False), (128, 256, False), (256, 384, False), (384, 400, False)]
    assert pieces.plan(0, 400, [(128, 256), (192, 256), (320, 384)]) == [
        (0, 128, False), (128, 256, True), (256, 320, False), (320, 384, True), (384, 400, False)]  # fmt: skip
    assert pieces.plan(0, 100, [(0, 100)]) == [(0, 100, True)]
    assert pieces.plan(5, 5, []) == []


def test_a_filesystem_without_hard_links_encodes_and_keeps_nothing(tmp_path, kl_folder, monkeypatch):
    vae = autoencoder.load_vae(kl_folder)
    x = images(70)
    key = latents.cache_key(dict(name="toy"), vae, SIZE)
    monkeypatch.setattr(pieces, "PIECE_IMAGES", 64)
    monkeypatch.setattr(latents.os, "link", lambda *a: (_ for _ in ()).throw(OSError(95, "Operation not supported")))
    monkeypatch.setattr(latents, "_publish", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):  # encoded whole, then kept from publishing
        latents.cached_latents(vae, ranged(x), key, root=tmp_path, num_images=70, progress=False, log=print)
    assert list(pieces.partial_folder(latents.cache_folder(key, tmp_path)).iterdir()) == []


def pieces_of_a_failed_publish(vae, x, key, root, monkeypatch):
    """The .NAME.partial of `x` encoded in pieces of 64 whose publishing failed (PIECE_IMAGES stays 64)."""
    monkeypatch.setattr(pieces, "PIECE_IMAGES", 64)
    publish = latents._publish
    monkeypatch.setattr(latents, "_publish", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        latents.cached_latents(vae, ranged(x), key, root=root, num_images=len(x), progress=False)
    monkeypatch.setattr(latents, "_publish", publish)
    return pieces.partial_folder(latents.cache_folder(key, root))


def test_pieces_removed_by_another_job_between_the_listing_and_the_link_are_encoded(tmp_path, kl_folder, monkeypatch):
    """Another job published the key and removed the pieces just after this one listed them."""
    vae = autoencoder.load_vae(kl_folder)
    x, root = images(70), tmp_path / "cache"
    key = latents.cache_key(dict(name="toy"), vae, SIZE)
    partial, listed = pieces_of_a_failed_publish(vae, x, key, root, monkeypatch), pieces.kept_pieces
    assert len(listed(partial, 0, 70)) == 2

    def then_removed(*a):
        found = listed(*a)
        shutil.rmtree(partial)
        return found

    monkeypatch.setattr(pieces, "kept_pieces", then_removed)
    lines = []
    cache = latents.cached_latents(vae, ranged(x), key, root=root, num_images=70, progress=False, log=lines.append)
    assert cache.num_images == 70 and lines[0].startswith("encoded 70 images") and "reused" not in lines[0]


def test_a_piece_claimed_by_a_dead_encode_is_taken_and_a_live_ones_is_not(tmp_path, monkeypatch):
    """Dead: its process gone (this host), or its claim untouched for CLAIM_STALE_S by this process's clock; a
    claim this encode holds is touched every CLAIM_BEAT_S, and released at the end."""
    monkeypatch.setattr(pieces, "CLAIM_STALE_S", 0.3)
    monkeypatch.setattr(pieces, "CLAIM_BEAT_S", 0.05)
    claims = pieces.Claims(tmp_path)
    try:
        (tmp_path / ".claim-a").write_text(f"{folders.this_host()} {dead_pid()} token\n")
        assert claims.take("a")
        elsewhere = tmp_path / ".claim-b"
        elsewhere.write_text("another-host 1 token\n")
        assert not claims.take("b")
        time.sleep(0.2)
        os.utime(elsewhere, ns=(time.time_ns(), time.time_ns() + 10**9))  # its encode touched it: alive
        assert not claims.take("b")
        time.sleep(0.2)
        assert not claims.take("b")
        time.sleep(0.2)
        assert claims.take("b")  # untouched for 0.4 s
        held = (tmp_path / ".claim-a").stat().st_mtime_ns
        time.sleep(0.2)
        assert (tmp_path / ".claim-a").stat().st_mtime_ns != held  # touched by the encode's thread
    finally:
        claims.close()
    assert not list(tmp_path.glob(".claim-*"))


def test_an_encode_whose_key_another_publishes_meanwhile_stops_and_reads_that_cache(tmp_path, kl_folder, monkeypatch):
    """Two runs of a sweep encoding one key: the other published (and removed the pieces) after this one's second
    piece; this one encodes no more and reads the published cache."""
    vae = count_encodes(autoencoder.load_vae(kl_folder))
    x, root = images(200), tmp_path / "cache"
    key = latents.cache_key(dict(name="toy"), vae, SIZE)
    monkeypatch.setattr(pieces, "PIECE_IMAGES", 64)
    theirs = latents.cached_latents(vae, ranged(x), key, root=tmp_path / "theirs", num_images=200, progress=False)
    final = latents.cache_folder(key, root)

    def published_during_the_second_piece(start, stop):
        if start == 64:
            shutil.copytree(theirs.path, final)
            shutil.rmtree(pieces.partial_folder(final))
        return ranged(x)(start, stop)

    lines, vae.encode_calls = [], 0
    cache = latents.cached_latents(vae, published_during_the_second_piece, key, root=root, num_images=200,
                                   progress=False, log=lines.append)  # fmt: skip
    assert vae.encode_calls == 2 and lines == [f"latents: another process published this key's cache while this one "
                                               f"encoded its pieces: reading {final} (200 images)"]  # fmt: skip
    assert cache.path == final and (final / "latents.npy").read_bytes() == (theirs.path / "latents.npy").read_bytes()
    assert [p.name for p in root.iterdir()] == [final.name]  # its build removed


def test_a_piece_completed_between_the_look_and_the_claim_is_linked_not_encoded(tmp_path, kl_folder, monkeypatch):
    """Its claimer linked it and released its claim just before this encode claimed it."""
    vae = count_encodes(autoencoder.load_vae(kl_folder))
    x, root = images(130), tmp_path / "cache"
    key = latents.cache_key(dict(name="toy"), vae, SIZE)
    partial = pieces_of_a_failed_publish(vae, x, key, root, monkeypatch)
    done = partial.rename(tmp_path / "done")
    take = pieces.Claims.take

    def completed_first(claims, name):
        shutil.copy(done / name, partial / name)  # the other encode's piece, complete
        return take(claims, name)

    monkeypatch.setattr(pieces.Claims, "take", completed_first)
    vae.encode_calls = 0
    cache = latents.cached_latents(vae, ranged(x), key, root=root, num_images=130, progress=False, log=print)
    assert vae.encode_calls == 0 and cache.num_images == 130


# --- normalisation, decoding, draws -----------------------------------------------------------


def test_vae_normalisation_uses_scaling_and_shift_factor_and_round_trips(tmp_path):
    vae = autoencoder.load_vae(make_kl(tmp_path / "vae", scaling_factor=0.5, shift_factor=0.25))
    cache = encode(vae, images(), tmp_path)
    record = autoencoder.normalization(cache, vae, "vae")
    assert record["kind"] == "vae" and record["scaling_factor"] == 0.5 and record["shift_factor"] == 0.25
    assert record["shift"] == [0.25] * 4 and record["scale"] == [0.5] * 4
    assert record["normalized_std"] == pytest.approx([s * 0.5 for s in cache.stats["std"]])
    json.dumps(record)  # goes into the run's config
    z = cache.draw(range(10), epoch=0, seed=0)
    torch.testing.assert_close(autoencoder.normalize(z, record), (z - 0.25) * 0.5)
    torch.testing.assert_close(autoencoder.denormalize(autoencoder.normalize(z, record), record), z)
    edm = autoencoder.normalization(cache, vae, "vae", target_std=0.5)
    torch.testing.assert_close(autoencoder.normalize(z, edm), (z - 0.25) * 0.25)

    # decode undoes the normalisation, then decodes: images in [-1, 1]
    decoded = autoencoder.decode(vae, autoencoder.normalize(z[:3], record), record, batch_size=2)
    with torch.no_grad():
        expected = vae.decode(z[:3]).sample.clamp(-1, 1)
    torch.testing.assert_close(decoded, expected, atol=1e-5, rtol=1e-4)
    assert decoded.shape == (3, 3, SIZE, SIZE) and decoded.abs().max() <= 1

    # Per-channel latents_mean / latents_std where the config has them
    config = json.loads((tmp_path / "vae" / "config.json").read_text())
    means, stds = [0.1, 0.2, 0.3, 0.4], [1.0, 2.0, 4.0, 8.0]
    (tmp_path / "vae" / "config.json").write_text(json.dumps(config | dict(latents_mean=means, latents_std=stds)))
    per_channel = autoencoder.normalization(cache, autoencoder.load_vae(tmp_path / "vae"), "vae")
    assert per_channel["shift"] == means and per_channel["scale"] == pytest.approx([0.5 / s for s in stds])
    torch.testing.assert_close(autoencoder.normalize(z, per_channel)[:, 3], (z[:, 3] - 0.4) * 0.5 / 8)

    # A config.json that does not set scaling_factor (diffusers would fill in SD's 0.18215)
    del config["scaling_factor"]
    (tmp_path / "vae" / "config.json").write_text(json.dumps(config))
    bare = autoencoder.load_vae(tmp_path / "vae")
    one_line_error(lambda: autoencoder.normalization(cache, bare, "vae"), "no scaling_factor", "dataset")
    one_line_error(lambda: autoencoder.normalization(cache, bare, "pixels"), "'vae' or 'dataset'")


def test_dataset_normalisation_gives_zero_mean_unit_std_per_channel(tmp_path, kl_folder):
    vae = autoencoder.load_vae(kl_folder)
    cache = encode(vae, images(64), tmp_path)
    record = autoencoder.normalization(cache, vae, "dataset")
    assert record["kind"] == "dataset" and record["mean"] == cache.stats["mean"] and record["std"] == cache.stats["std"]
    assert record["normalized_std"] == pytest.approx([1.0] * 4)
    z = torch.cat([autoencoder.normalize(cache.draw(range(64), epoch=e, seed=0), record) for e in range(8)])
    assert z.mean((0, 2, 3)).abs().max() < 0.05
    assert (z.std((0, 2, 3)) - 1).abs().max() < 0.05
    raw = autoencoder.denormalize(z, record)
    torch.testing.assert_close(autoencoder.normalize(raw, record), z, atol=1e-5, rtol=1e-5)
    half = autoencoder.normalization(cache, vae, "dataset", target_std=0.5)
    assert half["normalized_std"] == pytest.approx([0.5] * 4)


def test_draws_are_fresh_each_epoch_and_identical_for_the_same_seed_epoch_and_index(tmp_path, kl_folder):
    vae = autoencoder.load_vae(kl_folder)
    cache = encode(vae, images(), tmp_path)
    a = cache.draw([0, 1, 2, 3], epoch=5, seed=7)
    # the same (seed, epoch, index) in another batch, another order, a cache read afresh (a resume)
    resumed = drawn.LatentCache(cache.path)
    assert torch.equal(a[2], resumed.draw([9, 2], epoch=5, seed=7)[1])
    assert torch.equal(a, resumed.draw([0, 1, 2, 3], epoch=5, seed=7))
    assert not torch.equal(a, cache.draw([0, 1, 2, 3], epoch=6, seed=7))
    assert not torch.equal(a, cache.draw([0, 1, 2, 3], epoch=5, seed=8))
    assert not torch.equal(a[0], a[1])

    # Each draw is one orientation's mean plus its std times fresh noise; both orientations turn up.
    stored = torch.from_numpy(np.array(cache.array[3]))  # (2 orientations, mean/std, C, h, w)
    sides = set()
    for epoch in range(12):
        z = cache.draw([3], epoch=epoch, seed=0)[0]
        eps = [(z - stored[s, 0]) / stored[s, 1] for s in (0, 1)]
        side = min((0, 1), key=lambda s: eps[s].abs().max())
        assert eps[side].abs().max() < 6 and 0.7 < eps[side].std() < 1.3
        sides.add(side)
    assert sides == {0, 1}

    dataset = drawn.LatentDataset(cache, autoencoder.normalization(cache, vae, "dataset"), seed=7)
    dataset.set_epoch(5)
    torch.testing.assert_close(dataset[2], autoencoder.normalize(a[2:3], dataset.record)[0])
    assert torch.equal(dataset.batch([0, 1, 2, 3]), autoencoder.normalize(a, dataset.record))
    dataset.set_epoch(6)
    assert not torch.equal(dataset.batch([0, 1, 2, 3]), autoencoder.normalize(a, dataset.record))
    assert len(dataset) == 10


def test_a_tiny_vae_stores_its_latents_alone(tmp_path):
    from diffusers import AutoencoderTiny

    vae = autoencoder.load_vae(make_tiny(tmp_path / "tiny"))
    assert isinstance(vae, AutoencoderTiny)
    x = images()
    cache = encode(vae, x, tmp_path)
    assert cache.array.shape == (10, 2, 1, 4, 4, 4) and not cache.stochastic
    with torch.no_grad():
        expected = vae.encode(x).latents
    torch.testing.assert_close(torch.from_numpy(np.array(cache.array[:, 0, 0])), expected, atol=1e-5, rtol=1e-5)
    draws = {tuple(cache.draw([0], epoch=e, seed=0).flatten().tolist()) for e in range(12)}
    assert len(draws) == 2  # the two orientations, no noise
    record = autoencoder.normalization(cache, vae, "vae")  # TAESD's scaling_factor 1.0, shift 0
    assert record["scale"] == [1.0] * 4 and record["shift"] == [0.0] * 4
    assert autoencoder.decode(vae, cache.draw([0, 1], 0, 0), record).shape == (2, 3, SIZE, SIZE)


# --- shares, publishing, leftovers ------------------------------------------------------------


def test_shares_are_contiguous_aligned_to_the_decode_batch_and_cover_every_item():
    assert pieces.SHARD_ALIGN == 64
    assert latents.shares(200, 2) == [(0, 128), (128, 200)]
    assert latents.shares(20, 2) == [(0, 20), (20, 20)]  # few images: a share may be empty
    assert latents.shares(200, 1) == [(0, 200)]
    for n, world in ((1000, 3), (64 * 7, 4), (1, 8), (12345, 8)):
        parts = latents.shares(n, world)
        assert len(parts) == world and parts[0][0] == 0 and parts[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous, in rank order
        assert all(start % 64 == 0 or start == n for start, _ in parts)
        blocks = [-(-(stop - start) // 64) for start, stop in parts]  # decode batches a share
        assert max(blocks) - min(blocks) <= 1


def ranged(x, labels=None, batch_size=64, left_out=()):
    """images(start, stop) as decoding.decoded_batches gives them: batches of 64 items from `start`, unreadable
    items (`left_out`) dropped from their batch."""

    def images(start, stop):
        for i in range(start, stop, batch_size):
            keep = [j for j in range(i, min(i + batch_size, stop)) if j not in left_out]
            yield x[keep] if labels is None else (x[keep], labels[keep])

    return images


def test_images_of_start_and_stop_encode_as_the_whole_dataset_does_on_one_process(tmp_path, kl_folder):
    vae = autoencoder.load_vae(kl_folder)
    x, labels = images(70), torch.arange(70) % 3
    key = latents.cache_key(dict(name="toy"), vae, SIZE)
    whole = latents.cached_latents(vae, lambda: batches(x, 64, labels), key, root=tmp_path / "a", progress=False, log=print)
    shared = latents.cached_latents(vae, ranged(x, labels), key, root=tmp_path / "b", num_images=70, progress=False,
                                    log=print)  # fmt: skip
    assert (whole.path / "latents.npy").read_bytes() == (shared.path / "latents.npy").read_bytes()
    assert torch.equal(shared.labels, labels) and shared.stats == whole.stats
    assert shared.meta["ranks"] == [dict(rank=0, host=shared.meta["ranks"][0]["host"], device="cpu", start=0, stop=70,
                                         images=70, seconds=shared.meta["ranks"][0]["seconds"], kept=0)]  # fmt: skip
    one_line_error(lambda: latents.cached_latents(vae, ranged(x), key, root=tmp_path / "c", progress=False),
                   "images(start, stop)", "num_images")  # fmt: skip


def test_publishing_keeps_a_valid_cache_and_replaces_an_invalid_one_aside(tmp_path, kl_folder, monkeypatch):
    vae = autoencoder.load_vae(kl_folder)
    key = latents.cache_key(dict(name="toy"), vae, SIZE)
    first = encode(vae, images(), tmp_path)
    final, inode = first.path, (first.path / "latents.npy").stat().st_ino
    shutil.copytree(final, tmp_path / "good")

    def candidate(seed):  # a complete cache of the key in a temporary folder, as an encode leaves it
        tmp = folders.temporary(final)
        shutil.copytree(tmp_path / "good", tmp)
        array = np.load(tmp / "latents.npy")
        np.save(tmp / "latents.npy", array + seed)
        return tmp

    tmp = candidate(1)
    cache, ours = latents._publish(tmp, final, key, 8.0)
    assert not ours and cache.path == final and (final / "latents.npy").stat().st_ino == inode  # kept
    assert np.array_equal(cache.array, first.array)

    # A valid cache that turns up between the look and the move aside is put back, not deleted.
    read, looks = drawn.read, []

    def late(folder, *a):
        looks.append(folder)
        return None if len(looks) == 1 else read(folder, *a)

    monkeypatch.setattr(drawn, "read", late)
    cache, ours = latents._publish(tmp, final, key, 8.0)
    monkeypatch.setattr(drawn, "read", read)
    assert not ours and (final / "latents.npy").stat().st_ino == inode
    shutil.rmtree(tmp)

    # An invalid folder (another key's meta.json, or none) is renamed aside and replaced; nothing is left over.
    for broken in ("other key", "no meta"):
        meta = json.loads((final / "meta.json").read_text())
        if broken == "other key":
            (final / "meta.json").write_text(json.dumps(meta | dict(key=dict(other=1))))
        else:
            (final / "meta.json").unlink()
        tmp = candidate(2)
        cache, ours = latents._publish(tmp, final, key, 8.0)
        assert ours and cache.path == final and np.array_equal(cache.array, first.array + 2)
        assert [p.name for p in final.parent.iterdir()] == [final.name]


def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_leftovers_are_removed_for_this_host_exactly(tmp_path, monkeypatch):
    final = tmp_path / "abc"
    pid = dead_pid()
    monkeypatch.setattr(latents.socket, "gethostname", lambda: "node1")
    here = folders.this_host()  # node1 and this process's PID namespace
    assert here.startswith("node1~")  # Linux: the namespace is part of it
    hosts = (here, "node1-b" + here[5:], "node10" + here[5:], "xnode1" + here[5:], "node1~1")
    names = {host: tmp_path / f".abc.tmp-{host}-{pid}-0123abcd" for host in hosts}
    alive = tmp_path / f".abc.tmp-{here}-{os.getpid()}-fedc0000"
    pieces = tmp_path / f"..abc.partial.tmp-{here}-{pid}-0123abcd"  # renamed aside by a publisher killed removing them
    for folder in (*names.values(), alive, pieces):
        folder.mkdir()
    latents._IN_PROGRESS.add(str(alive))
    try:
        latents._remove_leftovers(final)
    finally:
        latents._IN_PROGRESS.discard(str(alive))
    assert not names[here].exists() and not pieces.exists()  # this host's, its process dead
    assert all(names[host].exists() for host in hosts[1:])  # other hosts', and another container's of the same name
    assert alive.exists()  # being written
    monkeypatch.setattr(latents.socket, "gethostname", lambda: "node1-b")
    latents._remove_leftovers(final)
    assert not names[hosts[1]].exists() and names[hosts[2]].exists()


# --- draws, decoding (vectorised) -----------------------------------------------------------------


def test_the_draws_generator_is_splitmix64_in_exact_uint64_arithmetic():
    values = [0, 1, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1, 0x123456789ABCDEF0]
    mixed = keyed_random.mix(torch.tensor([keyed_random.signed(v) for v in values], dtype=torch.int64))
    assert [v % 2**64 for v in mixed.tolist()] == [keyed_random.mix_int(v) for v in values]
    assert keyed_random.mix_int(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF  # splitmix64's first output for seed 0
    x = torch.tensor([5, -7])
    assert keyed_random.shr(x, 1).tolist() == [2, 2**63 - 4]  # logical


def test_draws_are_standard_normal_and_independent_across_indices_and_epochs():
    keys = keyed_random.draw_keys(3, 0, torch.arange(512))
    eps = keyed_random.normals(keyed_random.words(keys, 128), 256)  # 512 images of 256 normals
    assert eps.dtype == torch.float32 and eps.shape == (512, 256)
    flat = eps.double().flatten()
    assert abs(flat.mean()) < 0.01 and abs(flat.std() - 1) < 0.01
    assert abs((flat.abs() < 1).double().mean() - 0.6827) < 0.01 and abs((flat.abs() < 2).double().mean() - 0.9545) < 0.005
    assert abs(((flat**4).mean() - 3)) < 0.1  # the kurtosis of a normal
    per_element = eps.mean(0)  # each element across images: no offset of its own
    assert per_element.abs().max() < 5 / 512**0.5
    assert abs(torch.corrcoef(torch.stack([eps[:-1].flatten(), eps[1:].flatten()]))[0, 1]) < 0.02  # index i vs i+1
    assert abs(torch.corrcoef(torch.stack([eps[:, :-1].flatten(), eps[:, 1:].flatten()]))[0, 1]) < 0.02
    other = keyed_random.normals(keyed_random.words(keyed_random.draw_keys(3, 1, torch.arange(512)), 128), 256)
    assert abs(torch.corrcoef(torch.stack([eps.flatten(), other.flatten()]))[0, 1]) < 0.02  # epoch e vs e+1
    reseeded = keyed_random.normals(keyed_random.words(keyed_random.draw_keys(4, 0, torch.arange(512)), 128), 256)
    assert abs(torch.corrcoef(torch.stack([eps.flatten(), reseeded.flatten()]))[0, 1]) < 0.02


def test_a_batch_draw_is_the_draws_of_its_images_alone(tmp_path, kl_folder):
    vae = autoencoder.load_vae(kl_folder)
    cache = encode(vae, images(64), tmp_path)
    a, b = cache.draw([5], epoch=3, seed=1), cache.draw([40], epoch=3, seed=1)
    assert torch.equal(cache.draw([5, 40], epoch=3, seed=1), torch.cat([a, b]))
    assert torch.equal(cache.draw([40, 5, 40], epoch=3, seed=1), torch.cat([b, a, b]))  # any order, repeats
    everything = cache.draw(torch.arange(64), epoch=3, seed=1)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cache.draw(order, epoch=3, seed=1), everything[order])
    mapped = drawn.LatentCache(cache.path, max_gib=0.0)
    assert mapped.memmapped and torch.equal(mapped.draw(order, epoch=3, seed=1), everything[order])
    # Orientations: about half of the images drawn flipped in an epoch, each image both ways over epochs.
    stored = torch.from_numpy(np.array(cache.array))  # (N, 2, 2, C, h, w)
    eps = [(everything - stored[:, s, 0]) / stored[:, s, 1] for s in (0, 1)]
    sides = torch.stack([e.flatten(1).abs().max(1).values for e in eps]).argmin(0)
    assert 16 <= int(sides.sum()) <= 48
    chosen = torch.stack([eps[int(s)][i] for i, s in enumerate(sides)])
    assert chosen.abs().max() < 6 and abs(chosen.std() - 1) < 0.05


def test_decode_is_bounded_by_pixels(tmp_path, kl_folder, monkeypatch):
    vae = count_decodes(autoencoder.load_vae(kl_folder))
    z = torch.randn(7, 4, SIZE // 2, SIZE // 2)
    record = dict(shift=[0.0] * 4, scale=[1.0] * 4)
    monkeypatch.setattr(autoencoder, "ENCODE_PIXELS", 3 * SIZE * SIZE)  # 3 images of SIZE px at once
    out = autoencoder.decode(vae, z, record)
    assert vae.sizes == [3, 3, 1] and out.shape == (7, 3, SIZE, SIZE)
    monkeypatch.setattr(autoencoder, "ENCODE_PIXELS", 32 * SIZE * SIZE)
    vae.sizes.clear()
    autoencoder.decode(vae, z, record)
    assert vae.sizes == [7]


def count_decodes(vae):
    decode, vae.sizes = vae.decode, []

    def counted(z, *args, **kwargs):
        vae.sizes.append(len(z))
        return decode(z, *args, **kwargs)

    vae.decode = counted
    return vae
