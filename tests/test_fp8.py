"""--mixed_precision fp8 (fp8.py): which layers train in FP8, the refusals, the honest peak, and a tiny DiT
that trains close to bf16, resumes bit-identically, saves a network diffusers loads, and trains in two processes."""

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ddpm_train import config
from ddpm_train.training import ema as posthoc_ema
from ddpm_train.perf import flops
from ddpm_train.networks import fp8
from ddpm_train.perf import memory
from ddpm_train.networks import model as models
from conftest import ROOT
from ddpm_train.errors import ConfigError
from test_faults import Ranks, start_two_ranks
from test_train import run, scalars, tensors_of

# dit-tiny at 8px (16 tokens) and batch 4: torch._scaled_mm is emulated on a CPU, ~0.2 s a step here
FP8 = ["--model", "dit-tiny", "--image_size", 8, "--train_batch_size", 4, "--shapes_num_images", 16,
       "--save_images_epochs", 100, "--logging_steps", 1, "--mixed_precision", "fp8"]  # fmt: skip


def converted(network):
    return sorted(name for name, m in network.named_modules() if type(m).__name__ == "Float8Linear")


def test_only_the_blocks_attention_and_mlp_layers_train_in_fp8_on_the_same_weights():
    net = models.build_network("dit-tiny", 8)
    before = dict(net.named_parameters())
    assert fp8.convert(net) == 12
    per_block = ["attn1.to_k", "attn1.to_out.0", "attn1.to_q", "attn1.to_v", "ff.net.0.proj", "ff.net.2"]
    assert converted(net) == [f"transformer_blocks.{i}.{name}" for i in (0, 1) for name in per_block]
    # the adaLN modulation, the embedders, the patch embedding and the final layer stay as they were
    assert type(net.transformer_blocks[0].norm1.linear) is torch.nn.Linear and type(net.proj_out_2) is torch.nn.Linear
    after = dict(net.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)  # AdamW's tensors, unchanged
    plain = fp8.plain(net)
    assert converted(plain) == [] and all(dict(plain.named_parameters())[k] is before[k] for k in before)


def test_a_layer_whose_sides_are_not_multiples_of_16_stays_in_bf16():
    assert fp8.convertible(torch.nn.Linear(32, 64), "transformer_blocks.0.ff.net.2")
    assert not fp8.convertible(torch.nn.Linear(24, 64), "transformer_blocks.0.ff.net.2")
    assert not fp8.convertible(torch.nn.Linear(32, 64), "transformer_blocks.0.norm1.linear")


def test_the_sampling_copy_has_no_fp8_layer_and_the_trained_network_keeps_them():
    net = models.build_network("dit-tiny", 8)
    fp8.convert(net)
    copy = posthoc_ema.averaged_copy(net, None)
    assert converted(copy) == [] and len(converted(net)) == 12
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([100, 900])
    reference = models.build_network("dit-tiny", 8)
    reference.load_state_dict(copy.state_dict())
    assert torch.equal(copy(x, t).sample, reference.eval()(x, t).sample)


