import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ddpm_train.data import data
from ddpm_train.data import workers
from ddpm_train.data import batches
from ddpm_train.data import decoding
from ddpm_train.data import sources
from ddpm_train.data import pixels
from ddpm_train.data import shapes
from conftest import ROOT
from ddpm_train.errors import ConfigError


def test_shapes_are_deterministic_in_the_seed():
    a = shapes.make_shapes(8, 16, seed=1)
    assert a.shape == (8, 3, 16, 16) and a.dtype == torch.uint8
    assert torch.equal(a, shapes.make_shapes(8, 16, seed=1))
    assert not torch.equal(a, shapes.make_shapes(8, 16, seed=2))


def test_shapes_do_not_depend_on_how_many_are_made():
    assert torch.equal(shapes.make_shapes(3, 16, seed=0), shapes.make_shapes(10, 16, seed=0)[:3])


@pytest.mark.parametrize("size", [8, 24, 48, 128])
def test_shapes_at_any_size(size):
    assert shapes.make_shapes(2, size).shape == (2, 3, size, size)


def test_shapes_are_shapes_on_plain_backgrounds():
    images = shapes.make_shapes(32, 32, seed=0).long()
    for image in images:
        colours, counts = torch.unique(image.view(3, -1).T, dim=0, return_counts=True)
        # a plain background covers a large share of the image ...
        assert counts.max() > 0.3 * 32 * 32
        # ... and at least one shape of another colour sits on it
        assert (counts > 20).sum() >= 2
    # the backgrounds and shapes vary from image to image
    assert len({tuple(img[:, 0, 0].tolist()) for img in images}) == len(images)


