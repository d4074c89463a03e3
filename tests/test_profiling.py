"""Where the time goes: --profile, the step-time breakdown, plots and run.json."""

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ddpm_train.perf import compiling
from ddpm_train.perf import profiling
import train

TINY = [
    "--model", "tiny", "--image_size", "16", "--shapes_num_images", "32", "--train_batch_size", "4",
    "--num_inference_steps", "2", "--eval_batch_size", "1", "--lr_warmup_steps", "2",
    "--dataloader_num_workers", "0", "--save_images_epochs", "1",
    "--max_train_steps", "10", "--checkpointing_steps", "5", "--logging_steps", "2",
]  # fmt: skip


def run(output_dir, *extra):
    args = train.parse_args([*TINY, "--output_dir", str(output_dir), *map(str, extra)])
    args.timing_warmup_steps = 1  # a config.SETTINGS (train.py: 5): runs this short leave only their first step out
    return train.main(args)


def is_png(path):
    with Image.open(path) as image:
        image.verify()
        return image.format == "PNG"


GIT_REPOSITORY_VARIABLES = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")  # set, they would name another repository


def git(folder, *argv):
    """git in `folder`, whatever the environment says of other repositories or signing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "commit.gpgsign=false",
                           *argv], cwd=folder, env=env, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip


def checkout(folder):
    """A git checkout of one commit holding a ddpm_train/perf/profiling.py; returns the commit's hash."""
    (folder / "ddpm_train" / "perf").mkdir(parents=True)
    (folder / "ddpm_train" / "perf" / "profiling.py").write_text("# the code that ran\n")
    git(folder, "init", "-q")
    git(folder, "add", "ddpm_train")
    git(folder, "commit", "-q", "-m", "one commit")
    return git(folder, "rev-parse", "HEAD")


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """A 10-step run, whose code (profiling.py, which asks git) lies in a checkout of one commit of
    its own: not this repository, whose HEAD others may move while the tests run."""
    out = tmp_path_factory.mktemp("plain") / "run"
    commit = checkout(out.parent / "checkout")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(profiling, "__file__", str(out.parent / "checkout" / "ddpm_train" / "perf" / "profiling.py"))
        for name in GIT_REPOSITORY_VARIABLES:
            m.delenv(name, raising=False)
        run(out)
    (out.parent / "commit").write_text(commit)
    return out


@pytest.mark.slow
def test_profile_writes_a_trace_a_table_and_a_chart(tmp_path, capsys):
    out = tmp_path / "run"
    # a profile alone: --profile with --max_train_steps just long enough to record it (1 step + 1 warm-up +
    # config.SETTINGS' 3 recorded steps)
    run(out, "--profile", "--max_train_steps", 5)
    stdout = capsys.readouterr().out
    trace = json.loads((out / "profile" / "trace.json").read_text())
    names = [e.get("name", "") for e in trace["traceEvents"]]
    assert any(name.startswith("aten::") for name in names)
    assert sorted(name for name in names if name.startswith("ProfilerStep#")) == [f"ProfilerStep#{i}" for i in (1, 2, 3)]
    # the table names real operators, a convolution among the most expensive
    table = stdout[stdout.index("operators by self cpu time") :]
    assert re.search(r"aten::(convolution|mkldnn_convolution|_convolution|convolution_backward)", table)
    rows = json.loads((out / "profile" / "top_ops.json").read_text())
    assert len(rows) == 15 and all(r["self_ms"] >= 0 for r in rows)
    assert is_png(out / "profile" / "top_ops.png")


def test_a_run_that_ends_while_profiling_writes_what_it_recorded_and_leaves_no_profiler_running(tmp_path, capsys):
    """--max_train_steps 4 of the 5 a whole recording takes: the profiler is stopped at the end of training and
    what it recorded written, none left running to the interpreter's exit (which crashed)."""
    out = tmp_path / "run"
    run(out, "--profile", "--max_train_steps", 4)
    assert not torch.autograd.profiler._is_profiler_enabled
    trace = json.loads((out / "profile" / "trace.json").read_text())
    steps = sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
    assert steps[:2] == ["ProfilerStep#1", "ProfilerStep#2"]


class CountedStep:
    """What compiling.FastStep needs of a TrainStep to count its calls; it computes nothing."""

    def __init__(self):
        self.model, self.ema, self.accelerator = torch.nn.Linear(1, 1), None, None
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def __call__(self, micro_batches, step_number=None):
        return []


def first_recorded_step(fast):
    """The first step --profile records, as train.py's Meter starts it: after the step that leaves
    `fast` past its trial calls comes one warm-up step, then the recorded ones."""
    for number in range(1, 20):
        fast([], number)
        if profiling.past_trial_calls(fast):
            return number + 2


