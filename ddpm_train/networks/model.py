"""The network families (model.FAMILIES: how each builds, loads, compiles and is read by the loss terms) and presets.

The DDPM presets are diffusers `UNet2DModel`s, so a trained run loads with
`DDPMPipeline.from_pretrained(output_dir)`; the EDM2 presets (family `edm2`)
are `edm2.EDM2UNet`s, a diffusers model with the same forward signature. The
presets live in one dict of `Preset` records, `PRESETS`; `python flops.py --model NAME` prints
what each one costs.
"""

import json
import math
from pathlib import Path
from types import MappingProxyType
from typing import Callable, NamedTuple

import torch

from ddpm_train.errors import ConfigError  # noqa: I001 (before diffusers: errors.py quiets what importing torchao logs)
from diffusers import DiTTransformer2DModel, UNet2DConditionModel, UNet2DModel

from ddpm_train.data import captions
from ddpm_train.networks import dit
from ddpm_train import sizes
from ddpm_train.networks.dit import DiT
from ddpm_train.networks.edm2 import EDM2UNet


def _unet(channels, attention_at, layers_per_block=2, **extra):
    """UNet2DModel kwargs: one down and one up block per entry of `channels`.

    `attention_at` holds the indices (0 = full resolution) of the levels whose
    blocks carry self-attention; the up path mirrors the down path.
    """
    down = tuple("AttnDownBlock2D" if i in attention_at else "DownBlock2D" for i in range(len(channels)))
    up = tuple(b.replace("Down", "Up") for b in reversed(down))
    return dict(
        block_out_channels=tuple(channels),
        layers_per_block=layers_per_block,
        down_block_types=down,
        up_block_types=up,
        **extra,
    )


def _edm2(config, dropout):
    """EDM2UNet kwargs at FutureXiang/edm2's CIFAR-10 size (config/cifar10/*.yaml):
    128 channels x (1, 2, 2, 2), two blocks per level plus a down/up block,
    attention at 16x16 (level 1) and in the middle. 39,509,888 parameters for
    C and E, 39,542,685 for G (its zero-initialised gains, one embedding layer
    instead of two, and 256-channel encoder convs after the skip), as the seed
    counts. The learned weighting's u(sigma) lives in the objective (EDMObjective).
    """
    return dict(
        edm2_config=config,
        channels=128,
        channel_mult=(1, 2, 2, 2),
        num_blocks=2,
        attention_levels=(1,),
        dropout=dropout,
    )


class Preset(NamedTuple):
    """A --model preset. Its parameter counts and FLOPs are in docs/training.md's table, which
    `python flops.py --presets docs/training.md` generates from these."""

    description: str  # the table's "what it is"
    image_size: int  # the size it was made for
    learning_rate: float  # config.resolve fills it in unless --learning_rate is given
    settings: dict  # what its family (FAMILIES) builds the network from
    family: str = "unet"  # a key of FAMILIES
    ddpm: dict = MappingProxyType({})  # DDPM settings (prediction type, timestep sampling) where --objective ddpm
    flags: dict = MappingProxyType({})  # other train.py defaults, filled in where the command line leaves them unset
    lr_decay: dict = None  # a schedule config.resolve sets --lr_scheduler and --lr_ref_steps from


