import json

import pytest
import torch
from torch import nn

from ddpm_train.perf import flops
from ddpm_train.networks import model as models


def test_linear_flops_match_hand_count():
    batch, n_in, n_out = 5, 7, 3
    layer = nn.Linear(n_in, n_out)
    x = torch.randn(batch, n_in, requires_grad=True)
    # forward: one multiply and one add per weight per row
    assert flops.count_flops(lambda: layer(x)) == 2 * batch * n_in * n_out
    # backward: the same product again for dx and for dW
    assert flops.count_flops(lambda: layer(x).sum().backward()) == 3 * 2 * batch * n_in * n_out


def test_conv2d_flops_match_hand_count():
    batch, c_in, c_out, k, side = 2, 3, 4, 3, 8
    conv = nn.Conv2d(c_in, c_out, k, padding=1)
    x = torch.randn(batch, c_in, side, side, requires_grad=True)
    forward = 2 * batch * c_out * side * side * c_in * k * k
    assert flops.count_flops(lambda: conv(x)) == forward
    assert flops.count_flops(lambda: conv(x).sum().backward()) == 3 * forward


def test_reference_model_params_and_flops():
    # The diffusers train_unconditional.py UNet: 113,673,219 parameters,
    # 372.17 GFLOP/img forward+backward counted on a CPU (SDPA counted 0),
    # 23.82 TFLOP per step at batch 64.
    cost = flops.network_flops("ref128", 128, 1)
    assert cost["params"] == 113_673_219
    assert cost["flops_fwd"] == pytest.approx(124.10e9, rel=0.005)
    assert cost["flops_fwdbwd"] == pytest.approx(372.17e9, rel=0.005)
    assert 64 * cost["flops_fwdbwd"] == pytest.approx(23.82e12, rel=0.005)


def test_flops_scale_linearly_with_batch():
    one = flops.network_flops("tiny", 16, 1)
    four = flops.network_flops("tiny", 16, 4)
    assert four["flops_fwd"] == 4 * one["flops_fwd"]
    assert four["flops_fwdbwd"] == 4 * one["flops_fwdbwd"]


def test_meta_count_equals_a_real_cpu_count_plus_attention():
    # On the meta device attention runs as two batched matmuls, which are
    # counted; a CPU's fused attention kernel counts 0. Everything else must
    # match real tensors exactly, and the difference must be exactly the
    # attention matmuls: QK^T and AV, 2*L*L*C multiply-adds each forward,
    # twice that backward, for the mid block's L = 4*4 tokens of C = 64.
    from torch.utils.flop_counter import FlopCounterMode

    name, size, batch = "small", 16, 2

    def by_op(device):
        unet = models.build_network(name, size, device=device)
        x = torch.randn(batch, 3, size, size, device=device)
        t = torch.tensor([3, 500], device=device)
        with FlopCounterMode(display=False) as counter:
            unet(x, t).sample.square().mean().backward()
        return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}

    meta, real = by_op("meta"), by_op("cpu")
    attention = meta.pop("aten.bmm")
    assert meta == real
    tokens, channels = (size // 4) ** 2, 64
    assert attention == 3 * 2 * (2 * batch * tokens * tokens * channels)
    assert flops.network_flops(name, size, batch)["flops_fwdbwd"] == sum(real.values()) + attention


def test_gradient_checkpointing_adds_hardware_flops_only():
    plain = flops.step_flops("tiny", 16, 2)
    checkpointed = flops.step_flops("tiny", 16, 2, gradient_checkpointing=True)
    assert checkpointed["model_flops"] == plain["model_flops"]
    assert checkpointed["hardware_flops"] > plain["hardware_flops"]
    # the recompute is at most one more forward pass
    forward = flops.network_flops("tiny", 16, 2)["flops_fwd"]
    assert checkpointed["hardware_flops"] <= plain["hardware_flops"] + forward


def test_a_network_is_counted_once_per_process(monkeypatch):
    """network_flops keeps its counts by their arguments: a second run of the same network and input (the
    suite's many runs in one process) is not counted again; another input is."""
    first = flops.network_flops("tiny", 8, 3)
    first["params"] = -1  # a caller's change to its copy is its own
    counted = []
    monkeypatch.setattr(flops, "count_flops", lambda fn: counted.append(fn) or 0)
    assert flops.network_flops("tiny", 8, 3) == dict(first, params=sum(p.numel() for p in models.build_network("tiny", 8).parameters()))
    assert not counted
    assert flops.network_flops("tiny", 8, 5)["flops_fwd"] == 0 and len(counted) == 2  # forward, forward and backward


@pytest.mark.parametrize(
    "device_name, precision, gpu, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", "H100 SXM", 989.4),
        ("NVIDIA H100 80GB HBM3", "tf32", "H100 SXM", 494.7),
        ("NVIDIA H100 80GB HBM3", "fp32", "H100 SXM", 66.9),
        ("NVIDIA H100 PCIe", "bf16", "H100 PCIe", 756.5),
        ("NVIDIA H200", "fp16", "H200 SXM", 989.4),
        ("NVIDIA A100-SXM4-80GB", "bf16", "A100", 312.0),
        ("NVIDIA A100-SXM4-40GB", "tf32", "A100", 156.0),
        ("NVIDIA A100 80GB PCIe", "fp32", "A100", 19.5),
        ("NVIDIA A10G", "bf16", "A10/A10G", 125.0),
        ("NVIDIA L4", "fp16", "L4", 121.0),
        ("NVIDIA GeForce RTX 4090", "bf16", "RTX 4090", 165.2),
    ],
)
def test_peak_lookup(device_name, precision, gpu, tflops):
    assert flops.lookup_peak(device_name, precision) == (gpu, pytest.approx(tflops * 1e12))


