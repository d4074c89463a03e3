import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch
from PIL import Image

from ddpm_train.training import checkpoint
from ddpm_train import config
from ddpm_train.networks import model as models
from ddpm_train.training import optimizer as optimizers
from ddpm_train.training import builder
from bench import speed as bench
from conftest import ROOT
from ddpm_train.errors import ConfigError
from test_train import run as run_train
from test_train import scalars, spy_on_build, visible

TINY = bench.WORKLOADS["tiny"]
CPU = torch.device("cpu")
VARIANTS = bench.all_variants()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One CPU thread: tiny tensors gain nothing from two, and lose much (compiled code most)
    when other processes share the cores, as they do on a 2-core machine running tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fixed_step():
    """Weights, a uint8 batch, fixed model inputs and the fp32 eager step's loss and gradients on them."""
    torch.manual_seed(0)
    init_state = models.build_network(TINY["model"], TINY["image_size"]).state_dict()
    images = torch.randint(0, 256, (TINY["batch_size"], 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    inputs = bench.check_inputs(images, 0, CPU)
    reference = bench.reference_step(TINY, init_state, images, inputs, CPU)
    return init_state, images, inputs, reference


UNET_VARIANTS = [v for v in VARIANTS if v["name"] not in bench.DIT_ROWS_BY_NAME]  # a DiT's rows: their own tests


@pytest.mark.slow
@pytest.mark.parametrize("variant", UNET_VARIANTS, ids=[v["name"] for v in UNET_VARIANTS])
def test_each_variant_matches_the_fp32_eager_step(fixed_step, variant):
    if variant["cuda_only"]:
        pytest.skip(f"{variant['cuda_only']}: runs only on a CUDA GPU")
    init_state, images, inputs, reference = fixed_step
    settings = variant["settings"]
    torch.compiler.reset()  # so that a compiled variant compiles here rather than reusing another row's graph
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    step = bench.TrainingStep(settings, TINY, init_state, images, CPU)

    # the variant is what its settings say
    assert step.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last) == settings["channels_last"]
    assert bool(step.optimizer.defaults["fused"]) == settings["fused_adam"]
    # diffusers' example leaves foreach to torch, which picks the per-parameter loop for CPU tensors
    kind = "fused" if settings["fused_adam"] else "foreach" if settings["adam_foreach"] else "per-parameter"
    assert bench.optimizer_kind(step.optimizer, CPU) == kind
    assert (step.guard is not None) == settings["nonfinite_guard"]
    assert step.ema.foreach == settings["ema_foreach"]
    assert (step.model is step.unet) == (settings["compile_mode"] is None)

    check = bench.check_variant(step, settings, inputs, reference, CPU)
    assert check["passed"], check
    if settings["compile_mode"]:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before  # it really compiled
    if settings["precision"] == "bf16":
        # autocast really ran in bf16: far from fp32's rounding, within bf16's tolerance
        assert check["tolerance"] == bench.TOLERANCE["bf16"]
        assert check["grad_rel_err"] > 100 * bench.TOLERANCE["fp32"]
    else:
        assert check["tolerance"] == bench.TOLERANCE["fp32"]
    del step
    bench.release_memory(CPU)


def test_the_check_fails_when_the_step_differs(fixed_step):
    init_state, images, (clean, noise, timesteps), reference = fixed_step
    settings = next(v for v in VARIANTS if v["name"] == "reference")["settings"]
    step = bench.TrainingStep(settings, TINY, init_state, images, CPU)
    check = bench.check_variant(step, settings, (clean, noise, (timesteps + 7) % 1000), reference, CPU)
    assert not check["passed"] and check["grad_rel_err"] > 1e-3, check


def test_fused_and_foreach_adamw_take_the_same_steps():
    def three_steps(fused):
        torch.manual_seed(0)
        unet = models.build_network("tiny", 16)
        start = torch.cat([p.detach().reshape(-1).clone() for p in unet.parameters()])
        optimizer = optimizers.build("adamw", unet, fused, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, eps=1e-8)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in unet.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            optimizer.step()
        return optimizer, start, torch.cat([p.detach().reshape(-1) for p in unet.parameters()])

    fused_optimizer, start, fused = three_steps(True)
    foreach_optimizer, _, foreach = three_steps(False)
    assert fused_optimizer.defaults["fused"] and foreach_optimizer.defaults["foreach"]
    assert (fused - start).abs().max() > 1e-3  # the steps moved the weights
    torch.testing.assert_close(fused, foreach, rtol=0, atol=1e-6)


def test_train_default_row_follows_train_py(monkeypatch):
    cpu = bench.train_default_variant()["settings"]
    assert cpu["precision"] == "fp32" and cpu["compile_mode"] is None and not cpu["channels_last"]
    assert cpu["sync_every"] == config.parse_args([]).logging_steps
    # With a GPU, train.py's defaults are the ladder up to no_syncs, with --compile_mode auto, which
    # picks 'default' for ref128 (bound by the GPU) and CUDA graphs for adm64 (bound by launches).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    gpu = bench.train_default_variant()
    no_syncs = next(v for v in bench.LADDER if v["name"] == "no_syncs")["settings"]
    assert gpu["settings"] == dict(no_syncs, compile_mode="auto", channels_last=False, compile_scope="auto")  # NCHW: measured faster on an H100
    assert "(the settings of no_syncs where --compile_mode auto picks 'default' but channels_last=False)" in gpu["changed"]
    cuda = torch.device("cuda")
    for name, mode in (("ref128", "default"), ("adm64", "reduce-overhead")):
        assert bench.resolve_settings(gpu["settings"], bench.WORKLOADS[name], bench.WORKLOADS[name]["batch_size"], cuda)["compile_mode"] == mode


def test_a_row_and_a_training_run_take_their_pieces_from_one_builder(fixed_step, tmp_path, monkeypatch):
    """builder.build makes a ladder row's network, objective, optimizer, LR schedule and EMA as it makes a
    run's, and the row's step takes them as built: diffusers_example's AdamW too (as torch picks: adam_foreach None)."""
    init_state, images, _, _ = fixed_step
    built, real = [], builder.build
    monkeypatch.setattr(builder, "build", lambda *args, **kwargs: built.append(real(*args, **kwargs)) or built[-1])
    run_train(tmp_path / "run", "--max_train_steps", 1, "--objective", "ddpm")  # the ladder times the DDPM step
    example, default = (bench.TrainingStep(v["settings"], TINY, init_state, images, CPU)
                        for v in (bench.DIFFUSERS_EXAMPLE, bench.train_default_variant()))  # fmt: skip
    assert len(built) == 3
    run, example_pieces, row = built
    for step, pieces in ((example, example_pieces), (default, row)):
        assert step.step.optimizer is pieces.optimizer and step.step.lr_scheduler is pieces.lr_scheduler
        assert pieces.lr_scheduler.optimizer is pieces.optimizer
    assert example_pieces.optimizer.defaults["foreach"] is None and not example_pieces.optimizer.defaults["fused"]
    for piece in ("network", "objective", "ema", "noise_scheduler"):
        assert type(getattr(run, piece)) is type(getattr(row, piece)), piece
    adamw = ("betas", "weight_decay", "eps", "fused")  # the run's optimizer is accelerate's wrapper of the same AdamW
    assert [run.optimizer.param_groups[0][k] for k in adamw] == [row.optimizer.param_groups[0][k] for k in adamw]
    assert [p.shape for p in run.network.parameters()] == [p.shape for p in row.network.parameters()]
    assert run.objective.prediction_type == row.objective.prediction_type


def test_the_rows_after_the_cuda_graphs_change_one_thing_each_and_the_yardstick_comes_first():
    rows = {v["name"]: v for v in VARIANTS}
    assert VARIANTS[0]["name"] == "diffusers_example" and VARIANTS[1]["name"] == "reference"

    def changed(a, b):
        return {k for k in rows[a]["settings"] if rows[a]["settings"][k] != rows[b]["settings"][k]}

    # force_layout starts again from no_syncs: CUDA graphs (the rows above it) are not inherited
    assert changed("force_layout", "no_syncs") == {"force_layout"}
    assert rows["force_layout"]["settings"]["compile_mode"] == "default" and "'default' again" in rows["force_layout"]["changed"]
    assert changed("fused_norm", "no_syncs") == {"compile_mode", "compile_scope", "fused_norm"}  # as train.py --fused_norm runs it
    assert rows["force_layout"]["cuda_only"] and rows["fused_norm"]["cuda_only"]
    # diffusers' train_unconditional.py: eager, bf16, NCHW, torch's default AdamW, EMA without foreach, a sync per step
    example = rows["diffusers_example"]["settings"]
    assert example == dict(bench.STRICT_FP32, precision="bf16", conv_tf32=True, adam_foreach=None, sync_every=1)
    assert not rows["diffusers_example"]["cuda_only"]


def test_the_fused_norm_row_is_train_pys_step_with_fused_norm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    row = next(v for v in bench.LADDER if v["name"] == "fused_norm")["settings"]
    # from the function the train_default row is built by: train.py never forces Inductor's layout
    train = bench.train_settings(fused_norm=True, channels_last=True)
    assert {k: row[k] for k in row if row[k] != train[k]} == {} and row.keys() == train.keys()
    assert train == dict(bench.train_settings(), fused_norm=True, channels_last=True)
    # python -m bench --fused_norm: the train_default row is it (its channels_last follows, as fused_norm needs it)
    flagged = bench.all_variants(bench.parse_args(["--fused_norm"]).train_settings)[-1]
    assert flagged["name"] == "train_default" and flagged["settings"] == train
    assert flagged["changed"].startswith("train.py's step with fused_norm=True (the settings of ")


def test_the_fused_norm_and_force_layout_settings_reach_the_step(fixed_step, monkeypatch):
    from ddpm_train.networks import fused_norm

    init_state, images, inputs, reference = fixed_step
    calls = []
    monkeypatch.setattr(bench.compiling, "compile_network", lambda model, mode, force_layout=False, scope="whole": calls.append((mode, force_layout)) or model)
    settings = dict(bench.STRICT_FP32, fused_norm=True, force_layout=True)
    step = bench.TrainingStep(settings, TINY, init_state, images, CPU)
    assert calls == [(None, True)]
    blocks = [m for m in step.unet.modules() if type(m).__name__.endswith("ResnetBlock2D")]
    assert blocks and all(type(m) is fused_norm.FusedResnetBlock2D for m in blocks)
    assert type(step.unet.conv_norm_out) is fused_norm.GroupNormSiLU and isinstance(step.unet.conv_act, torch.nn.Identity)
    # NCHW on a CPU takes F.group_norm inside the swapped modules: the fp32 step is unchanged
    check = bench.check_variant(step, settings, inputs, reference, CPU)
    assert check["passed"] and check["tolerance"] == bench.TOLERANCE["fp32"], check


def test_fused_norm_is_off_in_train_py_and_bench_pys_needs_a_gpu_and_channels_last(tmp_path, capsys, monkeypatch):
    assert config.resolve(config.parse_args([])).fused_norm is False  # not measured faster yet; no train.py flag
    message = "--fused_norm needs a CUDA GPU and --channels_last (the kernels run on NHWC CUDA tensors)"
    argv = ["--workload", "tiny", "--variants", "train_default", "--output", str(tmp_path), "--fused_norm"]
    with pytest.raises(SystemExit) as stopped:  # on this CPU
        bench.main(bench.parse_args(argv))
    assert stopped.value.code == 2
    err = visible(capsys.readouterr().err)
    assert len(err) == 1 and message in err[0] and err[0].startswith("bench: error:"), err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    with pytest.raises(ConfigError, match="add --channels_last"):
        bench.train_settings(fused_norm=True, channels_last=False)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        bench.train_settings("--cpu", fused_norm=True)
    assert bench.train_settings(fused_norm=True)["channels_last"]  # fused_norm turns channels_last on, which it needs


@pytest.mark.slow
def test_bench_on_a_cpu_over_two_batch_sizes(tmp_path, capsys):
    argv = ["--workload", "tiny", "--batch_sizes", "2,1", "--steps", "2", "--warmup", "1", "--output", str(tmp_path),
            "--variants", "reference,tf32,train_default", "--tag", "run"]  # fmt: skip
    assert bench.main(bench.parse_args(argv)) == 0
    stdout = capsys.readouterr().out

    # versions first, then the tables
    import diffusers

    head = stdout.splitlines()[:5]
    assert head[0].startswith("device") and "CPU" in head[0]
    assert f"torch        {torch.__version__}" in head and f"diffusers    {diffusers.__version__}" in head
    assert re.search(r"^2\s+tf32\s+skipped: TF32 is a CUDA tensor-core format: not on cpu", stdout, re.M)

    result = json.loads((tmp_path / "run.json").read_text())
    assert {"device", "torch", "diffusers", "cuda", "date", "command"} <= set(result["environment"])
    assert result["environment"]["command"] == "python -m bench " + " ".join(argv)
    rows = result["results"]
    names = ["reference", "tf32", "train_default"]
    assert [(r["batch_size"], r["variant"]) for r in rows] == [(b, n) for b in (1, 2) for n in names]
    for r in rows:
        if r["variant"] == "tf32":
            assert r["status"] == "skipped" and "CUDA" in r["reason"]
            continue
        assert r["status"] == "ok" and r["check"]["passed"], r
        assert len(r["step_times_s"]) == 2 and r["step_time_s_median"] == statistics.median(r["step_times_s"])
        assert r["step_time_s_p10"] <= r["step_time_s_median"] <= r["step_time_s_p90"]
        assert r["images_per_s"] == pytest.approx(r["batch_size"] / r["step_time_s_median"])
        assert r["achieved_tflops"] == pytest.approx(r["flops_per_step"] / r["step_time_s_median"] / 1e12)
        assert r["mfu"] is None and r["peak_memory_gib"] is None  # a CPU has no known peak
        reference = next(x for x in rows if x["variant"] == "reference" and x["batch_size"] == r["batch_size"])
        assert r["speedup_over"] == "reference"
        assert r["speedup"] == pytest.approx(reference["step_time_s_median"] / r["step_time_s_median"])
        assert r["first_call_s"] > 0 and r["optimizer"] == ("fused" if r["settings"]["fused_adam"] else "foreach")
    flops_at = {r["batch_size"]: r["flops_per_step"] for r in rows}
    assert flops_at[2] == 2 * flops_at[1] > 0
    # bench/on_gpu.sh packs this JSON (bench_run), and its summary reads the last row that ran, the others as notes
    sys.path.insert(0, str(ROOT / "bench"))
    import pack_summary

    (tmp_path / "pack").mkdir()
    shutil.copyfile(tmp_path / "run.json", tmp_path / "pack" / "run.bench.json")
    numbers = pack_summary.ladder_numbers(tmp_path / "pack", dict(name="run"))
    assert numbers["mode"] == "ladder train_default" and numbers["ms/step"] == 1000 * rows[-1]["step_time_s_median"]
    assert numbers["compile s"] == rows[-1]["first_call_s"]  # a cold part's one-row ladder: its compile
    assert numbers["notes"].count(" ms") == 4  # reference and train_default at each batch size; tf32 did not run
    moved = [r for r in rows if r.get("loss_vs_first")]  # a row whose mean loss is not the first's says by how much
    assert numbers["notes"].count(" loss ") == len(moved) and all(f"{100 * r['loss_vs_first']:+.2f}%" in numbers["notes"] for r in moved)

    # the printed tables are also in the .txt, and the chart is a real PNG
    text = (tmp_path / "run.txt").read_text()
    assert "tiny: tiny (177,427 parameters) at 16px, batch 2" in text
    progress = re.compile(r"^  tiny batch \d+: \w+ \.\.\.$")
    assert text.splitlines() == [line for line in stdout.splitlines() if not progress.match(line)][: len(text.splitlines())]
    with Image.open(tmp_path / "run.png") as chart:
        assert chart.format == "PNG" and chart.width > 300 and chart.height > 200

    # --redraw draws the chart again from the JSON alone (for a GPU machine without matplotlib)
    (tmp_path / "run.png").unlink()
    assert bench.main(bench.parse_args(["--redraw", str(tmp_path / "run.json")])) == 0
    with Image.open(tmp_path / "run.png") as chart:
        assert chart.format == "PNG"


def fake_run_variant(out_of_memory_above, variant_name):
    """Stands in for run_variant: a quick row, or out of memory for `variant_name` above a batch size."""

    def run(variant, workload, batch_size, *args):
        if variant["name"] == variant_name and batch_size > out_of_memory_above:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        check = dict(precision="fp32", tolerance=1e-5, passed=True, loss_rel_err=0.0, grad_rel_err=0.0)
        return dict(status="ok", compile_mode=None, optimizer="foreach", check=check, first_call_s=0.1, step_times_s=[0.01],
                    step_time_s_median=0.01, step_time_s_p10=0.01, step_time_s_p90=0.01, mean_loss=1.0,
                    peak_memory_gib=None)  # fmt: skip

    return run


@pytest.mark.slow
def test_the_batch_sweep_stops_a_variant_at_out_of_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run_variant", fake_run_variant(1, "fused_adamw"))
    monkeypatch.setattr(bench, "reference_step", lambda *args: None)
    argv = ["--workload", "tiny", "--batch_sizes", "1,2,4", "--variants", "reference,fused_adamw",
            "--output", str(tmp_path), "--tag", "sweep"]  # fmt: skip
    assert bench.main(bench.parse_args(argv)) == 0
    rows = json.loads((tmp_path / "sweep.json").read_text())["results"]
    status = {(r["variant"], r["batch_size"]): (r["status"], r.get("reason", "")) for r in rows}
    assert [status[("reference", b)][0] for b in (1, 2, 4)] == ["ok", "ok", "ok"]
    assert status[("fused_adamw", 1)][0] == "ok"
    assert status[("fused_adamw", 2)][0] == "oom" and "out of memory at batch 2" in status[("fused_adamw", 2)][1]
    assert status[("fused_adamw", 4)] == ("skipped", "out of memory at batch 2")


@pytest.mark.slow
def test_the_ladder_starts_the_compile_workers_early_unless_told_inductors_timing(tmp_path, monkeypatch):
    """As train.py, the ladder asks for Inductor's compile workers at its start (compiling.start_compile_workers: on a
    GPU); --compile_workers inductor leaves them to Inductor, for on_gpu.sh's cold part to compare the two."""
    monkeypatch.setattr(bench, "run_variant", fake_run_variant(99, "reference"))
    monkeypatch.setattr(bench, "reference_step", lambda *args: None)
    calls = []
    monkeypatch.setattr(bench.compiling, "start_compile_workers", lambda device, mode: calls.append((device.type, mode)))
    argv = ["--workload", "tiny", "--variants", "reference", "--output", str(tmp_path), "--tag", "w"]
    assert bench.main(bench.parse_args(argv)) == 0 and calls == [("cpu", "default")]
    assert bench.main(bench.parse_args([*argv, "--compile_workers", "inductor"])) == 0 and len(calls) == 1


def test_a_row_that_breaks_is_recorded_and_fails_the_run(tmp_path, monkeypatch, capsys):
    def broken(*args):
        raise RuntimeError("no kernel image is available\nsecond line")

    monkeypatch.setattr(bench, "run_variant", broken)
    monkeypatch.setattr(bench, "reference_step", lambda *args: None)
    argv = ["--workload", "tiny", "--variants", "reference", "--output", str(tmp_path), "--tag", "broken"]
    assert bench.main(bench.parse_args(argv)) == 1
    row = json.loads((tmp_path / "broken.json").read_text())["results"][0]
    assert row["status"] == "error" and row["reason"] == "RuntimeError: no kernel image is available"
    assert "tiny batch 8 reference" in capsys.readouterr().err


# `python -m bench` with a Ctrl-C once it has imported, in its ladder's first row (bench.speed is imported first:
# bench/__main__.py finds it patched)
CTRL_C_IN_THE_LADDER = """
import os, runpy, signal, sys, time
from bench import speed
def interrupted(*args):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
speed.run_variant = interrupted
sys.argv = ["bench", *sys.argv[1:]]
runpy.run_module("bench", run_name="__main__")
"""


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_exit_130_while_bench_imports_and_while_it_times(tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "bench", "--output", str(tmp_path)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(0.5)  # torch's import alone takes longer
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130 and err.strip() == "bench: interrupted while starting: nothing was written", err
    done = subprocess.run([sys.executable, "-c", CTRL_C_IN_THE_LADDER, "--workload", "tiny", "--variants", "eager",
                           "--output", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    said = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 130 and said == "bench: interrupted: the rows measured so far are in the .json in --output", done.stderr


BAD_INPUTS = [
    (["--workload", "huge"], "invalid choice: 'huge'"),
    (["--workload", "edm2tiny"], "the ladder times the DDPM step; compare EDM2 with --sweep model"),
    (["--batch_sizes", "0,8"], "--batch_sizes must be integers of at least 1"),
    (["--batch_sizes", "8,many"], "--batch_sizes takes integers separated by commas"),
    (["--variants", "reference,warp"], "unknown --variants 'warp'"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--warmup", "-1"], "--warmup must be at least 0"),
    # another command's flags, which would be left unread (abbreviated too, as argparse takes them)
    (["--values", "8,16"], "--values is --sweep's, and the ladder does not read it: add --sweep NAME (batch_size,"),
    (["--num_im", "64"], "--num_images is --sweep's, and the ladder does not read it"),
    (["--rows", "ddpm"], "--rows is --quality's, and the ladder does not read it: add --quality, or leave it out"),
    (["--quality", "--sweep_epochs", "3"], "--sweep_epochs is --sweep's, and --quality does not read it: leave it out"),
    (["--sweep", "batch_size", "--quality_images", "64"], "--quality_images is --quality's, and --sweep does not"),
    (["--sweep", "batch_size", "--quality"], "--sweep and --quality are two commands: give one"),
    (["--quality", "--redraw", "{file}"], "--quality and --redraw are two commands: give one"),
    (["--train_args=--seed 1"], "--train_args is --sweep's and --quality's, and the ladder does not read it: add --sweep"),
    (["--quality", "--steps", "3"], "--steps is the ladder's, and --quality does not read it: leave it out"),
    (["--sweep", "batch_size", "--channels_last"], "--channels_last is the ladder's, and --sweep does not read it"),
    (["--output", "{file}"], "cannot write to --output"),
    (["--redraw", "{file}"], "not the JSON of a python -m bench run"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("not a folder")
    argv = ["--workload", "tiny"] + [a.format(file=tmp_path / "file") for a in argv]
    try:
        code = bench.main(bench.parse_args(argv))
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = visible(capsys.readouterr().err)
    assert len(err) == 1 and message in err[0] and err[0].startswith("bench: error:"), err


def test_a_read_only_output_is_refused_before_the_timing(tmp_path, capsys, monkeypatch):
    # root writes through chmod: the folder read-only as a mount's refusal says
    monkeypatch.setattr(checkpoint.os, "access", lambda path, mode: path != tmp_path)
    monkeypatch.setattr(bench, "run_variant", lambda *a, **k: pytest.fail("timed"))
    with pytest.raises(SystemExit) as stopped:
        bench.main(bench.parse_args(["--workload", "tiny", "--output", str(tmp_path)]))
    assert stopped.value.code == 2 and "cannot write in" in capsys.readouterr().err


@pytest.mark.slow
def test_train_py_runs_compiled_channels_last_with_fused_adamw(tmp_path, capsys, monkeypatch):
    """channels_last has no train.py flag; the ladder sets it on the configuration, as here."""
    built = spy_on_build(monkeypatch)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold compile, recorded there
    out = tmp_path / "run"
    config = run_train(out, "--max_train_steps", 2, "--compile_mode", "default", "--logging_steps", 1,
                       "--checkpointing_steps", 2, "--save_images_epochs", 100, channels_last=True)  # fmt: skip
    assert config["compile_mode"] == "default" and config["settings"]["channels_last"] and config["settings"]["fused_adam"]
    (pieces,) = built  # what the step trained: the network's convolutions channels_last, AdamW fused
    assert pieces.network.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert pieces.optimizer.defaults["fused"] is True
    assert [step for step, _ in scalars(out)["loss"]] == [1, 2]
    assert all(torch.isfinite(torch.tensor(v)) for _, v in scalars(out)["loss"])
    stdout = capsys.readouterr().out
    assert re.search(r"^final: step 2/2 \| loss [\d.]+ \|", stdout, re.M)
    # the compile is said, timed as its own part of the breakdown, and its artifacts kept for the next run
    assert "training tiny (177,427 parameters, --objective ddpm) on 64 images" in stdout  # the objective, said (shapes: DDPM)
    assert "step --compile_mode default; each repeated block compiled once" in stdout  # (auto: 2 steps would not repay it)
    assert "compiling the step (default) ..." in stdout and re.search(r"^compiled the step in [\d.]+ s; ", stdout, re.M)
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["compile_s"] > 0 and manifest["time_breakdown_s"]["compile"] == pytest.approx(manifest["compile_s"], rel=0.2)
    assert 0 < manifest["compile_phases_s"]["_compile.compile_inner"] <= manifest["compile_s"]  # where it went, by torch's timers
    assert (out / "compile_cache.bin").stat().st_size > 0
    # and this machine's record of it, from which the next run of the same step predicts a warm compile
    (recorded,) = json.loads((tmp_path / "inductor" / "train_py_compiles.json").read_text()).items()
    assert "| default regional |" in recorded[0] and recorded[1] == pytest.approx(manifest["compile_s"], abs=0.1)

    # what is saved is the plain UNet, not the compiled wrapper: the same keys as a fresh model
    from diffusers import UNet2DModel

    saved = UNet2DModel.from_pretrained(str(out / "unet"))
    assert saved.state_dict().keys() == models.build_network("tiny", 16).state_dict().keys()
    assert (out / "checkpoints" / "checkpoint-2").is_dir()


def test_the_fast_path_is_on_by_default_only_with_a_gpu(monkeypatch):
    cpu = config.resolve(config.parse_args([]))
    assert cpu.compile_mode == "off" and not cpu.cudnn_benchmark
    assert cpu.fused_adam  # fused AdamW runs on a CPU too, and is what the non-finite guard skips steps in
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = config.resolve(config.parse_args(["--mixed_precision", "no"]))
    assert gpu.cudnn_benchmark and gpu.compile_mode == "auto" and gpu.fused_adam
    assert not gpu.channels_last  # measured slower for ref128 on an H100 (BENCHMARKS.md)
    chosen = config.parse_args(["--mixed_precision", "no", "--compile_mode", "off"])
    chosen.fused_adam, chosen.channels_last = False, True  # as the ladder sets them: no train.py flag
    chosen = config.resolve(chosen)
    assert chosen.compile_mode == "off" and not chosen.fused_adam and chosen.channels_last
    forced_cpu = config.resolve(config.parse_args(["--mixed_precision", "no", "--cpu"]))
    assert forced_cpu.compile_mode == "off" and not forced_cpu.cudnn_benchmark


@pytest.mark.slow
def test_a_dit_workload_runs_train_pys_step_eager_compiled_and_as_train_py_picks(tmp_path, monkeypatch):
    """The dit workloads' rows without --variants: train.py's step (train_default's settings) with --compile_mode off,
    default compiled whole and regionally, and auto; the others' rows stay every row. On a GPU, auto compiles DiT-XL/2 in
    'default' (45.6 TFLOP a step keeps it busy), the whole network: the ladder times a run of any length, and a long
    run's faster step repays the whole network's longer compile."""
    dit = bench.validate(bench.parse_args(["--workload", "dit", "--output", str(tmp_path)]))
    assert dit.variants == ["eager", "compiled", "regional", *bench.DIT_ROWS_BY_NAME, "train_default"]
    unet_rows = [v["name"] for v in VARIANTS if v["name"] not in bench.DIT_ROWS_BY_NAME]
    assert bench.validate(bench.parse_args(["--workload", "tiny", "--output", str(tmp_path)])).variants == unet_rows
    rows = {v["name"]: v["settings"] for v in VARIANTS}
    assert rows["eager"] == dict(rows["train_default"], compile_mode=None) == rows["train_default"]  # a CPU's default is eager
    assert rows["compiled"] == dict(rows["train_default"], compile_mode="default", compile_scope="whole")
    assert rows["regional"] == dict(rows["train_default"], compile_mode="default", compile_scope="regional")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    gpu = {v["name"]: v["settings"] for v in bench.all_variants()}
    assert gpu["train_default"]["compile_mode"] == "auto" and gpu["train_default"]["precision"] == "bf16"
    assert gpu["eager"] == dict(gpu["train_default"], compile_mode=None)
    assert gpu["compiled"] == dict(gpu["train_default"], compile_mode="default", compile_scope="whole")
    workload = bench.WORKLOADS["dit"]
    picked = bench.resolve_settings(gpu["train_default"], workload, 64, torch.device("cuda"))
    assert picked["compile_mode"] == "default" and picked["compile_scope"] == "whole"


@pytest.mark.slow
def test_bench_times_a_dit_on_latents(tmp_path, capsys):
    """A latent workload's step takes float latents of its channels (a --vae run's batch after its cache), checked against
    the fp32 eager step on them, with the DiT's FLOPs at its latents' size and channels."""
    argv = ["--workload", "dit-tiny", "--variants", "eager,routed,train_default", "--steps", "2", "--warmup", "1",
            "--output", str(tmp_path), "--tag", "dit"]  # fmt: skip
    assert bench.main(bench.parse_args(argv)) == 0
    rows = json.loads((tmp_path / "dit.json").read_text())["results"]
    workload = bench.WORKLOADS["dit-tiny"]
    per_image = bench.flops.step_flops("dit-tiny", 8, 1, channels=4)
    assert per_image["params"] == sum(p.numel() for p in models.build_network("dit-tiny", 8, channels=4).parameters())
    assert [r["variant"] for r in rows] == ["eager", "routed", "train_default"]
    routed = rows.pop(1)  # its tokens routed: its own FLOPs, and no check against the step it does not compute
    assert routed["status"] == "ok" and routed["check"]["passed"] is None
    assert routed["flops_per_step"] == 4 * bench.flops.step_flops("dit-tiny", 8, 1, channels=4, routing="0.5")["model_flops"]
    assert routed["flops_per_step"] < rows[0]["flops_per_step"]
    # the same step on a CPU, its timed steps drawing the same noise: the same mean loss, to the bit
    assert rows[1]["loss_vs_first"] == 0.0 and rows[0]["mean_loss"] == rows[1]["mean_loss"]
    for r in rows:
        assert r["status"] == "ok" and r["check"]["passed"] and r["check"]["tolerance"] == bench.TOLERANCE["fp32"], r
        assert (r["channels"], r["flops_per_step"]) == (4, workload["batch_size"] * per_image["model_flops"])
    assert f"dit-tiny: dit-tiny ({per_image['params']:,} parameters) at 8x8x4 latents, batch 4" in capsys.readouterr().out
    # the step's network takes the latents' channels, and the check compares it on latents
    step = bench.TrainingStep(rows[0]["settings"], workload, models.build_network("dit-tiny", 8, channels=4).state_dict(),
                              torch.randn(4, 4, 8, 8), CPU)  # fmt: skip
    assert (step.unet.config.in_channels, step.unet.config.out_channels) == (4, 4)


def test_each_dit_row_is_the_compiled_step_with_one_change():
    rows = {v["name"]: v for v in VARIANTS}
    compiled = rows["compiled"]["settings"]
    assert rows["fp8"]["settings"] == dict(compiled, precision="fp8") and rows["fp8"]["cuda_only"] is None
    assert rows["max_autotune"]["settings"] == dict(compiled, compile_mode="max-autotune-no-cudagraphs")
    assert rows["cudnn_attention"]["settings"] == dict(compiled, sdpa_backend="CUDNN_ATTENTION")
    assert rows["flash_attention"]["settings"] == dict(compiled, sdpa_backend="FLASH_ATTENTION")
    assert rows["routed"]["settings"] == dict(compiled, token_routing="0.5")
    assert rows["muon"]["settings"] == dict(compiled, optimizer="muon")
    assert all(rows[name]["predicted_ms"]["dit"] for name in bench.DIT_ROWS_BY_NAME)  # written down before measuring
    # --compile_scope regional: the same changes on the `regional` row (each repeated block compiled once)
    regional = {v["name"]: v["settings"] for v in bench.all_variants({"compile_scope": "regional"})}
    assert regional["fp8"] == dict(regional["regional"], precision="fp8") and regional["compiled"] == compiled
    assert regional["flash_attention"] == dict(regional["regional"], sdpa_backend="FLASH_ATTENTION")


def dit_tiny_step(**change):
    workload = bench.WORKLOADS["dit-tiny"]
    settings = dict(next(v for v in VARIANTS if v["name"] == "eager")["settings"], **change)
    init = models.build_network("dit-tiny", 8, channels=4).state_dict()
    return bench.TrainingStep(settings, workload, init, torch.randn(4, 4, 8, 8), CPU), settings, init


def test_the_fp8_row_trains_fp8_layers_within_its_tolerance_of_the_fp32_step():
    step, settings, init = dit_tiny_step(precision="fp8")
    assert sum(type(m).__name__ == "Float8Linear" for m in step.unet.modules()) == 12
    inputs = bench.check_inputs(step.images, 0, CPU)
    reference = bench.reference_step(bench.WORKLOADS["dit-tiny"], init, step.images, inputs, CPU)
    check = bench.check_variant(step, settings, inputs, reference, CPU)
    assert check["passed"] and check["tolerance"] == bench.TOLERANCE["fp8"] and 0 < check["grad_rel_err"], check
    with pytest.raises(ConfigError, match="has none to convert"):  # a UNet's fp8 row: an error row, not a bf16 one
        bench.TrainingStep(settings, bench.WORKLOADS["tiny"], None, torch.zeros(2, 3, 16, 16, dtype=torch.uint8), CPU)


def test_a_row_s_attention_kernel_is_the_only_one_allowed():
    step, _, _ = dit_tiny_step(sdpa_backend="CUDNN_ATTENTION")
    with pytest.raises(RuntimeError, match="No viable backend"):  # a CPU has no cuDNN: the row pins the kernel
        step()
    step, _, _ = dit_tiny_step(sdpa_backend="MATH")
    assert torch.isfinite(step())


@pytest.mark.slow
def test_the_cpu_dit_workload_is_the_small_dit_on_pixels(tmp_path):
    """dit-small: the CPU's DiT on the built-in 32px images (uint8 RGB, as `small`), its rows checked and timed."""
    argv = ["--workload", "dit-small", "--variants", "eager", "--batch_sizes", "2", "--steps", "1", "--warmup", "0",
            "--output", str(tmp_path), "--tag", "small"]  # fmt: skip
    assert bench.main(bench.parse_args(argv)) == 0
    (row,) = json.loads((tmp_path / "small.json").read_text())["results"]
    assert row["status"] == "ok" and row["check"]["passed"] and "channels" not in row
    assert row["flops_per_step"] == 2 * bench.flops.step_flops("dit-small", 32, 1)["model_flops"]
    assert bench.train_defaults(bench.WORKLOADS["dit-small"]).latent_channels is None


@pytest.mark.slow
def test_a_row_that_pins_another_attention_kernel_traces_its_step_anew(tmp_path, monkeypatch):
    """Dynamo does not guard on sdpa_kernel: a compiled graph kept from the row before would run the kernel it was
    traced with (an H100's flash and cuDNN rows did: record 2026-11-27-h100-regional-memory). A row whose kernel
    differs is traced anew: its first call compiles, and Inductor lowers its graph rather than loading the one
    AOTAutograd's cache holds from the row before (whose key is Dynamo's graph, the same for every kernel: the
    next H100 call's flash and cuDNN rows loaded the default's, record 2026-11-28-h100-cold-fp8)."""
    math_row = ("math_attention", "SDPA's math kernel only", 1, None, dict(sdpa_backend="MATH"))  # a CPU has it
    monkeypatch.setattr(bench, "DIT_ROWS", (math_row,))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # no earlier run's graphs
    argv = ["--workload", "dit-tiny", "--variants", "compiled,math_attention", "--steps", "2", "--warmup", "1",
            "--output", str(tmp_path), "--tag", "kernels"]  # fmt: skip
    assert bench.main(bench.parse_args(argv)) == 0
    compiled, pinned = json.loads((tmp_path / "kernels.json").read_text())["results"]
    assert pinned["variant"] == "math_attention" and pinned["check"]["passed"], pinned
    # traced anew, its first call is a compile; the kept graph's first call is about one step
    assert pinned["first_call_s"] > 20 * pinned["step_time_s_median"], (compiled, pinned)
    assert "GraphLowering.run" in pinned["compile_phases_s"], pinned["compile_phases_s"]  # lowered, not loaded
    assert torch.compiler.config.cache_key_tag == ""  # the row's key is its own
    # where each 1st call went, by torch's compile timers, longest first: Dynamo's among them, inside the 1st call
    for row in (compiled, pinned):
        phases = row["compile_phases_s"]
        assert 0 < phases["_compile.compile_inner"] <= row["first_call_s"]
        assert list(phases.values()) == sorted(phases.values(), reverse=True)
    shown = [name for name in bench.compiling.COMPILE_PHASES_SHOWN if name in pinned["compile_phases_s"]]
    assert "_compile.compile_inner" in shown and len(shown) > 1
    line = ", ".join(f"{name} {pinned['compile_phases_s'][name]:g}" for name in shown)  # in a compile's order
    assert f"math_attention's 1st call, compile timers (s): {line}\n" in (tmp_path / "kernels.txt").read_text()
