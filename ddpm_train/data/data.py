"""Training images: the built-in shapes, a folder, a saved or a Hub dataset.

Every source yields tensors of shape (C, S, S), already resized and cropped: uint8,
or uint16 for 16-bit grayscale, of the channels the images have (`survey`: 1, 3 or 4). A class-conditional run (--class_conditional) also gets one class
label per image: from the subfolder of a folder in ImageFolder layout, from a
`datasets` column, or, for the built-in shapes, the kind of the one shape each
image then holds (`load_images`). Random flips and the scaling to [-1, 1] happen on whole batches on
the training device (`to_model_input`), so a dataset that is decoded once
(`preload_in_place`) never needs decoding again. Preloaded or streamed, a dataset
gives the same batches: an unreadable image keeps its index, and its place in a
batch goes to a readable image of that batch alike (`Batches`).

Batches come from a per-epoch permutation that depends only on the seed and
the epoch (`epoch_batches`), so a resumed run starts mid-epoch without
decoding the batches it skips.
"""

import atexit
import copy
import hashlib
import logging
import math
import operator
import os
import signal
import sys
import weakref
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import ExifTags, Image, ImageOps
from torchvision.transforms import v2 as T

from ddpm_train.data import captions
from ddpm_train import sizes
from ddpm_train.errors import ConfigError, first_line

try:  # HEIC and HEIF, an iPhone's photos: pillow-heif's opener for PIL (requirements.txt), which turns them upright
    from pillow_heif import register_heif_opener
except ImportError:  # an environment without it (the GPU machines' image): a folder's HEIC files are not looked for
    HEIF_EXTENSIONS = ()
else:
    register_heif_opener()
    HEIF_EXTENSIONS = (".heic", ".heif")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".avif", ".bmp", ".gif", ".tif", ".tiff", *HEIF_EXTENSIONS)
BUILTIN = "shapes"
SHAPE_KINDS = ["circle", "square", "triangle"]  # make_shapes' kind 0, 1, 2
ENCODE_BATCH = 64  # images a batch of decoding (preload) and of a latent run's encoding pass (images_to_encode)


# --- the built-in dataset ----------------------------------------------------


def _hsv_to_rgb(h, s, v):
    """Vectorised HSV -> RGB for tensors in [0, 1]; returns (..., 3)."""
    k = torch.stack([(5 + h * 6) % 6, (3 + h * 6) % 6, (1 + h * 6) % 6], dim=-1)
    return v[..., None] - v[..., None] * s[..., None] * (torch.minimum(k, 4 - k).clamp(0, 1))


def _shape_mask(kind, dx, dy, r):
    """Which subpixels a shape of `kind` (0 circle, 1 square, 2 triangle) of radius `r` covers, at offsets `dx`, `dy`
    from its centre."""
    if kind == 0:
        return dx**2 + dy**2 < r**2
    if kind == 1:
        return torch.maximum(dx.abs(), dy.abs()) < 0.85 * r
    return (dy < 0.5 * r) & (dx.abs() * math.sqrt(3) < dy + r)


