"""The built-in shapes: circles, squares and triangles drawn anti-aliased, the data a run trains on without --dataset."""

import math

import torch
import torch.nn.functional as F

from ddpm_train import sizes


BUILTIN = "shapes"


SHAPE_KINDS = ["circle", "square", "triangle"]  # make_shapes' kind 0, 1, 2


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