@pytest.mark.parametrize("device_name", ["Tesla T4", "cpu", "", None, "NVIDIA A1000"])
def test_unknown_gpu_has_no_peak(device_name):
    assert flops.lookup_peak(device_name, "bf16") == (None, None)


def test_matmul_precision():
    assert flops.matmul_precision("bf16", True) == "bf16"
    assert flops.matmul_precision("fp16", False) == "fp16"
    assert flops.matmul_precision("no", True) == "tf32"
    assert flops.matmul_precision("no", False) == "fp32"


def test_utilization():
    perf = flops.utilization(model_flops=10e12, hardware_flops=12e12, step_time_s=0.5, peak_flops=100e12)
    assert perf["achieved_flops"] == pytest.approx(20e12)
    assert perf["mfu"] == pytest.approx(0.20)
    assert perf["hfu"] == pytest.approx(0.24)
    unknown = flops.utilization(10e12, 10e12, 0.5, None)
    assert unknown["mfu"] is None and unknown["hfu"] is None


def test_step_timer_times_steps_but_not_warmup_or_pauses(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 6.0, 100.0, 101.5]).__next__
    monkeypatch.setattr(flops.time, "perf_counter", clock)
    timer = flops.StepTimer(torch.device("cpu"), warmup_steps=1)
    timer.restart()  # t=0
    timer.step_done()  # t=1: warm-up step, not timed
    timer.step_done()  # t=3: 2 s
    timer.step_done()  # t=6: 3 s
    timer.restart()  # t=100: sampling happened in between
    timer.step_done()  # t=101.5: 1.5 s
    assert timer.collect() == [2.0, 3.0, 1.5]
    assert timer.collect() == []
    assert timer.all_times == [2.0, 3.0, 1.5]


def test_flops_cli_json_for_the_reference_model(capsys):
    code = flops.main(flops.parse_args(["--image_size", "128", "--train_batch_size", "64", "--json"]))
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"params", "flops_per_image_fwd", "flops_per_image_fwdbwd", "flops_per_step"}
    assert result["model"] == "ref128"
    assert result["params"] == 113_673_219
    assert result["flops_per_step"] == pytest.approx(23.82e12, rel=0.005)


@pytest.mark.parametrize("argv, says", [(["--model", "nope"], "unknown --model 'nope'"),
                                        (["--image_size", "100000"], "--image_size 100000: each side must be from 8 to 8192"),
                                        (["--image_size", "96x"], "--image_size 96x: give one side (64) or width x height"),
                                        (["--presets", "README.md"], "--presets README.md: no preset table's markers in it")])
def test_flops_cli_refuses_bad_input_in_one_line(capsys, argv, says):
    with pytest.raises(SystemExit) as stopped:
        flops.main(flops.parse_args(argv))
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err


# --- DiT (issue 39): the count against the module structure, on any device, and in train.py's line ---


def linear_flops(n_in, n_out, rows=1):
    return 2 * rows * n_in * n_out


