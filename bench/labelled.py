"""A labelled real set for class-conditional runs, offline, and the class match and photos FD that score them.

scikit-image's wheel ships a few photos (`skimage.data`). Each of `PHOTOS` is one class; its
images are 32px crops of the photo scaled to a shorter side of `SHORT` px (a crop shows about
a quarter of the photo's height: an eye of the cat, a coin, a patch of bricks). The photo is
cut into a grid of blocks of about 40 px; a third of them, spread over the photo, are held
apart, and every crop lies inside one block, so no pixel of a held-apart crop is in a
training crop. No download:

    python -m bench.labelled write DIR              # DIR/train (a train.py --dataset folder), DIR/held (never trained on)
    python train.py --dataset DIR/train --class_conditional --image_size 32 ...
    python sample.py RUN --num_images 300 --guidance_scale 2 --output GEN   # the classes spread in runs
    python -m bench.labelled score DIR GEN --run RUN   # "class match 71.3% ± 2.6 (SE, 300 images, ...); photos FD 9.1"
    python -m bench.labelled trust DIR              # the scores of known image sets: how far to trust them
    python -m bench.labelled captions DIR           # DIR/train/metadata.jsonl from the class names, and DIR/clip
    python train.py --dataset DIR/train --text_encoder DIR/clip --image_size 32 ...    # from the captions
    python sample.py RUN --prompt "a photo of a cat" --num_images 30 --output GEN/cat  # ... a folder a class

The main score ("class match") is the share of generated images that a classifier, fitted on
the held-apart crops alone, puts in the class they were asked for. The classifier is a
multinomial logistic regression on fixed features: each colour channel's mean and spread, a
coarse colour histogram, and a fixed random three-layer CNN's channel means and spreads
(edges, grain, texture), each image with its mirror image, since train.py flips at random,
and with a grainy and a blurred copy, so that it reads which photo an image shows more than
how clean it is. It fits in seconds on a CPU and has never seen a training crop, so a run
that copies its training images gets no more than the training crops' own score: the
ceiling of `trust`.

A generated image's asked class comes from its folder (GEN/CLASS/*.png) or, for a flat folder
of sample.py's 000000.png ..., from the run (--run) and sample.py's --class_labels, as
sample.py labelled image i. Beside the match stand its binomial standard error and the match
that images blind to their labels would get (the sum over classes of how often a class is
asked for times how often it is seen): read a run against that, not against zero.
What the match cannot see: sharpness beyond what sets the classes apart, and variety within
a class (a run that draws one image per class scores 100%). The second score, "photos FD",
sees those: bench/faces.py's faces FD with the training crops as the real images (grey, so
blind to colour, which the match sees). Compare FDs at equal image counts only.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import sample
from bench import faces
from ddpm_train.training.rundir import RunDir

SIDE = 32  # the training size
SHORT = 128  # each photo's shorter side before cropping: a crop is a quarter of it
BLOCK = 40  # about this many px a block of the split (a crop lies inside one)
# class name -> skimage.data's loader: ten photos that look unlike one another, six in colour
PHOTOS = {
    "astronaut": "astronaut", "brick": "brick", "camera": "camera", "cat": "chelsea", "coffee": "coffee",
    "coins": "coins", "grass": "grass", "hubble": "hubble_deep_field", "ihc": "immunohistochemistry",
    "rocket": "rocket",
}  # fmt: skip
TRAIN_PER_CLASS = 200  # 2,000 training images in all, about the bare run's 2,048 shapes
HELD_PER_CLASS = 200  # the classifier's images
SEED = 0
EXTENSIONS = (".png", ".jpg", ".jpeg")


def photo(name):
    """The photo of class `name` as RGB uint8 (H, W, 3), its shorter side SHORT px (Lanczos)."""
    try:
        from skimage import data
    except ImportError as e:
        raise SystemExit("error: bench.labelled needs scikit-image: pip install scikit-image") from e
    image = Image.fromarray(np.asarray(getattr(data, PHOTOS[name])())).convert("RGB")
    w, h = image.size
    scale = SHORT / min(w, h)
    return np.asarray(image.resize((round(w * scale), round(h * scale)), Image.LANCZOS))


def blocks(height, width, held):
    """(y0, y1, x0, x1) of the photo's blocks in one split: a grid of about BLOCK px, block (i, j)
    held apart where (i + j) % 3 == 1, so that both splits reach every part of the photo."""
    ys, xs = (np.linspace(0, n, max(3, n // BLOCK) + 1).round().astype(int) for n in (height, width))
    return [(ys[i], ys[i + 1], xs[j], xs[j + 1]) for i in range(len(ys) - 1) for j in range(len(xs) - 1)
            if ((i + j) % 3 == 1) == held]  # fmt: skip


def crops(image, held, count, rng):
    """`count` random SIDE px crops of `image`, each inside one block of the split; (count, SIDE, SIDE, 3)."""
    parts = blocks(*image.shape[:2], held)
    out = []
    for _ in range(count):
        y0, y1, x0, x1 = parts[rng.integers(len(parts))]
        y, x = rng.integers(y0, y1 - SIDE + 1), rng.integers(x0, x1 - SIDE + 1)
        out.append(image[y : y + SIDE, x : x + SIDE])
    return np.stack(out)


def build(train_per_class=TRAIN_PER_CLASS, held_per_class=HELD_PER_CLASS, seed=SEED):
    """{"train": ..., "held": ...}, each (images (n, SIDE, SIDE, 3) uint8, labels (n,)), and the class names."""
    rng = np.random.default_rng(seed)
    names = sorted(PHOTOS)  # ImageFolder's order
    images = {"train": [], "held": []}
    for name in names:
        picture = photo(name)
        images["train"].append(crops(picture, False, train_per_class, rng))
        images["held"].append(crops(picture, True, held_per_class, rng))
    out = {}
    for split, parts in images.items():
        out[split] = (np.concatenate(parts), np.repeat(np.arange(len(names)), [len(p) for p in parts]))
    return out, names


def write(folder, **kwargs):
    """The set as PNGs: folder/train/CLASS/NNN.png (train.py --dataset folder/train --class_conditional)
    and folder/held/CLASS/NNN.png (the classifier's, never trained on). Returns {split: count}."""
    sets, names = build(**kwargs)
    for split, (images, labels) in sets.items():
        for i, (image, label) in enumerate(zip(images, labels)):
            path = Path(folder) / split / names[label] / f"{i:04d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(path)
    return {split: len(labels) for split, (_, labels) in sets.items()}


# The captions of issue 77's measurement: each crop's class name in these templates, one drawn each step.
TEMPLATES = ("a photo of a {}", "a close-up photo of the {}", "a picture of {}", "{}")


def write_captions(folder):
    """folder/train/metadata.jsonl (HF ImageFolder's layout, docs/text.md): each training crop captioned with its
    class name in every one of TEMPLATES. Returns the number of images captioned."""
    train = Path(folder) / "train"
    paths = sorted(train.glob("*/*.png"))
    rows = [json.dumps(dict(file_name=str(p.relative_to(train)), text=[t.format(p.parent.name) for t in TEMPLATES]))
            for p in paths]  # fmt: skip
    (train / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return len(rows)


def write_random_clip(folder, seed=0, positions=77):
    """A randomly initialised 2-layer CLIP text model (width 32, CLIP's 77 positions) and a tokenizer of single
    letters, digits and punctuation (a token a character), as transformers saves them: a --text_encoder for a machine
    with no encoder to download (its embeddings tell captions apart, and know no meaning)."""
    import string

    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in string.ascii_lowercase + string.digits + string.punctuation:
        vocab[c], vocab[c + "</w>"] = len(vocab), len(vocab) + 1
    CLIPTokenizer(vocab=vocab, merges=[], model_max_length=positions).save_pretrained(folder)
    torch.manual_seed(seed)
    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=positions, bos_token_id=0, eos_token_id=1,
                            pad_token_id=1)  # fmt: skip
    CLIPTextModel(config).save_pretrained(folder)
    return Path(folder)


def read_image(path):
    image = Image.open(path).convert("RGB")
    if image.size != (SIDE, SIDE):
        image = image.resize((SIDE, SIDE), Image.BICUBIC)
    return np.asarray(image)


def _images(paths):
    return np.stack([read_image(p) for p in paths]) if paths else np.zeros((0, SIDE, SIDE, 3), np.uint8)


def read_classes(folder):
    """A folder of class folders (write's train/ or held/, or generated images sorted by class):
    (images (n, SIDE, SIDE, 3) uint8, class names (n,)), in name order."""
    paths = sorted(p for p in Path(folder).glob("*/*") if p.suffix.lower() in EXTENSIONS and p.name not in faces.NOT_SAMPLES)
    return _images(paths), np.array([p.parent.name for p in paths])


def read_split(folder, split):
    """write's `split` ("train" or "held") of `folder`: (images, labels (n,), class names)."""
    root = Path(folder) / split
    if not root.is_dir():
        raise SystemExit(f"error: {folder} has no {split}/ folder: make the set with python -m bench.labelled write {folder}")
    images, classes = read_classes(root)
    names = sorted(set(classes))
    if len(names) < 2:
        raise SystemExit(f"error: {root} holds {len(names)} class folder(s): make the set with python -m bench.labelled write")
    return images, np.array([names.index(c) for c in classes]), names


def read_generated(folder, names, run=None, class_labels=None):
    """Generated images and the class each was asked for, as indices into `names` (the set's classes).

    Class folders (GEN/CLASS/*.png) say the class by name. A flat folder (sample.py's 000000.png,
    ...) needs the run it was sampled from: image i's class is what sample.py gave image i for
    --class_labels `class_labels` (None: the classes spread in runs), named by the run's class_names."""
    folder = Path(folder)
    flat = sorted(p for p in folder.glob("*") if p.suffix.lower() in EXTENSIONS and p.name not in faces.NOT_SAMPLES)
    if not flat:
        images, classes = read_classes(folder)
        if not len(images):
            raise SystemExit(f"error: no PNG or JPEG images in {folder}: give sample.py --output's folder, or one of class folders")
        unknown = sorted(set(classes) - set(names))
        if unknown:
            raise SystemExit(f"error: {folder}/{unknown[0]} is no class of the set (its classes: {', '.join(names)})")
        return images, np.array([names.index(c) for c in classes])
    if run is None:
        raise SystemExit(f"error: {folder} holds images without class folders: say which run sampled them (--run RUN), "
                         "so that each image's class is known")  # fmt: skip
    config = RunDir(run).config or {}
    run_names = config.get("class_names")
    if not run_names:
        raise SystemExit(f"error: {run} has no class_names in its train_config.json: score a class-conditional run")
    unknown = [n for n in run_names if n not in names]
    if unknown:
        raise SystemExit(f"error: the run's class {unknown[0]!r} is no class of the set (its classes: {', '.join(names)})")
    asked = sample.class_labels_for(class_labels, config, len(run_names), len(flat), 0, False)
    return _images(flat), np.array([names.index(run_names[int(i)]) for i in asked])


# --- the classifier ---------------------------------------------------------------


def random_cnn(width=32, seed=0):
    """A fixed, untrained three-layer CNN (He-initialised from `seed`) on RGB in [-1, 1]: each
    layer's channel means and spreads, (n, 6 * width)."""
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(width, c, 3, 3, generator=g) * (2 / (c * 9)) ** 0.5 for c in (3, width, width)]

    def features(x):
        out = []
        for i, w in enumerate(weights):
            if i:
                x = F.avg_pool2d(x, 2)
            x = torch.relu(F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), w))
            out += [x.mean((2, 3)), x.std((2, 3))]
        return torch.cat(out, 1)

    return features