@pytest.mark.parametrize("mode, trial_calls, first", [(None, 0, 3), ("reduce-overhead", 3, 5), ("step-graph", 4, 6)])
def test_profile_records_no_trial_call_of_the_step(mode, trial_calls, first):
    fast = compiling.FastStep(CountedStep(), mode, torch.device("cpu"))
    # reduce-overhead: compile, CUDA graph trees' warm-up and recording; step-graph: 3 warm-up calls, the capture
    assert fast.trial_calls == trial_calls
    fast.current = CountedStep()  # in place of the compiled or captured step: nothing compiles
    assert first_recorded_step(fast) == first == max(1, trial_calls) + 2


def test_profile_waits_for_the_trial_calls_of_the_mode_a_step_falls_back_to():
    fast = compiling.FastStep(CountedStep(), "step-graph", torch.device("cpu"), say=lambda line: None)

    def capture_fails(micro_batches, step_number):
        if step_number == 4:
            raise RuntimeError("capture failed")
        return []

    fast.current = capture_fails
    # reduce-overhead (a CountedStep around the uncompiled network) takes steps 4 to 6 as its trial calls
    assert first_recorded_step(fast) == 8 and fast.mode == "reduce-overhead"


class FakeGpuProfile:
    """What torch.profiler hands `on_trace_ready` after one step on a GPU, built from torch's own
    FunctionEvent objects the way torch/autograd/profiler.py builds them from a kineto trace: each
    kernel is an event of its own (`device_type` CUDA) whose `linked_correlation_id` is the id of
    the CPU operator that launched it, and is also appended to that operator's `kernels` (its self
    device time). So is a range that a `record_function` draws on the GPU's timeline
    (pytorch/pytorch#130730). Times in microseconds."""

    TRITON = "triton_poi_fused__to_copy_native_group_norm_silu_0"  # Inductor names the launch and the kernel alike
    CONV = "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc"
    COPY = "void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>"

    def __init__(self, linked=True):
        from torch.autograd import DeviceType
        from torch.autograd.profiler_util import EventList, FunctionEvent

        ids = iter(range(1, 100))
        events = []

        def cpu(name, start, end):
            event = FunctionEvent(next(ids), name, thread=1, start_us=start, end_us=end, stack=[], use_device="cuda")
            events.append(event)
            return event

        def gpu(name, start, us, launched_by, **kw):
            kernel = FunctionEvent(
                next(ids), name, thread=7, start_us=start, end_us=start + us, stack=[], use_device="cuda",
                device_type=DeviceType.CUDA, **kw,
            )  # fmt: skip
            if linked:
                kernel.linked_correlation_id = launched_by.id
            else:  # as torch 2.11's events (the GPU image's): no such field
                vars(kernel).pop("linked_correlation_id", None)
            events.append(kernel)
            launched_by.append_kernel(name, 0, us)

        step = cpu("ProfilerStep#3", 0, 1000)
        gpu("ProfilerStep#3", 0, 900, step, is_user_annotation=True)  # a range on the GPU's timeline, not work
        cpu("aten::copy_", 5, 55)  # torch folds the inner copy_ into this one, with its kernels
        copy = cpu("aten::copy_", 10, 50)
        gpu(self.COPY, 20, 100, copy)
        gpu("Memcpy HtoD (Pageable -> Device)", 120, 10, copy)
        cpu("aten::conv2d", 60, 200)
        gpu(self.CONV, 130, 300, cpu("aten::cudnn_convolution", 70, 190))
        gpu(self.TRITON, 430, 50, cpu(self.TRITON, 210, 230))
        gpu(self.TRITON, 480, 50, cpu(self.TRITON, 240, 260))
        optimizer = cpu("Optimizer.step#AdamW.step", 300, 400)
        gpu("Optimizer.step#AdamW.step", 530, 40, optimizer, is_user_annotation=True)
        gpu("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 535, 30, cpu("aten::_fused_adamw_", 310, 390))
        self._events = EventList(events, use_device="cuda")
        self._events._build_tree()

    def events(self):
        return self._events

    def key_averages(self):
        return self._events.key_averages()


BUSY_US = 100 + 10 + 300 + 50 + 50 + 30  # the kernels' time: what the device was busy with


def test_kernel_table_lists_each_kernel_once_with_its_share_of_the_busy_time():
    rows = profiling.top_operators(FakeGpuProfile(), top=10)
    names = [r["name"] for r in rows]
    assert len(names) == len(set(names))  # the Triton kernel once, not once as an operator too
    assert not any(name.startswith(("aten::", "ProfilerStep", "Optimizer")) for name in names)  # kernels only
    assert names[0] == FakeGpuProfile.CONV and rows[0]["self_ms"] == pytest.approx(0.3)
    assert rows[0]["share"] == pytest.approx(300 / BUSY_US)  # of the busy time, not of twice it
    [triton] = [r for r in rows if r["name"] == FakeGpuProfile.TRITON]
    assert triton["calls"] == 2 and triton["share"] == pytest.approx(100 / BUSY_US)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)  # every kernel is listed: all the busy time
    assert {r["where"] for r in rows} == {"device"} and {r["level"] for r in rows} == {"kernels"}
    assert "device kernels" in profiling.format_top_operators(rows)
    # the top few: shares of the whole busy time, so less than 1
    assert sum(r["share"] for r in rows[:2]) == pytest.approx(400 / BUSY_US)