def make_shapes(num_images, image_size, seed=0, max_shapes=3, supersample=4, with_labels=False):
    """Coloured circles, squares and triangles on plain backgrounds, as uint8, of `image_size` (sizes: a side
    or "WxH"; a shape's size and place are in units of the shorter side, so a wide image has room for more).

    Deterministic in `seed`. Shapes are rendered at `supersample` times the
    size and averaged down, for clean edges; shape j is drawn over shapes < j.

    With `with_labels`, returns (images, labels): the same images, and a dict
    of what each one holds (k = `max_shapes` slots per image, the first
    `count` of them drawn):

        background      (n, 3) float   RGB in [0, 1]
        count           (n,)   long    shapes drawn, 1..k
        drawn           (n, k) bool    slot j < count
        kind            (n, k) long    0 circle, 1 square, 2 triangle; -1 where not drawn
        color           (n, k, 3) float RGB in [0, 1]
        radius          (n, k) float   size, as a fraction of the image's shorter side
        center          (n, k, 2) float (x, y), in units of the image's shorter side
        pixels          (n, k) float   the shape's area in pixels of the image; 0 where not drawn
        visible_pixels  (n, k) float   of those, the ones not drawn over by a later shape
        shape_map       (n, H, W) int8 the slot of the shape at the centre of each pixel, -1 for
                                       the background
    """
    n, k = num_images, max_shapes
    height, width = sizes.height_width(image_size)
    unit = min(height, width)  # the shorter side
    # One row of uniform numbers per image, so the first m images of a larger
    # set are the m images of a smaller one.
    u = torch.rand(n, 4 + 7 * k, generator=torch.Generator().manual_seed(seed))
    shape_u = u[:, 4:].view(n, k, 7)

    def scale(x, lo, hi):
        return lo + (hi - lo) * x

    background = _hsv_to_rgb(u[:, 0], scale(u[:, 1], 0.1, 0.45), scale(u[:, 2], 0.2, 0.95))
    count = 1 + (u[:, 3] * k).long()  # 1..k shapes
    kind = (shape_u[..., 0] * 3).long()  # 0 circle, 1 square, 2 triangle
    color = _hsv_to_rgb(shape_u[..., 1], scale(shape_u[..., 2], 0.65, 1), scale(shape_u[..., 3], 0.7, 1))
    radius = scale(shape_u[..., 4], 0.12, 0.28)
    cx = radius + (width / unit - 2 * radius) * shape_u[..., 5]
    cy = radius + (height / unit - 2 * radius) * shape_u[..., 6]

    tall, wide, side = height * supersample, width * supersample, unit * supersample
    ys = ((torch.arange(tall) + 0.5) / side).view(1, tall, 1)
    xs = ((torch.arange(wide) + 0.5) / side).view(1, 1, wide)
    out = torch.empty(n, 3, height, width, dtype=torch.uint8)
    pixels, visible = torch.zeros(n, k), torch.zeros(n, k)
    shape_map = torch.empty(n, height, width, dtype=torch.int8) if with_labels else None
    chunk = max(1, 2**22 // (tall * wide))
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        img = background[lo:hi, :, None, None].expand(-1, -1, tall, wide).clone()
        owner = torch.full((hi - lo, tall, wide), -1) if with_labels else None  # the slot each subpixel shows
        for j in range(k):
            mask = torch.zeros(hi - lo, tall, wide, dtype=torch.bool)
            drawn = j < count[lo:hi]
            for shape in range(3):  # each kind's test, on the images whose slot j draws that kind
                rows = ((kind[lo:hi, j] == shape) & drawn).nonzero().flatten()
                if len(rows):
                    mask[rows] = _shape_mask(shape, xs - cx[lo + rows, j, None, None], ys - cy[lo + rows, j, None, None],
                                             radius[lo + rows, j, None, None])  # fmt: skip
            torch.where(mask[:, None], color[lo:hi, j, :, None, None], img, out=img)
            if with_labels:
                owner[mask] = j
                pixels[lo:hi, j] = mask.flatten(1).sum(1) / supersample**2
        img = F.avg_pool2d(img, supersample)
        out[lo:hi] = (img * 255).round().clamp(0, 255).to(torch.uint8)
        if with_labels:
            slots = (owner[:, None] == torch.arange(k).view(1, k, 1, 1)).flatten(2).sum(2)
            visible[lo:hi] = slots / supersample**2
            centre = supersample // 2
            shape_map[lo:hi] = owner[:, centre::supersample, centre::supersample]
    if not with_labels:
        return out
    drawn = torch.arange(k) < count[:, None]
    labels = dict(
        background=background, count=count, drawn=drawn, kind=torch.where(drawn, kind, -1), color=color,
        radius=radius, center=torch.stack([cx, cy], -1), pixels=pixels, visible_pixels=visible,
        shape_map=shape_map,
    )  # fmt: skip
    return out, labels


def builtin_images(num_images, image_size, seed, class_conditional=False):
    """The built-in dataset as (images, labels, class_names).

    Unconditional: `make_shapes`' images (up to 3 shapes each), labels and
    class_names None. Conditional: one shape per image, so that the image has
    one class, its kind (SHAPE_KINDS).
    """
    if not class_conditional:
        return make_shapes(num_images, image_size, seed=seed), None, None
    images, labels = make_shapes(num_images, image_size, seed=seed, max_shapes=1, with_labels=True)
    return images, labels["kind"][:, 0], list(SHAPE_KINDS)


# --- files and Hugging Face datasets ------------------------------------------


# PIL's modes of one 16-bit channel (a 16-bit grayscale PNG or TIFF opens as I;16, or as I).
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
# PIL's modes by what a run makes of them: one channel, or one with an alpha channel; any other mode PIL can
# convert to RGB is colour (CMYK, YCbCr, LAB, HSV and a palette without transparency convert). 32-bit float
# ("F") has no range to scale from, and is refused.
GRAY_MODES = ("1", "L", *SIXTEEN_BIT_MODES)
ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
REFUSED_MODES = ("F",)
EIGHT_BIT_MODES = {1: "L", 3: "RGB", 4: "RGBA"}  # what an image of 1, 3 or 4 channels is converted to at 8 bits


class Pixels(NamedTuple):
    """How a run holds its images: 1 (grayscale), 3 (RGB) or 4 (RGBA) channels of 8 or 16 bits."""

    channels: int = 3
    bits: int = 8

    @property
    def dtype(self):
        return torch.uint16 if self.bits == 16 else torch.uint8

    @property
    def top(self):
        """The largest value a pixel holds: 255 or 65,535."""
        return 2**self.bits - 1


def eight_bit(images):
    """uint8 images as they are; uint16 ones rounded to 8 bits (65,535 -> 255), as grids and FID take them."""
    return images if images.dtype == torch.uint8 else images.float().div(257).round().to(torch.uint8)


def pixels_of(options):
    """The Pixels a run's configuration (train.py's flags, resolved: config.resolve surveys the data) records;
    RGB at 8 bits for a run recorded before they were."""
    return Pixels(options.get("image_channels") or 3, options.get("image_bits") or 8)


def has_alpha(im):
    return im.mode in ALPHA_MODES or (im.mode == "P" and "transparency" in im.info)


def pixels_for(mode, alpha=False):
    """What one image of PIL `mode` is: Pixels(1, 8 or 16), or 3 or 4 channels of 8 bits, or of 16 for a file of 16-bit
    colour (the survey's mode "RGB;16" or "RGBA;16": sixteen_bit_colour)."""
    if mode in GRAY_MODES:
        return Pixels(1, 16 if mode in SIXTEEN_BIT_MODES else 8)
    colour = mode.removesuffix(COLOUR_16)
    return Pixels(4 if alpha or colour in ALPHA_MODES else 3, 16 if mode.endswith(COLOUR_16) else 8)


COLOUR_16 = ";16"  # the survey's mark on a mode PIL opens at 8 bits from a file of 16 bits a channel


def sixteen_bit_colour(im):
    """Whether PIL opened `im` as RGB or RGBA from a file of 16 bits a channel (a 16-bit colour PNG or TIFF): PIL
    reads it at 8 bits, its high bytes."""
    rawmodes = [tile.args if isinstance(tile.args, str) else tile.args[0] for tile in getattr(im, "tile", None) or []]
    return im.mode in ("RGB", "RGBA") and any(";16" in str(rawmode) for rawmode in rawmodes)


def colour_16(path, im):
    """A 16-bit colour file's values, as a uint16 tensor (C, H, W), turned upright (UPRIGHT): a TIFF read by
    tifffile, a PNG decoded by torchvision (PIL keeps 8 bits of each)."""
    if im.format == "TIFF":
        import tifffile

        values = torch.from_numpy(tifffile.imread(path).astype(np.uint16)).permute(2, 0, 1)
    else:
        from torchvision.io import ImageReadMode, decode_png, read_file

        values = decode_png(read_file(str(path)), ImageReadMode.UNCHANGED)
    return UPRIGHT[orientation(im)](values)


def orientation(im):
    """The EXIF orientation of a file PIL opened, 1 to 8 (1: stored upright): a phone stores a photo as its sensor
    read it and tags how to turn it."""
    if im.format == "PNG" and "exif" not in im.info:
        return 1  # PIL's getexif would decode the pixels to look for an eXIf chunk after them, where the PNG spec has none
    value = im.getexif().get(ExifTags.Base.Orientation, 1)
    return value if value in UPRIGHT else 1  # a value out of the standard's range: as stored, as PIL leaves it


# A (C, H, W) tensor turned as PIL's ImageOps.exif_transpose turns an image of each EXIF orientation.
UPRIGHT = {
    1: lambda x: x,
    2: lambda x: x.flip(-1),
    3: lambda x: x.flip(-2, -1),
    4: lambda x: x.flip(-2),
    5: lambda x: x.transpose(-2, -1),
    6: lambda x: x.rot90(-1, (-2, -1)),
    7: lambda x: x.transpose(-2, -1).flip(-2, -1),
    8: lambda x: x.rot90(1, (-2, -1)),
}


def upright(path, im, box=None):
    """A file's image as a viewer shows it, turned by its EXIF orientation as `datasets` turns a Hub set's: a PIL
    image, or a 16-bit colour file's tensor (colour_16). With `box`, the (height, width) it is to cover once turned,
    a JPEG is decoded at the least of 1/8, 1/4 or 1/2 of its size that still covers it (PIL's draft, which scales
    in the DCT before any pixel is made), where the resize that follows would throw the rest away: a phone's photo
    decodes several times faster (BENCHMARKS.md, "Speed on a CPU")."""
    if sixteen_bit_colour(im):
        return colour_16(path, im)
    turn = orientation(im)
    if box is not None:
        im.draft(im.mode, box if turn >= 5 else box[::-1])  # (width, height) as stored: turned, the sides swap
    return ImageOps.exif_transpose(im) if turn != 1 else im


def to_pixels(im, pixels):
    """`im` converted to `pixels`: PIL's L, RGB or RGBA, or for 16 bits a float image ("F") of 0 to 65,535, which
    resizes without rounding to 8 bits. PIL's convert clips a 16-bit image at 255, so that one of values 12 to
    65,506 came out 98% white: a 16-bit image's values are scaled to 8 bits first (65,535 -> 255), and an 8-bit
    one's up to 16 (255 -> 65,535)."""
    if torch.is_tensor(im) or pixels.bits == 16 and pixels.channels > 1:
        return _colour_pixels(im, pixels)
    if im.mode in REFUSED_MODES:
        raise ValueError(f"PIL mode {im.mode} (32-bit float) has no range to scale from: save it as a 16-bit PNG or TIFF")
    sixteen = im.mode in SIXTEEN_BIT_MODES
    if pixels.bits == 16:
        values = np.asarray(im if sixteen else im.convert("L"), dtype=np.float32) * (1 if sixteen else 257)
        return Image.fromarray(np.clip(values, 0, 65535))  # mode F
    if sixteen:
        im = Image.fromarray(np.clip(np.rint(np.asarray(im, dtype=np.float32) / 257), 0, 255).astype(np.uint8))
    if pixels.channels == 4 and im.mode == "P":
        im = im.convert("RGBA")  # a palette's transparency, kept (PIL warns converting it straight to RGB)
    return im.convert(EIGHT_BIT_MODES[pixels.channels])


def _colour_pixels(im, pixels):
    """to_pixels where the image or the run is colour at 16 bits: a float tensor (C, H, W) of 0 to 65,535 (colour_16's
    or a PIL image's, 8 bits scaled up, 16-bit grayscale repeated), alpha dropped or made opaque to fit the run; in an
    8-bit run (a VAE's) a 16-bit colour image rounded to 8 bits (eight_bit), as a PIL image."""
    if pixels.bits == 8:
        return to_pixels(Image.fromarray(eight_bit(im).permute(1, 2, 0).numpy()), pixels)
    if torch.is_tensor(im):
        im = im.float()
    else:
        sixteen = im.mode in SIXTEEN_BIT_MODES
        values = np.asarray(im if sixteen else im.convert("RGBA" if has_alpha(im) else "RGB"), dtype=np.float32)
        im = torch.from_numpy(values * (1 if sixteen else 257))
        im = im[None].expand(3, -1, -1) if sixteen else im.permute(2, 0, 1)
    if pixels.channels == 3:
        return im[:3]
    return im if len(im) == 4 else torch.cat([im, torch.full_like(im[:1], 65535)])


def covering(im, height, width):
    """`im` resized, its aspect ratio kept, to the least size that covers height x width: the side that binds is
    made the box's, the other truncated as torchvision's Resize(side) does (on a square box, exactly that)."""
    h, w = T.functional.get_size(im)  # a PIL image's or a tensor's (16-bit colour)
    size = [height, int(height * w / h)] if w * height >= h * width else [int(width * h / w), width]
    return T.functional.resize(im, size, interpolation=T.InterpolationMode.BILINEAR, antialias=True)


def image_transform(image_size, center_crop=True, pixels=Pixels()):
    """PIL image -> (C, H, W) of `pixels` (uint8 or uint16) at `image_size` (sizes: a side or "WxH"): converted
    (to_pixels), resized to cover H x W (an RGBA image with its alpha premultiplied, as PIL resizes it), cropped."""
    height, width = sizes.height_width(image_size)
    crop = T.CenterCrop((height, width)) if center_crop else T.RandomCrop((height, width))
    return T.Compose(
        [
            T.Lambda(lambda im: to_pixels(im, pixels)),
            T.Lambda(lambda im: covering(im, height, width)),
            crop,
            T.PILToTensor(),
            T.Lambda(lambda x: x if x.dtype == pixels.dtype else x.round().clamp(0, pixels.top).to(pixels.dtype)),
        ]
    )


class FileImages(torch.utils.data.Dataset):
    """Image files decoded on demand; an item is (image, None) or (None, error).

    `labels` (a LongTensor, one per path) and `class_names` are None unless the
    run is class-conditional. `box`: the (height, width) `transform` resizes each image to cover, so that a
    JPEG is decoded no larger than that needs (`upright`).
    """

    def __init__(self, paths, transform, labels=None, class_names=None, box=None):
        self.paths, self.transform = paths, transform
        self.labels, self.class_names, self.box = labels, class_names, box

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        try:
            with Image.open(self.paths[i]) as im:
                return self.transform(upright(self.paths[i], im, self.box)), None
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            return None, f"cannot read image {self.paths[i]} ({e})"


class HubImages(torch.utils.data.Dataset):
    """One image column of a `datasets.Dataset`; an item is (image, None) or (None, error).

    `labels` (a LongTensor, one per row) and `class_names` are None unless the
    run is class-conditional.
    """

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


def open_dataset(
    source, image_size, center_crop=True, config=None, split="train", image_column=None,
    class_conditional=False, label_column=None, pixels=Pixels(),
):  # fmt: skip
    """The torch Dataset behind `--dataset`: a folder, a saved dataset or a Hub id.

    With `class_conditional` its `labels` and `class_names` are filled (see
    `folder_labels` and `column_labels`), or the data's lack of labels is an error.
    (The built-in dataset is generated directly as a tensor: `builtin_images`.)
    """
    transform = image_transform(image_size, center_crop, pixels)
    path = Path(source).expanduser()
    if path.is_dir() and not _is_saved_dataset(path):
        paths = find_images(path)
        if not class_conditional:
            return FileImages(paths, transform, box=sizes.height_width(image_size))
        if label_column:
            raise ConfigError(
                f"--class_conditional {label_column} names a column of a datasets dataset, and {source} is a folder "
                "(its classes are its subfolders): use --class_conditional alone"
            )
        return FileImages(paths, transform, *folder_labels(path, paths), box=sizes.height_width(image_size))
    if path.is_dir():
        import datasets

        dataset = _pick_split(datasets.load_from_disk(str(path)), split, source)
    elif path.exists():
        raise ConfigError(f"--dataset {source} is a file: point it at a folder of images or a saved dataset")
    elif looks_like_path(source):
        raise ConfigError(f"--dataset {source}: no such folder; check the path")
    else:
        dataset = _load_hub(source, config, split)
    column = _image_column(dataset, image_column, source)
    if not class_conditional:
        return HubImages(dataset, column, transform)
    return HubImages(dataset, column, transform, *column_labels(dataset, label_column, source))


def _collate_decoded(items):
    """(stacked images that decoded, errors of those that did not, a bool tensor of which items decoded).

    The last tells which labels go with the images. Runs in the loader's worker
    processes, so it reports instead of raising.
    """
    images = [image for image, _ in items if image is not None]
    errors = [error for _, error in items if error is not None]
    decoded = torch.tensor([image is not None for image, _ in items])
    return (torch.stack(images) if images else None), errors, decoded


class Unreadable:
    """Images that could not be decoded: skipped with a warning that names each, and counted.

    With `strict` the first one stops the run instead. `verbose=False` keeps
    the other processes of a multi-process run quiet (they see the same files).
    """

    def __init__(self, strict=False, verbose=True):
        self.strict, self.verbose = strict, verbose
        self.messages = []

    def report(self, errors):
        for error in errors:
            if self.strict:
                raise ConfigError(f"{error}: remove or replace the file (or skip it: --on_fault skip)")
            if error not in self.messages:
                self.messages.append(error)
                if self.verbose:  # above a progress bar, not inside its line
                    from tqdm.auto import tqdm

                    tqdm.write(f"warning: skipping {error}", file=sys.stderr)

    def __len__(self):
        return len(self.messages)


def check_readable(dataset, unreadable):
    """Decode images until one works: a dataset with no readable image fails before training."""
    for i in range(len(dataset)):
        image, error = dataset[i]
        if image is not None:
            return
        unreadable.report([error])
    raise ConfigError(f"none of the {len(dataset)} images could be read: point --dataset at readable images")


def _decoding(dataset, num_workers, progress, unreadable, batch_size, require_readable):
    """(images that decoded or None, errors, a bool tensor of which items decoded) of each batch of
    `dataset`, in order, the errors reported to `unreadable` (default strict); none readable is an
    error with `require_readable` (decoded_batches)."""
    from tqdm.auto import tqdm

    unreadable = Unreadable(strict=True) if unreadable is None else unreadable
    loader = iterate(torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                                 collate_fn=_collate_decoded, generator=loader_generator(0, 0)))  # fmt: skip
    found = False
    # position 0: a bar left open (a generator an error stopped, its frame kept by the traceback) would push it down
    with tqdm(total=len(dataset), desc="decoding images", unit="img", disable=not progress, leave=False, position=0) as bar:
        for images, errors, decoded in loader:
            unreadable.report(errors)
            found = found or images is not None
            yield images, errors, decoded
            bar.update(len(decoded))
    if not found and require_readable:
        raise ConfigError(f"none of the {len(dataset)} images could be read: point --dataset at readable images")