def dit_forward_flops(layers, hidden, tokens, patch, in_channels, out_channels, frequencies=256):
    """One image's forward FLOPs of DiTTransformer2DModel (dit.DiT), from its modules, a multiply-add 2:
    only matrix products count (FlopCounterMode's convention: norms, activations, the position table's
    sum and the label's lookup are 0)."""
    embedder = linear_flops(frequencies, hidden) + linear_flops(hidden, hidden)  # TimestepEmbedding of the sinusoid
    block = (
        linear_flops(hidden, hidden, tokens) * 3  # to_q, to_k, to_v
        + 2 * (2 * tokens * tokens * hidden)  # QK^T and AV: 2*N*N*d per head, d summed over heads is D
        + linear_flops(hidden, hidden, tokens)  # to_out
        + linear_flops(hidden, 4 * hidden, tokens) + linear_flops(4 * hidden, hidden, tokens)  # the MLP
        + linear_flops(hidden, 6 * hidden)  # adaLN-Zero: shift, scale and gate of attention and MLP
        + embedder  # norm1.emb(t, y): every block calls the shared embedder again
    )
    patches = linear_flops(in_channels * patch * patch, hidden, tokens)  # PatchEmbed: a conv, stride = kernel
    final = (
        embedder  # the output layer calls transformer_blocks[0].norm1.emb once more
        + linear_flops(hidden, 2 * hidden)  # proj_out_1: shift and scale
        + linear_flops(hidden, patch * patch * out_channels, tokens)  # proj_out_2
    )
    return patches + layers * block + final


def dit_step_flops(layers, hidden, tokens, patch, in_channels, out_channels, frequencies=256):
    """Forward and backward: every product again for the gradient of its input and of its weight, but
    those whose input needs no gradient (the patch embedding's image, the embedders' sinusoid)."""
    forward = dit_forward_flops(layers, hidden, tokens, patch, in_channels, out_channels, frequencies)
    no_input_gradient = (linear_flops(in_channels * patch * patch, hidden, tokens)
                         + (layers + 1) * linear_flops(frequencies, hidden))  # fmt: skip
    return 3 * forward - no_input_gradient


