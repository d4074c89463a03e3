"""python -m bench --quality: whole train.py runs on the built-in shapes, scored offline as they train."""

import json

import pytest

from bench import quality
from bench import speed as bench

# The tiny preset at 16px instead of the bare run's small at 32px: seconds per row.
TINY = "--model tiny --image_size 16 --num_inference_steps 2 --eval_batch_size 4 --dataloader_num_workers 0"


def ladder(tmp_path, *argv):
    args = ["--quality", "--output", str(tmp_path), "--tag", "q", "--quality_images", "128", "--quality_samples", "8",
            f"--train_args={TINY}", *map(str, argv)]  # fmt: skip
    return bench.main(bench.parse_args(args))


@pytest.mark.slow
def test_a_row_is_trained_scored_along_the_way_and_written(tmp_path, capsys, monkeypatch, shape_scorer):
    # The row's train.py scores with the tests' 16px scorer (conftest.shape_scorer), told by the
    # environment it inherits (shapescore.IMAGES_ENV, STEPS_ENV), from a folder that holds only that
    # scorer's file: a row that trained the default one (a minute or more) would leave its file there.
    from ddpm_train.evaluation import shapescore

    scorers = tmp_path / "scorers"
    scorers.mkdir()
    cached = shapescore.cache_path(16, num_images=shape_scorer.num_images, steps=shape_scorer.steps)
    (scorers / cached.name).write_bytes(cached.read_bytes())
    monkeypatch.setenv(shapescore.CACHE_ENV, str(scorers))
    monkeypatch.setenv(shapescore.IMAGES_ENV, str(shape_scorer.num_images))
    monkeypatch.setenv(shapescore.STEPS_ENV, str(shape_scorer.steps))
    assert ladder(tmp_path, "--rows", "edm", "--quality_evals", 2) == 0
    assert [p.name for p in scorers.iterdir()] == [cached.name]  # scored by the tests' scorer, none trained
    result = json.loads((tmp_path / "q.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["edm"] and all(r["status"] == "ok" for r in rows.values())
    for r in rows.values():
        assert [e["images_seen"] for e in r["evals"]] == [64, 128]  # two scores, the last at the end
        assert all(e["fid"] >= 0 and 0 <= e["valid_fraction"] <= 1 for e in r["evals"])
        assert r["images_per_s"] > 0 and r["train_wall_s"] > 0
    assert rows["edm"]["command"].endswith("--objective edm")  # the row's own flags come last
    table = (tmp_path / "q.txt").read_text()
    assert "shape FD" in table and "edm" in table
    assert (tmp_path / "q.png").stat().st_size > 0 and (tmp_path / "q_edm.png").stat().st_size > 0
    # a ladder's JSON (one stopped part-way too) draws its plot and table again
    (tmp_path / "q.png").unlink()
    (tmp_path / "q.txt").unlink()
    assert bench.main(bench.parse_args(["--redraw", str(tmp_path / "q.json")])) == 0
    assert (tmp_path / "q.png").stat().st_size > 0 and "shape FD" in (tmp_path / "q.txt").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--rows", "nope"], "unknown --rows 'nope'"),
    (["--quality_evals", "0"], "--quality_evals must be at least 1"),
    (["--train_args=--max_train_steps 3"], "--train_args must not set --max_train_steps"),
])  # fmt: skip
def test_bad_ladder_flags_are_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as stopped:
        ladder(tmp_path, *argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_every_row_is_a_valid_train_py_command(tmp_path):
    args = bench.parse_args(["--quality", "--output", str(tmp_path)])
    rows = quality.validate(args)  # resolves every row's flags as train.py would
    assert [r["name"] for r in rows] == list(quality.ROWS)


def test_a_ladder_run_again_keeps_the_rows_it_trained_with_the_same_settings(tmp_path):
    settings = dict(images=64, evals=2, samples=8, base=quality.BASE, train_args=[])
    ok = dict(name="edm", status="ok", flags=quality.ROWS["edm"][1])
    failed = dict(name="ddpm", status="error", flags=[])
    changed = dict(name="min_snr", status="ok", flags=["--snr_gamma", "1"])  # the row's flags have changed since
    path = tmp_path / "q.json"
    path.write_text(json.dumps(settings | dict(rows=[ok, failed, changed])))
    assert list(quality.finished_rows(path, settings | dict(rows=[]))) == ["edm"]
    assert quality.finished_rows(path, settings | dict(images=128, rows=[])) == {}  # another length: train afresh
    assert quality.finished_rows(tmp_path / "none.json", settings) == {}