def decoded_batches(dataset, num_workers=0, progress=False, unreadable=None, labels=None, batch_size=ENCODE_BATCH,
                    require_readable=True):  # fmt: skip
    """Every readable image of `dataset` once, in order: batches (B, C, S, S), or with `labels` (one
    per item of `dataset`) (images, their labels). Unreadable images are passed to `unreadable` (default:
    strict, the first one is an error) and left out; none readable is an error (with `require_readable`,
    else no batch: a part of a dataset may hold only unreadable images)."""
    start = 0
    for images, _, decoded in _decoding(dataset, num_workers, progress, unreadable, batch_size, require_readable):
        if images is not None:
            yield images if labels is None else (images, labels[start : start + len(decoded)][decoded])
        start += len(decoded)


def preload(dataset, num_workers=0, progress=False, unreadable=None):
    """Decode every image once into one tensor (N, C, S, S) (decoded_batches: the unreadable
    left out)."""
    return torch.cat(list(decoded_batches(dataset, num_workers, progress, unreadable)))


class PreloadedImages(torch.utils.data.Dataset):
    """A preloaded dataset some of whose images are unreadable, each item at its index, as a streamed
    dataset has them: `images` (K, C, S, S) holds the K readable images in order, `rows[i]` the row of
    item i, -1 where it is unreadable, and `errors[i]` why. An item is (image, None) or (None, error),
    as FileImages' are; Batches fills the places of the unreadable as it does for a stream (`filled`)."""

    def __init__(self, images, readable, errors):
        self.images, self.errors = images, errors
        self.rows = torch.where(readable, readable.long().cumsum(0) - 1, -1)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = int(self.rows[i])
        return (self.images[row], None) if row >= 0 else (None, self.errors[i])

    @property
    def device(self):
        return self.images.device

    def to(self, device):
        """The same items, their images on `device`."""
        moved = copy.copy(self)
        moved.images = self.images.to(device)
        return moved

    def filled(self, batches):
        """(picks, failure): for each batch of indices the indices it takes, the places of its unreadable
        images filled as Batches fills a streamed batch's (`_refill`), up to the first batch with no
        readable image; `failure` is then the error that batch raises when streamed, else None."""
        picks = []
        for index in batches:
            readable = index[self.rows[index] >= 0]
            if not len(readable):
                error = self.errors[int(index[0])]
                return picks, f"every image of a batch was unreadable ({error}): check the dataset"
            picks.append(readable[_refill(len(readable), len(index))])
        return picks, None


