"""How far to trust the shape score: the score of known image sets against real images.

    python -m bench.trust --image_size 32 --num_images 2048 samples/shapes-small-cpu-eps.png

Real images of another seed (the floor), the same altered (colour channels permuted,
blurred, cut into shuffled patches), uniform noise, and the images of any grid PNG a run
wrote, each scored by shapescore.py's network as metrics.py scores a run (shape FD, KID,
and the shares it recognises as valid, sure and real-looking). docs/sampling.md reads the
table.
"""

import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2.functional import gaussian_blur


from ddpm_train.data import shapes
from ddpm_train.evaluation import metrics
from ddpm_train.evaluation import shapescore
from ddpm_train.errors import ConfigError, OneLineParser, one_line_errors


# --- images to score it on ----------------------------------------------------------------


def noise(num_images, image_size, seed=0):
    """Uniform noise, uint8."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_images, 3, image_size, image_size), dtype=torch.uint8, generator=g)


def blurred(images, sigma):
    """Gaussian blur of `sigma` pixels."""
    size = 2 * math.ceil(3 * sigma) + 1
    return gaussian_blur(images.float(), [size, size], [sigma, sigma]).round().clamp(0, 255).to(torch.uint8)


def shuffled_patches(images, grid=4, seed=0):
    """Each image cut into grid x grid patches, put back in a random order: the same
    pixels and colours, no whole shapes."""
    n, c, s, _ = images.shape
    p = s // grid
    g = torch.Generator().manual_seed(seed)
    patches = images[:, :, : p * grid, : p * grid].unfold(2, p, p).unfold(3, p, p).reshape(n, c, grid * grid, p, p)
    order = torch.stack([torch.randperm(grid * grid, generator=g) for _ in range(n)]).view(n, 1, -1, 1, 1)
    patches = patches.gather(2, order.expand(-1, c, -1, p, p)).view(n, c, grid, grid, p, p)
    out = images.clone()
    out[:, :, : p * grid, : p * grid] = patches.permute(0, 1, 2, 4, 3, 5).reshape(n, c, p * grid, p * grid)
    return out


def grid_images(path, image_size, padding=2):
    """The images of a grid PNG written by sampling.save_grid (train.py's samples/NNNN.png):
    cells of `image_size` with `padding` pixels between them. Every cell is read, so pass
    full grids (an empty cell would read as a black image)."""
    if not Path(path).is_file():
        raise ConfigError(f"{path}: no such file")
    with Image.open(path) as image:
        pixels = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
    step = image_size + padding
    height, width = pixels.shape[1:]
    rows, cols = (height - padding) // step, (width - padding) // step
    if rows < 1 or cols < 1 or (rows * step + padding, cols * step + padding) != (height, width):
        raise ConfigError(
            f"{path} ({width}x{height}) is not a grid of {image_size}px images with {padding}px padding: check --image_size"
        )
    corners = [(padding + r * step, padding + c * step) for r in range(rows) for c in range(cols)]
    return torch.stack([pixels[:, y : y + image_size, x : x + image_size] for y, x in corners])


# --- the trust table ------------------------------------------------------------------


def trust_table(image_size=32, num_images=2048, grids=(), device="cpu", log=print):
    """Rows (name, images, scores) of the score of known sets against `num_images` real images
    (seed 0, as a run's training set): real images of another seed, the same altered, noise,
    and the images of each grid in `grids`, with real images of the grid's size for its floor."""
    grids = {Path(path).name: grid_images(path, image_size) for path in grids}  # a bad file fails before any training
    scorer = shapescore.load_or_train(image_size, device=device, log=log)
    reference = metrics.Reference.from_features(
        metrics.embed(scorer, metrics.uint8_batches(shapes.make_shapes(num_images, image_size, seed=0), 256), device), key={}
    )  # fmt: skip
    other = shapes.make_shapes(num_images, image_size, seed=1)
    sigma = image_size / 32
    sets = [
        ("real, another seed", other),
        ("real, colour channels permuted", other[:, [1, 2, 0]]),
        (f"real, blurred ({sigma:g} px)", blurred(other, sigma)),
        (f"real, blurred ({2 * sigma:g} px)", blurred(other, 2 * sigma)),
        ("real, 4x4 patches shuffled", shuffled_patches(other)),
        ("uniform noise", noise(num_images, image_size)),
    ]
    for name, images in grids.items():
        floor = f"real, {len(images)} images"
        sets += [(floor, other[: len(images)])] if floor not in dict(sets) else []
        sets.append((name, images))
    rows = []
    for name, images in sets:
        features = metrics.embed(scorer, metrics.uint8_batches(images, 256), device)
        result = metrics.score(reference, scorer, scorer.name, features, device)
        with torch.no_grad():
            sure, looks_real = scorer.sure(features), scorer.looks_real(features)
        result |= dict(sure=float(sure.float().mean()), looks_real=float(looks_real.float().mean()))
        rows.append((name, len(images), result))
    return scorer, rows


def format_table(rows):
    lines = ["| images | n | shape FD | KID | valid | sure | looks real |", "|---|---|---|---|---|---|---|"]
    for name, n, r in rows:
        lines.append(
            f"| {name} | {n} | {r['fid']:.2f} | {r['kid_mean']:.4f} ± {r['kid_std']:.4f} | {r['valid_fraction']:.3f} | "
            f"{r['sure']:.3f} | {r['looks_real']:.3f} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    p = OneLineParser(prog="bench.trust", description="The shape score of known image sets: how far to trust it.")
    p.add_argument("grids", nargs="*", help="grid PNGs of a run (train.py's samples/NNNN.png) to score too")
    p.add_argument("--image_size", type=int, default=32, help="image size (the scorer is trained for it once)")
    p.add_argument("--num_images", type=int, default=2048, help="real reference images, and images per altered set")
    p.add_argument("--device", default="cpu", help="where to embed the images (and train the scorer if it is not cached)")
    return p.parse_args(argv)


def main(args):
    """Print the trust table; a bad argument is one line and exit code 2."""
    start = time.perf_counter()
    with one_line_errors("bench.trust"):
        scorer, rows = trust_table(args.image_size, args.num_images, args.grids, args.device)
    info = scorer.info
    print(
        f"{scorer.name} (cached in {shapescore.cache_path(args.image_size)}); trained in {info['total_s']} s on {info['device']} "
        f"with {info['threads']} threads; each set against {args.num_images} real images (seed 0)"
    )
    print(format_table(rows))
    print(f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main(parse_args())