def colour_histogram(x, levels=4):
    """The share of pixels in each of levels^3 RGB bins; x in [-1, 1]."""
    q = ((x + 1) / 2 * levels).clamp(0, levels - 1e-3).long()
    bins = ((q[:, 0] * levels + q[:, 1]) * levels + q[:, 2]).flatten(1)
    bins = bins + levels**3 * torch.arange(len(x)).view(-1, 1)  # image i's bins at i * levels^3
    counts = torch.bincount(bins.flatten(), minlength=len(x) * levels**3).view(len(x), levels**3)
    return counts.float() / bins.shape[1]


class Classifier:
    """Logistic regression (multinomial, L2 `l2`, L-BFGS) on fixed features of the `images`
    (uint8 (n, SIDE, SIDE, 3)) labelled `labels`. With `augment` it also fits a grainy copy
    (Gaussian noise of std up to 0.2) and a blurred copy (sigma 0.3 to 1.5 px) of each image,
    so that it reads which photo an image shows rather than how clean it is (the distance
    scores see that); and every image with its mirror image, as train.py flips at random."""

    def __init__(self, images, labels, num_classes, l2=1e-3, augment=True, seed=0):
        self.num_classes = num_classes
        self.cnn = random_cnn(seed=seed)
        labels = np.asarray(labels)
        if augment:
            rng = np.random.default_rng(seed)
            images, labels = np.concatenate([images, grain(images, rng.uniform(0, 0.2, len(images)), rng),
                                             blur(images, rng.uniform(0.3, 1.5, len(images)))]), np.tile(labels, 3)  # fmt: skip
        x = self._tensor(images)
        feats = torch.cat([self._raw(x), self._raw(x.flip(3))])
        y = torch.as_tensor(np.concatenate([labels, labels]), dtype=torch.long)
        self.centre, self.scale = feats.mean(0), feats.std(0) + 1e-6
        z = (feats - self.centre) / self.scale
        self.weight = torch.zeros(z.shape[1], num_classes, requires_grad=True)
        self.bias = torch.zeros(num_classes, requires_grad=True)
        optimizer = torch.optim.LBFGS([self.weight, self.bias], max_iter=200, line_search_fn="strong_wolfe")

        def loss():
            optimizer.zero_grad()
            value = F.cross_entropy(z @ self.weight + self.bias, y) + l2 * self.weight.pow(2).sum()
            value.backward()
            return value

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a small problem: two threads wait on each other (4x slower on a busy 2-core CPU)
        try:
            optimizer.step(loss)
        finally:
            torch.set_num_threads(threads)
        self.weight.requires_grad_(False)
        self.bias.requires_grad_(False)

    @staticmethod
    def _tensor(images):
        return torch.as_tensor(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 127.5 - 1

    def _raw(self, x):
        with torch.no_grad():
            return torch.cat([x.mean((2, 3)), x.std((2, 3)), colour_histogram(x), self.cnn(x)], 1)

    def predict(self, images):
        """The class of each image (uint8 (n, SIDE, SIDE, 3)), (n,)."""
        if not len(images):
            return np.zeros(0, int)
        with torch.no_grad():
            z = (self._raw(self._tensor(images)) - self.centre) / self.scale
            return (z @ self.weight + self.bias).argmax(1).numpy()


def class_match(seen, asked, num_classes):
    """The share of images seen as the class asked for, its binomial standard error, the match of
    images blind to their labels, and each class's match (None where it was never asked for)."""
    seen, asked = np.asarray(seen), np.asarray(asked)
    n = len(asked)
    match = float((seen == asked).mean())
    ask, see = np.bincount(asked, minlength=num_classes) / n, np.bincount(seen, minlength=num_classes) / n
    per_class = [float((seen[asked == c] == c).mean()) if (asked == c).any() else None for c in range(num_classes)]
    return dict(match=match, se=sampling_error(match, n), blind=float(ask @ see), n=n, per_class=per_class)


def class_grid(images, asked, num_classes, per_class=8, gap=2):
    """A PIL image of one row a class (class 0 on top): the first `per_class` images asked for it, black where fewer."""
    side = SIDE + gap
    grid = np.zeros((num_classes * side - gap, per_class * side - gap, 3), np.uint8)
    for c in range(num_classes):
        for j, image in enumerate(images[np.asarray(asked) == c][:per_class]):
            grid[c * side : c * side + SIDE, j * side : j * side + SIDE] = image
    return Image.fromarray(grid)


def grey(images):
    """uint8 RGB images as bench/faces.py's grey vectors, (n, SIDE * SIDE) in [0, 1]."""
    return np.stack([faces.grey_vector(Image.fromarray(x), SIDE) for x in images])


class Judge:
    """The set's scores, fitted once: the classifier (on the held-apart split) and photos FD, bench/faces.py's
    Frechet distance in the space of the training split's grey principal components and a fixed
    random CNN (blind to colour: the class match sees that)."""

    def __init__(self, folder):
        held, held_labels, self.names = read_split(folder, "held")
        self.train, self.labels, train_names = read_split(folder, "train")
        if train_names != self.names:
            raise SystemExit(f"error: {folder}/train and {folder}/held have different classes: write the set again")
        self.held, self.held_labels = held, held_labels
        self.classifier = Classifier(held, held_labels, len(self.names))
        self.fd_scorer = faces.Scorer(grey(self.train))

    def match(self, images, asked):
        return class_match(self.classifier.predict(images), asked, len(self.names))

    def fd(self, images):
        return self.fd_scorer.fd(grey(images))

    def score(self, images, asked):
        """class_match of `images` asked for classes `asked`, with their photos FD ("fd")."""
        return self.match(images, asked) | dict(fd=self.fd(images))


def score(folder, generated, run=None, class_labels=None, grid=None):
    """Judge.score of the generated images, with the class names; `folder` is write's. With `grid`,
    class_grid of the images is saved there."""
    judge = Judge(folder)
    images, asked = read_generated(generated, judge.names, run, class_labels)
    if grid:
        class_grid(images, asked, len(judge.names)).save(grid)
    return judge.score(images, asked) | dict(classes=judge.names)


def format_match(m):
    fd = f"; photos FD {m['fd']:.2f}" if "fd" in m else ""
    return (f"class match {100 * m['match']:.1f}% ± {100 * m['se']:.1f} (SE, {m['n']} images, "
            f"{len(m['per_class'])} classes; blind to the labels {100 * m['blind']:.1f}%){fd}")  # fmt: skip


def blur(images, sigma):
    """Each image blurred by a Gaussian of `sigma` px (one for all, or one per image), uint8."""
    from scipy.ndimage import gaussian_filter

    sigmas = np.broadcast_to(np.asarray(sigma, dtype=np.float64), (len(images),))
    out = [gaussian_filter(x.astype(np.float64), (s, s, 0), mode="reflect") for x, s in zip(images, sigmas)]
    return np.stack(out).round().clip(0, 255).astype(np.uint8) if out else images.copy()


def grain(images, std, rng):
    """Each image with Gaussian noise of `std` (one for all, or one per image; 1 is the range 0-255), uint8."""
    std = np.broadcast_to(np.asarray(std, dtype=np.float64), (len(images),)).reshape(-1, 1, 1, 1)
    return (images + rng.normal(0, 1, images.shape) * std * 255).round().clip(0, 255).astype(np.uint8)


def trust_table(folder, samples=300, seed=0):
    """(what, class_match with "fd") of known image sets, each asked for its own class: the ceiling,
    the floor, and what the scores read (colour alone, blur, grain, one class only). The match
    is of every image of a set; the photos FD of `samples` of them drawn at random (FD's bias
    depends on the count: this is the count to compare a run's `samples` images with)."""
    rng = np.random.default_rng(seed)
    judge = Judge(folder)
    train, labels = judge.train, judge.labels
    flat = np.broadcast_to(train.mean((1, 2), keepdims=True), train.shape).round().astype(np.uint8)
    one = np.flatnonzero(labels == labels[0])

    def row(images, asked=labels):
        pick = rng.choice(len(images), min(samples, len(images)), replace=False)
        return judge.match(images, asked) | dict(fd=judge.fd(images[pick]))

    return [
        ("the training split (the ceiling: what a run that copies its data scores)", row(train)),
        ("the held-apart split (other crops of the same photos; the classifier's own images)",
         row(judge.held, judge.held_labels)),
        ("the training split, blurred sigma 1 px", row(blur(train, 1.0))),
        ("the training split, blurred sigma 2 px", row(blur(train, 2.0))),
        ("the training split, grain: Gaussian noise of std 0.15", row(grain(train, 0.15, rng))),
        ("the training split, grain: Gaussian noise of std 0.3", row(grain(train, 0.3, rng))),
        ("each training image's mean colour, flat (what colour alone gives)", row(flat)),
        (f"one class only ({judge.names[labels[0]]}), asked as itself (no variety across classes)",
         row(train[one], labels[one])),
        ("the training split, asked for shuffled classes (chance)", row(train, rng.permutation(labels))),
        ("uniform noise (the floor)", row(rng.integers(0, 256, train.shape, dtype=np.uint8))),
    ]  # fmt: skip


def sampling_error(match, n):
    """The binomial standard error of a class match `match` measured on `n` images."""
    return math.sqrt(match * (1 - match) / n)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.labelled", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write the set: DIR/train (train.py's --dataset) and DIR/held")
    w.add_argument("folder")
    c = sub.add_parser("captions", help="caption the training crops (DIR/train/metadata.jsonl) and write a random "
                       "CLIP text encoder to DIR/clip, for a --text_encoder run")  # fmt: skip
    c.add_argument("folder")
    s = sub.add_parser("score", help="class match and photos FD of a folder of generated images")
    s.add_argument("set", help="the folder `write` made")
    s.add_argument("generated", help="sample.py --output's folder, or a folder of class folders")
    s.add_argument("--run", default=None, help="the run that sampled a flat folder: its classes label image i")
    s.add_argument("--class_labels", default=None, help="sample.py's --class_labels for that folder (default: none given)")
    s.add_argument("--json", default=None, help="also write the result here")
    s.add_argument("--grid", default=None, help="also draw 8 images a class here (a PNG, one row a class)")
    t = sub.add_parser("trust", help="the scores of known image sets")
    t.add_argument("set", help="the folder `write` made")
    t.add_argument("--samples", type=int, default=300, help="FD and the sampling error at this many generated images")
    args = parser.parse_args(argv)
    if args.command == "write":
        counts = write(args.folder)
        print(f"wrote {counts['train']} training images to {Path(args.folder) / 'train'} and {counts['held']} held-apart "
              f"images to {Path(args.folder) / 'held'} ({len(PHOTOS)} classes, {SIDE}px)")  # fmt: skip
    elif args.command == "captions":
        count, clip = write_captions(args.folder), write_random_clip(Path(args.folder) / "clip")
        print(f"captioned {count} training images ({len(TEMPLATES)} templates each) and wrote a random CLIP to {clip}")
    elif args.command == "score":
        result = score(args.set, args.generated, args.run, args.class_labels, args.grid)
        print(format_match(result))
        print("per class: " + ", ".join(f"{n} {'-' if m is None else f'{100 * m:.0f}%'}"
                                        for n, m in zip(result["classes"], result["per_class"])))  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    else:
        rows = trust_table(args.set, args.samples)
        print(f"class match (every image of a set) | photos FD ({args.samples} of them) | the set")
        for name, m in rows:
            print(f"{100 * m['match']:6.1f}% ± {100 * m['se']:.1f}  (blind {100 * m['blind']:4.1f}%) | {m['fd']:7.2f} | {name}")
        ceiling = rows[0][1]["match"]
        print(f"sampling error at {args.samples} images (binomial SE): ± {100 * sampling_error(0.5, args.samples):.1f} "
              f"points at 50%, ± {100 * sampling_error(ceiling, args.samples):.1f} at the ceiling")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
