"""The --loss_terms flag: extra terms of the objective (representation and coupling methods), what each is, where it applies,
and the terms that read a block's output.

    --loss_terms dispersive:0.25,layersync:0.2,deltafm:0.05,immiscible:64   (none: the objective alone)

- dispersive (Wang & He 2025): λ · log mean_ij exp(-‖z_i - z_j‖² / (D τ)) over the batch's flattened outputs z
  of the family's middle block (model.Family.middle_block), τ = 1; every objective and family.
- layersync (vita-epfl/LayerSync): w · mean over tokens of -cos(h_shallow, stopgrad(h_deep)); DiTs only.
- deltafm (gstoica27/DeltaFM): -λ ‖v - u_j‖² beside flow's ‖v - u_i‖² (objectives.FlowObjective.terms_at); flow only.
- immiscible (yhli123/Immiscible-Diffusion): each image's noise is the nearest of k draws (objectives.nearest_noise);
  a coupling, not a term: nothing is added to the loss.

A name alone takes its paper's value. docs/loss_terms.md has the formulas, sources and costs.
"""

import math
from typing import NamedTuple

import torch

from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.errors import ConfigError

NONE = "none"


class Method(NamedTuple):
    """One of --loss_terms' methods: its paper's value, what the value is, and where it applies."""

    default: float  # the value a name alone takes
    value: str  # what the number after the colon is, in the line that refuses a bad one
    objectives: tuple = tuple(objectives.OBJECTIVES.values())  # the objective classes it applies to
    families: tuple = tuple(models.FAMILIES)  # the network families it applies to (model.FAMILIES' keys)
    why: str = ""  # the reason it applies nowhere else, in the line that refuses it
    pairs: bool = False  # compares the images of a batch: nothing to compare at batch size 1
    count: bool = False  # the value is a whole number of at least 2, not a weight
    latent_default: float = None  # the value a name alone takes in a latent run (--vae), where it differs
    reads_blocks: bool = False  # it reads blocks' outputs, which --token_routing leaves with part of the tokens


METHODS = {
    "dispersive": Method(0.25, "a weight", pairs=True, reads_blocks=True),  # Wang & He's λ 0.25 (their code: 0.25 * disp_loss)
    "layersync": Method(0.2, "a weight", families=("dit",), reads_blocks=True,
                        why="it aligns a shallow block's tokens with a deep block's of the same width: a DiT's "
                            "blocks all share one, a UNet's change resolution and channels from level to level"),  # fmt: skip
    "deltafm": Method(0.05, "a weight", objectives=(objectives.FlowObjective,), pairs=True,
                      why="it contrasts flow matching's velocity targets: add --objective flow"),  # fmt: skip
    # The authors' k: 4 in their pixel-space code (CIFAR-10), 64 for Stable Diffusion's latents. On a flat image
    # the nearest of 64 draws is three times as biased as the nearest of 4 (docs/loss_terms.md).
    "immiscible": Method(4, "a number of noise draws", count=True, latent_default=64),
}
DISPERSIVE_TAU = 1.0  # the released code's (raywang4/DispLoss: exp(-diff), diff = ‖z_i - z_j‖² / D)


def parse(text, latents=False):
    """{method: value} of a --loss_terms value, in METHODS' order: 'none' (or empty, or None) is {}; a name alone
    takes its paper's value (`latents`: a latent run's, where the paper's differs). An unknown name, a repeated one or a bad value: ConfigError, one line."""
    if text is None or str(text).strip().lower() in ("", NONE):
        return {}
    found = {}
    for item in str(text).split(","):
        name, colon, value = item.strip().partition(":")
        if name not in METHODS:
            raise ConfigError(f"--loss_terms {text}: unknown term '{name}': choose {', '.join(METHODS)} (NAME or "
                              f"NAME:VALUE, comma-separated), or none")  # fmt: skip
        if name in found:
            raise ConfigError(f"--loss_terms {text}: {name} is given twice")
        method = METHODS[name]
        default = method.latent_default if latents and method.latent_default is not None else method.default
        found[name] = _value(text, name, method, value) if colon else default
    return {name: found[name] for name in METHODS if name in found}


