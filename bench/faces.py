"""Real images for the quality comparisons: scikit-image's 200 LFW crops, and a score for them.

The built-in shapes are drawn by the project; a default tuned on them alone may not hold on
photos. scikit-image's wheel ships `skimage.data.lfw_subset()`: 200 grey 25x25 crops of
Labeled Faces in the Wild, 100 faces then 100 non-faces (background patches of the same
photos). No download, so a CPU without network can train on them and score the result:

    python -m bench.faces write DIR                      # the 200 crops as 32px RGB PNGs, a train.py --dataset folder
    python -m bench.faces write DIR --gray               # the same crops as grayscale ('L') PNGs: a 1-channel run
    python train.py --dataset DIR --image_size 32 ...
    python sample.py RUN --num_images 400 --output GEN   # the run's images
    python -m bench.faces score DIR GEN                  # "faces FD 12.3 (400 images, 20 components)"
    python -m bench.faces trust DIR                      # the score of known image sets: how far to trust it

The score ("faces FD") is the Frechet distance between the real and the generated images
in the space of the real images' first `COMPONENTS` principal components (grey, 32px,
each image and its mirror image, since train.py flips at random). Inception would need a
download, and a network trained on 200 images (the shape score's way) would learn little
that PCA does not: on images this small, the leading components are the light, the pose
and the face's outline. What it cannot see: detail finer than those components (the
`trust` table shows how blur and noise move it), and copying: a run that reproduces its
200 training images scores near the floor, so compare runs at the same training budget
only. Scores from different image counts differ by their bias; compare equal counts.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from scipy import linalg

NOT_SAMPLES = ("grid.png", "copies.png")  # the pictures sample.py writes beside its samples
SIDE = 32  # the training size: the UNet presets halve it to 4
COMPONENTS = 20  # principal components kept; 400 real vectors estimate their covariance well


def lfw_subset():
    """The 200 crops as float [0, 1], (200, 25, 25); needs scikit-image (`pip install scikit-image`)."""
    try:
        from skimage.data import lfw_subset as load
    except ImportError as e:
        raise SystemExit("error: bench.faces needs scikit-image: pip install scikit-image") from e
    return np.asarray(load(), dtype=np.float64)


def to_grey_images(crops, side=SIDE):
    """Grey crops in [0, 1] as grayscale ('L') PIL images of `side` px (bicubic)."""
    return [
        Image.fromarray(np.round(crop * 255).clip(0, 255).astype(np.uint8)).resize((side, side), Image.BICUBIC)
        for crop in crops
    ]


def to_rgb_images(crops, side=SIDE):
    """Grey crops in [0, 1] as RGB PIL images of `side` px (bicubic): to_grey_images' pixels in
    three equal channels."""
    return [grey.convert("RGB") for grey in to_grey_images(crops, side)]


def write(folder, crops=None, gray=False):
    """The crops as PNGs in `folder` (a train.py --dataset folder); returns how many. RGB files
    (a run trains 3 channels on three copies of the grey), or with `gray` the same pixels as
    'L' files (a run trains 1 channel: docs/images.md)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    crops = lfw_subset() if crops is None else crops
    images = to_grey_images(crops) if gray else to_rgb_images(crops)
    for i, image in enumerate(images):
        image.save(folder / f"{i:03d}.png")
    return len(images)


def read_grey(folder, side=SIDE):
    """Every PNG/JPEG in `folder` as grey float vectors in [0, 1], (n, side*side), in name order."""
    paths = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg") and p.name not in NOT_SAMPLES)
    if not paths:
        raise SystemExit(f"error: no PNG or JPEG images in {folder}: give a folder of images (sample.py --output)")
    return np.stack([grey_vector(Image.open(p), side) for p in paths])


def grey_vector(image, side=SIDE):
    image = image.convert("L")
    if image.size != (side, side):
        image = image.resize((side, side), Image.BICUBIC)
    return np.asarray(image, dtype=np.float64).reshape(-1) / 255.0


def to_vectors(crops, side=SIDE):
    """Crops in [0, 1] as the grey vectors read_grey gives for their written PNGs."""
    return np.stack([grey_vector(image, side) for image in to_rgb_images(crops, side)])


def with_mirrors(vectors, side=SIDE):
    """Each image and its left-right mirror image."""
    mirrored = vectors.reshape(-1, side, side)[:, :, ::-1].reshape(len(vectors), -1)
    return np.concatenate([vectors, mirrored])