PRESETS = {
    # The bare `python train.py`: small enough to learn the built-in shapes on a
    # 2-core CPU in a few minutes.
    "small": Preset(
        description="sized for a 2-core CPU: batch 4, 12 epochs, no EMA; its DDPM (`--objective ddpm`) with v-prediction and lognormal timesteps",
        image_size=32,
        # A 1M-parameter UNet tolerates a high rate, and the bare command has
        # only a few thousand steps to show the shapes.
        learning_rate=2e-3,
        # DDPM with v-prediction and EDM's noise levels (--timestep_sampling lognormal):
        # the quality ladder's best row, ahead of eps-prediction with uniform timesteps
        # and of the EDM objective (BENCHMARKS.md).
        ddpm=dict(prediction_type="v_prediction", timestep_sampling="lognormal"),
        # Batch 4: this run is short of optimizer steps, not of images; at the same
        # images smaller batches scored better down to 4, and 2 worse (BENCHMARKS.md).
        # No EMA: the cosine decay to zero already averages the last steps, and the
        # raw weights scored better than the EMA in every comparison (BENCHMARKS.md).
        # 12 epochs (6,144 steps): minutes on a 2-core CPU, and the first length whose
        # grid holds triangles and squares (BENCHMARKS.md).
        flags=dict(train_batch_size=4, num_epochs=12, ema="none"),
        settings=_unet((32, 64, 64), attention_at=(), layers_per_block=1, norm_num_groups=8),
    ),
    # For tests and smoke runs: a few hundred thousand parameters.
    "tiny": Preset(
        description="for tests",
        image_size=16,
        learning_rate=2e-3,
        settings=_unet((16, 32), attention_at=(1,), layers_per_block=1, norm_num_groups=8, attention_head_dim=8),
    ),
    # `small` with a fourth level (4x4) and attention at the two lowest: 4x the
    # parameters for ~1.3x the cost per image on a CPU. A row of the quality ladder.
    "small_deep": Preset(
        description="`small` with a 4×4 level and attention at 8×8 and 4×4",
        image_size=32,
        learning_rate=2e-3,
        settings=_unet((32, 64, 128, 128), attention_at=(2, 3), layers_per_block=1, norm_num_groups=8,
                   attention_head_dim=32),  # fmt: skip
    ),
    # Ho et al. (2020)'s CIFAR-10 network, as in google/ddpm-cifar10-32.
    "ddpm32": Preset(
        description="Ho et al. (2020)'s CIFAR-10 network",
        image_size=32,
        learning_rate=1e-4,
        settings=_unet((128, 256, 256, 256), attention_at=(1,)),
    ),
    # ADM-style 64px UNet (Dhariwal & Nichol 2021): attention at 16x16 and 8x8
    # with 32-channel heads. ADM resamples with average pooling and nearest
    # upsampling; UNet2DModel's blocks always use 3x3 convolutions there, which
    # add 1.58M parameters (22.08M instead of ADM's 20.5M) and 7.1 GFLOP/img.
    "adm64": Preset(
        description="ADM-style (Dhariwal & Nichol 2021): (64,128,192,256), attention at 16×16 and 8×8, 32-channel heads",
        image_size=64,
        learning_rate=1e-4,
        settings=_unet((64, 128, 192, 256), attention_at=(2, 3), attention_head_dim=32),
    ),
    # The diffusers train_unconditional.py model: 113,673,219 parameters.
    "ref128": Preset(
        description="diffusers' `train_unconditional.py` UNet: block_out_channels (128,128,256,256,512,512), attention in the 5th down and 2nd up block",
        image_size=128,
        learning_rate=1e-4,
        settings=_unet((128, 128, 256, 256, 512, 512), attention_at=(4,)),
    ),
    # EDM2 (Karras et al. 2024) Configs C, E and G at the CIFAR-10 size of
    # FutureXiang/edm2, with its dropout (0.13) and its learning rates: Adam,
    # 200 epochs of linear warm-up, then constant (C) or alpha_ref /
    # sqrt(max(t / t_ref, 1)) with t_ref = 400 epochs (E, G: Config E's
    # inverse-square-root decay, Table 1; NVlabs/edm2 learning_rate_schedule).
    # `lr_decay` records that schedule: config.resolve sets --lr_scheduler and --lr_ref_steps from it.
    # C: config/cifar10/C.yaml, lrate 4e-4 at batch 512.
    "edm2c": Preset(
        description="EDM2 Config C at CIFAR-10 size ([edm2.md](edm2.md))",
        image_size=32,
        learning_rate=4e-4,
        lr_decay=None,
        family="edm2",
        settings=_edm2("C", dropout=0.13),
    ),
    # E: config/cifar10/E.yaml, lrate 2e-2 at batch 512, tref_epoch 400.
    "edm2e": Preset(
        description="EDM2 Config E at CIFAR-10 size ([edm2.md](edm2.md))",
        image_size=32,
        learning_rate=2e-2,
        lr_decay=dict(schedule="inverse_sqrt", ref_images=400 * 50_000),
        family="edm2",
        settings=_edm2("E", dropout=0.13),
    ),
    # G: config/cifar10/G.yaml as of commit ffdda02 (the seed dropped it
    # later, finding G worse than E in pixel space): lrate 5e-3 at batch 128.
    # For tests and smoke runs: Config G at 16 channels, two levels.
    "edm2tiny": Preset(
        description="Config G at 16 channels, for tests",
        image_size=16,
        learning_rate=1e-2,
        lr_decay=dict(schedule="inverse_sqrt", ref_images=1000),
        family="edm2",
        settings=dict(edm2_config="G", channels=16, channel_mult=(1, 2), num_blocks=1, attention_levels=(1,),
                  channels_per_head=16, dropout=0.0),  # fmt: skip
    ),
    # Config G at the cost of `small` (1.26M parameters, 1.25x its FLOPs at 32px): the
    # quality ladder's EDM2 row, against the UNet2DModel it replaces on a CPU. The rate
    # and decay are edm2tiny's, which trains the built-in shapes (docs/edm2.md).
    "edm2small": Preset(
        description="Config G at 32 channels × (1, 2, 2), attention at 8×8: about `small`'s cost",
        image_size=32,
        learning_rate=1e-2,
        lr_decay=dict(schedule="inverse_sqrt", ref_images=1000),
        family="edm2",
        settings=dict(edm2_config="G", channels=32, channel_mult=(1, 2, 2), num_blocks=1, attention_levels=(2,),
                  channels_per_head=32, dropout=0.0),  # fmt: skip
    ),
    "edm2g": Preset(
        description="EDM2 Config G",
        image_size=32,
        learning_rate=5e-3,
        lr_decay=dict(schedule="inverse_sqrt", ref_images=400 * 50_000),
        family="edm2",
        settings=_edm2("G", dropout=0.13),
    ),
}

