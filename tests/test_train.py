import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from tqdm import tqdm

from ddpm_train.perf import compiling
from ddpm_train.networks import model as models
from ddpm_train.training import step as steps
import train
from conftest import ROOT

# A tiny model on 64 built-in images at 16px: 8 steps per epoch.
TINY = [
    "--model", "tiny", "--image_size", "16", "--shapes_num_images", "64", "--train_batch_size", "8",
    "--num_inference_steps", "4", "--eval_batch_size", "4", "--lr_warmup_steps", "2",
    "--dataloader_num_workers", "0",
]  # fmt: skip


def run(output_dir, *flags, **settings):
    """train.py with TINY and `flags`, and `settings` (config.SETTINGS: no flag sets them) on its
    configuration; runs this short leave only their first step out of the timing (train.py: 5)."""
    args = train.parse_args([*TINY, "--output_dir", str(output_dir), *map(str, flags)])
    for name, value in {"timing_warmup_steps": 1, **settings}.items():
        setattr(args, name, value)
    return train.main(args)


def scalars(output_dir):
    """{tag: [(step, value)]} from the run's tensorboard logs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for events in (output_dir / "logs").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return {tag: sorted(values) for tag, values in found.items()}


def test_end_to_end_run_writes_every_output(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    # a CPU has no peak in flops.PEAK_TFLOPS: one for the test, so that MFU and HFU are numbers
    monkeypatch.setattr(train.flops, "describe_peak", lambda *args: (0.5e12, "peak 0.5 TFLOP/s (a test's)"))
    config = run(
        out, "--max_train_steps", 9, "--save_images_epochs", 1, "--logging_steps", 3,
        "--checkpointing_steps", 2, "--checkpoints_total_limit", 2,
    )  # fmt: skip
    stdout = capsys.readouterr().out

    # samples: a grid after epoch 0 and at the end (epoch 1, one step in); 4 images of 16px, 2 by 2
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["0000.png", "0001.png"]
    with Image.open(out / "samples" / "0001.png") as grid:
        assert grid.size == (2 * 16 + 3 * 2, 2 * 16 + 3 * 2)

    # the trained model loads as a diffusers pipeline and generates
    from diffusers import DDPMPipeline

    pipeline = DDPMPipeline.from_pretrained(str(out))
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline(batch_size=1, num_inference_steps=2, output_type="np").images
    assert image.shape == (1, 16, 16, 3)

    # checkpoints every 2 steps and at the end, only the newest 2 kept, nothing half-written left behind
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-8", "checkpoint-9"]
    state = json.loads((out / "checkpoints" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["skipped_nonfinite"] == 0 and state["run"]["model"] == "tiny"

    # the resolved configuration
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["model"] == "tiny" and saved["total_train_steps"] == 9 and saved["params"] == config["params"]
    assert saved["model_flops_per_step"] > 0

    # tensorboard: loss and learning rate every log, throughput and utilization once timed
    logged = scalars(out)
    assert [step for step, _ in logged["loss"]] == [3, 6, 9]
    for tag in ("images_per_s", "step_time_s", "mfu", "hfu", "achieved_flops"):
        assert [step for step, _ in logged[tag]] == [3, 6, 9] and all(v > 0 for _, v in logged[tag]), tag
    assert [step for step, _ in logged["lr"]] == [3, 6, 9] and logged["lr"][0][1] > 0

    # the stdout line users quote
    line = re.compile(
        r"step (\d+)/9 \| loss [\d.]+ \| [\d.e+-]+ s/step \| [\d.]+ img/s \| [\d.e+-]+ TFLOP/step \| "
        r"[\d.e+-]+ TFLOP/s \| MFU [\d.]+% HFU [\d.]+% \| peak 0.5 TFLOP/s \(a test's\)"
    )
    assert [m.group(1) for m in line.finditer(stdout)] == ["3", "6", "9", "9"]
    assert re.search(r"^final: step 9/9", stdout, re.M)

    # train.py's start to its loop, by part: said before the first step, and in run.json
    startup = json.loads((out / "run.json").read_text())["startup_s"]
    assert list(startup) == ["imports", "accelerate", "data", "FLOPs and compile plan", "data to the device", "network", "step"]
    assert all(seconds >= 0 for seconds in startup.values()) and startup["network"] > 0
    ready = re.search(r"^ready to train ([\d.]+) s after train.py started: (.*)$", stdout, re.M)
    assert ready and float(ready.group(1)) == pytest.approx(sum(startup.values()), abs=0.1)
    assert f"network {startup['network']:.1f} s" in ready.group(2) or startup["network"] < 0.05


def test_unknown_peak_prints_no_percentage(tmp_path, capsys):
    run(tmp_path, "--max_train_steps", 3, "--logging_steps", 3, "--checkpointing_steps", 100)
    stdout = capsys.readouterr().out
    lines = [ln for ln in stdout.splitlines() if ln.startswith("step 3/3")]
    assert lines and "MFU/HFU n/a | peak unknown for cpu fp32" in lines[0]
    assert "%" not in lines[0]


def test_dry_run_prints_the_configuration_and_flops_and_writes_nothing(tmp_path, capsys):
    config = run(tmp_path / "dry", "--dry_run")
    stdout = capsys.readouterr().out
    assert "model tiny: 177,427 parameters" in stdout
    assert f"{config['model_flops_per_step'] / 1e12:.4g} TFLOP per step" in stdout
    assert re.search(r"^learning_rate\s+0.002$", stdout, re.M)  # the tiny preset's default, resolved
    assert not (tmp_path / "dry").exists()


def tensors_of(folder):
    found = {}
    for f in sorted(folder.rglob("*.safetensors")):
        found.update({f"{f.relative_to(folder)}:{k}": v for k, v in load_file(f).items()})
    ema = torch.load(folder / "custom_checkpoint_1.pkl", weights_only=False) if folder.name.startswith("checkpoint") else None
    return found, ema


@pytest.mark.parametrize("accumulation", [1, 2])
def test_resume_is_bit_identical(tmp_path, accumulation, capsys):
    # 8 steps straight, versus the checkpoint at step 4 (mid-epoch) resumed for 4 more.
    flags = ["--max_train_steps", 8, "--checkpointing_steps", 4, "--gradient_accumulation_steps", accumulation,
             "--train_batch_size", 4, "--save_images_epochs", 100]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, *flags)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "checkpoint-4", resumed / "checkpoints" / "checkpoint-4")
    capsys.readouterr()
    run(resumed, *flags)  # the same command again: it continues from the newest checkpoint
    # a run that started afresh would write the same weights (training is deterministic): it must have resumed
    assert f"resumed from {resumed / 'checkpoints' / 'checkpoint-4'} at step 4" in capsys.readouterr().out
    assert json.loads((resumed / "run.json").read_text())["startup_s"]["resume"] > 0  # a part of the startup

    for part in ("checkpoints/checkpoint-8", "unet"):
        a, a_ema = tensors_of(straight / part)
        b, b_ema = tensors_of(resumed / part)
        assert a.keys() == b.keys() and a
        for key in a:
            assert torch.equal(a[key], b[key]), key
        if a_ema is not None:
            assert a_ema["optimization_step"] == b_ema["optimization_step"] == 8
            assert all(torch.equal(x, y) for x, y in zip(a_ema["shadow_params"], b_ema["shadow_params"]))


def visible(stream):
    """The lines a terminal shows: progress bars redraw themselves with carriage returns."""
    return [line.split("\r")[-1] for line in stream.split("\n") if line.split("\r")[-1].strip()]


BAD_INPUTS = [
    (["--dataset", "./no/such/folder"], "no such folder"),
    (["--dataset", "{empty}"], "no images"),
    (["--dataset", "{broken}", "--on_fault", "stop"], "cannot read image"),
    (["--model", "huge"], "unknown --model 'huge'"),
    (["--model", "ref128", "--image_size", "100"], "multiple of 32"),
    (["--image_size", "100000"], "--image_size 100000: each side must be from 8 to 8192"),  # not a 61 TB allocation
    (["--image_size", "64x100000"], "--image_size 64x100000: each side must be from 8 to 8192"),
    (["--image_size", "96by64"], "--image_size 96by64: give one side (64) or width x height (96x64)"),
    (["--model", "ref128", "--image_size", "96x100"], "each side must be a multiple of 32"),
    (["--train_batch_size", "0"], "--train_batch_size must be at least 1"),
    (["--num_epochs", "0"], "--num_epochs must be at least 1"),
    (["--learning_rate", "0"], "--learning_rate must be a finite number greater than 0"),
    (["--learning_rate=-1e-4"], "--learning_rate must be a finite number greater than 0"),
    (["--dataset", "someone/no-such-dataset"], "could not load dataset 'someone/no-such-dataset'"),
    (["--mixed_precision", "fp8"], "tiny has none to convert"),  # a UNet: fp8 is a DiT's
    (["--mixed_precision", "fp4"], "invalid choice: 'fp4'"),
    (["--train_batch_size", "many"], "invalid int value: 'many'"),
    (["--shapes_num_images", "4"], "fewer than one optimizer step takes"),
    (["--resume", "./no/checkpoint"], "--resume no/checkpoint: not a checkpoint folder"),
]


@pytest.mark.parametrize("flags, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, flags, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "broken" / "fine.png")
    (tmp_path / "broken" / "bad.jpg").write_bytes(b"\xff\xd8\xff truncated")
    flags = [f.format(empty=tmp_path / "empty", broken=tmp_path / "broken") for f in flags]
    # a bar left open (in a notebook, or by an earlier test's generator its traceback keeps): ours still one line
    with tqdm(total=1, file=io.StringIO(), leave=False), pytest.raises(SystemExit) as exit_info:
        run(tmp_path / "out", *flags)
    assert exit_info.value.code == 2
    err = visible(capsys.readouterr().err)
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err


def test_the_reference_command_builds_the_reference_model(tmp_path, capsys):
    argv = ["--image_size", "128", "--train_batch_size", "64", "--num_epochs", "50", "--learning_rate", "1e-4",
            "--shapes_num_images", "64", "--dry_run", "--output_dir", str(tmp_path)]  # fmt: skip
    config = train.main(train.parse_args(argv))
    assert config["model"] == "ref128" and config["params"] == 113_673_219
    assert config["learning_rate"] == 1e-4 and config["total_train_steps"] == 50
    assert config["model_flops_per_step"] == pytest.approx(23.82e12, rel=0.005)


@pytest.mark.slow
def test_bad_input_from_the_command_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "train.py", "--train_batch_size", "0", "--output_dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == "train.py: error: --train_batch_size must be at least 1 (got 0)"


# train.py as `python train.py` runs it, with a Ctrl-C while its data loads (data is imported here first: train.py's
# import finds it patched)
CTRL_C_WHILE_THE_DATA_LOADS = """
import os, runpy, signal, sys
from ddpm_train.data import data
load_images = data.load_images
def interrupted(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return load_images(*args, **kwargs)
data.load_images = interrupted
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.slow
def test_ctrl_c_while_train_py_imports_is_one_line_and_exit_130(tmp_path):
    """A fresh interpreter spends seconds importing torch and diffusers before main: a Ctrl-C there is one line,
    not Python's traceback from inside an import."""
    process = subprocess.Popen([sys.executable, "train.py", "--output_dir", str(tmp_path / "run")], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(0.5)  # torch's import alone takes longer
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert err.strip() == "train.py: interrupted while starting: nothing was written" and not out
    assert not (tmp_path / "run").exists()
    # imported, a Ctrl-C is main's again (here while the data loads): its own line, its cleanup
    done = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_THE_DATA_LOADS, "--cpu", *TINY, "--output_dir",
                           str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 130 and done.stderr.strip().splitlines()[-1] == "train.py: interrupted: stopped without saving", done.stderr


def test_the_logged_loss_and_its_terms_are_the_means_of_the_finite_steps_since_the_last_log():
    meter = steps.LossMeter(torch.device("cpu"))
    for loss, term in ((1.0, 0.5), (float("nan"), 7.0), (3.0, 1.5), (float("inf"), 7.0)):  # a step is whole or out
        meter.add(dict(loss=torch.tensor(loss), edm=torch.tensor(term), edm_logvar=torch.tensor(loss - term)))
    assert meter.read() and meter.last == 2.0 and meter.last_terms == dict(edm=1.0, edm_logvar=1.0)
    assert not meter.read() and meter.last == 2.0  # a new interval: nothing added yet
    meter.add(dict(loss=torch.tensor(float("nan")), edm=torch.tensor(1.0), edm_logvar=torch.tensor(1.0)))
    assert not meter.read() and meter.last == 2.0  # only a skipped step: the last mean stands
    meter.add(dict(loss=torch.tensor(5.0), edm=torch.tensor(4.0), edm_logvar=torch.tensor(1.0)))
    assert meter.read() and meter.last == 5.0 and meter.last_terms == dict(edm=4.0, edm_logvar=1.0)


def test_a_compile_that_fails_falls_back_to_eager_and_trains_the_same_weights(tmp_path, capsys, monkeypatch):
    """The compile of the step raises (injected into Inductor): the run says so, goes on eager
    from the same state, finishes, records it, and ends with an eager run's weights."""
    import torch._inductor.compile_fx

    def broken_compile(*args, **kwargs):
        raise RuntimeError("injected compile failure\nsecond line")

    flags = ["--max_train_steps", 3, "--save_images_epochs", 100]
    run(tmp_path / "eager", *flags, "--compile_mode", "off")
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", broken_compile)
    torch.compiler.reset()
    run(tmp_path / "fell", *flags, "--compile_mode", "default")  # (auto would train 3 steps eager: too short to repay)
    torch.compiler.reset()
    out = capsys.readouterr().out

    assert "--compile_mode default failed (RuntimeError: injected compile failure); falling back to eager" in out
    manifest = json.loads((tmp_path / "fell" / "run.json").read_text())
    assert manifest["step_compile_mode"] == "eager"
    assert manifest["compile_fallbacks"] == [
        dict(mode="default", error="RuntimeError: injected compile failure", fell_back_to="eager")
    ]
    a, _ = tensors_of(tmp_path / "eager" / "unet")
    b, _ = tensors_of(tmp_path / "fell" / "unet")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)


def spy_on_build(monkeypatch):
    """The list that each builder.build call's Pieces (what the step trains) are appended to."""
    from ddpm_train.training import builder

    built, build = [], builder.build
    monkeypatch.setattr(builder, "build", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    return built


def test_v_prediction_with_zero_terminal_snr_and_min_snr_trains_and_samples(tmp_path, monkeypatch):
    built = spy_on_build(monkeypatch)
    out = tmp_path / "run"
    run(out, "--max_train_steps", 2, "--save_images_epochs", 1, "--objective", "ddpm", "--prediction_type", "v_prediction",
        "--zero_terminal_snr", "--snr_gamma", 5)  # fmt: skip
    (pieces,) = built  # the objective trained: v-prediction, min-SNR-5, on the rescaled betas
    assert pieces.noise_scheduler.config.prediction_type == "v_prediction" and pieces.objective.snr_gamma == 5
    assert pieces.noise_scheduler.alphas_cumprod[-1] < 1e-6  # zero terminal SNR
    assert math.isfinite(json.loads((out / "run.json").read_text())["final_loss"])
    with Image.open(out / "samples" / "0000.png") as grid:
        pixels = np.asarray(grid)
    assert 0 < pixels.mean() < 255 and pixels.std() > 0  # sampled: neither blank nor NaN-black
    from diffusers import DDPMPipeline

    assert DDPMPipeline.from_pretrained(str(out)).scheduler.config.rescale_betas_zero_snr


def test_auto_trains_a_run_too_short_to_repay_its_compile_eager_and_a_warm_cache_changes_that(tmp_path, capsys, monkeypatch):
    """--compile_mode auto, 40 steps of the tiny preset on a CPU (its compile made to save 10% of a step): the predicted
    cold compile outweighs what 40 steps save,
    so the step is eager and the line says both numbers; with this machine's record of the same step compiled before
    (its graphs in Inductor's cache, TORCHINDUCTOR_CACHE_DIR), the warm compile pays at 40,000 steps, where the cold one does not."""
    from ddpm_train.perf import compiling

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    unet = models.FAMILIES["unet"]
    monkeypatch.setitem(models.FAMILIES, "unet", unet._replace(compile_costs=unet.compile_costs._replace(cpu_saved_share=0.1)))  # a prediction for the test: a CPU's UNet gains nothing
    flags = ["--compile_mode", "auto", "--dry_run"]
    config = run(tmp_path / "short", *flags, "--max_train_steps", 40)
    assert config["step_compile_mode"] == "eager" and config["step_compile_scope"] == "regional"
    assert "step auto: eager: compiling (default, each repeated block once) would take about 78 s (cold cache), " \
           "more than it saves in this run's 40 steps" in capsys.readouterr().out  # fmt: skip
    args = train.parse_args([*TINY, "--compile_mode", "auto"])
    key = compiling.compile_key(config_args(args), torch.device("cpu"), "default", "regional")
    compiling.remember_compile(key, 60.0)  # what the first compile of this step recorded
    assert run(tmp_path / "warm", *flags, "--max_train_steps", 40000)["step_compile_mode"] == "default"
    assert "compile about 7 s (warm cache)" in capsys.readouterr().out
    assert run(tmp_path / "cold", *flags, "--max_train_steps", 40000, "--train_batch_size", 4)["step_compile_mode"] == "eager"


@pytest.mark.parametrize("planned", ["eager", "default"])
def test_the_run_starts_the_compile_workers_once_it_has_planned_its_step(tmp_path, monkeypatch, planned):
    """train.py asks for Inductor's compile workers with its device and the planned mode once the plan is made,
    before the network is built (compiling.start_compile_workers: on a GPU whose step compiles they start then)."""
    calls = []
    monkeypatch.setattr(compiling, "start_compile_workers", lambda device, mode: calls.append((device.type, mode)))
    build = train.builder.build
    monkeypatch.setattr(train.builder, "build", lambda *a, **k: calls.append("network") or build(*a, **k))
    if planned != "eager":  # a plan that compiles, its compile left out: the test's step runs eager
        monkeypatch.setattr(compiling, "plan_compile", lambda *a, **k: compiling.CompilePlan(planned, "whole", "a test's plan"))
        monkeypatch.setattr(compiling, "compile_network", lambda model, mode, **k: model)
    run(tmp_path / "run", "--max_train_steps", 1, "--save_images_epochs", 100, "--compile_mode", "auto")
    assert calls == [("cpu", planned), "network"]


def test_the_compile_record_keys_what_changes_the_step_s_graphs():
    """Routing, captions, the optimizer and the loss's extra terms each change what a step compiles: a record of one
    never plans another's compile."""
    import argparse

    base = vars(config_args(train.parse_args(list(map(str, TINY)))))
    key = lambda **kw: compiling.compile_key(argparse.Namespace(**(base | kw)), torch.device("cpu"), "default", "regional")  # noqa: E731
    changed = [dict(token_routing=0.5), dict(text_dim=32, text_length=16), dict(optimizer="muon"), dict(loss_terms="dispersive:0.25")]
    assert len({key(), *(key(**kw) for kw in changed)}) == 1 + len(changed)


def config_args(args):
    """`args` resolved as train.py resolves them (compile_key reads the resolved size, precision and batch)."""
    from ddpm_train.config import resolve

    return resolve(args)
