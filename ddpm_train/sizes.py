"""Image sizes: a square's side (64) or a width by height ("96x64"), read from a flag, divided and spelled.

A run records a square size as its side, an int, as it always has, and any other as the string "WxH", width
first, as image sizes are written. A network's `sample_size` is diffusers' spelling: the side, or [height,
width]. Every function takes any of the three.
"""

import math
import re

from ddpm_train.errors import ConfigError

LIMITS = (8, 8192)  # each side: a larger one fills any machine's memory in its first batch


def parse(text, flag="--image_size"):
    """A size flag's value: '64' -> 64, '96x64' -> '96x64' (width 96, height 64), '64x64' -> 64."""
    found = re.fullmatch(r"\s*(\d+)\s*(?:[xX×]\s*(\d+)\s*)?", str(text))
    if not found:
        raise ConfigError(f"{flag} {text}: give one side (64) or width x height (96x64)")
    width = int(found[1])
    height = int(found[2] or width)
    if not all(LIMITS[0] <= side <= LIMITS[1] for side in (width, height)):
        raise ConfigError(f"{flag} {text}: each side must be from {LIMITS[0]} to {LIMITS[1]}")
    return of(height, width)


def height_width(size):
    """(height, width) of a size in any of its spellings."""
    if isinstance(size, str):
        width, height = (int(side) for side in size.lower().split("x"))
        return height, width
    if isinstance(size, (list, tuple)):
        return int(size[0]), int(size[1])
    return int(size), int(size)


def of(height, width):
    """The run's spelling: the side of a square, else "WxH"."""
    return int(height) if height == width else f"{int(width)}x{int(height)}"


def divided(size, factor):
    """The size `factor` times smaller (a VAE's latents; the caller checks that `factor` divides it)."""
    height, width = height_width(size)
    return of(height // factor, width // factor)


def times(size, factor):
    """The size `factor` times larger (a VAE's images of its latents)."""
    height, width = height_width(size)
    return of(height * factor, width * factor)


def sample_size(size):
    """A network's sample_size, diffusers' way: the side of a square, else [height, width]."""
    height, width = height_width(size)
    return height if height == width else [height, width]


def pixels(size):
    """height x width."""
    height, width = height_width(size)
    return height * width


def side_of_area(size):
    """The side of the square of the same area, rounded: what `--model auto` picks by."""
    return round(math.sqrt(pixels(size)))


def spelled(size):
    """'64px', or 'width 96, height 64' so that nobody reads the two sides the wrong way round."""
    height, width = height_width(size)
    return f"{width}px" if height == width else f"width {width}, height {height}"


def box(size):
    """'WxH', a square's too (32x32)."""
    height, width = height_width(size)
    return f"{width}x{height}"


def with_channels(size, channels):
    """'WxHxC': a latent's or a network input's shape, as the printed lines spell it (8x8x4)."""
    height, width = height_width(size)
    return f"{width}x{height}x{channels}"
