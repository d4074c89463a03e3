"""--optimizer muon (optimizer.py): which parameters Muon trains, the adaLN matrix split by rows, one optimizer for
the LR schedule, the guard and the step's time marks, and a train.py run that resumes bit for bit."""

import argparse
import re
import shutil

import pytest
import torch

from ddpm_train.perf import compiling
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.training import optimizer as optimizers
from ddpm_train.training import step as steps
from ddpm_train.errors import ConfigError
from test_edm_train import same
from test_train import run, scalars, tensors_of

ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)

# What Muon trains, by parameter name: a DiT block's matrices (its adaLN modulation in six blocks of rows), a UNet's
# attention and time projections, EDM2's blocks' embedding projections. Everything else is AdamW's.
MUON = {
    "dit-tiny": r"transformer_blocks\.\d\.(attn1\.to_[qkv]|attn1\.to_out\.0|ff\.net\.0\.proj|ff\.net\.2|norm1\.linear)\.weight",
    "tiny": r".*(attentions\.\d\.to_[qkv]|attentions\.\d\.to_out\.0|resnets\.\d\.time_emb_proj)\.weight",
    "edm2tiny": r".*\.emb_linear\.weight",
}


def built(name, kind="muon"):
    torch.manual_seed(0)
    net = models.build_network(name, models.PRESETS[name].image_size)
    extra = torch.nn.Parameter(torch.zeros(3, 4))  # a 2-D objective parameter (as EDM's u(sigma)): AdamW's
    return net, extra, optimizers.build(kind, net, also=[extra], **ADAMW)


@pytest.mark.parametrize("name", MUON)
def test_muon_trains_the_blocks_matrices_and_adamw_the_rest(name):
    net, extra, optimizer = built(name)
    names = {id(p): n for n, p in net.named_parameters()} | {id(extra): "extra"}
    muon = {names[id(p)]: group["chunks"] for group in optimizer.muon.param_groups for p in group["params"]}
    adamw = [names[id(p)] for group in optimizer.adamw.param_groups for p in group["params"]]
    assert sorted([*muon, *adamw]) == sorted(names.values())  # every parameter, once
    assert sorted(muon) == sorted(n for n in names.values() if re.fullmatch(MUON[name], n))
    assert {n: c for n, c in muon.items() if c > 1} == {n: 6 for n in muon if "norm1.linear" in n}
    assert "extra" in adamw and not any(".emb." in n for n in muon)  # a DiT's shared timestep and label embedder
    assert isinstance(optimizer, torch.optim.Optimizer) and optimizer.param_groups == [
        *optimizer.muon.param_groups, *optimizer.adamw.param_groups]  # fmt: skip


def test_adamw_is_built_as_before_muon():
    net, extra, optimizer = built("tiny", "adamw")
    assert type(optimizer) is torch.optim.AdamW and optimizer.param_groups[0]["params"] == [*net.parameters(), extra]
    assert optimizer.defaults["betas"] == ADAMW["betas"] and optimizer.defaults["foreach"]


