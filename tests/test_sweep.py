"""python -m bench --sweep: whole train.py runs with one setting varied."""

import json
import subprocess

import pytest
from PIL import Image

from ddpm_train import config
import forked
from bench import speed as bench
from bench import sweep

# 32 images at 16px: an epoch is a few steps of the tiny preset; two epochs, the second timed.
FAST = ["--workload", "tiny", "--num_images", "32", "--sweep_epochs", "2"]


@pytest.fixture(autouse=True)
def forked_train_runs(monkeypatch):
    """Each train.py the bench starts runs in a child forked from this process (forked.py), not in
    a fresh interpreter that imports torch and diffusers again."""
    monkeypatch.setattr(subprocess, "run", forked.run)


def run_sweep(tmp_path, *argv):
    return bench.main(bench.parse_args([*FAST, "--output", str(tmp_path), "--tag", "sweep", *map(str, argv)]))


def is_png(path):
    with Image.open(path) as image:
        image.verify()
        return image.format == "PNG"


def point_args(*argv):
    """(parsed args, points) as the sweep would run them, without running anything."""
    args = bench.parse_args([*FAST, *argv])
    return args, sweep.validate(args, bench.WORKLOADS)


def resolved(args, point):
    """What train.py makes of one point's flags."""
    return config.resolve(config.parse_args(sweep.train_flags(args, bench.WORKLOADS["tiny"], point, "shapes", "out")))


@pytest.mark.slow
def test_a_batch_size_sweep_writes_its_json_table_and_plot(tmp_path, capsys):
    assert run_sweep(tmp_path, "--sweep", "batch_size", "--values", "8,4") == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert result["sweep"]["name"] == "batch_size" and result["environment"]["device_type"] == "cpu"
    points = result["points"]
    assert [p["value"] for p in points] == [4, 8] and all(p["status"] == "ok" for p in points)
    for p, steps in zip(points, (8, 4)):  # 32 images in batches of 4, then of 8
        assert p["steps_per_epoch"] == steps and p["images_per_epoch"] == 32
        assert [e["epoch"] for e in p["epoch_times_s"]] == [0, 1]
        # the first epoch warms up: the time per epoch is the second's
        assert p["time_per_epoch_s"] == p["epoch_times_s"][1]["seconds"] > 0
        assert p["images_per_s"] == pytest.approx(32 / p["time_per_epoch_s"])
        assert p["step_time_s_median"] > 0 and 0 <= p["data_share"] < 1
        assert any(line.startswith("final: step") for line in p["output"])
    table = (tmp_path / "sweep.txt").read_text()
    assert "s/epoch" in table and "command      python -m bench --workload tiny" in table
    assert is_png(tmp_path / "sweep.png")
    assert "wrote" in capsys.readouterr().out


def test_the_plot_is_drawn_from_the_points(tmp_path):
    points = [
        dict(value=v, reference=False, status="ok", time_per_epoch_s=t, images_per_s=32 / t) for v, t in ((4, 2.0), (8, 1.0))
    ]
    env = dict(device="a CPU", device_type="cpu", torch="x", date="2026-11-23")
    spec = dict(name="batch_size", what="batch", workload="tiny", model="tiny", image_size=16, batch_size=8)
    result = dict(environment=env, sweep=spec, points=points)
    sweep.draw(result, tmp_path / "a.png")
    points[1]["time_per_epoch_s"] = 0.5
    sweep.draw(result, tmp_path / "b.png")
    with Image.open(tmp_path / "a.png") as a, Image.open(tmp_path / "b.png") as b:
        assert a.tobytes() != b.tobytes()
    # --redraw draws a sweep's JSON too
    (tmp_path / "c.json").write_text(json.dumps(result))
    assert bench.main(bench.parse_args(["--redraw", str(tmp_path / "c.json")])) == 0
    assert is_png(tmp_path / "c.png")