def preload_in_place(dataset, num_workers=0, progress=False, unreadable=None):
    """Decode every image once, each keeping its index: a tensor (N, C, S, S) when all N are
    readable, else a PreloadedImages of the N, which remembers the unreadable (reported to `unreadable`,
    default strict). So a preloaded dataset has the images, the steps per epoch and the batches of the
    same dataset streamed. None readable is an error."""
    parts, readable, errors, start = [], [], {}, 0
    for images, failed, decoded in _decoding(dataset, num_workers, progress, unreadable, ENCODE_BATCH, True):
        if images is not None:
            parts.append(images)
        errors |= dict(zip((start + (~decoded).nonzero()[:, 0]).tolist(), failed))
        readable.append(decoded)
        start += len(decoded)
    images = torch.cat(parts)
    return PreloadedImages(images, torch.cat(readable), errors) if errors else images


# --- batches -------------------------------------------------------------------


def epoch_batches(num_images, batch_size, seed, epoch, rank=0, world_size=1):
    """Index tensors of this process's batches in one epoch (the last partial batch is dropped).

    The order is a permutation that depends only on (seed, epoch), so every
    process agrees on it and a resumed run can start anywhere in the epoch.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(num_images, generator=g)
    per_step = batch_size * world_size
    steps = num_images // per_step
    return [order[s * per_step + rank * batch_size : s * per_step + (rank + 1) * batch_size] for s in range(steps)]


def loader_generator(seed, epoch):
    """A DataLoader's own generator: its workers' base seed is drawn from it, not from torch's global one. A
    loader made without one draws from the global generator, so that streaming, or drawing latents ahead in
    workers, would change the noise every later step draws, where preloading or drawing in process does not:
    with it, every way of reading the data leaves the training noise as it is (a resume may switch them)."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch) + 7)


