"""The time input a network receives in training is the one sampling gives it at the same noise level, for
every objective, network family and compile scope (eager, whole, regional).

The objective is built as train.py builds it (builder.build), and the step calls the network through a
wrapper: torch.compile's for the whole network, compiling.RegionalNetwork for its blocks. Sampling calls the bare
network (sampling.generate with the run's own sampler). A forward pre-hook on the bare network records what it
gets both ways. Compiling uses Dynamo's eager backend: the graphs are traced as Inductor's would be, in a
fraction of the time, and the wrappers are the ones the step uses.
"""

import pytest
import torch

from ddpm_train.perf import compiling
from ddpm_train import config
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.diffusion import samplers
import sample
from ddpm_train.evaluation import sampling
from ddpm_train.training import step as steps
from ddpm_train.training import builder

FAMILIES = {"unet": "tiny", "edm2": "edm2tiny", "dit": "dit-tiny"}  # the smallest preset of each
SCOPES = ("eager", "whole", "regional")
SAMPLING_STEPS = 2
# Each objective with each family whose time input it gives (config refuses --objective ddpm for EDM2's networks).
CASES = [(o, f) for o, kind in objectives.OBJECTIVES.items() for f in FAMILIES
         if models.FAMILIES[f].time_input in kind.time_inputs]  # fmt: skip


def test_every_family_has_a_preset_here():
    assert set(FAMILIES) == set(models.FAMILIES)


class TimeInputs:
    """A forward pre-hook on the bare network: the time input of each call (its second argument), flattened."""

    def __init__(self, network):
        self.seen = []
        self.handle = network.register_forward_pre_hook(self.record)

    def record(self, module, args):
        self.seen.append(torch.as_tensor(args[1]).detach().clone().float().flatten())  # net(x, t, ...) everywhere

    def take(self):
        seen, self.seen = self.seen, []
        return seen


@pytest.fixture(scope="module")
def networks():
    """One network of each family with its recorder, and its wrappers by compile scope, built once."""
    torch.compiler.reset()
    real = torch.compile

    def traced(fn, mode=None, dynamic=None):
        return real(fn, backend="eager", dynamic=dynamic)

    built = {}
    with pytest.MonkeyPatch.context() as m:  # RegionalNetwork compiles each block, when built, with torch.compile
        m.setattr(steps.torch, "compile", traced)
        for family, preset in FAMILIES.items():
            torch.manual_seed(0)
            network = models.build_network(preset, 16)
            wrapped = {"eager": network, "whole": real(network, backend="eager", dynamic=False),
                       "regional": compiling.RegionalNetwork(network)}  # fmt: skip
            built[family] = network, TimeInputs(network), wrapped
    yield built
    for _, recorder, _ in built.values():
        recorder.handle.remove()
    torch.compiler.reset()


def run_pieces(objective, preset):
    """The objective and the grids' sampler that builder.build makes for a CPU run of `preset` at 16px
    (EDM's sampler without churn, so that the network sees the schedule's own σ)."""
    argv = ["--model", preset, "--image_size", "16", "--objective", objective, "--cpu", "--compile_mode", "off"]
    args = config.resolve(config.parse_args([*argv, "--churn", "0"]))
    return builder.build(args, total_steps=1, lr_ref_steps=1)  # EDM2's inverse_sqrt schedule needs one


def sampled(network, recorder, scheduler):
    """The noise levels the sampler steps through and what the network received at each, in order."""
    network.eval()
    sampling.generate(network, scheduler, sampling.image_seeds(0, 1), SAMPLING_STEPS)
    received = []
    for t in recorder.take():  # one time input for the batch per call; EDM's Heun calls twice at a level
        assert torch.equal(t, t[:1].expand_as(t))
        if not received or received[-1] != t[0]:
            received.append(t[0])
    if isinstance(scheduler, samplers.EDMHeunSampler):
        levels = samplers.karras_sigmas(SAMPLING_STEPS, scheduler.sigma_min, scheduler.sigma_max, scheduler.rho)[:-1]
    elif objectives.sampled_by(scheduler) is objectives.FlowObjective:
        levels = scheduler.timesteps.double() / objectives.NUM_TRAIN_TIMESTEPS  # the samplers give t = 1000 σ
    else:
        levels = scheduler.timesteps  # DDPM's noise level is its timestep
    return levels, torch.stack(received)


def trained(objective, net, recorder, levels, image_shape):
    """What the network receives when the objective's loss is taken through `net` at these noise levels."""
    x0 = torch.zeros(len(levels), *image_shape)
    if isinstance(objective, objectives.DDPMObjective):
        objective.timesteps = lambda n, device: levels.long()
        objective.loss(net, x0)
    else:
        objective.loss_at(net, x0, levels.float(), torch.randn_like(x0))
    (t,) = recorder.take()
    return t


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("objective_name,family", CASES)
def test_training_gives_the_network_the_time_input_sampling_gives_it(networks, objective_name, family, scope):
    """The objective's call through the step's wrapper gives the bare network what the run's sampler gives it."""
    network, recorder, wrapped = networks[family]
    pieces = run_pieces(objective_name, FAMILIES[family])
    levels, at_sampling = sampled(network, recorder, pieces.sampling_scheduler)
    network.train()
    at_training = trained(pieces.objective, wrapped[scope], recorder, levels, sampling.image_shape(network))
    torch.testing.assert_close(at_training, at_sampling, rtol=1e-5, atol=1e-5)