def dit_shape(name, side, channels):
    """dit_forward_flops' arguments for preset `name` on side x side x channels inputs (out = in, as train.py)."""
    d = models.PRESETS[name].settings
    patch = d["patch_size"]
    return dict(layers=d["num_layers"], hidden=d["num_attention_heads"] * d["attention_head_dim"],
                tokens=(side // patch) ** 2, patch=patch, in_channels=channels, out_channels=channels)  # fmt: skip


def test_dit_xl2_forward_is_twice_the_papers_multiply_adds():
    """DiT's Table 4: XL/2 118.64 G 'flops' at 256px (32x32x4 latents), multiply-adds (DiT #14):
    237.3 GFLOP. This implementation runs the embedder 29 times (0.09 GFLOP) where the paper's runs once."""
    cost = flops.network_flops("dit-xl2", 32, 1, channels=4)
    assert cost["flops_fwd"] == pytest.approx(237.3e9, rel=0.005)
    assert cost["flops_fwd"] == pytest.approx(2 * 118.64e9, rel=0.005)
    shape = dit_shape("dit-xl2", 32, 4)
    assert (cost["flops_fwd"], cost["flops_fwdbwd"]) == (dit_forward_flops(**shape), dit_step_flops(**shape))


@pytest.mark.parametrize("name, side, channels", [("dit-tiny", 16, 3), ("dit-small", 32, 3), ("dit-tiny", 8, 4)])
def test_dit_flops_equal_the_formula_from_its_modules(name, side, channels):
    batch = 3
    cost = flops.network_flops(name, side, batch, channels=channels)
    assert cost["flops_fwd"] == batch * dit_forward_flops(**dit_shape(name, side, channels))
    assert cost["flops_fwdbwd"] == batch * dit_step_flops(**dit_shape(name, side, channels))


@pytest.mark.parametrize("name", ["dit-tiny", "small"])
def test_a_count_on_cpu_tensors_equals_the_meta_devices(name):
    """torch's table has no formula for a CPU's fused attention kernel; count_flops adds one (the math path's
    matmuls, the backward twice the forward), so a count on a CPU's real tensors is the meta device's."""
    from torch.utils.flop_counter import FlopCounterMode

    side, batch = 16, 2

    def step(device):
        net = models.build_network(name, side, device=device)
        x, t = torch.randn(batch, 3, side, side, device=device), torch.tensor([3, 500], device=device)
        return lambda: net(x, t).sample.square().mean().backward()

    on_cpu = flops.count_flops(step("cpu"))
    assert on_cpu == flops.count_flops(step("meta")) == flops.network_flops(name, side, batch)["flops_fwdbwd"]
    with FlopCounterMode(display=False) as plain:  # torch's own table: the CPU's attention kernel counts 0
        step("cpu")()
    missed = on_cpu - plain.get_total_flops()
    if name == "dit-tiny":
        shape = dit_shape(name, side, 3)
        assert missed == batch * shape["layers"] * 3 * 2 * (2 * shape["tokens"] ** 2 * shape["hidden"])
    assert missed > 0  # the CPU ran its fused kernel: this test is about it


@pytest.mark.slow
def test_train_py_counts_a_dit_as_flops_py_does(tmp_path, capsys):
    """The dry run's FLOPs of DiT-XL/2 at 256px through SD's VAE (32x32x4 latents; offline, its assumed VAE)
    are flops.py's and the formula's, attention included."""
    from test_train import run

    config = run(tmp_path / "dry", "--model", "dit-xl2", "--image_size", 256, "--vae", "stabilityai/sd-vae-ft-mse",
                 "--train_batch_size", 64, "--dry_run")  # fmt: skip
    assert (config["latent_size"], config["latent_channels"]) == (32, 4)
    flops.main(flops.parse_args(["--model", "dit-xl2", "--image_size", "32", "--channels", "4",
                                 "--train_batch_size", "64", "--json"]))  # fmt: skip
    out = capsys.readouterr().out
    per_step = json.loads(out.splitlines()[-1])["flops_per_step"]
    assert config["model_flops_per_step"] == per_step == 64 * dit_step_flops(**dit_shape("dit-xl2", 32, 4))
    assert f"{per_step / 1e12:.4g} TFLOP per step" in out


def test_train_py_step_line_for_a_dit_has_flops_py_count_and_its_mfu(tmp_path, capsys, monkeypatch):
    """What a user reads on a CPU: the step line's TFLOP/step is flops.py's (attention included, though the CPU
    runs its fused kernel), and MFU is the achieved TFLOP/s over the peak."""
    import re

    import train
    from test_train import run

    monkeypatch.setattr(train.flops, "describe_peak", lambda *args: (1e9, "peak 0.001 TFLOP/s (a test's)"))
    run(tmp_path / "run", "--model", "dit-tiny", "--train_batch_size", 4, "--shapes_num_images", 16, "--max_train_steps",
        3, "--logging_steps", 3, "--save_images_epochs", 100)  # fmt: skip
    line = re.search(r"^step 3/3 \|.*\| ([\d.e+-]+) TFLOP/step \| ([\d.e+-]+) TFLOP/s \| MFU ([\d.]+)%", capsys.readouterr().out, re.M)
    per_step = 4 * dit_step_flops(**dit_shape("dit-tiny", 16, 3))
    assert per_step == 4 * flops.network_flops("dit-tiny", 16, 1)["flops_fwdbwd"]
    assert line and line.group(1) == f"{per_step / 1e12:.4g}"
    assert float(line.group(3)) == pytest.approx(100 * float(line.group(2)) / 0.001, rel=1e-3, abs=0.051)


# The small tools' Ctrl-C: while torch imports (errors.quit_on_ctrl_c), then in main (errors.ctrl_c_raises and
# one_line_errors(interrupted=...)): one line each, exit code 130, never Python's traceback. For main's, a function
# each tool calls from another module sends the SIGINT (the tool runs as __main__, its own functions out of reach).
SMALL_TOOLS = {
    "flops.py": ("from ddpm_train.networks import model\nopened = model.resolve_model_name\n"
                 "def interrupted(*args):\n    os.kill(os.getpid(), signal.SIGINT)\n    return opened(*args)\n"
                 "model.resolve_model_name = interrupted\n", [], "stopped: nothing was written"),
    "ema.py": ("from ddpm_train.training import rundir\nopened = rundir.RunDir.__init__\n"
               "def interrupted(self, *args):\n    os.kill(os.getpid(), signal.SIGINT)\n    opened(self, *args)\n"
               "rundir.RunDir.__init__ = interrupted\n", ["reconstruct", "{folder}", "--std", "0.1"],
               "stopped before the end: run it again to write the network whole"),
    "profiling.py": ("import tensorboard.backend.event_processing.event_accumulator as events\n"
                     "opened = events.EventAccumulator\n"
                     "def interrupted(*args, **kwargs):\n    os.kill(os.getpid(), signal.SIGINT)\n"
                     "    return opened(*args, **kwargs)\n"
                     "events.EventAccumulator = interrupted\n", ["plots", "{folder}"], "stopped: the plots drawn so far stay"),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("tool", sorted(SMALL_TOOLS))
def test_ctrl_c_in_a_small_tool_is_one_line_and_exit_130(tool, tmp_path):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    patch, argv, words = SMALL_TOOLS[tool]
    argv = [a.format(folder=tmp_path) for a in argv]
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "events.out.tfevents.1").write_bytes(b"")
    process = subprocess.Popen([sys.executable, tool, *argv], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
    time.sleep(0.5)  # torch's import alone takes longer
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130 and err.strip() == f"{tool}: interrupted while starting: nothing was written", err
    script = f"import os, runpy, signal, sys\n{patch}sys.argv = [{tool!r}, *sys.argv[1:]]\nrunpy.run_path({tool!r}, run_name='__main__')\n"
    done = subprocess.run([sys.executable, "-c", script, *argv], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 130 and done.stderr.strip() == f"{tool}: interrupted: {words}", done.stderr