def write_image(path, size=(40, 30), mode="RGB", color=(200, 30, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color if mode == "RGB" else color[0]).save(path)


def test_folder_is_searched_recursively_and_images_become_rgb(tmp_path):
    write_image(tmp_path / "a.png")
    write_image(tmp_path / "nested" / "deeper" / "b.JPG")
    write_image(tmp_path / "nested" / "c.webp", mode="L", color=(90,))
    (tmp_path / "notes.txt").write_text("not an image")
    dataset = sources.open_dataset(str(tmp_path), image_size=16)
    assert len(dataset) == 3
    images = decoding.preload(dataset)
    assert images.shape == (3, 3, 16, 16) and images.dtype == torch.uint8
    # sorted by path: a.png, nested/c.webp (greyscale, now three equal channels), nested/deeper/b.JPG
    assert torch.all(images[1] == 90)
    assert images[2, :, 0, 0].tolist() == pytest.approx([200, 30, 30], abs=3)  # JPEG is lossy


def test_resize_and_center_crop_keep_the_middle(tmp_path):
    # 60x20: left third red, middle blue, right third green; the centre crop is all blue
    pixels = np.zeros((20, 60, 3), np.uint8)
    pixels[:, :20] = (255, 0, 0)
    pixels[:, 20:40] = (0, 0, 255)
    pixels[:, 40:] = (0, 255, 0)
    Image.fromarray(pixels).save(tmp_path / "wide.png")
    image = decoding.preload(sources.open_dataset(str(tmp_path), image_size=8))[0]
    assert image.shape == (3, 8, 8)
    assert image[2].min() > 200 and image[0].max() < 50 and image[1].max() < 50


def test_saved_dataset(tmp_path):
    import datasets

    pictures = [Image.new("RGB", (20, 20), (i * 40, 0, 0)) for i in range(5)]
    ds = datasets.Dataset.from_dict({"picture": pictures, "label": list(range(5))})
    ds = ds.cast_column("picture", datasets.Image())
    ds.save_to_disk(str(tmp_path / "saved"))
    dataset = sources.open_dataset(str(tmp_path / "saved"), image_size=8)
    images = decoding.preload(dataset)
    assert images.shape == (5, 3, 8, 8)
    assert images[:, 0, 0, 0].tolist() == [0, 40, 80, 120, 160]


def test_saved_dataset_dict_uses_the_split(tmp_path):
    import datasets

    def part(value, n):
        return datasets.Dataset.from_dict({"image": [Image.new("RGB", (8, 8), (value,) * 3)] * n}).cast_column(
            "image", datasets.Image()
        )

    datasets.DatasetDict(train=part(10, 3), test=part(250, 2)).save_to_disk(str(tmp_path / "dd"))
    test_split = decoding.preload(sources.open_dataset(str(tmp_path / "dd"), image_size=8, split="test"))
    assert len(test_split) == 2 and int(test_split.float().mean().round()) == 250
    with pytest.raises(ConfigError, match="no split 'valid'.*train, test"):
        sources.open_dataset(str(tmp_path / "dd"), image_size=8, split="valid")


def test_saved_dataset_without_an_image_column(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(tmp_path / "t"))
    with pytest.raises(ConfigError, match="no image column \\(columns: text\\)"):
        sources.open_dataset(str(tmp_path / "t"), image_size=8)


def test_missing_path(tmp_path):
    with pytest.raises(ConfigError, match="no such folder"):
        sources.open_dataset(str(tmp_path / "nope"), image_size=8)


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no images .* found under"):
        sources.open_dataset(str(tmp_path / "empty"), image_size=8)


def test_unreadable_image_is_named(tmp_path):
    write_image(tmp_path / "good.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    dataset = sources.open_dataset(str(tmp_path), image_size=8)
    with pytest.raises(ConfigError, match="cannot read image .*broken.png"):
        decoding.preload(dataset)  # strict unless told otherwise
    unreadable = decoding.Unreadable(verbose=False)
    images = decoding.preload(dataset, unreadable=unreadable)
    assert len(images) == 1 and len(unreadable) == 1 and "broken.png" in unreadable.messages[0]


def test_unreachable_hub_dataset_is_one_clear_error():
    # conftest sets HF_HUB_OFFLINE: the Hub cannot be reached
    with pytest.raises(ConfigError) as e:
        sources.open_dataset("someone/no-such-dataset", image_size=8)
    message = str(e.value)
    assert "someone/no-such-dataset" in message and "built-in dataset" in message and "local folder" in message
    assert "\n" not in message


def test_epoch_batches_are_a_shared_permutation_split_across_processes():
    ranks = [batches.epoch_batches(50, 4, seed=3, epoch=2, rank=r, world_size=3) for r in range(3)]
    assert all(len(made) == 50 // 12 for made in ranks)
    seen = torch.cat([b for made in ranks for b in made])
    assert len(seen) == len(set(seen.tolist())) == 4 * 12  # no image twice; last partial batch dropped
    assert all(torch.equal(a, b) for a, b in zip(ranks[0], batches.epoch_batches(50, 4, 3, 2, 0, 3)))
    assert not torch.equal(ranks[0][0], batches.epoch_batches(50, 4, 3, 3, 0, 3)[0])  # a new order each epoch


def test_batches_start_mid_epoch_with_the_same_batches():
    images = shapes.make_shapes(40, 8)
    made = batches.Batches(images, 4, seed=0, device=torch.device("cpu"))
    whole = list(made.epoch(1))
    assert len(whole) == made.batches_per_epoch() == 10
    resumed = list(made.epoch(1, start=6))
    assert len(resumed) == 4 and all(torch.equal(a, b) for a, b in zip(whole[6:], resumed))


def test_streamed_batches_equal_preloaded_ones(tmp_path):
    for i in range(12):
        write_image(tmp_path / f"{i:02d}.png", color=(i * 20, 0, 0))
    dataset = sources.open_dataset(str(tmp_path), image_size=8)
    cpu = torch.device("cpu")
    streamed = list(batches.Batches(dataset, 4, seed=0, device=cpu, num_workers=2).epoch(0))
    preloaded = list(batches.Batches(decoding.preload(dataset), 4, seed=0, device=cpu).epoch(0))
    assert len(streamed) == len(preloaded) == 3
    assert all(torch.equal(a, b) for a, b in zip(streamed, preloaded))


def test_streamed_random_crops_depend_on_seed_epoch_and_index_alone_and_the_workers_start_once(tmp_path):
    """The same crops through two workers as in this process, and from a resume's mid-epoch start; fresh each
    epoch; this process's generator left as it was; the same two workers every epoch (forked anew, each epoch's
    first step waited for them)."""
    rng = np.random.default_rng(0)
    for i in range(12):  # 24x16 noise: 17 crops of 16x16 to choose from, each different
        Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(tmp_path / f"{i:02d}.png")
    dataset = sources.open_dataset(str(tmp_path), image_size=16, center_crop=False)
    cpu = torch.device("cpu")
    here, ahead = batches.Batches(dataset, 4, 0, cpu), batches.Batches(dataset, 4, 0, cpu, num_workers=2)
    state = torch.get_rng_state()
    epochs = {epoch: list(here.epoch(epoch)) for epoch in (0, 1)}
    assert torch.equal(torch.get_rng_state(), state)  # the training draws from it in this process
    workers = []
    for epoch in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(ahead.epoch(epoch), epochs[epoch], strict=True))
        workers.append([w.pid for w in ahead.loader._iterator._workers])
    assert len(workers[0]) == 2 and workers[0] == workers[1]
    resumed = list(ahead.epoch(1, start=1))
    assert len(resumed) == 2 and all(torch.equal(a, b) for a, b in zip(resumed, epochs[1][1:]))
    crops = [{int(i): image for b, index in zip(epochs[e], batches.epoch_batches(12, 4, 0, e)) for i, image in zip(index, b)}
             for e in (0, 1)]  # fmt: skip
    assert sum(not torch.equal(crops[0][i], crops[1][i]) for i in range(12)) >= 10  # drawn afresh each epoch


def test_a_streamed_batch_with_an_unreadable_image_keeps_its_size_and_its_labels(tmp_path):
    """A captured or compiled step needs every batch at the full size: the unreadable image's place
    goes to a readable one of its batch, with that image's label, the same way every time."""
    for i in range(6):
        write_image(tmp_path / "red" / f"{i}.png", color=(200, 20 * i, 0))
        write_image(tmp_path / "blue" / f"{i}.png", color=(0, 20 * i, 200))
    (tmp_path / "blue" / "6.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    dataset = sources.open_dataset(str(tmp_path), image_size=8, class_conditional=True)
    assert dataset.class_names == ["blue", "red"] and len(dataset) == 13
    unreadable = decoding.Unreadable(verbose=False)
    made = batches.Batches(dataset, 3, seed=0, device=torch.device("cpu"), unreadable=unreadable, labels=dataset.labels)
    epoch = list(made.epoch(0))
    assert len(epoch) == 4 and len(unreadable) == 1 and "6.png" in unreadable.messages[0]
    for images, labels in epoch:
        assert images.shape == (3, 3, 8, 8) and labels.shape == (3,)
        assert torch.equal(labels, (images[:, 0, 0, 0] > 100).long())  # red is class 1
    shown = [tuple(image[:, 0, 0].tolist()) for images, _ in epoch for image in images]
    assert len(set(shown)) == 11  # one of the 12 readable images is left out, one shown twice
    again = list(made.epoch(0, start=1))
    assert all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(epoch[1:], again, strict=True))


def test_model_input_is_scaled_and_flipped():
    images = torch.zeros(64, 3, 4, 4, dtype=torch.uint8)
    images[..., 0] = 255  # left column white
    torch.manual_seed(0)
    x = batches.to_model_input(images.clone(), random_flip=True)
    assert x.dtype == torch.float32 and x.min() == -1 and x.max() == 1
    flipped = x[:, 0, 0, -1] == 1
    assert 10 < flipped.sum() < 54  # about half
    assert torch.all(x[~flipped, :, :, 0] == 1)
    unflipped = batches.to_model_input(images.clone(), random_flip=False)
    assert torch.all(unflipped[..., 0] == 1) and torch.all(unflipped[..., 1:] == -1)


def run_args(*argv):
    from ddpm_train import config

    return config.resolve(config.parse_args(["--image_size", "8", "--dataloader_num_workers", "0", *map(str, argv)]))


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for (x, y), (u, v) in zip(a, b):
        assert torch.equal(x, u) and torch.equal(y, v)


def test_preloaded_and_streamed_data_with_an_unreadable_image_are_the_same_batches(tmp_path, monkeypatch):
    """--preload_data may change on resume: with an unreadable image (--on_fault skip) the preloaded dataset
    keeps its index too, as many images and labels (class counts, steps per epoch), and the same batches."""
    monkeypatch.setattr(decoding, "ENCODE_BATCH", 4)  # preloaded in batches of 4: the unreadable image in the second
    for i in range(5):
        write_image(tmp_path / "red" / f"{i}.png", color=(200, 20 * i, 0))
        write_image(tmp_path / "blue" / f"{i}.png", color=(0, 20 * i, 200))
    (tmp_path / "blue" / "3b.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")  # item 4: blue/0, 1, 2, 3, 3b, 4
    loaded = {}
    for flag in ("--preload_data", "--no-preload_data"):
        unreadable = decoding.Unreadable(verbose=False)
        images, labels, _ = data.load_images(run_args("--dataset", tmp_path, "--class_conditional", flag), unreadable)
        loaded[flag] = images, labels, unreadable
    (preloaded, labels, unreadable), (streamed, same_labels, _) = loaded.values()
    assert isinstance(preloaded, decoding.PreloadedImages) and isinstance(streamed, sources.FileImages)
    assert len(preloaded) == len(streamed) == 11 and torch.equal(labels, same_labels)  # train.py: class_counts
    assert len(unreadable) == 1 and preloaded.rows.tolist() == [0, 1, 2, 3, -1, 4, 5, 6, 7, 8, 9]
    image, error = preloaded[4]
    assert image is None and "3b.png" in error and torch.equal(preloaded[5][0], streamed[5][0])
    cpu = torch.device("cpu")
    quiet = dict(unreadable=decoding.Unreadable(verbose=False), labels=labels)
    fast = batches.Batches(preloaded, 3, seed=4, device=cpu, **quiet)
    slow = batches.Batches(streamed, 3, seed=4, device=cpu, **quiet)
    assert fast.preloaded and len(fast) == len(slow) == 11 and fast.batches_per_epoch() == slow.batches_per_epoch() == 3
    moved = batches.Batches(preloaded.to(cpu), 3, seed=4, device=cpu, **quiet)  # train.py's move to the GPU
    assert_same_batches(list(moved.epoch(0)), list(slow.epoch(0)))
    filled = 0
    for epoch in range(3):
        made = list(fast.epoch(epoch))
        assert_same_batches(made, list(slow.epoch(epoch)))
        assert_same_batches(list(fast.epoch(epoch, start=1)), made[1:])
        shown = [tuple(image[:, 0, 0].tolist()) for images, _ in made for image in images]
        filled += len(set(shown)) < len(shown)  # an image shown twice: the unreadable image's place
        for images, batch_labels in made:
            assert torch.equal(batch_labels, (images[:, 0, 0, 0] > 100).long())  # red is class 1
    assert filled  # some epoch drew the unreadable image


def test_a_batch_of_only_unreadable_images_stops_preloaded_data_as_streamed(tmp_path):
    write_image(tmp_path / "a.png")
    write_image(tmp_path / "b.png", color=(0, 0, 200))
    for name in ("c.png", "d.png"):
        (tmp_path / name).write_bytes(b"not an image")
    cpu, outcomes = torch.device("cpu"), []
    for flag in ("--preload_data", "--no-preload_data"):
        unreadable = decoding.Unreadable(verbose=False)
        images, _, _ = data.load_images(run_args("--dataset", tmp_path, flag), unreadable)
        got = []
        with pytest.raises(ConfigError, match=r"every image of a batch was unreadable \(cannot read image .*[cd].png"):
            for epoch in range(2):  # seed 2: epoch 1's second batch is c and d
                got += batches.Batches(images, 2, seed=2, device=cpu, unreadable=unreadable).epoch(epoch)
        outcomes.append(got)
    preloaded, streamed = outcomes
    assert len(preloaded) == len(streamed) == 3 and all(torch.equal(a, b) for a, b in zip(preloaded, streamed))


STREAM_AND_EXIT = """
import sys, torch
sys.path.insert(0, {root!r})
from ddpm_train.data import batches, decoding

class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((3, 8, 8), i, dtype=torch.uint8), None

epoch = batches.Batches(Items(), 4, 0, torch.device("cpu"), num_workers=2).epoch(0)
next(epoch), next(epoch)  # a batch from each worker: both have started (and set their signals)
if {signalled}:  # the decode before training and FID's reference: workers a group's SIGTERM reaches too
    import multiprocessing
    import subprocess
    from ddpm_train.evaluation import metrics
    decoded = decoding._decoding(Items(), 2, False, None, 4, True)
    references = metrics.uint8_batches(Items(), 4, num_workers=2)
    next(decoded), next(references), next(decoded), next(references)
    subprocess.run(["kill", "-TERM", *(str(w.pid) for w in multiprocessing.active_children())], check=True)
    import time
    time.sleep(1)
    assert len(list(decoded)) == 14 and len(list(references)) == 14  # they read on
    decoded, references = decoding._decoding(Items(), 2, False, None, 4, True), metrics.uint8_batches(Items(), 4, num_workers=2)
    next(decoded), next(references)  # and these are left running, to be ended at exit
print("exiting mid-epoch")
"""


@pytest.mark.slow
def test_a_process_that_exits_mid_epoch_ends_its_workers_which_ignore_sigterm(tmp_path):
    """DataLoader workers leave SIGTERM to the main process (workers._ignore_stop_signals); multiprocessing's exit
    sends them SIGTERM and waits: workers.stop_workers, at exit, ends them first, or the process would never end."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", STREAM_AND_EXIT.format(root=str(ROOT), signalled=False)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "exiting mid-epoch", done.stderr[-2000:]


@pytest.mark.slow
def test_the_decoders_before_training_and_fids_reference_read_on_through_a_groups_sigterm(tmp_path):
    """decoding._decoding (preloading, the latent encode) and metrics.uint8_batches (FID's reference, inside
    training's evaluation): their workers, signalled by another process, read on; one left running ends at exit."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", STREAM_AND_EXIT.format(root=str(ROOT), signalled=True)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "exiting mid-epoch", done.stderr[-2000:]


@pytest.mark.slow
def test_a_signal_between_a_workers_fork_and_its_start_is_not_its_death(monkeypatch):
    """A group's SIGTERM that reaches a worker before it has set its signals (an epoch's start) waits, blocked
    since the fork, and is discarded once the worker ignores it; this process's own mask is as it was."""
    import os
    import signal

    ignore = workers._ignore_stop_signals

    def signalled_first(worker_id):
        os.kill(os.getpid(), signal.SIGTERM)
        ignore(worker_id)

    monkeypatch.setattr(workers, "_ignore_stop_signals", signalled_first)
    items = [(torch.full((3, 2, 2), i, dtype=torch.uint8), None) for i in range(8)]
    loader = torch.utils.data.DataLoader(items, batch_size=2, num_workers=2, collate_fn=decoding.collate_decoded)
    assert len(list(workers.iterate(loader))) == 4
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


def test_stop_workers_passes_over_a_loader_read_in_this_process():
    """workers.iterate registers only a loader with workers: one read in this process has none to end."""
    items = [(torch.full((3, 8, 8), i, dtype=torch.uint8), None) for i in range(16)]
    made = batches.Batches(items, 4, 0, torch.device("cpu"), num_workers=0).epoch(0)
    next(made)  # left mid-epoch, as a stopped run leaves it
    workers.stop_workers()
    assert len(list(made)) == 3


@pytest.mark.parametrize("name, dtype, mode", [("deep.png", np.uint16, "I;16"), ("deep.tif", np.int32, "I")])
def test_a_16_bit_image_trains_scaled_to_8_bits_not_clipped_white(tmp_path, name, dtype, mode):
    """A 16-bit grayscale image (a PNG opens as PIL's I;16; a TIFF of 32-bit integers as I) of values 12 to 65,506:
    convert("RGB") alone clipped it at 255, 98% white. Each value v reaches the batch as round(v / 257) in all
    three channels."""
    values = np.linspace(12, 65506, 64).reshape(8, 8)
    path = tmp_path / name
    Image.fromarray(values.astype(dtype)).save(path)
    with Image.open(path) as opened:
        assert opened.mode == mode
    image, error = sources.FileImages([path], pixels.image_transform(8))[0]
    assert error is None and image.dtype == torch.uint8 and image.shape == (3, 8, 8)
    expected = torch.from_numpy(np.rint(values / 257)).to(torch.uint8)
    assert all(torch.equal(channel, expected) for channel in image)


def test_a_new_source_is_its_images_class_and_one_sources_entry(tmp_path, monkeypatch):
    """A kind of --dataset the project has never seen (here "listed:FILE", a text file of image paths) trains, is
    surveyed, keyed and captioned through its Images subclass and one SOURCES entry alone."""
    for name, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
        Image.new("RGB", (12, 8), colour).save(tmp_path / f"{name}.png")
    (tmp_path / "list.txt").write_text("red.png\nblue.png\n")

    class Listed(sources.Images):
        def __init__(self, listing, transform):
            self.paths = [listing.parent / line for line in listing.read_text().split()]
            self.transform = transform

        def __len__(self):
            return len(self.paths)

        def __getitem__(self, i):
            return self.transform(Image.open(self.paths[i])), None

        def identity(self, args):
            return dict(listed=[str(p) for p in self.paths])

        def headers(self):
            return [(str(p), pixels.read_header(p)) for p in self.paths]

        def captions(self, args):
            return [[p.stem] for p in self.paths]

    def opened(source, path, transform, box, options):
        return Listed(Path(source.removeprefix("listed:")), transform)

    listed = sources.Source(lambda source, path: source.startswith("listed:"), opened)
    monkeypatch.setattr(sources, "SOURCES", dict(listed=listed) | sources.SOURCES)
    args = run_args("--dataset", f"listed:{tmp_path / 'list.txt'}", "--no-preload_data")
    images, labels, _ = data.load_images(args, decoding.Unreadable())
    assert isinstance(images, Listed) and labels is None
    assert images[0][0].shape == (3, 8, 8) and images[0][0][0].float().mean() == 255  # red, resized and cropped
    found = data.survey(images, (8, 8))
    assert found.count == found.looked == 2 and found.sizes == (12, 12, 8, 8) and found.modes == {"RGB": 2}
    assert data.run_captions(args) == [["red"], ["blue"]]
    identity, _, count, _ = data.images_to_encode(args, decoding.Unreadable())
    assert count == 2 and identity["listed"][0].endswith("red.png")