@pytest.mark.slow
def test_the_data_loader_sweep_streams_each_worker_count_and_preloads_once(tmp_path):
    # 0 workers: streamed and decoded in the training process (a worker would import torch again: slow in the suite)
    assert run_sweep(tmp_path, "--sweep", "dataloader_num_workers", "--values", "0") == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    streamed, preloaded = result["points"]
    assert streamed["value"] == 0 and streamed["data_path"] == "streamed" and not streamed["reference"]
    assert "--no-preload_data --dataloader_num_workers 0" in streamed["command"]
    assert preloaded["value"] == "preloaded" and preloaded["data_path"] == "preloaded" and preloaded["reference"]
    # without --dataset, the shapes were written as image files for the DataLoader to decode
    assert "JPEG" in result["sweep"]["dataset_note"]
    assert all(p["status"] == "ok" and p["time_per_epoch_s"] > 0 for p in result["points"])
    assert is_png(tmp_path / "sweep.png")


@pytest.mark.parametrize(
    "argv, check",
    [
        (["--sweep", "batch_size", "--values", "4"], lambda a: a.train_batch_size == 4),
        (["--sweep", "dataloader_num_workers", "--values", "2"], lambda a: not a.preload_data and a.dataloader_num_workers == 2),
        (["--sweep", "mixed_precision", "--values", "bf16"], lambda a: a.mixed_precision == "bf16"),
        (["--sweep", "compile", "--values", "on"], lambda a: a.compile_mode != "off"),
        (["--sweep", "compile", "--values", "off"], lambda a: a.compile_mode == "off"),
        # --train_args reach every point, and the swept flag comes after them
        (["--sweep", "batch_size", "--values", "2", "--train_args", "--learning_rate 3e-4"],
         lambda a: a.learning_rate == 3e-4 and a.train_batch_size == 2),
    ],
)  # fmt: skip
def test_each_sweep_sets_what_it_says(argv, check):
    args, points = point_args(*argv)
    settings = resolved(args, points[0])
    assert check(settings)
    assert settings.num_epochs == 2 and settings.model == "tiny"


def test_a_dit_workload_sweeps_bf16_against_fp8():
    args, points = point_args("--sweep", "mixed_precision", "--values", "bf16,fp8", "--workload", "dit-tiny")
    flags = [sweep.train_flags(args, bench.WORKLOADS["dit-tiny"], point, "shapes", "out") for point in points]
    assert [config.resolve(config.parse_args(f)).mixed_precision for f in flags] == ["bf16", "fp8"]


def test_the_model_sweep_trains_each_preset_with_its_own_objective():
    args, points = point_args("--sweep", "model", "--values", "tiny,edm2tiny")
    ddpm, edm = (resolved(args, point) for point in points)  # a UNet on the built-in shapes: DDPM
    assert (ddpm.model, ddpm.objective) == ("tiny", "ddpm") and (edm.model, edm.objective) == ("edm2tiny", "edm")


def test_the_preloaded_point_preloads():
    args, points = point_args("--sweep", "dataloader_num_workers", "--values", "0")
    assert [p["value"] for p in points] == [0, "preloaded"]
    assert resolved(args, points[1]).preload_data


