"""An image file decoded to a tensor: its mode kept (1, 3 or 4 channels, 8 or 16 bits), turned upright, resized to
cover the run's shape and cropped; and its header read without decoding it."""

from typing import NamedTuple

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps
from torchvision.transforms import v2 as T

from ddpm_train import sizes

try:  # HEIC and HEIF, an iPhone's photos: pillow-heif's opener for PIL (requirements.txt), which turns them upright
    from pillow_heif import register_heif_opener
except ImportError:  # an environment without it (the GPU machines' image): a folder's HEIC files are not looked for
    HEIF_EXTENSIONS = ()
else:
    register_heif_opener()
    HEIF_EXTENSIONS = (".heic", ".heif")


IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".avif", ".bmp", ".gif", ".tif", ".tiff", *HEIF_EXTENSIONS)


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


def header_of(im, turn=1):
    """An image's mode, its size as it is shown (turned by a file's EXIF orientation `turn`: a Hub set's images
    arrive turned), and whether it is turned."""
    w, h = im.size
    return im.mode + ("+alpha" if im.mode == "P" and has_alpha(im) else ""), (h, w) if turn >= 5 else (w, h), turn != 1


def read_header(path):
    try:
        with Image.open(path) as im:
            mark = COLOUR_16 if sixteen_bit_colour(im) else ""  # read before anything that may decode the image
            mode, size, turned = header_of(im, orientation(im))
            return mode + mark, size, turned
    except (OSError, ValueError, Image.DecompressionBombError):
        return None  # unreadable: training skips it, or stops at it, and says so