def test_a_fused_matrix_is_orthogonalized_one_block_of_rows_at_a_time():
    torch.manual_seed(0)
    fused = torch.nn.Parameter(torch.randn(6 * 8, 8))
    apart = [torch.nn.Parameter(block.detach().clone()) for block in fused.chunk(6)]
    whole = torch.nn.Parameter(fused.detach().clone())
    muon = dict(lr=0.1, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    split = optimizers.SplitMuon([{"params": [fused], "chunks": 6}], **muon)
    separate, together = optimizers.SplitMuon(apart, **muon), optimizers.SplitMuon([whole], **muon)  # torch's, unsplit
    for _ in range(2):  # the second step with momentum
        grad = torch.randn_like(fused)
        fused.grad, whole.grad = grad, grad.clone()
        for p, g in zip(apart, grad.chunk(6)):
            p.grad = g.clone()
        for optimizer in (split, separate, together):
            optimizer.step()
    assert torch.equal(fused.detach(), torch.cat([p.detach() for p in apart]))
    assert not torch.allclose(fused, whole)  # the whole matrix orthogonalized at once steps elsewhere
    assert len(split.state_dict()["state"]) == 1 and split.state[fused]["momentum_buffer"].shape == fused.shape


def test_on_a_cpu_newton_schulz_runs_in_float32_and_torch_s_own_is_back_after_the_step():
    """torch's Newton-Schulz is bf16, some 30x slower than float32 on a CPU without bf16 units."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 16))
    p.grad = torch.randn(8, 16)
    before = p.detach().clone()
    optimizers.SplitMuon([p], lr=0.1, weight_decay=0.0).step()
    update = p.grad.lerp(torch.zeros(8, 16).lerp(p.grad, 1 - 0.95), 0.95)  # torch's first Nesterov momentum step
    stepped = before - p.detach()
    in_fp32 = 0.1 * optimizers.newton_schulz_fp32(update, (3.4445, -4.775, 2.0315), 5, 1e-7)
    assert optimizers._muon._zeropower_via_newtonschulz is not optimizers.newton_schulz_fp32
    in_bf16 = 0.1 * optimizers._muon._zeropower_via_newtonschulz(update, (3.4445, -4.775, 2.0315), 5, 1e-7).float()
    assert (stepped - in_fp32).abs().max() < 1e-6 < 1e-4 < (stepped - in_bf16).abs().max()


def test_a_torch_whose_newton_schulz_takes_other_arguments_keeps_its_own_and_says_so(monkeypatch):
    """torch's private function is swapped only while it takes newton_schulz_fp32's arguments."""
    original, called = optimizers._muon._zeropower_via_newtonschulz, []

    def changed(grad, ns_coefficients, ns_steps, eps, dtype=torch.bfloat16):  # as a later torch might have it
        called.append(dtype)
        return original(grad, ns_coefficients, ns_steps, eps)

    monkeypatch.setattr(optimizers._muon, "_zeropower_via_newtonschulz", changed)
    p = torch.nn.Parameter(torch.randn(8, 16))
    p.grad = torch.randn(8, 16)
    with pytest.warns(UserWarning, match="on a CPU it runs in torch's bf16"):
        optimizers.SplitMuon([p], lr=0.1, weight_decay=0.0).step()
    assert called and optimizers._muon._zeropower_via_newtonschulz is changed


def test_the_lr_schedule_moves_muons_learning_rate_too_after_a_load():
    _, _, optimizer = built("dit-tiny")
    schedule = models.make_lr_scheduler("cosine", optimizer, 2, 10)
    optimizer.load_state_dict(optimizer.state_dict())  # as accelerate's prepare does: new group dicts
    for _ in range(3):
        optimizer.step()
        schedule.step()
    rates = [group["lr"] for group in optimizer.muon.param_groups + optimizer.adamw.param_groups]
    assert len(rates) == 3 and set(rates) == {schedule.get_last_lr()[0]} and 0 < rates[0] < ADAMW["lr"]


def test_the_optimizer_phase_times_muon_and_the_guard_drops_both_gradients():
    torch.manual_seed(0)
    net, _, optimizer = built("dit-tiny")
    objective = objectives.DDPMObjective(objectives.make_noise_scheduler())
    schedule = models.make_lr_scheduler("constant", optimizer, 0, 10)
    phases = []
    muon_step = optimizer.muon.step
    optimizer.muon.step = lambda *a: (phases.append("muon"), muon_step(*a))[1]
    guard = steps.NonFiniteGuard(optimizer, "skip", torch.device("cpu"))
    assert not guard.on_device  # neither is fused as a whole: the guard reads its flag on the host
    train = steps.TrainStep(net, net, objective, optimizer, schedule, None, guard, 1.0, False, mark=phases.append)
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    before = [p.detach().clone() for p in net.parameters()]
    train([images])
    assert phases == ["forward", "backward", "muon", "optimizer"]
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters()) if a.ndim == 2)
    with torch.no_grad():
        net.proj_out_2.bias.fill_(float("nan"))  # a non-finite loss: the guard drops Muon's and AdamW's gradients
    before = [p.detach().clone() for p in net.parameters()]
    train([images])
    assert guard.count() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()) if not a.isnan().any())


def test_a_step_graph_refuses_muon_and_auto_does_not_capture_it():
    args = argparse.Namespace(compile_mode="step-graph", gradient_accumulation_steps=1, mixed_precision="bf16",
                              on_fault="skip", fused_adam=True, optimizer="muon", model="ddpm32",
                              gradient_checkpointing=False, compile_scope=None)  # fmt: skip
    cuda = torch.device("cuda")
    for mode in compiling.STEP_GRAPH_MODES:
        args.compile_mode = mode
        with pytest.raises(ConfigError, match=f"--compile_mode {mode} cannot capture CUDA graphs here: --optimizer muon"):
            compiling.choose_compile_mode(args, cuda, 1, 1e12)
    args.compile_mode = "reduce-overhead"  # torch.compile's graphs hold the network, not the optimizer
    assert compiling.choose_compile_mode(args, cuda, 1, 1e12)[0] == "reduce-overhead"
    args.compile_mode = "auto"  # where AdamW's step would be captured (test_step.py's GPU bare run)
    plan = compiling.plan_compile(args, cuda, 1, 4.78e12, 3_072, 989.4e12, lambda mode, scope: None)
    assert plan.mode != "eager-graph"
    assert compiling.plan_compile(argparse.Namespace(**dict(vars(args), optimizer="adamw")), cuda, 1, 4.78e12, 3_072,
                                  989.4e12, lambda mode, scope: None).mode == "eager-graph"  # fmt: skip


@pytest.mark.parametrize("name", ["dit-tiny", "tiny"])
def test_a_muon_run_learns_and_resumes_bit_identically(tmp_path, capsys, name):
    flags = ["--model", name, "--optimizer", "muon", "--max_train_steps", 8, "--checkpointing_steps", 4,
             "--train_batch_size", 4, "--save_images_epochs", 100, "--logging_steps", 4,
             "--class_conditional", "--image_size", "24x16"]  # fmt: skip (labels, and a non-square grid)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, *flags)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "checkpoint-4", resumed / "checkpoints" / "checkpoint-4")
    capsys.readouterr()
    run(resumed, *flags)
    assert "checkpoint-4 at step 4" in capsys.readouterr().out
    (_, first), (_, last) = scalars(straight)["loss"]
    assert last < 0.9 * first
    end = [straight / "checkpoints" / "checkpoint-8", resumed / "checkpoints" / "checkpoint-8"]
    a, b = (tensors_of(folder)[0] for folder in end)
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)
    state, again = (torch.load(folder / "optimizer.bin", weights_only=False) for folder in end)
    assert same(state, again)
    matrices = sum(len(group) for group in optimizers.muon_matrices(models.build_network(name, 16, num_classes=4)).values())
    assert len(state["muon"]["state"]) == matrices  # a momentum buffer for each matrix Muon trained
    assert all(buffer["momentum_buffer"].ndim == 2 for buffer in state["muon"]["state"].values())
    assert all("exp_avg" in moments for moments in state["adamw"]["state"].values())


def test_the_memory_line_counts_muons_one_buffer_a_matrix_and_adamws_two_moments():
    net, extra, muon = built("dit-tiny")
    matrices = sum(p.numel() * 4 for group in optimizers.muon_matrices(net).values() for p in group)
    everything = sum(p.numel() * 4 for p in [*net.parameters(), extra])
    assert optimizers.state_bytes(muon) == 2 * everything - matrices