# DiT (Peebles & Xie 2023) at Table 1's sizes, patches 2, 4 and 8: dit-s2 ... dit-xl8. Made for
# ImageNet 256px through SD's VAE (32x32x4 latents); DiT's AdamW 1e-4 at a constant rate. Parameters
# and FLOPs against the paper's: docs/dit.md.
for _size, _patch in [(s, p) for s in dit.SIZES for p in dit.PATCHES]:
    PRESETS[f"dit-{_size}{_patch}"] = Preset(
        description=f"DiT-{_size.upper()}/{_patch} (Peebles & Xie 2023)",
        image_size=256,
        learning_rate=1e-4,
        family="dit",
        settings=dit.dit_kwargs(_size, _patch),
        flags=dict(lr_scheduler="constant"),
    )
# For tests and smoke runs, and a DiT at about the `small` UNet's cost on a CPU (32px pixels, patch 4:
# 64 tokens); the rate is `small`'s.
PRESETS["dit-tiny"] = Preset(description="test-sized DiT", image_size=16, learning_rate=2e-3, family="dit",
                           settings=dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, patch_size=2))  # fmt: skip
PRESETS["dit-small"] = Preset(description="CPU-sized DiT for the built-in dataset", image_size=32, learning_rate=2e-3,
                            family="dit", settings=dict(num_layers=6, num_attention_heads=3, attention_head_dim=64,
                                                    patch_size=4))  # fmt: skip

# `--model auto` picks the preset made for the image size, else `small`.
AUTO_MODEL = {128: "ref128", 64: "adm64"}


def resolve_model_name(name, image_size):
    """The preset `--model` names; `auto` picks one by image size: a non-square one's by its area, as the square of
    the same area (96x43 as 64)."""
    if name == "auto":
        return AUTO_MODEL.get(sizes.side_of_area(image_size), "small")
    if name not in PRESETS:
        raise ConfigError(f"unknown --model '{name}': choose one of auto, {', '.join(PRESETS)}")
    return name


