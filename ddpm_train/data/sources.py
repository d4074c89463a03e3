"""Where a run's images come from: one entry in SOURCES for each kind of --dataset (a folder, a saved `datasets`
dataset, a Hub id), each opening an Images dataset that decodes on demand."""

import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from PIL import Image

from ddpm_train import sizes
from ddpm_train.data import captions
from ddpm_train.data.pixels import IMAGE_EXTENSIONS, Pixels, header_of, image_transform, read_header, upright
from ddpm_train.errors import ConfigError, first_line


SURVEY_ROWS = 256  # the rows of a `datasets` dataset whose images a run looks at; a folder's: every file's header
HEADER_THREADS = 16  # a folder's headers read at once (on a network disk each read waits)


class Images(torch.utils.data.Dataset):
    """A source's images, decoded on demand: an item is (image, None) or (None, error). `labels` (a LongTensor, one
    per image) and `class_names` are None unless the run is class-conditional. What the rest of the project asks
    of a source beyond its items, each read without decoding an image:"""

    labels = class_names = None

    def identity(self, args):
        """What the images are, for the caches' keys: a change to them changes it."""
        raise NotImplementedError

    def headers(self):
        """[(name, (mode, (width, height), turned) or None where unreadable)] of the images the survey looks at."""
        raise NotImplementedError

    def captions(self, args):
        """Each image's captions (captions.py), in the order of the items."""
        raise NotImplementedError


class FileImages(Images):
    """Image files under `folder` (`paths`). `box`: the (height, width) `transform` resizes each image to cover, so
    that a JPEG is decoded no larger than that needs (`upright`)."""

    def __init__(self, paths, transform, labels=None, class_names=None, box=None, folder=None):
        self.paths, self.transform, self.folder = paths, transform, folder
        self.labels, self.class_names, self.box = labels, class_names, box

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        try:
            with Image.open(self.paths[i]) as im:
                return self.transform(upright(self.paths[i], im, self.box)), None
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            return None, f"cannot read image {self.paths[i]} ({e})"

    def identity(self, args):
        """The folder's resolved path and a hash of its files' paths (as listed under the folder as given, so a
        symlinked folder or symlinked files hash as their names there), and the sizes and modification times of
        what they point to, and how many files their EXIF orientation turns (the survey's: a cache made before
        they were turned holds them as stored)."""
        digest = hashlib.sha256()
        for image in self.paths:
            try:
                stat = Path(image).stat()  # follows a symlink: what the image is
            except OSError as e:
                raise ConfigError(f"cannot read image {image} ({e}): remove or replace the file") from None
            digest.update(f"{Path(image).relative_to(self.folder)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
        turned = (getattr(args, "data_survey", None) or {}).get("turned")  # an earlier cache of them holds them unturned
        found = dict(folder=str(self.folder.resolve()), files=len(self.paths), fingerprint=digest.hexdigest())
        return found | (dict(turned=turned) if turned else {})

    def headers(self):
        """Every file's."""
        with ThreadPoolExecutor(HEADER_THREADS) as pool:
            return list(zip(map(str, self.paths), pool.map(read_header, self.paths)))

    def captions(self, args):
        """Its metadata.jsonl or each image's .txt file."""
        return captions.folder_captions(self.folder, self.paths)


class HubImages(Images):
    """One image column of a `datasets.Dataset`, saved or from the Hub."""

    def __init__(self, dataset, column, transform, labels=None, class_names=None):
        self.dataset, self.column, self.transform = dataset, column, transform
        self.labels, self.class_names = labels, class_names

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        try:
            return self.transform(self.dataset[i][self.column]), None
        except (OSError, ValueError) as e:
            return None, f"cannot read the image in row {i} ({e})"

    def identity(self, args):
        """Its name (a saved one's resolved path), configuration, split, image column, rows and the fingerprint
        `datasets` gives its contents."""
        path = Path(args.dataset).expanduser()
        return dict(dataset=str(path.resolve()) if path.is_dir() else args.dataset, config=args.dataset_config,
                    split=args.split, image_column=self.column, rows=len(self.dataset),
                    fingerprint=getattr(self.dataset, "_fingerprint", None))  # fmt: skip

    def headers(self):
        """The first SURVEY_ROWS rows'."""
        return [(f"row {i}", header_of(self.dataset[i][self.column])) for i in range(min(len(self), SURVEY_ROWS))]

    def captions(self, args):
        """Its text column (--caption_column)."""
        return captions.column_captions(self.dataset, args.caption_column, args.dataset)


def find_images(folder):
    """The image files under `folder`, at any depth, sorted; as `datasets` reads a folder, a hidden file or folder
    below it (a name that starts with "."; a Mac's "._x.jpg" beside each x.jpg on a shared drive, thumbnails) and a
    folder whose name starts with "__" (a Mac zip's __MACOSX) are left out."""
    def kept(path):
        *folders, name = path.relative_to(folder).parts
        return not name.startswith(".") and not any(part.startswith((".", "__")) for part in folders)

    paths = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file() and kept(p))
    if not paths:
        raise ConfigError(
            f"no images ({', '.join(e[1:] for e in IMAGE_EXTENSIONS)}) found under {folder}: "
            "point --dataset at a folder of images"
        )
    return paths