# The iterators with workers of every DataLoader `iterate` started and stop_workers has not ended.
_WITH_WORKERS = weakref.WeakSet()


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _ignore_stop_signals(worker_id):
    """A DataLoader worker's first act: SIGTERM and SIGINT are the main process's to act on. A cluster that
    preempts a job signals every one of its processes, and a terminal's Ctrl-C goes to the whole process group:
    a worker that died of it made the main process fail at once ("DataLoader worker ... is killed by signal:
    Terminated", raised by torch's SIGCHLD handler) before it had saved the step's checkpoint. The main process ends its workers itself
    (stop_workers); a worker whose main process died notices within seconds and ends (torch's watchdog)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # one that came since the fork (blocked: iterate) is discarded


def iterate(loader):
    """iter(loader) for every DataLoader this project makes: its workers leave SIGTERM and SIGINT to this process
    (_ignore_stop_signals), and stop_workers ends them if they still run then."""
    if not loader.num_workers:
        return iter(loader)
    loader.worker_init_fn = _ignore_stop_signals  # read as the workers start (a persistent loader's: once)
    # Blocked while the workers are forked (they inherit the mask): a signal between a worker's fork and its
    # _ignore_stop_signals would kill it; here it waits until the workers are started, then is this process's.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        iterator = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    _WITH_WORKERS.add(iterator)
    return iterator


def stop_workers():
    """End the workers of every DataLoader iterated through `iterate` (train.main's last act, and any process's at
    exit: they ignore SIGTERM, which multiprocessing's own exit sends them before it waits for them)."""
    for iterator in list(_WITH_WORKERS):
        iterator._shutdown_workers()  # what the iterator does at its end and when deleted
    _WITH_WORKERS.clear()


atexit.register(stop_workers)  # after multiprocessing's exit handler, so run before it


class _IndexBatches(torch.utils.data.Sampler):
    """The index lists of `batches`, each index as (epoch, index): what _EpochDraws and _EpochItems take."""

    def __init__(self, batches, epoch):
        self.batches, self.epoch = batches, epoch

    def __iter__(self):
        return iter([(self.epoch, i) for i in b.tolist()] for b in self.batches)

    def __len__(self):
        return len(self.batches)


class _EpochDraws(torch.utils.data.Dataset):
    """A latents.LatentDataset for DataLoader workers: `__getitems__` draws a whole batch of (epoch, index)
    pairs with its `batch`, set to the epoch in the worker itself, so that a worker's batch is the one this
    process would draw, and one set of workers serves every epoch. A draw reads only its images' rows of the
    cache's array (a forked worker shares the array: nothing copies it)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitems__(self, pairs):
        self.dataset.set_epoch(pairs[0][0])
        return self.dataset.batch(torch.tensor([i for _, i in pairs], dtype=torch.long))

    def __getitem__(self, pair):
        return self.__getitems__([pair])[0]


def _item_seed(seed, epoch, index):
    """The seed of item `index`'s random transform (its random crop) in `epoch`."""
    return ((int(seed) * 1_000_003 + int(epoch)) * 1_000_000_007 + int(index)) & (2**63 - 1)


class _EpochItems(torch.utils.data.Dataset):
    """A streamed dataset for a DataLoader that serves every epoch: items are (epoch, index) pairs, each decoded
    with torch's CPU generator seeded by _item_seed, so that its random crop depends on (seed, epoch, index)
    alone: the same whichever worker (or this process) decodes it and wherever the epoch starts (a resume), and
    the workers keep no random state between epochs. The generator's state is put back after each item: in this
    process the training draws from it."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, pair):
        epoch, index = pair
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(_item_seed(self.seed, epoch, index))  # not CUDA's (torch.manual_seed)
            return self.dataset[index]


def _as_drawn(batch):
    """A DataLoader's collate_fn for _EpochDraws: the batch is drawn whole already."""
    return batch


class Batches:
    """uint8 batches on `device`, from a preloaded tensor (or PreloadedImages) or streamed through a
    DataLoader; or a latent run's float latents, drawn from a latents.LatentDataset for each epoch (with
    `num_workers`, drawn ahead by that many DataLoader workers: the same batches).

    With `labels` (a LongTensor, one per index of `source`: the labels that
    `load_images` returns, which for a streamed dataset are its `labels`) each
    batch is (images, labels), the labels on `device` too. The order of the
    batches is the same with labels or without.
    """

    def __init__(
        self, source, batch_size, seed, device, rank=0, world_size=1, num_workers=0, unreadable=None, labels=None,
    ):  # fmt: skip
        self.source, self.batch_size, self.seed = source, batch_size, seed
        self.device, self.rank, self.world_size, self.num_workers = device, rank, world_size, num_workers
        self.preloaded = isinstance(source, (torch.Tensor, PreloadedImages))
        self.drawn = hasattr(source, "set_epoch") and hasattr(source, "batch")  # latents.LatentDataset
        # Streamed images are decoded every epoch; one that fails is left out, and readable images of its batch
        # take its place (`epoch`; a PreloadedImages' unreadable likewise, reported when it was preloaded).
        self.unreadable = Unreadable() if unreadable is None else unreadable
        if labels is not None and len(labels) != len(source):
            raise ValueError(f"{len(labels)} labels for {len(source)} images")
        # Preloaded labels sit where the images do, so that one index picks both; a captioned run's captions are
        # drawn and looked up on the host (captions.Draws), each batch's rows then moved.
        self.labels = labels.to(source.device) if isinstance(labels, torch.Tensor) and self.preloaded else labels
        self.loader = None  # streamed images' or a latent run's draws' DataLoader, made once for every epoch

    def __len__(self):
        return len(self.source)

    def batches_per_epoch(self):
        return len(self.source) // (self.batch_size * self.world_size)

    def _epoch_loader(self, dataset, collate, batches, epoch):
        """The batches of `dataset` (whose items are (epoch, index) pairs) through the one DataLoader of every
        epoch, made at the first: its workers start once (forked anew each epoch, they kept its first step
        waiting: 0.15-0.3 s a start here) and keep nothing random (each item's draw or crop is its own); pinned
        on CUDA; their base seeds from a generator of its own (loader_generator), not the global one."""
        if self.loader is None:
            self.loader = torch.utils.data.DataLoader(
                dataset, batch_sampler=_IndexBatches([], epoch), num_workers=self.num_workers, collate_fn=collate,
                pin_memory=self.device.type == "cuda", persistent_workers=self.num_workers > 0,
                generator=loader_generator(self.seed, 0),
            )  # fmt: skip
        self.loader.batch_sampler.batches, self.loader.batch_sampler.epoch = batches, epoch
        return iterate(self.loader)

    def _labels(self, indices, epoch):
        """The labels of the images at host `indices`, on the device."""
        if isinstance(self.labels, torch.Tensor):
            return self.labels[indices].to(self.device, non_blocking=True)
        return self.labels.batch(indices, epoch, self.device)  # captions.Draws

    def epoch(self, epoch, start=0):
        """The epoch's batches from batch index `start` on."""
        batches = epoch_batches(len(self.source), self.batch_size, self.seed, epoch, self.rank, self.world_size)
        batches = batches[start:]
        if self.drawn:  # a latent run's: each image's latent drawn for this epoch (latents.LatentDataset)
            if self.num_workers and batches:
                # Drawn ahead by worker processes, batch for batch the same as in this process (_EpochDraws);
                # forked, they share the cache's array.
                draws = self._epoch_loader(_EpochDraws(self.source), _as_drawn, batches, epoch)
            else:
                self.source.set_epoch(epoch)
                draws = map(self.source.batch, batches)
            for index, latents in zip(batches, draws):
                latents = latents.to(self.device, non_blocking=True)
                yield latents if self.labels is None else (latents, self._labels(index, epoch))
            return
        if self.preloaded:
            # picks: the indices each batch takes; rows: where their images lie. A PreloadedImages' unreadable
            # images have no row: their places go to readable images of their batch, as a stream fills them.
            images, picks, rows, failure = self.source, batches, batches, None
            if isinstance(images, PreloadedImages):
                picks, failure = images.filled(batches)
                images, rows = images.images, [images.rows[pick] for pick in picks]
            # The epoch's order goes to the images' device in one copy: a blocking
            # copy per batch would make the host wait for the GPU at every step.
            order = torch.stack(rows).to(images.device) if rows else []
            taken = order  # where the labels lie: at the indices, where a PreloadedImages' rows are not
            if picks is not rows and picks and isinstance(self.labels, torch.Tensor):
                taken = torch.stack(picks).to(images.device)
            for step, index in enumerate(order):
                batch = images[index].to(self.device, non_blocking=True)
                if self.labels is None:
                    yield batch
                elif isinstance(self.labels, torch.Tensor):
                    yield batch, self.labels[taken[step]].to(self.device, non_blocking=True)
                else:
                    yield batch, self._labels(picks[step], epoch)
            if failure is not None:
                raise ConfigError(failure)
            return
        loader = self._epoch_loader(_EpochItems(self.source, self.seed), _collate_decoded, batches, epoch)
        for index, (images, errors, decoded) in zip(batches, loader):
            self.unreadable.report(errors)
            if images is None:
                raise ConfigError(f"every image of a batch was unreadable ({errors[0]}): check the dataset")
            taken = index[decoded]
            if len(images) < len(index):
                # The batch's readable images, from its first on, again in the places of the unreadable: a
                # captured or compiled step's static shapes need the full batch, and what repeats depends
                # only on which images failed, so the same seed still gives the same batches.
                fill = _refill(len(images), len(index))
                images, taken = images[fill], taken[fill]
            images = images.to(self.device, non_blocking=True)
            yield images if self.labels is None else (images, self._labels(taken, epoch))


def _refill(readable, size):
    """Which of a batch's `readable` images (in its order) fill its `size` places: the readable from the
    first on, again in the places of the unreadable. Streamed and preloaded batches both fill so."""
    return torch.arange(size) % readable


def to_model_input(images, random_flip=True):
    """uint8 or uint16 (B, C, S, S) -> float in [-1, 1], each image flipped left-right with probability 1/2.
    A float batch is a latent run's, drawn already (its orientation too: latents.LatentCache.draw): as it is."""
    if images.is_floating_point():
        return images
    x = images.float().div_((65535 if images.dtype == torch.uint16 else 255) / 2).sub_(1)
    if random_flip:
        flip = torch.rand(x.shape[0], device=x.device) < 0.5
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
    return x


# --- what the data flags say ------------------------------------------------------

PRELOAD_MAX_GIB = 8.0  # --preload_data without a size


def random_flips(args):
    """--augment flip: each image flipped left-right at random in every step (step.TrainStep)."""
    return "flip" in args.augment.split(",")


def random_crops(args):
    """--augment crop: a random crop of each image after resizing, drawn every epoch, instead of the centre."""
    return "crop" in args.augment.split(",")


def label_column_of(args):
    """The column --class_conditional LABEL_COLUMN names; None for --class_conditional alone (the labels
    found by type) or an unconditional run."""
    return args.class_conditional if isinstance(args.class_conditional, str) else None


def preload_max_gib(args):
    """The most GiB --preload_data keeps in memory: its MAX_GIB, PRELOAD_MAX_GIB without one, 0 with
    --no-preload_data."""
    return 0.0 if args.preload_data is False else PRELOAD_MAX_GIB if args.preload_data is True else args.preload_data


def load_images(args, unreadable):
    """The training data of the run's flags: (images, labels, class_names).

    images: a uint8 or uint16 tensor (generated or preloaded), a PreloadedImages (preloaded, some images unreadable:
    `preload_in_place`), or a Dataset to stream when preloading is off, needs random crops, or would pass
    --preload_data MAX_GIB. Preloaded or streamed, a dataset has as many items, the unreadable included,
    and the same batches (Batches).
    labels: None, or with --class_conditional a LongTensor of class indices, one per index of images
    (an unreadable image's too).
    class_names: None, or the name of each class index.
    """
    if args.dataset == BUILTIN:
        _check_builtin_labels(args)
        return builtin_images(args.shapes_num_images, args.image_size, args.seed, args.class_conditional)
    dataset = open_run_dataset(args)
    labels, class_names = dataset.labels, dataset.class_names
    pixels = pixels_of(vars(args))
    gib = len(dataset) * pixels.channels * pixels.bits // 8 * sizes.pixels(args.image_size) / 2**30
    if not args.preload_data or random_crops(args) or gib > preload_max_gib(args):
        check_readable(dataset, unreadable)
        return dataset, labels, class_names
    decode = dict(num_workers=args.dataloader_num_workers, progress=unreadable.verbose, unreadable=unreadable)
    return preload_in_place(dataset, **decode), labels, class_names


def _check_builtin_labels(args):
    if args.class_conditional and label_column_of(args):
        raise ConfigError(
            f"--class_conditional {label_column_of(args)} names a column of a datasets dataset; the built-in shapes "
            "are labelled by kind: use --class_conditional alone"
        )


def run_captions(args):
    """Each image's captions (captions.py) in the order of the run's dataset: a folder's metadata.jsonl or .txt
    files, or a dataset's text column (--caption_column). No image is decoded."""
    dataset = open_run_dataset(args)
    if isinstance(dataset, FileImages):
        return captions.folder_captions(Path(args.dataset).expanduser(), dataset.paths)
    return captions.column_captions(dataset.dataset, args.caption_column, args.dataset)


def open_run_dataset(args):
    """open_dataset of the run's flags (not the built-in shapes): nothing decoded yet."""
    return open_dataset(
        args.dataset, args.image_size, not random_crops(args), args.dataset_config, args.split, args.image_column,
        args.class_conditional, label_column_of(args), pixels_of(vars(args)),
    )  # fmt: skip


# --- what the images are -----------------------------------------------------------

SURVEY_ROWS = 256  # the rows of a `datasets` dataset whose images a run looks at; a folder's: every file's header
HEADER_THREADS = 16  # a folder's headers read at once (on a network disk each read waits)


class Survey(NamedTuple):
    """What a run's images are (survey): read from their headers, no image decoded, before training."""

    count: int  # images in the set
    looked: int  # of which were looked at: every one of a folder, the first SURVEY_ROWS of a dataset
    modes: dict  # PIL mode (with "+alpha" where a palette has transparency) -> how many of those looked at
    sizes: tuple  # (least width, most width, least height, most height)
    aspects: tuple  # (least, most) width / height
    pixels: Pixels  # what the run makes of them
    mixed: bool  # images of more than one kind (grayscale, colour, alpha), trained as RGB
    cropped: int  # of those looked at, how many the crop to the run's shape loses more than CROP_LOSS of
    turned: int = 0  # of those looked at, how many files their EXIF orientation turns upright (`upright`)
    upscaled: int = 0  # of those looked at, how many are smaller than the run's shape in either side: scaled up


def _header(im, turn=1):
    """An image's mode, its size as it is shown (turned by a file's EXIF orientation `turn`: a Hub set's images
    arrive turned), and whether it is turned."""
    w, h = im.size
    return im.mode + ("+alpha" if im.mode == "P" and has_alpha(im) else ""), (h, w) if turn >= 5 else (w, h), turn != 1


def _read_header(path):
    try:
        with Image.open(path) as im:
            mark = COLOUR_16 if sixteen_bit_colour(im) else ""  # read before anything that may decode the image
            mode, size, turned = _header(im, orientation(im))
            return mode + mark, size, turned
    except (OSError, ValueError, Image.DecompressionBombError):
        return None  # unreadable: training skips it, or stops at it, and says so


CROP_LOSS = 0.25  # a crop that loses more of most images is said
# A set of fewer images is said to be small: Gu et al. 2023 find runs on a few hundred to a thousand images copying
# most of their samples and on tens of thousands almost none; lucidrains' trainer answered 140 copies "at least 10k".
SMALL_SET = 10_000


def survey(dataset, box=(1, 1)):
    """What `dataset` (a FileImages or HubImages) holds, and the Pixels a run trains it as: all grayscale, one
    channel (16 bits where any image has them); all with alpha, four; anything else, or a mix, RGB. A 32-bit
    float image is refused here, before training, in one line. `box`: the (height, width) the run crops to."""
    if isinstance(dataset, FileImages):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(HEADER_THREADS) as pool:
            headers = list(pool.map(_read_header, dataset.paths))
        names = [str(p) for p in dataset.paths]
    else:
        rows = range(min(len(dataset), SURVEY_ROWS))
        headers, names = [_header(dataset.dataset[i][dataset.column]) for i in rows], [f"row {i}" for i in rows]
    found = [(name, header) for name, header in zip(names, headers) if header is not None]
    for name, (mode, _, _) in found:
        if mode in REFUSED_MODES:
            raise ConfigError(f"image {name} is PIL mode {mode} (32-bit float), which has no range to scale from: "
                              "save it as a 16-bit PNG or TIFF (16-bit grayscale is kept at 16 bits)")  # fmt: skip
    if not found:  # none readable: training says so (check_readable)
        return Survey(len(dataset), 0, {}, (0, 0, 0, 0), (0, 0), Pixels(), False, 0)
    kinds = {pixels_for(mode.removesuffix("+alpha"), mode.endswith("+alpha")) for _, (mode, _, _) in found}
    channels = {kind.channels for kind in kinds}
    pixels = Pixels(channels.pop(), max(kind.bits for kind in kinds)) if len(channels) == 1 else Pixels()
    widths, heights = [w for _, (_, (w, _), _) in found], [h for _, (_, (_, h), _) in found]
    modes = {}
    for _, (mode, _, _) in found:
        modes[mode] = modes.get(mode, 0) + 1
    aspects, aspect = [w / h for w, h in zip(widths, heights)], box[1] / box[0]
    cropped = sum(min(a / aspect, aspect / a) < 1 - CROP_LOSS for a in aspects)  # the share a covering crop keeps
    upscaled = sum(h < box[0] or w < box[1] for w, h in zip(widths, heights))  # the covering resize scales these up
    return Survey(len(dataset), len(headers), modes, (min(widths), max(widths), min(heights), max(heights)),
                  (min(aspects), max(aspects)), pixels, len(channels) > 1, cropped,
                  sum(turned for _, (_, _, turned) in found), upscaled)  # fmt: skip


KIND_WORDS = {1: "grayscale", 3: "RGB", 4: "RGBA"}


def survey_lines(args):
    """What a run prints before training about its images (args.data_survey, config.resolve's): what they are and
    what it makes of them; a note where the set is small (it may copy); a warning where most of them are smaller
    than the run's shape (scaled up), and one where the crop loses more than CROP_LOSS of most of them. None for the
    built-in shapes."""
    if not args.data_survey:
        return []
    found, pixels = Survey(**args.data_survey), pixels_of(vars(args))
    size = sizes.box(args.image_size)
    of = f" (the first {found.looked:,} looked at)" if found.looked < found.count else ""
    modes = ", ".join(f"{n:,} {mode}" for mode, n in sorted(found.modes.items(), key=lambda kv: -kv[1]))
    w0, w1, h0, h1 = found.sizes
    span = lambda lo, hi, fmt="{}": fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"  # noqa: E731
    why = (" (images of more than one kind)" if found.mixed else
           " (a VAE encodes 8-bit RGB)" if Pixels(*found.pixels) != pixels else "")  # fmt: skip
    crop = "cropped at random each epoch" if random_crops(args) else "centre-cropped"
    turned = f" ({found.turned:,} turned upright by their EXIF orientation)" if found.turned else ""
    lines = [f"data: {found.count:,} images{of}: {modes}; width {span(w0, w1)}, height {span(h0, h1)}{turned}, aspect "
             f"(width/height) {span(*found.aspects, fmt='{:.2f}')}; trained as {KIND_WORDS[pixels.channels]} at "
             f"{pixels.bits} bits{why}, each resized to cover {size} (width x height) and {crop}"]  # fmt: skip
    if found.count < SMALL_SET:
        lines.append(f"note: {found.count:,} images is a small set, whose samples may copy its images (Gu et al. 2023): "
                     "the evaluation's copy check counts them, and --augment and --init_from help (docs/copies.md)")  # fmt: skip
    if found.upscaled * 2 > found.looked:
        lines.append(f"warning: {found.upscaled:,} of the {found.looked:,} images looked at are smaller than {size} and "
                     "are scaled up, which adds no detail to learn: train at a size they cover, or on larger images")  # fmt: skip
    if found.cropped * 2 > found.looked:
        lines.append(f"warning: cropping to {size} loses more than {CROP_LOSS:.0%} of {found.cropped:,} of the "
                     f"{found.looked:,} images looked at: to keep them whole, crop or pad them to that shape first")  # fmt: skip
    return lines


# --- a latent run's images --------------------------------------------------------


LABELLING = ("class_conditional", "label_column")  # what images_to_encode's identity holds beyond the images'


def images_to_encode(args, unreadable):
    """A latent run's images, not decoded yet: (identity, images, count, class_names).

    identity: what the images are, for the latent cache's key (latents.cache_key); images: a
    callable, called only to encode them (a cache miss), that returns uint8 batches of every
    readable image once, each batch with its labels, (images, labels), when the run is
    class-conditional (a captioned run's: each image's index in the dataset, which its captions are read by); count: how many images there are (some may prove unreadable).

    `images(start=0, stop=None)` gives those of the dataset's items [start, stop) only (a shard of
    the encoding): when `start` is a multiple of 64, the very batches of 64 that the whole pass gives
    for those items. A range of unreadable images only gives no batch; the whole dataset unreadable
    is an error."""
    labelled = dict(zip(LABELLING, (bool(args.class_conditional), label_column_of(args))))
    if getattr(args, "text_encoder", None):  # a captioned run's latents keep each image's index, its captions' key
        labelled["indexed"] = True
    if args.dataset == BUILTIN:
        _check_builtin_labels(args)
        count = args.shapes_num_images

        def generated(start=0, stop=None):
            start, stop = _item_range(start, stop, count)
            # the first `stop` images of a larger set are those of a smaller one (make_shapes)
            images, labels, _ = builtin_images(stop, args.image_size, args.seed, args.class_conditional)
            images = images[start:].split(ENCODE_BATCH)
            return images if labels is None else zip(images, labels[start:].split(ENCODE_BATCH))

        identity = dict(dataset=BUILTIN, num_images=count, seed=args.seed, **labelled)
        return identity, generated, count, list(SHAPE_KINDS) if args.class_conditional else None
    dataset = open_run_dataset(args)
    identity = dict(dataset_identity(args, dataset), **labelled)

    def decoded(start=0, stop=None):
        start, stop = _item_range(start, stop, len(dataset))
        labels = None if dataset.labels is None else dataset.labels[start:stop]
        if "indexed" in labelled:
            labels = torch.arange(start, stop)
        whole = (start, stop) == (0, len(dataset))
        items = dataset if whole else torch.utils.data.Subset(dataset, range(start, stop))
        return decoded_batches(items, args.dataloader_num_workers, unreadable=unreadable, labels=labels,
                               batch_size=ENCODE_BATCH, require_readable=whole)  # fmt: skip

    return identity, decoded, len(dataset), dataset.class_names


def _item_range(start, stop, count):
    """[start, stop) of `count` items, checked: (start, stop) with stop None read as `count`."""
    bad = ConfigError(f"images [{start}, {stop}) of a dataset of {count}: a range needs 0 <= start < stop <= {count}")
    try:
        start, stop = operator.index(start), count if stop is None else operator.index(stop)
    except TypeError:
        raise bad from None
    if isinstance(start, bool) or isinstance(stop, bool) or not 0 <= start < stop <= count:
        raise bad
    return start, stop


def dataset_identity(args, dataset):
    """What a FileImages or HubImages of the run's --dataset holds, read without decoding an image: for a
    folder its resolved path and a hash of its files' paths (as listed under the folder as given, so a
    symlinked folder or symlinked files hash as their names there), and the sizes and modification times
    of what they point to, and how many files their EXIF orientation turns (the survey's: a cache made before
    they were turned holds them as stored); for a `datasets` dataset its name (a saved one's resolved path),
    configuration, split, image column, rows and the fingerprint `datasets` gives its contents."""
    path = Path(args.dataset).expanduser()
    if isinstance(dataset, FileImages):
        digest = hashlib.sha256()
        for image in dataset.paths:
            try:
                stat = Path(image).stat()  # follows a symlink: what the image is
            except OSError as e:
                raise ConfigError(f"cannot read image {image} ({e}): remove or replace the file") from None
            digest.update(f"{Path(image).relative_to(path)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
        turned = (getattr(args, "data_survey", None) or {}).get("turned")  # an earlier cache of them holds them unturned
        return dict(folder=str(path.resolve()), files=len(dataset.paths), fingerprint=digest.hexdigest()) | (
            dict(turned=turned) if turned else {})
    return dict(dataset=str(path.resolve()) if path.is_dir() else args.dataset, config=args.dataset_config,
                split=args.split, image_column=dataset.column, rows=len(dataset),
                fingerprint=getattr(dataset.dataset, "_fingerprint", None))  # fmt: skip