class CompileCosts(NamedTuple):
    """What compiling one network family's step costs and saves, by which compiling.plan_compile weighs a compile
    against the run. Each number is rounded from the records (BENCHMARKS.md), as the comments say."""

    # How much slower a step compiled block by block runs than the whole network compiled as one graph (the
    # glue between blocks stays eager, and no fusion crosses a block's edge), by device type ("cuda", "cpu");
    # positive: compiling.choose_compile_scope divides by it. The CPU's from its record (Speed on a CPU, regional against
    # whole: DiT the mean of its two models, the UNet rounded up); the GPU's from an H100's ladder rows
    # (DiT-XL/2's regional row against the whole network's of earlier calls; ddpm32's two scopes in one
    # session, under CUDA graphs, a mode in which train.py compiles the whole network anyway).
    regional_step_cost: dict
    # A cold compile of train.py's step (the first step: forward and backward) in seconds, by (device type,
    # scope); a warm one (Inductor's cache holds the graphs) takes compiling.WARM_COMPILE_FRACTION of it. The GPU's
    # whole-network compiles on an H100 and an H200, DiT-XL/2's regional one (one graph for every block) and
    # ddpm32's regional one on an H100; the CPU's whole and regional, one thread, in Speed on a CPU. The GPU's
    # regional share of the whole differs from the CPU's in both directions (DiT's far smaller, the UNet's
    # larger: on an H100 ddpm32's regional compile took 1.06 of its whole one, under CUDA graphs), so a UNet's
    # regional compile on a GPU is the whole one times that ratio, and auto compiles its whole network there.
    cold_compile_s: dict
    # The eager step on a GPU: its time is FLOPs / (peak * eager_mfu), no less than eager_launch_floor_s, and
    # a compiled mode without CUDA graphs saves saved_share of it (compiling.SAVED_SHARE_CUDA_GRAPHS with them); from
    # the H100's eager and compiled ladder rows (DiT-XL/2's; ref128's and adm64's, whose CUDA graphs set the
    # launch-bound share, in the first H100 record).
    eager_mfu: float
    eager_launch_floor_s: float
    saved_share: float
    # The eager step replayed as one CUDA graph (`eager-graph`) keeps the eager kernels and loses the launch
    # gaps between them: FLOPs / (peak * graph_mfu) plus graph_floor_s for its many small kernels, never less
    # than the eager kernels' time, after compiling.EAGER_GRAPH_CAPTURE_S of warm-up steps and capture. The UNet's two
    # numbers solve an H200's two rows (the eager step captured: ddpm32 at batch 128, 4.78 TFLOP, 45.2 ms;
    # adm64 at batch 32, 1.47 TFLOP, 23.4 ms); its warm-up steps took 3.9 s in the bare run. A DiT's step is
    # bound by its kernels eager (24.6% MFU, no floor), so a graph saves it nothing.
    graph_mfu: float
    graph_floor_s: float
    # On a CPU, which has no peak in flops.py, the eager step's rate on a 2-core CPU takes the place of
    # peak * MFU (DiT-S/2's measured there; the bare run's `small`), and compiling saves cpu_saved_share
    # of it. A UNet's is 0: compiling `tiny` made its step slower in the sweep, so its compile never pays.
    cpu_eager_flops: float
    cpu_saved_share: float


UNET_COSTS = CompileCosts(
    regional_step_cost={"cuda": 0.52, "cpu": 0.14},
    cold_compile_s={("cuda", "whole"): 100, ("cuda", "regional"): 100 * 1.06, ("cpu", "whole"): 90, ("cpu", "regional"): 78},
    eager_mfu=0.116, eager_launch_floor_s=0.1, saved_share=0.40, graph_mfu=0.153, graph_floor_s=0.0137,
    cpu_eager_flops=80e9, cpu_saved_share=0.0,
)  # fmt: skip
DIT_COSTS = CompileCosts(
    regional_step_cost={"cuda": 0.03, "cpu": 0.035},
    cold_compile_s={("cuda", "whole"): 85, ("cuda", "regional"): 14, ("cpu", "whole"): 54, ("cpu", "regional"): 36},
    eager_mfu=0.246, eager_launch_floor_s=0.02, saved_share=0.32, graph_mfu=0.246, graph_floor_s=0.0,
    cpu_eager_flops=150e9, cpu_saved_share=0.19,
)  # fmt: skip

