"""A loss term that reads a block's output (models.BlockOutputs) gets the same tensor, and trains the network the
same way, whether the step calls the network eager, compiled whole or compiled block by block (Dynamo's eager
backend, as in test_time_input.py: the graphs traced as Inductor's would be)."""

import pytest
import torch

from ddpm_train.perf import compiling
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives

PRESETS = ("tiny", "edm2tiny", "dit-tiny")  # one network of each family


class WithMiddleBlock(objectives.FlowObjective):
    """Flow matching plus a term on the middle repeated block's output: its mean square (a stand-in for a
    representation loss such as issue 66's)."""

    def __init__(self, network):
        super().__init__(c_noise=models.family_of(network).time_input == "c_noise")
        self.middle = models.block_names(network)[len(models.block_names(network)) // 2]
        self.blocks = models.BlockOutputs(network, [self.middle])

    def terms(self, net, x0):
        terms = super().terms(net, x0)
        return terms | {"middle": self.blocks.outputs.pop(self.middle).float().square().mean()}


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_a_term_reads_a_blocks_output_alike_in_every_compile_scope(preset, monkeypatch):
    torch.compiler.reset()
    real = torch.compile
    results = {}
    for scope in ("eager", "whole", "regional"):
        torch.manual_seed(0)
        network = models.build_network(preset, 16)
        objective = WithMiddleBlock(network)
        with monkeypatch.context() as m:
            m.setattr(torch, "compile", lambda fn, mode=None, dynamic=None: real(fn, backend="eager", dynamic=dynamic))
            net = {"eager": network, "whole": torch.compile(network), "regional": compiling.RegionalNetwork(network)}[scope]
            torch.manual_seed(1)
            terms = objective.terms(net, torch.rand(2, network.config.in_channels, 16, 16) * 2 - 1)
        terms["middle"].backward()
        first_block = dict(network.named_modules())[models.block_names(network)[0]]
        first = next(p for p in first_block.parameters() if p.grad is not None)  # before the middle block: reached
        results[scope] = terms["flow"].item(), terms["middle"].item(), first.grad.clone()
        assert not objective.blocks.outputs  # read once, nothing left over for the next call
    for scope in ("whole", "regional"):
        assert results[scope][:2] == pytest.approx(results["eager"][:2], rel=1e-5), scope
        torch.testing.assert_close(results[scope][2], results["eager"][2], rtol=1e-4, atol=1e-6)
    assert results["eager"][1] > 0 and results["eager"][2].abs().sum() > 0
