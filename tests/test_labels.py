"""data.py: class labels for --class_conditional, from class folders, datasets columns and the built-in shapes."""

import hashlib

import pytest
import torch
from PIL import Image

from ddpm_train import config
from ddpm_train.data import data
from ddpm_train.data import batches
from ddpm_train.data import decoding
from ddpm_train.data import sources
from ddpm_train.data import shapes
from ddpm_train.errors import ConfigError

CPU = torch.device("cpu")
UNCONDITIONAL_SHAPES_SHA256 = "83b989f65a271201a4b0e08b752647ab4199a11c78d6e5b5c0d36623b04f33bc"


def run_args(*argv):
    """Resolved flags of a tiny run; no DataLoader worker processes."""
    return config.resolve(config.parse_args(["--image_size", "8", "--dataloader_num_workers", "0", *map(str, argv)]))


def load(*argv):
    """load_images of the flags `argv`, skipping unreadable images: (images, labels, class_names, unreadable)."""
    unreadable = decoding.Unreadable(verbose=False)
    return (*data.load_images(run_args(*argv), unreadable), unreadable)


def write_image(path, red):
    """A plain image whose red channel is `red`: tells which file an image came from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (10, 10), (red, 0, 0)).save(path)


def class_tree(root):
    """dog/ and cat/, 3 images each (one of dog's nested deeper), and a broken file in cat/.

    Returns the class of every readable image by its red value: classes sort by name, cat 0 and dog 1.
    """
    reds = {"dog/0.png": 20, "dog/1.png": 40, "dog/deeper/2.png": 60}
    reds |= {"cat/0.png": 80, "cat/1.png": 100, "cat/2.png": 120}
    for name, red in reds.items():
        write_image(root / name, red)
    (root / "cat" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    return {red: 0 if name.startswith("cat/") else 1 for name, red in reds.items()}


def check_aligned(images, labels, classes):
    assert labels.dtype == torch.long and len(labels) == len(images)
    assert [classes[int(red)] for red in images[:, 0, 0, 0]] == labels.tolist()


def test_class_folders_give_labels_and_an_unreadable_image_keeps_its_place_and_label(tmp_path):
    classes = class_tree(tmp_path)
    images, labels, class_names, unreadable = load("--dataset", tmp_path, "--class_conditional")
    assert class_names == ["cat", "dog"]
    # preloaded as streamed: broken.png (cat's item 3) keeps its index and its label, and has no image
    assert isinstance(images, decoding.PreloadedImages) and len(images) == len(labels) == 7 and len(unreadable) == 1
    readable = images.rows >= 0
    assert readable.tolist() == [True] * 3 + [False] + [True] * 3
    check_aligned(images.images, labels[readable], classes)
    assert labels.bincount().tolist() == [4, 3]  # dog/deeper/2.png is a dog; broken.png is a cat
    unconditional, *_ = load("--dataset", tmp_path / "dog")  # all readable: one tensor
    assert isinstance(unconditional, torch.Tensor) and len(unconditional) == 3


def test_streamed_class_folders_give_aligned_labels_in_batches(tmp_path):
    classes = class_tree(tmp_path)
    dataset, labels, class_names, _ = load("--dataset", tmp_path, "--class_conditional", "--no-preload_data")
    assert isinstance(dataset, sources.FileImages) and len(labels) == len(dataset) == 7 and class_names == ["cat", "dog"]
    unreadable = decoding.Unreadable(verbose=False)
    made = batches.Batches(dataset, 7, seed=0, device=CPU, unreadable=unreadable, labels=labels)
    [(images, batch_labels)] = made.epoch(0)
    # broken.png is left out, its place taken by a readable image of the batch, labels following
    assert len(images) == 7 and len(unreadable) == 1
    check_aligned(images, batch_labels, classes)


def test_unconditional_folder_has_no_labels_and_the_same_images(tmp_path):
    class_tree(tmp_path)
    images, labels, class_names, _ = load("--dataset", tmp_path)
    assert labels is None and class_names is None
    conditional = load("--dataset", tmp_path, "--class_conditional")[0]  # broken.png: both PreloadedImages
    assert torch.equal(images.images, conditional.images) and torch.equal(images.rows, conditional.rows)


def save_dataset(path, column, values, feature):
    """A saved dataset of plain images (red channel 40 * row) and one more column; returns the reds."""
    import datasets

    reds = [40 * i for i in range(len(values))]
    rows = {"image": [Image.new("RGB", (10, 10), (red, 0, 0)) for red in reds], column: values}
    features = datasets.Features({"image": datasets.Image(), column: feature})
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(path))
    return reds


def test_saved_dataset_class_label_column(tmp_path):
    import datasets

    reds = save_dataset(tmp_path, "label", [1, 0, 1, 1], datasets.ClassLabel(names=["plane", "bird"]))
    images, labels, class_names, _ = load("--dataset", tmp_path, "--class_conditional")
    assert class_names == ["plane", "bird"] and labels.tolist() == [1, 0, 1, 1]
    assert images[:, 0, 0, 0].tolist() == reds


@pytest.mark.parametrize(
    "values, kind, names, expected",
    [
        ([7, 3, 7, 10], "int64", ["3", "7", "10"], [1, 0, 1, 2]),  # numeric order, not "10" < "3"
        (["b", "a", "b", "a"], "string", ["a", "b"], [1, 0, 1, 0]),
    ],
)
def test_label_column_of_plain_values_is_numbered_in_sorted_order(tmp_path, values, kind, names, expected):
    import datasets

    save_dataset(tmp_path, "y", values, datasets.Value(kind))
    _, labels, class_names, _ = load("--dataset", tmp_path, "--class_conditional", "y")
    assert class_names == names and labels.tolist() == expected


def test_builtin_shapes_are_labelled_by_their_one_shape():
    images, labels, class_names = shapes.builtin_images(24, 16, seed=3, class_conditional=True)
    _, truth = shapes.make_shapes(24, 16, seed=3, max_shapes=1, with_labels=True)
    assert class_names == ["circle", "square", "triangle"] and labels.dtype == torch.long
    assert torch.all(truth["count"] == 1) and torch.equal(labels, truth["kind"][:, 0])
    assert set(labels.tolist()) == {0, 1, 2}
    assert torch.equal(images, shapes.make_shapes(24, 16, seed=3, max_shapes=1))
    loaded, loaded_labels, _, _ = load("--class_conditional", "--shapes_num_images", 24, "--image_size", 16, "--seed", 3)
    assert torch.equal(loaded, images) and torch.equal(loaded_labels, labels)


def test_builtin_unconditional_images_are_unchanged():
    images, labels, class_names = shapes.builtin_images(6, 16, seed=0)
    assert labels is None and class_names is None
    # make_shapes(6, 16, seed=0) before class labels existed
    assert hashlib.sha256(images.numpy().tobytes()).hexdigest() == UNCONDITIONAL_SHAPES_SHA256
    images, labels, _, _ = load("--shapes_num_images", 6, "--image_size", 16)
    assert labels is None and torch.equal(images, shapes.make_shapes(6, 16, seed=0))


def test_flat_folder_is_an_error_for_a_conditional_run(tmp_path):
    write_image(tmp_path / "a" / "0.png", 10)
    write_image(tmp_path / "b" / "0.png", 20)
    write_image(tmp_path / "loose.png", 30)
    with pytest.raises(ConfigError, match="needs class labels.*loose.png sits directly in.*ImageFolder.*ClassLabel"):
        load("--dataset", tmp_path, "--class_conditional")
    (tmp_path / "loose.png").unlink()
    (tmp_path / "b" / "0.png").rename(tmp_path / "a" / "1.png")
    with pytest.raises(ConfigError, match="at least 2 classes.*only 'a'"):
        load("--dataset", tmp_path, "--class_conditional")


def test_dataset_without_labels_and_a_missing_label_column_are_errors(tmp_path):
    import datasets

    save_dataset(tmp_path, "score", [0.5, 0.25], datasets.Value("float32"))
    with pytest.raises(ConfigError, match="needs class labels.*no ClassLabel column \\(columns: image, score\\)") as e:
        load("--dataset", tmp_path, "--class_conditional")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="no column 'kind' \\(columns: image, score\\); fix --class_conditional LABEL_COLUMN"):
        load("--dataset", tmp_path, "--class_conditional", "kind")
    with pytest.raises(ConfigError, match="column 'score' .* not class labels"):
        load("--dataset", tmp_path, "--class_conditional", "score")


@pytest.mark.parametrize("preloaded", [True, False])
def test_labelled_batches_keep_the_unconditional_order(tmp_path, preloaded):
    for i in range(12):
        write_image(tmp_path / f"c{i % 3}" / f"{i:02d}.png", 20 * i)
    dataset = sources.open_dataset(str(tmp_path), 8, class_conditional=True)
    source = decoding.preload(dataset) if preloaded else dataset
    plain = list(batches.Batches(source, 4, seed=1, device=CPU).epoch(2, start=1))
    labelled = list(batches.Batches(source, 4, seed=1, device=CPU, labels=dataset.labels).epoch(2, start=1))
    assert len(plain) == len(labelled) == 2
    for images, (same, labels) in zip(plain, labelled):
        assert torch.equal(images, same)
        assert labels.tolist() == [int(red) // 20 % 3 for red in images[:, 0, 0, 0]]
    # Two processes: each rank's half of every global batch, its labels still its images'
    ranks = [list(batches.Batches(source, 2, seed=1, device=CPU, rank=r, world_size=2, labels=dataset.labels).epoch(2, start=1))
             for r in (0, 1)]  # fmt: skip
    for images, (zero, one) in zip(plain, zip(*ranks)):
        assert torch.equal(torch.cat([zero[0], one[0]]), images)
        for shard, labels in (zero, one):
            assert labels.tolist() == [int(red) // 20 % 3 for red in shard[:, 0, 0, 0]]


def test_a_macs_hidden_files_and_zip_folder_are_neither_images_nor_classes(tmp_path):
    # a Mac writes "._x.png" beside each x.png on a shared drive and a __MACOSX folder into each zip: not images,
    # as `datasets` leaves them out; a folder the run is pointed at may itself be hidden
    root = tmp_path / ".data" / "set"
    classes = class_tree(root)
    (root / "cat" / "._0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (root / "__MACOSX" / "cat").mkdir(parents=True)
    (root / "__MACOSX" / "cat" / "._0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    write_image(root / "dog" / ".thumbnails" / "2.png", 60)
    images, labels, class_names, unreadable = load("--dataset", root, "--class_conditional")
    assert class_names == ["cat", "dog"] and len(images) == 7 and len(unreadable) == 1  # broken.png alone
    check_aligned(images.images, labels[images.rows >= 0], classes)