class Family(NamedTuple):
    """What every preset of a network family shares, decided here once. A Preset names its family and
    holds the settings the family builds its network from."""

    build: Callable  # (settings, sample_size, channels, num_classes) -> a fresh network
    size_multiple: Callable  # settings -> what an input side must be a multiple of
    reduces: str  # how it reduces its input, in the line that refuses a size: "patches" or "halvings"
    # The objective without --objective (config.default_objective keeps a UNet's DDPM on the built-in shapes):
    # flow matching for diffusers' UNets and the DiTs (it beat the presets' DDPM on real photos at two seeds:
    # BENCHMARKS.md, Real images), EDM for EDM2's networks.
    default_objective: str
    saves_pipeline: bool  # with DDPM or flow, the run saves a diffusers DDPMPipeline; else its network alone in unet/
    # The block (of block_names) whose output a representation term reads (loss_terms.py: dispersive): its middle.
    middle_block: Callable = None  # block names -> one of them
    # LayerSync's shallow and deep blocks (names -> (shallow, deep)); None where it does not apply.
    sync_blocks: Callable = None
    # The noise level it takes as its time input: "timestep", DDPM's t on a scale of 0 to 1000 (its sinusoidal
    # embedding was made for that), or "c_noise", EDM2's ln(σ)/4 into its Fourier features. Each objective gives
    # each in its own way (objectives.py: `time_input`).
    time_input: str = "timestep"
    network_class: type = None  # the class it builds, and loads a run's saved network with (load_network)
    # The `_class_name`s its networks are saved as (config.json), and the class --init_from loads such a source with.
    classes: tuple = ()
    source_class: type = None
    layout: tuple = ()  # the config keys that give its parameters' shapes: a preset that agrees on them is a source's
    compile_costs: CompileCosts = None  # what compiling its step costs and saves (compiling.plan_compile)
    called: str = ""  # what a model card calls one ("a DiT")
    card_lines: Callable = None  # (square) -> the model card's lines on loading its network alone, where it has some
    lr_schedule: str = "cosine"  # --lr_scheduler where its preset names none (EDM2's: constant after warm-up)
    # Its blocks are transformer blocks that all take the same tokens (dit.py): --token_routing and FP8's linear
    # layers apply to it, and its rows of the preset table are docs/dit.md's
    transformer: bool = False
    # A captioned run's (--text_encoder) network: (settings, sample_size, channels, text_dim) -> one attending to the
    # captions' embeddings (None where the family takes no captions), and the class it loads as where that is not
    # network_class (one saved as `text_class` or its diffusers base).
    text_build: Callable = None
    text_class: type = None


def _build_unet(settings, sample_size, channels, num_classes):
    """diffusers' UNet2DModel; a class-conditional one has one class embedding more, the null label."""
    classes = dict(num_class_embeds=num_classes + 1) if num_classes else {}
    net = UNet2DModel(sample_size=sample_size, in_channels=channels, out_channels=channels, **settings, **classes)
    net._repeated_blocks = UNET_REPEATED_BLOCKS  # diffusers 0.42.1 declares none for UNet2DModel
    return net


class TextUNet(UNet2DConditionModel):
    """diffusers' UNet2DConditionModel whose `class_labels` are captions.Words (a batch's caption embeddings and
    masks), so that the step, the grids and guidance hand it its condition as they hand a class-conditional network
    its labels; its caption is pooled over the real tokens alone (dit.pooled_caption)."""

    captions = None  # a run's or a sampling's caption table (captions.Table: ids -> Words); never saved

    def forward(self, sample, timestep, class_labels=None, **kwargs):
        return super().forward(sample, timestep, encoder_hidden_states=class_labels.embeddings.to(sample.dtype),
                               encoder_attention_mask=class_labels.mask, added_cond_kwargs=dict(mask=class_labels.mask),
                               **kwargs)  # fmt: skip

    def get_aug_embed(self, emb, encoder_hidden_states, added_cond_kwargs):
        return dit.pooled_caption(self.add_embedding, encoder_hidden_states, added_cond_kwargs["mask"])