def _value(text, name, method, value):
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if method.count:
        if not (number >= 2 and number == int(number) and math.isfinite(number)):
            raise ConfigError(f"--loss_terms {text}: {name} takes {method.value}, a whole number of at least 2 "
                              f"(got '{value}')")  # fmt: skip
        return int(number)
    if not (0 < number < math.inf):
        raise ConfigError(f"--loss_terms {text}: {name} takes {method.value}, a finite number greater than 0 "
                          f"(got '{value}')")  # fmt: skip
    return number


def spell(terms):
    """The one spelling of parsed `terms` (parse's), as a run records and compares it: 'none' for no terms."""
    return ",".join(f"{name}:{value:g}" for name, value in terms.items()) or NONE


def check(terms, objective, family, batch_size, routed=False):
    """ConfigError (one line) for a term of `terms` that does not apply to objective class `objective` (objectives.of),
    network family `family` (model.FAMILIES' key), a micro-batch of `batch_size` images or a `routed` network."""
    for name in terms:
        method = METHODS[name]
        if objective not in method.objectives:
            raise ConfigError(f"--loss_terms {name} applies to --objective {' or '.join(o.name for o in method.objectives)}, "
                              f"not {objective.name}: {method.why}")  # fmt: skip
        if family not in method.families:
            raise ConfigError(f"--loss_terms {name} applies to {' and '.join(method.families)} networks, not a "
                              f"{family}: {method.why}")  # fmt: skip
        if method.reads_blocks and routed:
            raise ConfigError(f"--loss_terms {name} reads blocks' outputs, which --token_routing leaves with part of "
                              "the tokens: drop one of them")  # fmt: skip
        if method.pairs and batch_size < 2:
            raise ConfigError(f"--loss_terms {name} compares the images of a batch: at --train_batch_size 1 there is "
                              "nothing to compare; use 2 or more, or drop it")  # fmt: skip


def attach(objective, network, family, terms):
    """`objective` (objectives.Objective) with `terms` (parse's) added, returned: immiscible's noise draws, deltafm's
    contrast (a FlowObjective's) and the readers of dispersive and layersync on the blocks of `network` (the bare
    network as built) that its `family` (model.Family) names. Call it once, where the objective is built."""
    rule = {"dispersive": family.middle_block, "layersync": family.sync_blocks}
    names = models.block_names(network)
    readers = []
    for name, value in terms.items():
        if name == "immiscible":
            objective.noise_draws = value
        elif name == "deltafm":
            objective.contrast = value
        else:
            blocks = rule[name](names)
            blocks = (blocks,) if isinstance(blocks, str) else blocks
            readers.append(BlockTerm(name, value, models.BlockOutputs(network, blocks), blocks))
    objective.readers = tuple(readers)
    return objective


class BlockTerm:
    """A term on block outputs, read after the network's call: {name: weight · TERMS[name](outputs, in order)}."""

    def __init__(self, name, weight, blocks, names):
        self.name, self.weight, self.blocks, self.names = name, weight, blocks, names

    def __call__(self):
        outputs = [self.blocks.outputs.pop(name) for name in self.names]  # nothing kept for the next call
        return {self.name: self.weight * TERMS[self.name](*outputs)}


def dispersive(z, tau=DISPERSIVE_TAU):
    """log mean_ij exp(-‖z_i - z_j‖² / (D τ)) over the B×B pairs of the batch `z` flattened to B×D, the diagonal's
    zeros included (raywang4/DispLoss: pdist's pairs twice and B zeros), through logsumexp. In fp32 whatever the autocast, through
    ‖z_i‖² + ‖z_j‖² - 2 z_i·z_j (a matmul, differentiable at z_i = z_j, where pdist's square root is not)."""
    with torch.autocast(z.device.type, enabled=False):
        z = z.float().flatten(1)
        square = z.square().sum(1)
        distance = (square[:, None] + square[None, :] - 2 * z @ z.T).clamp(min=0)  # rounding: never below 0
        return torch.logsumexp((-distance / (z.shape[1] * tau)).flatten(), 0) - 2 * math.log(len(z))


def layersync(shallow, deep):
    """-cos(h_shallow, stopgrad(h_deep)) per token (the last axis: a DiT's hidden width), the mean over the batch
    and its tokens: LayerSync's alignment; no gradient reaches the deep block through it."""
    return -torch.nn.functional.cosine_similarity(shallow.float(), deep.detach().float(), dim=-1).mean()


TERMS = {"dispersive": dispersive, "layersync": layersync}