@pytest.mark.parametrize("linked", [True, False], ids=["torch-2.14", "torch-2.11-no-correlation-id"])
def test_operator_table_gives_each_kernel_to_the_operator_that_launched_it(linked):
    rows = profiling.top_operators(FakeGpuProfile(linked), top=10, level="operators")
    # aten::conv2d launched nothing itself; ProfilerStep and Optimizer.step are ranges, not work
    assert {r["name"]: r["calls"] for r in rows} == {
        "aten::cudnn_convolution": 1, "aten::copy_": 1, FakeGpuProfile.TRITON: 2, "aten::_fused_adamw_": 1
    }  # fmt: skip
    assert [r["self_ms"] for r in rows] == pytest.approx([0.3, 0.11, 0.1, 0.03])  # copy_'s kernel and memcpy
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert rows[0]["share"] == pytest.approx(300 / BUSY_US)
    assert {r["level"] for r in rows} == {"operators"}
    assert "operators by self device time" in profiling.format_top_operators(rows)


def test_top_operators_rejects_an_unknown_level():
    with pytest.raises(ValueError, match="kernels.*operators"):
        profiling.top_operators(FakeGpuProfile(), top=3, level="kernel")


def test_cpu_profile_ranks_operators_by_self_cpu_time_once_each():
    from torch.profiler import ProfilerActivity, profile

    conv = torch.nn.Conv2d(3, 8, 3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            conv(torch.randn(2, 3, 16, 16)).relu().sum().backward()
    for level in ("kernels", "operators"):  # no device events: CPU operators either way
        rows = profiling.top_operators(prof, top=100, level=level)
        names = [r["name"] for r in rows]
        assert len(names) == len(set(names)) and {r["where"] for r in rows} == {"cpu"}
        assert any("convolution" in name for name in names)
        assert sum(r["share"] for r in rows) <= 1.0 + 1e-6
    assert "operators by self cpu time" in profiling.format_top_operators(rows)


def test_breakdown_parts_are_non_negative_and_add_up_to_the_wall_time(plain_run):
    manifest = json.loads((plain_run / "run.json").read_text())
    parts, wall = manifest["time_breakdown_s"], manifest["train_wall_s"]
    assert set(parts) == {*profiling.STEP_PHASES, *profiling.PAUSES, "unaccounted"}
    assert all(v >= 0 for v in parts.values())
    measured = sum(v for k, v in parts.items() if k != "unaccounted")
    # The phases explain the wall time. What they leave out, the Python between this run's 10
    # steps (the progress bar, logging every 2 steps), is about 17 ms however fast the run:
    # 3% of 0.5 s, but 5.3% of 0.34 s in a warm pytest process. So 5% plus 30 ms: losing the
    # forward, the backward or the sampling (60 ms or more each, even then) still fails.
    assert wall * 0.95 - 0.03 <= measured <= wall * 1.05
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


def pixels(path):
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


@pytest.fixture
def plotted(monkeypatch):
    """{file name: [(label, steps, values), ...]}: the lines of each figure draw_run_plots saves, read
    off the figure as it is saved."""
    from matplotlib.figure import Figure

    lines, save = {}, Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        lines[Path(path).name] = [(ln.get_label(), list(ln.get_xdata()), list(ln.get_ydata())) for ax in fig.axes for ln in ax.get_lines()]  # fmt: skip
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return lines


def test_plots_are_drawn_from_the_logged_values(plain_run, tmp_path, plotted):
    names = ("loss.png", "lr.png", "images_per_s.png")
    assert all(is_png(plain_run / "plots" / name) for name in names)
    drawn_in_training = {name: pixels(plain_run / "plots" / name) for name in names}
    profiling.draw_run_plots(plain_run)
    logged = profiling.read_scalars(plain_run)
    steps, losses = logged["loss"]
    assert steps == [2, 4, 6, 8, 10]
    assert plotted["loss.png"] == [("raw", steps, losses), ("smoothed", steps, profiling.smooth(losses))]
    assert plotted["lr.png"] == [("raw", *logged["lr"])] and plotted["images_per_s.png"] == [("raw", *logged["images_per_s"])]
    assert set(plotted) == set(names)  # no MFU on a CPU
    # the PNGs train.py left are these pictures
    assert all(np.array_equal(pixels(plain_run / "plots" / name), drawn_in_training[name]) for name in names)

    # log one value differently: the plot's line and its picture follow
    from torch.utils.tensorboard import SummaryWriter

    other = tmp_path / "other"
    with SummaryWriter(str(other / "logs")) as writer:
        for step, value in zip(steps, losses):
            writer.add_scalar("loss", value * (3 if step == 4 else 1), step)
    profiling.draw_run_plots(other)
    [(_, other_steps, raw), _] = plotted["loss.png"]
    assert other_steps == steps and raw[1] == pytest.approx(3 * losses[1]) and raw[:1] + raw[2:] == losses[:1] + losses[2:]
    assert not np.array_equal(pixels(other / "plots" / "loss.png"), drawn_in_training["loss.png"])


def test_plots_command(plain_run, tmp_path, capsys):
    assert profiling.main(profiling.parse_args(["plots", str(plain_run)])) == 0
    assert str(plain_run / "plots" / "loss.png") in capsys.readouterr().out
    with pytest.raises(SystemExit) as stopped:
        profiling.main(profiling.parse_args(["plots", str(tmp_path)]))
    assert stopped.value.code == 2
    assert "has no logs/ folder" in capsys.readouterr().err


def test_run_manifest_has_every_field(plain_run):
    m = json.loads((plain_run / "run.json").read_text())
    assert m["config"]["model"] == "tiny" and m["config"]["max_train_steps"] == 10
    assert m["git_commit"] == (plain_run.parent / "commit").read_text()  # its code's checkout, exactly
    assert set(m["versions"]) >= {"python", "torch", "diffusers", "accelerate"} and m["versions"]["torch"]
    assert m["device"]["type"] == "cpu" and m["device"]["count"] == 1
    assert {"cuda", "driver"} <= set(m["device"])
    assert m["start_time"] <= m["end_time"]  # ISO 8601 in UTC: string order is time order
    assert m["steps"] == 10 and isinstance(m["final_loss"], float) and m["final_loss"] > 0
    assert m["median_step_time_s"] > 0 and m["images_per_s"] > 0
    assert m["mfu"] is None and m["hfu"] is None  # no known peak on a CPU
    assert m["peak_memory_gib"] > 0
    assert m["samples_dir"].endswith("samples") and m["checkpoints"][-1].endswith("checkpoint-10")


def test_the_commit_is_the_checkouts_with_dirty_for_local_changes_and_none_outside_git(tmp_path, monkeypatch):
    commit = checkout(tmp_path / "checkout")
    code = tmp_path / "checkout" / "ddpm_train" / "perf" / "profiling.py"
    monkeypatch.setattr(profiling, "__file__", str(code))
    for name in GIT_REPOSITORY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert profiling.git_commit() == commit
    (tmp_path / "checkout" / "notes.txt").write_text("untracked")  # not a change to the code that ran
    assert profiling.git_commit() == commit
    code.write_text("# changed\n")
    assert profiling.git_commit() == f"{commit}-dirty"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no checkout above it counts
    monkeypatch.setattr(profiling, "__file__", str(tmp_path / "elsewhere" / "ddpm_train" / "perf" / "profiling.py"))
    assert profiling.git_commit() is None


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


def test_quiet_known_compile_warnings_drops_diffusers_upsampling_lru_cache_warning_only():
    import warnings

    from diffusers.models.upsampling import Upsample2D

    def compile_upsample(quiet, *other_warnings):
        """The warnings of Dynamo tracing diffusers' Upsample2D in bf16 (it calls the lru_cache'd
        is_torch_version), then of `other_warnings`."""
        torch._dynamo.reset()
        torch._dynamo.utils.warn_once_cache.clear()  # else Dynamo warns once per process
        up = Upsample2D(4, use_conv=True).to(torch.bfloat16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if quiet:
                profiling.quiet_known_compile_warnings()
            torch.compile(up, backend="eager")(torch.randn(1, 4, 8, 8, dtype=torch.bfloat16))
            for message in other_warnings:
                warnings.warn(message)
        torch._dynamo.reset()
        return [str(w.message) for w in caught]

    real = compile_upsample(quiet=False)  # the real messages, so the filter is tested on them
    assert real and all(m.startswith("Dynamo detected a call to a `functools.lru_cache`-wrapped") for m in real)
    assert all("'upsampling.py:" in m and "/diffusers/models/upsampling.py" in m for m in real)
    other_site = real[0].replace("upsampling.py", "mine.py")  # the same warning for a call elsewhere
    assert compile_upsample(True, other_site, "an unrelated warning") == [other_site, "an unrelated warning"]
    # catch_warnings put the filters back: the filter lasts only where it is installed
    assert not any(f[1] is not None and f[1].pattern.startswith("Dynamo") for f in warnings.filters)