def test_several_processes_are_started_by_the_launcher():
    args, points = point_args("--sweep", "num_processes", "--values", "1,2")
    one, two = (sweep.command(args, p, ["--x"]) for p in points)
    assert one[1].endswith("train.py")
    assert two[1:3] == ["-m", "accelerate.commands.launch"] and two[two.index("--num_processes") + 1] == "2"
    # on a CPU the processes use gloo (train.py --cpu) and share out the cores
    flags = sweep.train_flags(args, bench.WORKLOADS["tiny"], points[1], "shapes", "out")
    assert "--cpu" in flags and "--cpu" not in sweep.train_flags(args, bench.WORKLOADS["tiny"], points[0], "shapes", "out")
    threads = int(sweep.process_environment(args, points[1])["OMP_NUM_THREADS"])
    assert threads == max(1, (sweep.os.cpu_count() or 1) // 2)


def test_a_failed_point_is_recorded_and_the_sweep_exits_1(tmp_path, capsys):
    assert run_sweep(tmp_path, "--sweep", "batch_size", "--values", "4", "--dataset", tmp_path / "missing") == 1
    [point] = json.loads((tmp_path / "sweep.json").read_text())["points"]
    assert point["status"] == "error" and point["returncode"] == 2
    assert point["reason"].startswith("train.py: error:") and "missing" in point["reason"]
    assert is_png(tmp_path / "sweep.png")  # drawn all the same
    assert "1 point(s) of the sweep failed" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sweep", "compile", "--values", "maybe"], "--sweep compile takes --values from off, on"),
        (["--sweep", "model", "--values", "tiny,huge"], "--sweep model takes --values from small, tiny"),
        (["--sweep", "batch_size", "--values", "0,4"], "--sweep batch_size takes --values of at least 1"),
        (["--sweep", "batch_size", "--values", "four"], "--sweep batch_size takes whole numbers"),
        (["--sweep", "batch_size", "--values", ","], "--values is empty"),
        (["--sweep", "batch_size", "--sweep_epochs", "1"], "--sweep_epochs must be at least 2"),
        (["--sweep", "batch_size", "--batch_sizes", "4"], "--batch_sizes and --variants are for the ladder"),
        (["--sweep", "compile", "--workload", "all"], "--sweep runs one workload"),
        (["--sweep", "batch_size", "--train_args", "--train_batch_size 4"], "--train_args must not set --train_batch_size"),
        (["--sweep", "compile", "--train_args", "--output_dir x"], "--train_args must not set --output_dir"),
        (["--sweep", "compile", "--train_args", "--model small"], "--train_args must not set --model: pick --workload"),
        (["--sweep", "compile", "--train_args", "'unclosed"], "--train_args is not a valid command line"),
        (["--sweep", "compile", "--train_args=--frobnicate"], "--train_args: unrecognized arguments: --frobnicate"),
        (["--sweep", "mixed_precision", "--values", "fp16"], "--mixed_precision fp16 needs a CUDA GPU"),
        (["--sweep", "mixed_precision", "--values", "fp8"], "tiny has none to convert"),
        (["--sweep", "batch_size", "--values", "64"], "--num_images 32 is less than one step of 64 images"),
    ],
)
def test_bad_sweep_flags_exit_2_with_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as stopped:
        run_sweep(tmp_path, *argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())  # nothing was run or written


def test_a_process_sweep_needs_more_than_one_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sweep, "_gpu_count", lambda: 1)
    with pytest.raises(SystemExit) as stopped:
        run_sweep(tmp_path, "--sweep", "num_processes")
    assert stopped.value.code == 2
    assert "needs more than one GPU (this machine has 1)" in capsys.readouterr().err


def test_ctrl_c_keeps_the_points_measured_so_far(tmp_path, monkeypatch, capsys):
    def run_point(args, workload, point, dataset, output_dir):
        if point["value"] == 8:
            raise KeyboardInterrupt
        return dict(point, status="ok", data_path="preloaded", time_per_epoch_s=2.0, images_per_s=16.0,
                    step_time_s_median=0.1, step_images_per_s=40.0, mfu=None, data_share=0.01, peak_memory_gib=1.0)  # fmt: skip

    monkeypatch.setattr(sweep, "run_point", run_point)
    assert run_sweep(tmp_path, "--sweep", "batch_size", "--values", "4,8") == 130
    assert [p["value"] for p in json.loads((tmp_path / "sweep.json").read_text())["points"]] == [4]
    assert is_png(tmp_path / "sweep.png") and "4      preloaded" in (tmp_path / "sweep.txt").read_text()
    assert "interrupted after 1 of 2 points" in capsys.readouterr().err
