"""What a run's data flags make: its training images (load_images), their captions, the survey printed before
training, a latent run's images to encode, and what the dataset holds (its identity, for the caches' keys).

The pieces live beside this module: shapes.py (the built-in set), pixels.py (a file decoded), sources.py (where
--dataset points), decoding.py (decoding a dataset, preloading), batches.py (each epoch's batches).
"""

import operator
from typing import NamedTuple

import torch

from ddpm_train import sizes
from ddpm_train.data.decoding import ENCODE_BATCH, check_readable, decoded_batches, preload_in_place
from ddpm_train.data.pixels import REFUSED_MODES, Pixels, pixels_for, pixels_of
from ddpm_train.data.shapes import BUILTIN, SHAPE_KINDS, builtin_images
from ddpm_train.data.sources import open_dataset
from ddpm_train.errors import ConfigError


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
    """Each image's captions (captions.py) in the order of the run's dataset, as its source keeps them. No image is
    decoded."""
    return open_run_dataset(args).captions(args)


def open_run_dataset(args):
    """open_dataset of the run's flags (not the built-in shapes): nothing decoded yet."""
    return open_dataset(
        args.dataset, args.image_size, not random_crops(args), args.dataset_config, args.split, args.image_column,
        args.class_conditional, label_column_of(args), pixels_of(vars(args)),
    )  # fmt: skip


# --- what the images are -----------------------------------------------------------

class Survey(NamedTuple):
    """What a run's images are (survey): read from their headers, no image decoded, before training."""

    count: int  # images in the set
    looked: int  # of which were looked at: every one of a folder, the first sources.SURVEY_ROWS of a dataset
    modes: dict  # PIL mode (with "+alpha" where a palette has transparency) -> how many of those looked at
    sizes: tuple  # (least width, most width, least height, most height)
    aspects: tuple  # (least, most) width / height
    pixels: Pixels  # what the run makes of them
    mixed: bool  # images of more than one kind (grayscale, colour, alpha), trained as RGB
    cropped: int  # of those looked at, how many the crop to the run's shape loses more than CROP_LOSS of
    turned: int = 0  # of those looked at, how many files their EXIF orientation turns upright (`upright`)
    upscaled: int = 0  # of those looked at, how many are smaller than the run's shape in either side: scaled up


CROP_LOSS = 0.25  # a crop that loses more of most images is said
# A set of fewer images is said to be small: Gu et al. 2023 find runs on a few hundred to a thousand images copying
# most of their samples and on tens of thousands almost none; lucidrains' trainer answered 140 copies "at least 10k".
SMALL_SET = 10_000


def survey(dataset, box=(1, 1)):
    """What `dataset` (a sources.Images) holds, and the Pixels a run trains it as: all grayscale, one
    channel (16 bits where any image has them); all with alpha, four; anything else, or a mix, RGB. A 32-bit
    float image is refused here, before training, in one line. `box`: the (height, width) the run crops to."""
    headers = dataset.headers()
    found = [(name, header) for name, header in headers if header is not None]
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
    identity = dict(dataset.identity(args), **labelled)

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