def _build_text_unet(settings, sample_size, channels, text_dim):
    """A captioned run's UNet: the preset's blocks as a UNet2DConditionModel, cross-attention (with the
    self-attention and feed-forward of diffusers' transformer block) where the preset has attention and in the
    middle, attending to `text_dim`-wide embeddings, and the caption pooled by attention and added to the time
    embedding that every ResNet reads (diffusers' addition_embed_type "text", Imagen's pooled text): a preset with
    attention in its middle alone did not follow its prompts (docs/text.md). Its heads keep the preset's width
    (UNet2DModel's attention_head_dim, 8 where it names none; UNet2DConditionModel takes heads a block instead)."""
    settings = dict(settings)
    width = settings.pop("attention_head_dim", 8)
    down = tuple(b.replace("AttnDown", "CrossAttnDown") for b in settings.pop("down_block_types"))
    up = tuple(b.replace("AttnUp", "CrossAttnUp") for b in settings.pop("up_block_types"))
    heads = tuple(max(1, c // width) for c in settings["block_out_channels"])
    net = TextUNet(sample_size=sample_size, in_channels=channels, out_channels=channels, down_block_types=down,
                   up_block_types=up, attention_head_dim=heads, cross_attention_dim=text_dim, addition_embed_type="text",
                   addition_embed_type_num_heads=max(1, text_dim // 64), **settings)  # fmt: skip  (CLIP-L: 12 heads)
    net._repeated_blocks = UNET_REPEATED_BLOCKS
    return net


def _build_text_dit(settings, sample_size, channels, text_dim):
    """A captioned run's DiT: the project's own (dit.DiT), attending to `text_dim`-wide embeddings."""
    return DiT(sample_size=sample_size, in_channels=channels, out_channels=channels, text_dim=text_dim, **settings)


def stand_in_captions(batch_size, text, device="meta"):
    """The kwargs that call a network counted on `device` (flops.py, memory.py) as a step calls it: for a captioned
    one (`text`: its embeddings' (width, tokens)), class_labels of stand-in captions, every token real."""
    if not text:
        return {}
    width, length = text
    return dict(class_labels=captions.Words(torch.empty(batch_size, length, width, device=device),
                                            torch.ones(batch_size, length, dtype=torch.bool, device=device)))  # fmt: skip


# --- the repeated blocks that Muon, compiling and the loss terms read ---------------------------------------


def block_names(network):
    """The names of `network`'s repeated blocks (the classes its `_repeated_blocks` declares: a UNet's ResNet and
    attention blocks, a DiT's transformer blocks, EDM2's blocks), in the order of the forward pass."""
    kinds = tuple(getattr(network, "_repeated_blocks", None) or ())
    return [name for name, module in network.named_modules() if type(module).__name__ in kinds]


class BlockOutputs:
    """The way a loss term reads a network's intermediate activations: the outputs of the blocks named (see
    block_names), kept during each forward call by a forward hook on each block of the bare network, registered
    once when the objective is built. After `net(...)` a term reads `outputs[name]`, a tensor of the graph, so
    its gradient reaches the network. The hooks run inside the compiled call of torch.compile (whole or
    regional: Dynamo keeps the tensors as the graph's outputs; tests/test_block_outputs.py), and a captured
    step graph captures them with the rest of the step (not yet run on a GPU)."""

    def __init__(self, network, names):
        modules = dict(network.named_modules())
        self.outputs = {}
        self.handles = [modules[name].register_forward_hook(self._keeper(name)) for name in names]

    def _keeper(self, name):
        def keep(module, args, output):
            self.outputs[name] = output[0] if isinstance(output, tuple) else output

        return keep


def _unet_middle(names):
    """A diffusers UNet's middle: its mid-block's output (the last ResNet of mid_block), at the lowest resolution."""
    return [name for name in names if name.startswith("mid_block.")][-1]


def _edm2_middle(names):
    """An EDM2 network's middle: the last of the decoder's blocks at the lowest resolution that come before its
    first decoder block (dec.RxR_in1, EDM2's mid-block), whose output the decoder's levels then widen."""
    return [name for name in names if "_in" in name.rsplit(".", 1)[-1]][-1]


def _dit_card_lines(square):
    """A DiT run's model card: how its network alone loads (diffusers' DiTTransformer2DModel takes square inputs
    only, docs/images.md; DiTPipeline takes 1000 classes and DDPM's epsilon only, docs/dit.md)."""
    if not square:
        return ["diffusers' `DiTTransformer2DModel` takes square inputs only: load this network with ddpm-train's "
                '`dit.DiT.from_pretrained("USER/REPO", subfolder="unet")`.', ""]  # fmt: skip
    return ["The network alone loads in diffusers, with the same outputs:", "", "```python",
            "from diffusers import DiTTransformer2DModel", "",
            'net = DiTTransformer2DModel.from_pretrained("USER/REPO", subfolder="unet")  # or this folder', "```", ""]  # fmt: skip


def _dit_middle(names):
    """A DiT's middle block: block depth/2 (counting from 1), its output halfway down the stack."""
    return names[max(len(names) // 2, 1) - 1]


# LayerSync's blocks on SiT-XL/2 (vita-epfl/LayerSync): the 8th aligned to the 16th of 28.
LAYERSYNC_BLOCKS = (8, 16, 28)


def _dit_sync_blocks(names):
    """LayerSync's shallow and deep DiT blocks: SiT-XL's 8th and 16th of 28, scaled to this depth (rounded; the
    deep one at least one block below the shallow one): 2 and 3 of 6, 3 and 7 of 12, 1 and 2 of 2."""
    shallow_at, deep_at, depth = LAYERSYNC_BLOCKS
    if len(names) < 2:
        raise ConfigError(f"--loss_terms layersync needs two blocks to align; this DiT has {len(names)}")
    shallow = max(1, round(len(names) * shallow_at / depth))
    deep = min(len(names), max(shallow + 1, round(len(names) * deep_at / depth)))
    return names[shallow - 1], names[deep - 1]


FAMILIES = {
    "unet": Family(_build_unet, lambda settings: 2 ** (len(settings["block_out_channels"]) - 1), "halvings", "flow", True,
                   _unet_middle, network_class=UNet2DModel, classes=("UNet2DModel", "TextUNet"), source_class=UNet2DModel,
                   layout=("block_out_channels", "layers_per_block", "down_block_types", "up_block_types"),
                   compile_costs=UNET_COSTS, called="a UNet", text_build=_build_text_unet, text_class=TextUNet),
    "edm2": Family(lambda settings, size, channels, classes: EDM2UNet(sample_size=size, num_classes=classes,
                                                                      in_channels=channels, out_channels=channels, **settings),
                   lambda settings: 2 ** (len(settings["channel_mult"]) - 1), "halvings", "edm", False, _edm2_middle,
                   time_input="c_noise", network_class=EDM2UNet, classes=("EDM2UNet",), source_class=EDM2UNet,
                   layout=("edm2_config", "channels", "channel_mult", "num_blocks", "attention_levels"),
                   compile_costs=UNET_COSTS,  # EDM2's blocks and steps are not measured: the UNet's
                   called="an EDM2 network", lr_schedule="constant_with_warmup"),
    "dit": Family(lambda settings, size, channels, classes: DiT(sample_size=size, num_classes=classes,
                                                                in_channels=channels, out_channels=channels, **settings),
                  lambda settings: settings["patch_size"], "patches", "flow", False, _dit_middle, _dit_sync_blocks,
                  network_class=DiT, classes=("DiTTransformer2DModel", "DiT"), source_class=DiTTransformer2DModel,
                  layout=("num_layers", "num_attention_heads", "attention_head_dim", "patch_size"),
                  compile_costs=DIT_COSTS, called="a DiT", card_lines=_dit_card_lines, transformer=True,
                  text_build=_build_text_dit),
}  # fmt: skip


def family_name(name):
    """'unet' (diffusers' UNet2DModel), 'edm2' or 'dit': the network family of preset `name`."""
    return PRESETS[name].family


def family_by_class(name):
    """(family name, Family) whose networks are saved as class `name` (a config.json's `_class_name`), or None."""
    return next(((key, kind) for key, kind in FAMILIES.items() if name in kind.classes), None)


def family_of(net):
    """The Family whose `classes` hold the class of `net`, a network as built or loaded (its class's name, or the
    `_class_name` its config names); a class of no family is a ConfigError, never a guess at its time input."""
    name = (getattr(net, "config", None) or {}).get("_class_name") or type(net).__name__
    found = family_by_class(name)
    if found:
        return found[1]
    raise ConfigError(f"a network of class {name} belongs to no network family (model.FAMILIES): add its family's entry")


def family(name):
    """The Family of preset `name`, and the preset's settings for it."""
    preset = PRESETS[name]
    return FAMILIES[preset.family], preset.settings


def size_multiple(name):
    """Image sides must be a multiple of this: one halving per level but the last, or a DiT's patch."""
    kind, settings = family(name)
    return kind.size_multiple(settings)


def check_image_size(name, image_size, factor=1):
    """The network of preset `name` must halve each side of its input evenly: `image_size` over `factor`
    (a latent run's VAE factor: the network sees latents `factor` times smaller)."""
    multiple, (height, width) = size_multiple(name), sizes.height_width(sizes.divided(image_size, factor))
    if any(side < multiple or side % multiple for side in (height, width)):
        examples = ", ".join(str(multiple * k * factor) for k in (1, 2, 3, 4))  # multiples, not powers of two
        latents = f" (its {width}x{height} latents: the VAE's factor is {factor})" if factor > 1 else ""
        how = (f"it cuts its input into {multiple}x{multiple} patches" if family(name)[0].reduces == "patches"
               else f"it halves its input {multiple.bit_length() - 1} times")  # fmt: skip
        raise ConfigError(
            f"--model {name} cannot take --image_size {image_size}{latents}: {how}, so each side must be a "
            f"multiple of {multiple * factor} ({examples}, ...)"
        )


def build_network(name, image_size, device=None, num_classes=0, channels=3, settings=None, text_dim=0):
    """A fresh network of preset `name` for inputs of `image_size` (sizes: a side or "WxH") and `channels`
    channels (3 for images; a latent run's: its VAE's latent channels at its latent size), built by
    its family (FAMILIES): a UNet2DModel, an EDM2UNet or a DiT.

    `num_classes` > 0: class-conditional, `class_labels` 0..num_classes-1, and
    num_classes itself the null label that classifier-free guidance trains
    with (`null_label`): a UNet2DModel gets a class embedding with one entry
    more, added to its time embedding; an EDM2UNet gets EDM2's one-hot label
    input, the null label an all-zero one.
    `settings`: what a run's --init_from source's config sets beyond the preset's (init_from.extra_settings).
    `text_dim` > 0: a captioned run's network (Family.text_build), attending to embeddings that wide.
    """
    check_image_size(name, image_size)
    kind, preset_settings = family(name)
    settings = dict(preset_settings) | dict(settings or {})
    with torch.device(device or "cpu"):
        if text_dim:
            return kind.text_build(settings, sizes.sample_size(image_size), channels, text_dim)
        return kind.build(settings, sizes.sample_size(image_size), channels, num_classes)


# The UNet's blocks that regional compilation (compiling.RegionalNetwork) compiles once per shape: its ResNet
# blocks and attention; the down- and upsamplers, embeddings and the last norm and conv run eager.
UNET_REPEATED_BLOCKS = ("ResnetBlock2D", "Attention")


def network_channels(config):
    """The channels of what a run's network takes (`config`: its flags or train_config.json): a latent run's
    latents', else its images' (1, 3 or 4; 3 for a run recorded before they were)."""
    return config.get("latent_channels") or config.get("image_channels") or 3


def build_run_network(config):
    """A fresh network for a run's train_config.json `config`: at its latent size and channels for a
    latent run (--vae), else at its image size and channels; with what its --init_from source's config set
    beyond the preset (its record's "settings": google's DDPM UNets' time embedding, say)."""
    return build_network(config["model"], config.get("latent_size") or config["image_size"],
                         num_classes=config.get("num_classes") or 0, channels=network_channels(config),
                         settings=(config.get("init_source") or {}).get("settings"), text_dim=config.get("text_dim") or 0)  # fmt: skip


def num_classes_of(net):
    """The classes a network was built for (0: unconditional), read from its config; a TextUNet's: its captions
    but the empty one, so that its null label is the empty caption's id."""
    if getattr(net, "captions", None) is not None:
        return len(net.captions) - 1
    config = net.config
    if "num_class_embeds" in config:  # UNet2DModel: one embedding more, the null label
        return (config["num_class_embeds"] or 1) - 1
    return config.get("num_classes", 0) or 0


def null_label(num_classes):
    """The label that stands for "no class": the last embedding (build_network)."""
    return num_classes


# --- the learning-rate schedule (shared by train.py and python -m bench) -------------


def make_lr_scheduler(schedule, optimizer, warmup_steps, max_train_steps, ref_steps=None):
    """diffusers' schedules with a linear warm-up, or EDM2's inverse square root:

    lr(t) = lr_ref * min(t / warmup, 1) / sqrt(max(t / t_ref, 1))
    (Karras et al. 2024, Config E; NVlabs/edm2 training_loop.learning_rate_schedule).
    """
    from diffusers.optimization import get_scheduler

    if schedule != "inverse_sqrt":
        return get_scheduler(schedule, optimizer, num_warmup_steps=warmup_steps, num_training_steps=max_train_steps)

    def factor(step):
        ramp = min(step / warmup_steps, 1.0) if warmup_steps else 1.0
        return ramp / math.sqrt(max(step / ref_steps, 1.0))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def load_network(path):
    """The network saved with `save_pretrained` in folder `path` (config.json + weights), in eval mode.

    The network class of the family whose saved classes hold the config's _class_name (a UNet2DModel where
    it names none: a config of before diffusers wrote it).
    """
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{path}: no config.json, so no saved network")
    name = json.loads(config_file.read_text()).get("_class_name")
    # a captioned run's network: its own class (a checkpoint's) or the diffusers class it is (a StableDiffusionPipeline's)
    text = [k.text_class for k in FAMILIES.values() if k.text_class and name in (k.text_class.__name__, k.text_class.__base__.__name__)]
    found = family_by_class(name)
    kind = found[1] if found else FAMILIES["unet"]
    return (text[0] if text else kind.network_class).from_pretrained(str(path)).eval()