def random_cnn(width=16, seed=0):
    """A fixed, untrained three-layer CNN (He-initialised from `seed`): vectors (n, SIDE*SIDE) ->
    each layer's channel means, (n, 3 * width). Random convolutions respond to edges, grain
    and texture, which the leading principal components do not see (Naeem et al. 2020 use
    random embeddings for FD-type scores)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(width, c, 3, 3, generator=g) * (2 / (c * 9)) ** 0.5 for c in (1, width, width)]

    def features(vectors):
        x = (torch.tensor(vectors, dtype=torch.float32).view(-1, 1, SIDE, SIDE) - 0.5) / 0.25
        out = []
        with torch.no_grad():
            for i, w in enumerate(weights):
                if i:
                    x = torch.nn.functional.avg_pool2d(x, 2)
                x = torch.relu(torch.nn.functional.conv2d(torch.nn.functional.pad(x, (1, 1, 1, 1), mode="reflect"), w))
                out.append(x.mean((2, 3)))
        return torch.cat(out, 1).double().numpy()

    return features


class Scorer:
    """Features of the real images (with their mirror images): their first principal
    components (the light, pose and outline) and a fixed random CNN's channel means (edges,
    grain, texture), each standardised by the real images' spread; and the real statistics."""

    def __init__(self, real, components=COMPONENTS, side=SIDE):
        data = with_mirrors(real, side)
        if components >= len(data):
            raise SystemExit(f"error: {components} components need more than {len(data)} real images: use fewer")
        self.mean = data.mean(0)
        _, _, vt = np.linalg.svd(data - self.mean, full_matrices=False)
        self.basis = vt[:components]
        self.cnn = random_cnn()
        raw = self._raw(data)
        self.centre, self.scale = raw.mean(0), raw.std(0) + 1e-8
        self.real_mu, self.real_cov = self.statistics(data)

    def _raw(self, vectors):
        return np.concatenate([(vectors - self.mean) @ self.basis.T, self.cnn(vectors)], 1)

    def features(self, vectors):
        return (self._raw(vectors) - self.centre) / self.scale

    def statistics(self, vectors):
        f = self.features(vectors)
        return f.mean(0), np.cov(f, rowvar=False)

    def fd(self, vectors):
        """Frechet distance between the real images' features and those of `vectors`."""
        mu, cov = self.statistics(vectors)
        return frechet(self.real_mu, self.real_cov, mu, cov)


def frechet(mu1, cov1, mu2, cov2):
    root = linalg.sqrtm(cov1 @ cov2)
    return float(((mu1 - mu2) ** 2).sum() + np.trace(cov1 + cov2 - 2 * np.real(root)))


def blur(vectors, sigma, side=SIDE):
    from scipy.ndimage import gaussian_filter

    images = vectors.reshape(-1, side, side)
    return np.stack([gaussian_filter(x, sigma, mode="reflect") for x in images]).reshape(len(vectors), -1)


def trust_table(real, seed=0):
    """(name, FD) of known sets against the real images, all at the real images' count with mirrors."""
    rng = np.random.default_rng(seed)
    scorer = Scorer(real)
    n = 2 * len(real)
    both = with_mirrors(real)
    half = rng.permutation(len(real))
    rows = [
        ("the real images (the floor: 0 by construction)", scorer.fd(both)),
        ("half of them, with mirrors (sampling error at half the count)", scorer.fd(with_mirrors(real[half[: len(real) // 2]]))),
        ("faces only (the first 100), with mirrors", scorer.fd(with_mirrors(real[:100]))),
        ("blurred, sigma 0.5 px", scorer.fd(blur(both, 0.5))),
        ("blurred, sigma 1 px", scorer.fd(blur(both, 1.0))),
        ("blurred, sigma 2 px", scorer.fd(blur(both, 2.0))),
        ("grain: Gaussian noise of std 0.05", scorer.fd(np.clip(both + rng.normal(0, 0.05, both.shape), 0, 1))),
        ("grain: Gaussian noise of std 0.15", scorer.fd(np.clip(both + rng.normal(0, 0.15, both.shape), 0, 1))),
        ("contrast halved about the mean grey", scorer.fd(0.5 * both + 0.5 * both.mean())),
        ("the mean image, every time", scorer.fd(np.repeat(both.mean(0, keepdims=True), n, 0) + rng.normal(0, 1e-3, both.shape))),
        ("uniform noise", scorer.fd(rng.uniform(0, 1, both.shape))),
    ]
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.faces", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write the 200 crops as 32px RGB PNGs")
    w.add_argument("folder")
    w.add_argument("--gray", action="store_true", help="write them as grayscale ('L') PNGs instead: the same pixels, one channel")
    s = sub.add_parser("score", help="faces FD of a folder of generated images")
    s.add_argument("real", help="the folder `write` made")
    s.add_argument("generated", help="sample.py --output's folder")
    t = sub.add_parser("trust", help="the score of known image sets")
    t.add_argument("real", help="the folder `write` made")
    args = parser.parse_args(argv)
    if args.command == "write":
        kind = "grayscale " if args.gray else ""
        print(f"wrote {write(args.folder, gray=args.gray)} {kind}images of {SIDE}px to {args.folder}")
    elif args.command == "score":
        real, generated = read_grey(args.real), read_grey(args.generated)
        print(f"faces FD {Scorer(real).fd(generated):.2f} ({len(generated)} images, {COMPONENTS} components)")
    else:
        for name, value in trust_table(read_grey(args.real)):
            print(f"{value:9.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
