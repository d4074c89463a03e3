"""Token routing (dit.py, --token_routing): while a DiT trains, a share of each image's tokens skips the routed
blocks and rejoins unchanged; sampling sees every token; the FLOPs counted are the routed step's; the flag's
bad values and the runs it does not apply to are one line."""

import pytest
import torch

from ddpm_train.perf import compiling
from ddpm_train.networks import dit
from ddpm_train.perf import flops
from test_config import one_line_error
from test_train import run as train


def routed_net(text, sample_size=8, layers=3):
    torch.manual_seed(0)
    net = dit.DiT(num_classes=3, num_layers=layers, num_attention_heads=2, attention_head_dim=8, in_channels=3,
                  sample_size=sample_size, patch_size=2)  # fmt: skip
    with torch.no_grad():
        for p in net.parameters():  # adaLN-Zero starts at zero: random weights make every block change its tokens
            p.normal_(0, 0.05)
    net.routing = dit.routing(text, layers)
    return net


def around_routed_block(net, call):
    """The tokens before block 2 and after it (block 1's output, block 3's input), and block 2's input, of `call()`."""
    seen = {}

    def keep(name, tokens):
        seen.setdefault(name, tokens.detach().clone())

    blocks = net.transformer_blocks
    hooks = [blocks[0].register_forward_hook(lambda m, a, out: keep("before", out)),
             blocks[1].register_forward_pre_hook(lambda m, a: keep("routed", a[0])),
             blocks[2].register_forward_pre_hook(lambda m, a: keep("after", a[0]))]  # fmt: skip
    call()
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("sample_size", [8, [8, 12]], ids=["square", "8x12"])
def test_the_routed_tokens_skip_the_routed_blocks_and_rejoin_unchanged(sample_size):
    net = routed_net("0.25:2-2", sample_size)
    x, t = torch.randn(2, 3, *([sample_size] * 2 if isinstance(sample_size, int) else sample_size)), torch.tensor([3, 700])
    seen = around_routed_block(net, lambda: net(x, t, return_dict=False)[0].square().mean().backward())
    tokens = seen["before"].shape[1]
    assert seen["routed"].shape[1] == tokens - tokens // 4  # a fixed count goes through
    unchanged = (seen["after"] == seen["before"]).all(dim=-1)
    assert unchanged.sum(dim=1).tolist() == [tokens // 4] * 2  # the others wait, as they were
    assert all(p.grad is not None for p in net.transformer_blocks[1].parameters())


def test_sampling_and_an_eval_copy_see_every_token():
    net = routed_net("0.5:2-2")
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([3, 700])
    with torch.no_grad():
        routed_off = around_routed_block(net, lambda: net(x, t))
    net.eval()
    evaluated = around_routed_block(net, lambda: net(x, t))
    assert routed_off["routed"].shape == routed_off["before"].shape == evaluated["routed"].shape


@pytest.mark.parametrize("scope", ["whole", "regional"])
def test_a_compiled_network_routes_the_same_count(scope, monkeypatch):
    """Dynamo's eager backend traces the graphs as Inductor's would: the routed count is a static shape."""
    real = torch.compile
    monkeypatch.setattr(compiling.torch, "compile", lambda fn, mode=None, **kw: real(fn, backend="eager", **kw))
    net = routed_net("0.5:2-2")
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([3, 700])
    call = real(net, backend="eager", fullgraph=True) if scope == "whole" else compiling.RegionalNetwork(net)
    seen = around_routed_block(net, lambda: call(x, t, return_dict=False)[0].square().mean().backward())
    assert seen["routed"].shape[1] == 8 and seen["before"].shape[1] == 16


def test_the_step_s_flops_are_the_routed_ones_and_sampling_s_every_token():
    plain = flops.network_flops("dit-small", 32, 2)
    routed = flops.network_flops("dit-small", 32, 2, routing="0.5")
    assert routed["flops_fwd"] == plain["flops_fwd"]
    assert 0.4 * plain["flops_fwdbwd"] < routed["flops_fwdbwd"] < 0.8 * plain["flops_fwdbwd"]
    assert flops.step_flops("dit-small", 32, 2, routing="0.5")["model_flops"] == routed["flops_fwdbwd"]


def test_the_default_blocks_scale_tread_s_to_the_depth():
    assert dit.routing("0.5", 12) == dit.Routing(0.5, 2, 10)  # TREAD's DiT-B: the 3rd block to the 11th
    assert dit.routing("0.5", 28)[1:] == (5, 25) and dit.routing("0.5", 6)[1:] == (1, 4)
    assert dit.routing("0", 12) is None and dit.routing("0.5:1-6", 6) == dit.Routing(0.5, 0, 5)


def test_a_routed_run_says_its_routing_and_its_flops(tmp_path, capsys):
    train(tmp_path, "--model", "dit-tiny", "--token_routing", "0.5", "--max_train_steps", 2, "--save_images_epochs", 100)
    out = capsys.readouterr().out
    assert "TFLOP per step (token routing: 50% of the tokens skip blocks 2-2 of 2); " in out, out


@pytest.mark.parametrize("flags, says", [
    (["--token_routing", "1"], "--token_routing: give a share in [0, 1)"),
    (["--token_routing", "0.5:0-1"], "--token_routing: give a share in [0, 1)"),
    (["--token_routing", "0.5:2-3", "--model", "dit-tiny"], "--token_routing 0.5:2-3: this network has blocks 1 to 2"),
    (["--token_routing", "0.5"], "--token_routing routes a DiT's tokens past its middle blocks, not a UNet's: drop it"),
    (["--token_routing", "0.5", "--model", "dit-tiny", "--loss_terms", "dispersive"],
     "--loss_terms dispersive reads blocks' outputs, which --token_routing leaves with part of the tokens"),
])  # fmt: skip
def test_a_bad_routing_is_one_line(tmp_path, capsys, flags, says):
    from test_train import TINY

    assert says in one_line_error(capsys, [*TINY, *flags, "--output_dir", tmp_path, "--dry_run"])
