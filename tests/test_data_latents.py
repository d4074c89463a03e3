"""data.py for latent runs (issue 37): the dataset's identity for the latent cache key (symlinked folders
and files too), the encoding pass over a range of the dataset (sharded encoding), and latent draws
prefetched by DataLoader workers."""

import pytest
import torch
from PIL import Image

from ddpm_train import config
from ddpm_train.data import drawn
from ddpm_train.data import data
from ddpm_train.data import batches
from ddpm_train.data import decoding
from ddpm_train.data import autoencoder
from ddpm_train.data import latents
from ddpm_train.errors import ConfigError

CPU = torch.device("cpu")


def run_args(*argv):
    """Resolved flags of a tiny run; no DataLoader worker processes."""
    return config.resolve(config.parse_args(["--image_size", "8", "--dataloader_num_workers", "0", *map(str, argv)]))


def write_images(folder, count=4, classes=("a", "b")):
    """`count` plain images in each class subfolder of `folder`, each of its own red; returns the folder."""
    for c, name in enumerate(classes):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.new("RGB", (10, 10), (10 * (c * count + i), 50, 0)).save(folder / name / f"{i}.png")
    return folder


def symlinked_files(target, folder):
    """`folder`: the same tree as `target`, each image a symlink to `target`'s."""
    for image in sorted(target.rglob("*.png")):
        link = folder / image.relative_to(target)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(image)
    return folder


def identity(folder, *flags):
    return data.images_to_encode(run_args("--dataset", folder, *flags), decoding.Unreadable(verbose=False))[0]


def test_identity_of_a_folder_survives_symlinks(tmp_path):
    images = write_images(tmp_path / "images")
    plain = identity(images)
    assert plain == identity(images) and plain["folder"] == str(images.resolve()) and plain["files"] == 8
    # a symlink to the folder: the same folder, the same files
    (tmp_path / "link").symlink_to(images, target_is_directory=True)
    assert identity(tmp_path / "link") == plain
    # a folder of symlinked files: computed (no traceback) and stable; the same names, sizes and times hash the same
    linked = identity(symlinked_files(images, tmp_path / "linked"))
    assert linked == identity(tmp_path / "linked") and linked["folder"] == str((tmp_path / "linked").resolve())
    assert linked["fingerprint"] == plain["fingerprint"]
    # what the links point to counts: another image behind one name is another dataset
    Image.new("RGB", (12, 10), (0, 0, 0)).save(images / "a" / "0.png")
    assert identity(tmp_path / "linked")["fingerprint"] != linked["fingerprint"]
    conditional = identity(tmp_path / "linked", "--class_conditional")
    assert conditional["class_conditional"] and conditional["fingerprint"] == identity(tmp_path / "linked")["fingerprint"]
    # a link left dangling after the folder was listed: one line, no traceback
    args = run_args("--dataset", tmp_path / "linked")
    dataset = data.open_run_dataset(args)
    (images / "b" / "3.png").unlink()
    with pytest.raises(ConfigError, match=r"cannot read image .*linked/b/3.png \(.*\): remove or replace the file"):
        dataset.identity(args)


def test_identity_of_a_saved_dataset_is_stable(tmp_path):
    import datasets

    pictures = [Image.new("RGB", (10, 10), (40 * i, 0, 0)) for i in range(3)]
    rows = datasets.Dataset.from_dict({"image": pictures}).cast_column("image", datasets.Image())
    rows.save_to_disk(str(tmp_path / "saved"))
    found = identity(tmp_path / "saved")
    assert found == identity(tmp_path / "saved")
    assert found["dataset"] == str((tmp_path / "saved").resolve()) and found["rows"] == 3 and found["fingerprint"]


def test_a_latent_run_trains_on_a_folder_of_symlinked_images(tmp_path, monkeypatch):
    """train.py --vae on symlinked image files (the identity of their folder crashed with a traceback before):
    16px images, a tiny random VAE, two steps."""
    from test_latents import make_kl
    from test_train import run

    monkeypatch.setenv(latents.CACHE_ENV, str(tmp_path / "latent-cache"))
    folder = symlinked_files(write_images(tmp_path / "images"), tmp_path / "linked")
    result = run(tmp_path / "run", "--dataset", folder, "--vae", make_kl(tmp_path / "kl"), "--train_batch_size", 4,
                 "--max_train_steps", 2, "--num_inference_steps", 1, "--save_images_epochs", 100,
                 "--logger", "none")  # fmt: skip
    assert result["latents"]["cache_key"]["dataset"]["folder"] == str(folder.resolve())
    assert (tmp_path / "run" / "unet").is_dir()


