"""bench/labelled.py: scikit-image's photos as a labelled train.py folder, and the class match that
scores a class-conditional run on them. The classifier must read the class from real images it
never saw, fall to chance on shuffled labels and on noise, and know which class sample.py asked
each flat file for. Small sets: seconds."""

import json
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT))
from ddpm_train.data import sources
from bench import faces, labelled, quality  # noqa: E402
from bench import speed as bench  # noqa: E402


@pytest.fixture(scope="module")
def small():
    """12 training and 30 held-apart crops a class: ((train, labels), (held, labels), class names)."""
    sets, names = labelled.build(train_per_class=12, held_per_class=30)
    return sets["train"], sets["held"], names


def test_the_classifier_reads_the_class_of_real_crops_it_never_saw_and_chance_elsewhere(small):
    (train, labels), held, names = small
    classifier = labelled.Classifier(*held, len(names))
    k = len(names)
    assert train.shape == (12 * k, 32, 32, 3) and train.dtype == np.uint8 and k == len(labelled.PHOTOS) == 10
    rng = np.random.default_rng(0)
    real = labelled.class_match(classifier.predict(train), labels, k)
    shuffled = labelled.class_match(classifier.predict(train), rng.permutation(labels), k)
    noise = labelled.class_match(classifier.predict(rng.integers(0, 256, train.shape, dtype=np.uint8)), labels, k)
    assert real["match"] > 0.6, real  # 84.8% with the full set (docs/conditional.md)
    assert shuffled["match"] < 0.3 and noise["match"] < 0.3, (shuffled, noise)
    assert abs(real["blind"] - 1 / k) < 1e-9  # asked in equal shares: blind to the labels is chance
    assert real["se"] == pytest.approx((real["match"] * (1 - real["match"]) / len(train)) ** 0.5)


def test_no_held_apart_pixel_is_in_a_training_crop():
    for height, width in ((128, 128), (128, 192), (128, 147)):
        cover = np.zeros((2, height, width), int)
        for held in (False, True):
            for y0, y1, x0, x1 in labelled.blocks(height, width, held):
                assert y1 - y0 >= labelled.SIDE and x1 - x0 >= labelled.SIDE
                cover[int(held), y0:y1, x0:x1] += 1
        assert (cover.sum(0) == 1).all()  # every pixel in exactly one block of one split
        assert 0.25 < cover[1].mean() < 0.45  # about a third held apart


def test_write_makes_a_class_folder_train_py_reads_and_a_held_apart_one(tmp_path):
    assert labelled.write(tmp_path, train_per_class=2, held_per_class=1) == {"train": 20, "held": 10}
    paths = sources.find_images(tmp_path / "train")
    labels, names = sources.folder_labels(tmp_path / "train", paths)
    assert names == sorted(labelled.PHOTOS) and labels.tolist() == [i // 2 for i in range(20)]
    images, held_labels, held_names = labelled.read_split(tmp_path, "held")
    assert images.shape == (10, 32, 32, 3) and held_labels.tolist() == list(range(10)) and held_names == names
    judge = labelled.Judge(tmp_path)  # photos FD: the training crops against themselves, and noise
    noise = np.random.default_rng(0).integers(0, 256, judge.train.shape, dtype=np.uint8)
    assert judge.fd_scorer.fd(faces.with_mirrors(labelled.grey(judge.train))) < 1e-6  # its own real images, mirrored
    assert judge.score(noise, judge.labels)["fd"] > 5 * judge.fd(judge.train)


def test_a_flat_folder_is_labelled_as_sample_py_asked_and_class_folders_by_name(tmp_path, small):
    (train, labels), _, names = small
    run, gen = tmp_path / "run", tmp_path / "gen"
    run.mkdir()
    gen.mkdir()
    run_names = ["cat", "coins", "hubble"]  # a run of three of the classes, in its own order
    (run / "train_config.json").write_text(json.dumps(dict(class_names=run_names, num_classes=3)))
    from PIL import Image

    for i in range(6):
        Image.fromarray(train[i]).save(gen / f"{i:06d}.png")
    Image.fromarray(train[0]).save(gen / "grid.png")  # sample.py's grid is no sample
    _, asked = labelled.read_generated(gen, names, run=run)  # spread in runs: 0 0 1 1 2 2
    assert [names[i] for i in asked] == ["cat", "cat", "coins", "coins", "hubble", "hubble"]
    _, asked = labelled.read_generated(gen, names, run=run, class_labels="hubble,0")  # taken in turn
    assert [names[i] for i in asked] == ["hubble", "cat"] * 3
    with pytest.raises(SystemExit, match="--run RUN"):
        labelled.read_generated(gen, names)
    by_class = tmp_path / "by_class"
    for name in ("coins", "rocket"):
        (by_class / name).mkdir(parents=True)
        Image.fromarray(train[0]).save(by_class / name / "0.png")
    _, asked = labelled.read_generated(by_class, names)
    assert [names[i] for i in asked] == ["coins", "rocket"]
    grid = labelled.class_grid(train, labels, len(names), per_class=3)
    assert grid.size == (3 * 34 - 2, 10 * 34 - 2)


def test_the_quality_ladder_trains_the_labelled_photos_class_conditional_to_its_images(tmp_path):
    args = bench.parse_args(["--quality", "--output", str(tmp_path), "--quality_data", "labelled",
                             "--rows", "lognormal_t_v,batch_4", "--quality_images", "8192", "--quality_evals", "2"])  # fmt: skip
    rows = quality.validate(args)
    assert [r["steps"] for r in rows] == [512, 2048] and args.guidance == [1.0, 2.0, 3.0]
    flags = quality.train_flags(args, "batch_4", "out", "photos/train", rows[1]["steps"])
    assert flags[flags.index("--dataset") + 1] == "photos/train" and "--class_conditional" in flags
    assert flags[flags.index("--max_train_steps") + 1] == "2048" and flags[flags.index("--checkpointing_steps") + 1] == "1024"
    assert "--shapes_num_images" not in flags and "--eval_every_epochs" not in flags
    result = dict(images=8192, evals=2, samples=300, data="labelled", guidance=[1.0, 2.0],
                  trust=dict(classes=list(range(10)), ceiling=0.848, chance=0.1), rows=[dict(
                      name="batch_4", status="ok", params=1000, images_seen=8192, images_per_s=9.5, train_wall_s=60,
                      what="w", evals=[dict(match={"1": dict(match=0.5, se=0.029), "2": dict(match=0.625, se=0.028)})])])  # fmt: skip
    table = "\n".join(quality.format_table(result))
    assert "ceiling) 84.8%" in table and "50.0 ± 2.9" in table and "62.5 ± 2.8" in table