def _is_saved_dataset(path):
    return any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json", "state.json"))


def looks_like_path(name):
    return name.startswith(("/", "./", "../", "~")) or os.sep + os.sep in name or name.endswith(os.sep)


def _image_column(dataset, requested, source):
    import datasets

    columns = list(dataset.column_names)
    if requested:
        if requested not in columns:
            raise ConfigError(
                f"dataset {source} has no column '{requested}' (columns: {', '.join(columns)}); fix --image_column"
            )
        return requested
    for c in columns:
        if isinstance(dataset.features[c], datasets.Image):
            return c
    for c in ("image", "img"):
        if c in columns:
            return c
    raise ConfigError(f"dataset {source} has no image column (columns: {', '.join(columns)}); pass --image_column")


def _needs_labels(why):
    """The error of a class-conditional run on data that carries no class labels."""
    return ConfigError(
        f"--class_conditional needs class labels, and {why}: put the images of each class in a subfolder of "
        "--dataset (ImageFolder layout), use a datasets dataset with a ClassLabel column or name its label column "
        "(--class_conditional LABEL_COLUMN), "
        "or train on the built-in shapes (leave out --dataset)"
    )


def _check_classes(class_names, source):
    if len(class_names) < 2:
        found = f"only {class_names[0]!r}" if class_names else "none"
        raise ConfigError(f"--class_conditional needs at least 2 classes; {source} has {found}")


def folder_labels(folder, paths):
    """(labels, class_names) of image `paths` in ImageFolder layout: the class of an image is the
    subfolder of `folder` it sits in (at any depth below it), classes sorted by name as
    torchvision's ImageFolder sorts them. Subfolders without images are not classes."""
    tops = [Path(p).relative_to(folder).parts for p in paths]
    loose = [p for p, parts in zip(paths, tops) if len(parts) == 1]
    if loose:
        raise _needs_labels(f"{loose[0]} sits directly in {folder}, in no class folder")
    class_names = sorted({parts[0] for parts in tops})
    _check_classes(class_names, folder)
    index = {name: i for i, name in enumerate(class_names)}
    return torch.tensor([index[parts[0]] for parts in tops], dtype=torch.long), class_names


def column_labels(dataset, requested, source):
    """(labels, class_names) of a `datasets.Dataset`: the column `requested` (--class_conditional LABEL_COLUMN),
    else the one ClassLabel column. A ClassLabel column keeps its own names and numbers; a plain
    column of ints or of strings is numbered in the sorted order of its distinct values."""
    import datasets

    columns = list(dataset.column_names)
    if requested:
        if requested not in columns:
            raise ConfigError(
                f"dataset {source} has no column '{requested}' (columns: {', '.join(columns)}); fix --class_conditional "
                "LABEL_COLUMN"
            )
        column = requested
    else:
        found = [c for c in columns if isinstance(dataset.features[c], datasets.ClassLabel)]
        if not found:
            raise _needs_labels(f"dataset {source} has no ClassLabel column (columns: {', '.join(columns)})")
        if len(found) > 1:
            raise ConfigError(
                f"dataset {source} has several ClassLabel columns ({', '.join(found)}): pick one with "
                "--class_conditional LABEL_COLUMN"
            )
        column = found[0]
    values = list(dataset[column])  # only this column is read: no image is decoded
    feature = dataset.features[column]
    if isinstance(feature, datasets.ClassLabel):
        class_names = list(feature.names)
        labels = torch.tensor(values, dtype=torch.long)
        bad = ((labels < 0) | (labels >= len(class_names))).nonzero()
        if len(bad):
            row = int(bad[0])
            raise ConfigError(
                f"dataset {source}: row {row} of column '{column}' has no class (label {values[row]}, "
                f"{len(class_names)} classes); use a split whose rows all have one (--split)"
            )
    elif values and (all(isinstance(v, int) for v in values) or all(isinstance(v, str) for v in values)):
        distinct = sorted(set(values))
        index = {value: i for i, value in enumerate(distinct)}
        labels = torch.tensor([index[v] for v in values], dtype=torch.long)
        class_names = [str(value) for value in distinct]
    else:
        raise ConfigError(
            f"column '{column}' of dataset {source} holds {feature}, not class labels: "
            "name a column of ints or strings (or a ClassLabel) with --class_conditional LABEL_COLUMN"
        )
    _check_classes(class_names, f"column '{column}' of dataset {source}")
    return labels, class_names