def batches_equal(a, b):
    """Two lists of batches, each a tensor or a tuple of tensors, equal batch for batch."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        x, y = (x, y) if isinstance(x, tuple) else ((x,), (y,))
        assert len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y))


def test_a_range_of_the_images_to_encode_is_the_same_batches(tmp_path):
    """images(start, stop): a shard of the encoding pass, in the batches of 64 the whole pass gives (labels too)."""
    folder = write_images(tmp_path / "images", count=40)  # 80 images: batches of 64 and 16
    (folder / "b" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")  # item 80 (sorted last), in the second batch
    unreadable = decoding.Unreadable(verbose=False)
    _, images, count, class_names = data.images_to_encode(run_args("--dataset", folder, "--class_conditional"), unreadable)
    assert count == 81 and class_names == ["a", "b"]
    whole = list(images())
    assert [len(x) for x, _ in whole] == [64, 16] and len(unreadable) == 1
    batches_equal(list(images(0, 64)) + list(images(64, None)), whole)
    batches_equal(list(images(64)), whole[1:])
    # a range off the batches of 64: the same images and labels, in other batches
    middle = list(images(10, 70))
    assert torch.equal(torch.cat([x for x, _ in middle]), torch.cat([x for x, _ in whole])[10:70])
    assert torch.equal(torch.cat([y for _, y in middle]), torch.cat([y for _, y in whole])[10:70])
    assert list(images(80, 81)) == []  # only the broken image: no batch, and no error
    for start, stop in [(-1, 3), (5, 5), (0, 82), (1.5, 3), (None, 3)]:
        with pytest.raises(ConfigError, match=r"a range needs 0 <= start < stop <= 81"):
            images(start, stop)


@pytest.mark.parametrize("conditional", [False, True])
def test_a_range_of_the_builtin_images_to_encode(conditional):
    flags = ["--shapes_num_images", 70, "--image_size", 8] + (["--class_conditional"] if conditional else [])
    _, images, count, _ = data.images_to_encode(run_args(*flags), decoding.Unreadable(verbose=False))
    whole = list(images())
    assert count == 70 and len(whole) == 2 and isinstance(whole[0], tuple) == conditional
    batches_equal(list(images(0, 64)) + list(images(64, None)), whole)
    with pytest.raises(ConfigError, match="a range needs"):
        images(60, 71)


@pytest.mark.parametrize("memmapped", [False, True])
def test_latent_draws_prefetched_by_workers_are_the_draws_of_the_main_process(tmp_path, memmapped):
    """--dataloader_num_workers on a latent run: workers draw the epoch's batches ahead, each the batch (and the
    labels) the main process draws, at the epoch asked for."""
    from test_latents import make_kl

    vae = autoencoder.load_vae(make_kl(tmp_path / "kl"))
    images = torch.randint(0, 256, (12, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(12) % 3
    key = latents.cache_key(dict(name="prefetch"), vae, 16)
    cache = latents.cached_latents(vae, lambda: [(images, labels)], key, root=tmp_path / "cache", progress=False,
                                   log=lambda line: None)  # fmt: skip
    cache = drawn.LatentCache(cache.path, max_gib=0.0 if memmapped else 8.0)
    assert cache.memmapped == memmapped
    record = autoencoder.normalization(cache, vae, "dataset")
    dataset = drawn.LatentDataset(cache, record, seed=3)
    here = batches.Batches(dataset, 4, 3, CPU, labels=cache.labels)
    ahead = batches.Batches(dataset, 4, 3, CPU, num_workers=2, labels=cache.labels)
    straight = {epoch: list(here.epoch(epoch)) for epoch in (0, 1)}  # this process' dataset is left at epoch 1
    in_here, batch = [], dataset.batch
    dataset.batch = lambda indices: in_here.append(indices) or batch(indices)  # a forked worker counts in its copy
    workers = []
    for epoch in (0, 1):
        got = list(ahead.epoch(epoch))
        workers.append([w.pid for w in ahead.loader._iterator._workers])
        assert len(got) == 3
        for (z, y), (same_z, same_y), index in zip(got, straight[epoch], batches.epoch_batches(12, 4, 3, epoch), strict=True):
            assert torch.equal(z, same_z) and torch.equal(y, same_y) and torch.equal(y, labels[index])
            assert torch.equal(z, autoencoder.normalize(cache.draw(index, epoch, 3), record))
    resumed = list(ahead.epoch(1, start=2))
    assert len(resumed) == 1 and torch.equal(resumed[0][0], straight[1][2][0])
    assert in_here == []  # every batch drawn by the workers
    # started once: the same two workers drew every epoch (forked anew, each epoch's first step waited for them)
    assert len(workers[0]) == 2 and workers[0] == workers[1] == [w.pid for w in ahead.loader._iterator._workers]