@pytest.mark.parametrize("flags, expected", [
    (["--model", "tiny"], "tiny has none to convert"),
    (["--model", "dit-tiny", "--image_size", "8", "old torch"], "needs torch 2.11 or later"),
    (["--model", "dit-tiny", "--image_size", "8", "no torchao"], "pip install torchao==0.18.0"),
    (["--model", "dit-tiny", "--image_size", "8", "A100"], "NVIDIA A100-SXM4-80GB is 8.0: use bf16"),
])  # fmt: skip
def test_each_refusal_is_one_line_that_says_what_to_change(flags, expected, monkeypatch):
    if "old torch" in flags:
        monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    if "no torchao" in flags:
        monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import torchao.float8: ImportError
    if "A100" in flags:
        monkeypatch.setattr(config, "on_gpu", lambda args: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    argv = [f for f in flags if f not in ("old torch", "no torchao", "A100")]
    with pytest.raises(ConfigError, match=expected) as refused:
        config.resolve(config.parse_args([*argv, "--mixed_precision", "fp8"]))
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_a_refusal_exits_with_one_line_and_no_traceback():
    result = subprocess.run([sys.executable, "train.py", "--model", "tiny", "--mixed_precision", "fp8"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and "use bf16" in result.stderr


def test_the_peak_is_bf16_s_with_the_fp8_peak_beside_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    peak, words = flops.describe_peak(torch.device("cuda"), "fp8", True)
    assert peak == flops.describe_peak(torch.device("cuda"), "bf16", True)[0] == 989.4e12
    assert "bf16 989.4 TFLOP/s" in words and "fp8 peak 1978.9" in words
    assert flops.lookup_peak("NVIDIA A100-SXM4-80GB", "fp8") == ("A100", None)  # no FP8 tensor cores


def test_the_memory_estimate_is_bf16_s():
    step = ("dit-tiny", 8, 4, 3)
    assert memory.count_step(*step, "fp8") == memory.count_step(*step, "bf16") != memory.count_step(*step, "no")


@pytest.mark.slow
def test_importing_the_networks_prints_nothing_with_torchao_installed():
    result = subprocess.run([sys.executable, "-c", "from ddpm_train.networks import model; from ddpm_train.training import rundir"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0 and result.stderr == ""


# Adam's steps move each weight by about the learning rate whatever the gradient's size: after 12 steps the fp8 run's
# weights are this close to the bf16 run's, relative to how far the bf16 run moved them from where both started
# (measured: 0.069, torch 2.14.1 and torchao 0.18.0 on a CPU).
WEIGHTS_TOLERANCE = 0.2


def flat(run_dir):
    """The saved network's weights (its EMA's) in one vector."""
    return torch.cat([p.detach().reshape(-1) for p in models.load_network(run_dir / "unet").parameters()])


def test_the_first_line_says_what_fp8_was_measured_to_give_on_a_gpu_and_that_a_cpu_only_emulates_it():
    on_gpu, on_cpu = (fp8.describe(torch.nn.Linear(16, 16), torch.device(kind)) for kind in ("cuda", "cpu"))
    assert "no faster in FP8" in on_gpu and "docs/fp8.md" in on_gpu and "emulated" not in on_gpu
    assert "emulated on a CPU" in on_cpu and "no faster in FP8" not in on_cpu


@pytest.mark.slow
def test_fp8_trains_close_to_bf16_resumes_bit_identically_and_saves_a_network_diffusers_loads(tmp_path, capsys):
    from diffusers import DiTTransformer2DModel

    steps = ["--max_train_steps", 12, "--checkpointing_steps", 6]
    run(tmp_path / "fp8", *FP8, *steps)
    assert "mixed precision fp8 (12 linear layers in FP8 through torchao" in capsys.readouterr().out
    losses = [v for _, v in scalars(tmp_path / "fp8")["loss"]]
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses  # it learns
    run(tmp_path / "bf16", *FP8[:-1], "bf16", *steps)
    run(tmp_path / "start", *FP8[:-1], "bf16", "--max_train_steps", 1, "--learning_rate", 1e-30)  # where both start
    moved = (flat(tmp_path / "bf16") - flat(tmp_path / "start")).norm()
    ratio = ((flat(tmp_path / "fp8") - flat(tmp_path / "bf16")).norm() / moved).item()
    assert moved > 0 and ratio < WEIGHTS_TOLERANCE
    # the checkpoint holds ordinary weights under the usual names; the saved network loads in diffusers
    ours = load_file(tmp_path / "fp8" / "checkpoints" / "checkpoint-12" / "model.safetensors")
    assert ours.keys() == load_file(tmp_path / "bf16" / "checkpoints" / "checkpoint-12" / "model.safetensors").keys()
    assert converted(DiTTransformer2DModel.from_pretrained(tmp_path / "fp8" / "unet")) == []
    # resumed from step 6, the same 12 steps
    straight, _ = tensors_of(tmp_path / "fp8" / "unet")
    shutil.rmtree(tmp_path / "fp8" / "checkpoints" / "checkpoint-12")
    run(tmp_path / "fp8", *FP8, *steps)
    assert "resumed from" in capsys.readouterr().out
    resumed, _ = tensors_of(tmp_path / "fp8" / "unet")
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)


@pytest.mark.slow
def test_two_processes_train_in_fp8(tmp_path):
    out = tmp_path / "run"
    ranks = Ranks(start_two_ranks([*map(str, FP8), "--output_dir", str(out), "--max_train_steps", "2"]))
    assert ranks.codes == [0, 0], ranks
    assert "mixed precision fp8 (12 linear layers" in ranks.out0 and (out / "unet" / "config.json").is_file()