def _pick_split(dataset, split, source):
    import datasets

    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ConfigError(f"dataset {source} has no split '{split}' (splits: {', '.join(dataset)}); fix --split")
        return dataset[split]
    return dataset


def _load_hub(name, config, split):
    try:
        import datasets
    except ImportError:
        raise ConfigError("loading a Hub dataset needs the `datasets` package: pip install datasets") from None
    quiet = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()  # no retry warnings: the one-line error below says it
    hub_logger = logging.getLogger("huggingface_hub")
    hub_level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline, unknown id, bad split, gated: all reported the same way
        raise ConfigError(
            f"could not load dataset '{name}' from the Hugging Face Hub ({first_line(e, 200)}); "
            "check the id and the network, or train on the built-in dataset (leave out --dataset) "
            "or on a local folder (--dataset PATH)"
        ) from None
    finally:
        datasets.logging.set_verbosity(quiet)
        hub_logger.setLevel(hub_level)


def _open_folder(source, path, transform, box, options):
    paths = find_images(path)
    if not options["class_conditional"]:
        return FileImages(paths, transform, box=box, folder=path)
    if options["label_column"]:
        raise ConfigError(
            f"--class_conditional {options['label_column']} names a column of a datasets dataset, and {source} is a "
            "folder (its classes are its subfolders): use --class_conditional alone"
        )
    return FileImages(paths, transform, *folder_labels(path, paths), box=box, folder=path)


def _open_table(dataset, source, transform, options):
    column = _image_column(dataset, options["image_column"], source)
    if not options["class_conditional"]:
        return HubImages(dataset, column, transform)
    return HubImages(dataset, column, transform, *column_labels(dataset, options["label_column"], source))


def _open_saved(source, path, transform, box, options):
    import datasets

    return _open_table(_pick_split(datasets.load_from_disk(str(path)), options["split"], source), source, transform, options)


def _open_hub(source, path, transform, box, options):
    return _open_table(_load_hub(source, options["config"], options["split"]), source, transform, options)


class Source(NamedTuple):
    """A kind of --dataset: `names(source, path)` says whether --dataset `source` (at `path`, expanded) is one;
    `open(source, path, transform, box, options)` opens its Images (options: open_dataset's keywords)."""

    names: Callable
    open: Callable


# The first whose `names` says yes opens --dataset.
SOURCES = {
    "folder": Source(lambda source, path: path.is_dir() and not _is_saved_dataset(path), _open_folder),
    "saved dataset": Source(lambda source, path: path.is_dir(), _open_saved),
    "Hub dataset": Source(lambda source, path: not path.exists() and not looks_like_path(source), _open_hub),
}


def open_dataset(
    source, image_size, center_crop=True, config=None, split="train", image_column=None,
    class_conditional=False, label_column=None, pixels=Pixels(),
):  # fmt: skip
    """The Images behind `--dataset`: those of the first of SOURCES that names it.

    With `class_conditional` its `labels` and `class_names` are filled (see
    `folder_labels` and `column_labels`), or the data's lack of labels is an error.
    (The built-in dataset is generated directly as a tensor: shapes.builtin_images.)
    """
    transform = image_transform(image_size, center_crop, pixels)
    path = Path(source).expanduser()
    options = dict(config=config, split=split, image_column=image_column, class_conditional=class_conditional,
                   label_column=label_column)  # fmt: skip
    for kind in SOURCES.values():
        if kind.names(source, path):
            return kind.open(source, path, transform, sizes.height_width(image_size), options)
    if path.exists():
        raise ConfigError(f"--dataset {source} is a file: point it at a folder of images or a saved dataset")
    raise ConfigError(f"--dataset {source}: no such folder; check the path")
