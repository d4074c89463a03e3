"""Where the time goes: --profile, the step-time breakdown, plots and run.json."""

import json
import re

import pytest
import torch
from PIL import Image

import profiling
import train

TINY = [
    "--model", "tiny", "--image_size", "16", "--shapes_num_images", "32", "--train_batch_size", "4",
    "--num_inference_steps", "2", "--eval_batch_size", "1", "--lr_warmup_steps", "2",
    "--dataloader_num_workers", "0", "--timing_warmup_steps", "1", "--save_images_epochs", "1",
    "--max_train_steps", "10", "--checkpointing_steps", "5", "--logging_steps", "2",
]  # fmt: skip


def run(output_dir, *extra):
    return train.main(train.parse_args([*TINY, "--output_dir", str(output_dir), *map(str, extra)]))


def is_png(path):
    with Image.open(path) as image:
        image.verify()
        return image.format == "PNG"


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "run"
    run(out)
    return out


def test_profile_writes_a_trace_a_table_and_a_chart(tmp_path, capsys):
    out = tmp_path / "run"
    run(out, "--profile", "--profile_steps", 2, "--profile_only")
    stdout = capsys.readouterr().out
    trace = json.loads((out / "profile" / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(name.startswith("aten::") for name in names)
    # the table names real operators, a convolution among the most expensive
    table = stdout[stdout.index("operators by self cpu time") :]
    assert re.search(r"aten::(convolution|mkldnn_convolution|_convolution|convolution_backward)", table)
    rows = json.loads((out / "profile" / "top_ops.json").read_text())
    assert len(rows) == 15 and all(r["self_ms"] >= 0 for r in rows)
    assert is_png(out / "profile" / "top_ops.png")
    # --profile_only: stops once recorded (1 skipped + 1 warm-up + 2 recorded steps), without the pipeline
    assert "stopped after profiling at step 4" in stdout
    assert not (out / "model_index.json").exists()


def test_breakdown_parts_are_non_negative_and_add_up_to_the_wall_time(plain_run):
    manifest = json.loads((plain_run / "run.json").read_text())
    parts, wall = manifest["time_breakdown_s"], manifest["train_wall_s"]
    assert set(parts) == {*profiling.STEP_PHASES, *profiling.PAUSES, "unaccounted"}
    assert all(v >= 0 for v in parts.values())
    measured = sum(v for k, v in parts.items() if k != "unaccounted")
    assert measured == pytest.approx(wall, rel=0.05)  # the phases explain the wall time
    assert parts["forward"] > 0 and parts["backward"] > 0 and parts["sampling"] > 0 and parts["checkpointing"] > 0


def test_breakdown_counts_each_phase():
    breakdown = profiling.Breakdown(torch.device("cpu"))
    breakdown.start()
    for _ in range(3):
        breakdown.begin_step()
        for phase in profiling.STEP_PHASES:
            torch.randn(50, 50) @ torch.randn(50, 50)
            breakdown.phase_done(phase)
    with breakdown.pause("sampling"):
        torch.randn(200, 200) @ torch.randn(200, 200)
    parts, wall = breakdown.summary()
    assert all(parts[p] > 0 for p in (*profiling.STEP_PHASES, "sampling"))
    assert parts["checkpointing"] == 0
    assert sum(parts.values()) == pytest.approx(wall, rel=1e-6)


def test_plots_are_drawn_from_the_logged_values(plain_run, tmp_path):
    for name in ("loss.png", "lr.png", "images_per_s.png"):
        assert is_png(plain_run / "plots" / name)
    drawn = profiling.draw_run_plots(plain_run)
    logged = profiling.read_scalars(plain_run)
    assert drawn["loss"] == logged["loss"] and drawn["loss"][0] == [2, 4, 6, 8, 10]

    # log one value differently: the plot's data follows
    from torch.utils.tensorboard import SummaryWriter

    other = tmp_path / "other"
    with SummaryWriter(str(other / "logs")) as writer:
        for step, value in zip(*logged["loss"]):
            writer.add_scalar("loss", value * (3 if step == 4 else 1), step)
    changed = profiling.draw_run_plots(other)["loss"]
    assert changed[1][1] == pytest.approx(3 * drawn["loss"][1][1]) and changed[1][0] == drawn["loss"][1][0]
    assert is_png(other / "plots" / "loss.png")


def test_plots_command(plain_run, tmp_path, capsys):
    assert profiling.main(profiling.parse_args(["plots", str(plain_run)])) == 0
    assert str(plain_run / "plots" / "loss.png") in capsys.readouterr().out
    assert profiling.main(profiling.parse_args(["plots", str(tmp_path)])) == 2
    assert "has no logs/ folder" in capsys.readouterr().err


def test_run_manifest_has_every_field(plain_run):
    m = json.loads((plain_run / "run.json").read_text())
    assert m["config"]["model"] == "tiny" and m["config"]["max_train_steps"] == 10
    assert m["git_commit"] is None or isinstance(m["git_commit"], str)
    assert set(m["versions"]) >= {"python", "torch", "diffusers", "accelerate"} and m["versions"]["torch"]
    assert m["device"]["type"] == "cpu" and m["device"]["count"] == 1
    assert {"cuda", "driver"} <= set(m["device"])
    assert m["start_time"] <= m["end_time"]  # ISO 8601 in UTC: string order is time order
    assert m["steps"] == 10 and isinstance(m["final_loss"], float) and m["final_loss"] > 0
    assert m["median_step_time_s"] > 0 and m["images_per_s"] > 0
    assert m["mfu"] is None and m["hfu"] is None  # no known peak on a CPU
    assert m["peak_memory_gib"] > 0
    assert m["samples_dir"].endswith("samples") and m["checkpoints"][-1].endswith("checkpoint-10")


def test_run_manifest_times_each_whole_epoch_without_the_pauses(plain_run):
    m = json.loads((plain_run / "run.json").read_text())
    # 32 images in batches of 4: epoch 0 is 8 steps; epoch 1 stops at step 10, so is not whole
    [epoch] = m["epoch_times_s"]
    parts = m["time_breakdown_s"]
    training = sum(parts[p] for p in profiling.STEP_PHASES)
    assert epoch["epoch"] == 0 and 0 < epoch["seconds"] < training  # the checkpoint at step 5 is left out
    assert epoch["images_per_s"] == pytest.approx(32 / epoch["seconds"])


def test_the_periodic_line_has_peak_memory(plain_run, capsys, tmp_path):
    run(tmp_path / "again", "--max_train_steps", 4)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step 4/4")]
    assert lines and re.search(r"\| peak mem [\d.]+ GiB", lines[0])
