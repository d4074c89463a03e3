"""Model presets, the noise schedule and the DDPM training loss.

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
import torch.nn.functional as F

from errors import ConfigError  # noqa: I001 (before diffusers: errors.py quiets what importing torchao logs)
from diffusers import DDPMScheduler, UNet2DModel

import dit
import edm2
import sizes
from dit import DiT
from edm2 import EDM2UNet


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


def _build_unet(settings, sample_size, channels, num_classes):
    """diffusers' UNet2DModel; a class-conditional one has one class embedding more, the null label."""
    classes = dict(num_class_embeds=num_classes + 1) if num_classes else {}
    net = UNet2DModel(sample_size=sample_size, in_channels=channels, out_channels=channels, **settings, **classes)
    net._repeated_blocks = UNET_REPEATED_BLOCKS  # diffusers 0.42.1 declares none for UNet2DModel
    return net


def _unet_middle(names):
    """A diffusers UNet's middle: its mid-block's output (the last ResNet of mid_block), at the lowest resolution."""
    return [name for name in names if name.startswith("mid_block.")][-1]


def _edm2_middle(names):
    """An EDM2 network's middle: the last of the decoder's blocks at the lowest resolution that come before its
    first decoder block (dec.RxR_in1, EDM2's mid-block), whose output the decoder's levels then widen."""
    return [name for name in names if "_in" in name.rsplit(".", 1)[-1]][-1]


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
                   _unet_middle),
    "edm2": Family(lambda settings, size, channels, classes: EDM2UNet(sample_size=size, num_classes=classes,
                                                                      in_channels=channels, out_channels=channels, **settings),
                   lambda settings: 2 ** (len(settings["channel_mult"]) - 1), "halvings", "edm", False, _edm2_middle),
    "dit": Family(lambda settings, size, channels, classes: DiT(sample_size=size, num_classes=classes,
                                                                in_channels=channels, out_channels=channels, **settings),
                  lambda settings: settings["patch_size"], "patches", "flow", False, _dit_middle, _dit_sync_blocks),
}  # fmt: skip


def family_name(name):
    """'unet' (diffusers' UNet2DModel), 'edm2' or 'dit': the network family of preset `name`."""
    return PRESETS[name].family


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


def build_network(name, image_size, device=None, num_classes=0, channels=3, settings=None):
    """A fresh network of preset `name` for inputs of `image_size` (sizes: a side or "WxH") and `channels`
    channels (3 for images; a latent run's: its VAE's latent channels at its latent size), built by
    its family (FAMILIES): a UNet2DModel, an EDM2UNet or a DiT.

    `num_classes` > 0: class-conditional, `class_labels` 0..num_classes-1, and
    num_classes itself the null label that classifier-free guidance trains
    with (`null_label`): a UNet2DModel gets a class embedding with one entry
    more, added to its time embedding; an EDM2UNet gets EDM2's one-hot label
    input, the null label an all-zero one.
    `settings`: what a run's --init_from source's config sets beyond the preset's (init_from.extra_settings).
    """
    check_image_size(name, image_size)
    kind, preset_settings = family(name)
    with torch.device(device or "cpu"):
        return kind.build(dict(preset_settings) | dict(settings or {}), sizes.sample_size(image_size), channels, num_classes)


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
                         settings=(config.get("init_source") or {}).get("settings"))  # fmt: skip


def num_classes_of(net):
    """The classes a network was built for (0: unconditional), read from its config."""
    config = net.config
    if "num_class_embeds" in config:  # UNet2DModel: one embedding more, the null label
        return (config["num_class_embeds"] or 1) - 1
    return config.get("num_classes", 0) or 0


def null_label(num_classes):
    """The label that stands for "no class": the last embedding (build_network)."""
    return num_classes


NUM_TRAIN_TIMESTEPS = 1000  # DDPM's T (Ho et al. 2020, and every config here)


def make_noise_scheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS, beta_schedule="linear", prediction_type="epsilon",
                         zero_terminal_snr=False, latents=False):  # fmt: skip
    """DDPM's forward process. `zero_terminal_snr`: the betas rescaled so that abar_T = 0, x_T pure
    noise as sampling assumes (Lin et al. 2024, Algorithm 1); it needs v-prediction, as eps says
    nothing of x_0 at t = T. `latents`: a latent run's, saved with its pipeline without
    DDPMScheduler's default clipping of x_0 to [-1, 1] (the range of images, not of latents)."""
    return DDPMScheduler(
        num_train_timesteps=num_train_timesteps,
        beta_schedule=beta_schedule,
        prediction_type=prediction_type,
        rescale_betas_zero_snr=zero_terminal_snr,
        clip_sample=not latents,
    )


def run_setting(config, name, default):
    """A setting (config.SETTINGS: not a flag) of the run whose train_config.json is `config`: under its
    "settings"; a run of before they were kept apart has it beside its flags; else `default`."""
    return (config.get("settings") or {}).get(name, config.get(name, default))


def run_noise_scheduler(config):
    """The noise scheduler a run trained with, from its train_config.json (a flow run's: make_flow_scheduler)."""
    if objective_kind(config.get("objective")) == "flow":
        return make_flow_scheduler(flow_shift(config["objective"]))
    return make_noise_scheduler(run_setting(config, "num_train_timesteps", NUM_TRAIN_TIMESTEPS), config["beta_schedule"],
                                config["prediction_type"], config.get("zero_terminal_snr", False),
                                bool(config.get("vae")))  # fmt: skip


def ddpm_loss(model, clean_images, noise, timesteps, alphas_cumprod, prediction_type="epsilon", snr_gamma=None):
    """The DDPM training loss, Algorithm 1 of Ho et al. (2020), in fp32.

    x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps          (their eq. 4)
    loss = || target - model(x_t, t) ||^2                  (their eq. 14)

    with target eps ("epsilon"), x_0 ("sample") or the velocity
    v = sqrt(abar_t) eps - sqrt(1 - abar_t) x_0 ("v_prediction", Salimans & Ho
    2022). `alphas_cumprod` is the scheduler's abar table, already on the
    device, so that no step copies it there again.

    `snr_gamma`: min-SNR-gamma weighting (Hang et al. 2023, eq. 8): each image's
    loss times min(SNR, gamma) / SNR for eps, / (SNR + 1) for v, and
    min(SNR, gamma) for x_0, SNR = abar / (1 - abar); as diffusers'
    train_text_to_image.py computes it.
    """
    abar = alphas_cumprod[timesteps].float().view(-1, 1, 1, 1)
    clean_images, noise = clean_images.float(), noise.float()
    noisy = abar.sqrt() * clean_images + (1 - abar).sqrt() * noise
    prediction = model(noisy, timesteps, return_dict=False)[0]
    if prediction_type == "epsilon":
        target = noise
    elif prediction_type == "sample":
        target = clean_images
    elif prediction_type == "v_prediction":
        target = abar.sqrt() * noise - (1 - abar).sqrt() * clean_images
    else:
        raise ConfigError(f"unknown --prediction_type '{prediction_type}': choose epsilon, v_prediction or sample")
    if snr_gamma is None:
        return F.mse_loss(prediction.float(), target)
    snr = (abar / (1 - abar)).view(-1)
    clipped = torch.minimum(snr, torch.full_like(snr, snr_gamma))
    weight = {"epsilon": clipped / snr, "v_prediction": clipped / (snr + 1), "sample": clipped}[prediction_type]
    per_image = F.mse_loss(prediction.float(), target, reduction="none").mean(dim=(1, 2, 3))
    return (per_image * weight).mean()


# EDM's noise levels, and DDPM's with --timestep_sampling lognormal: ln σ ~ N(P_mean, P_std²) (EDM Table 1). The defaults are EDM's CIFAR-10 values,
# which the seed repository (FutureXiang/edm2, config/cifar10/*.yaml) keeps for its
# EDM2 networks; EDM2 used -0.8/1.6 for ImageNet-64 and -0.4/1.0 for ImageNet-512
# latents (NVlabs/edm2 train_edm2.py, config_presets).
P_MEAN, P_STD = -1.2, 1.2
TIMESTEP_SAMPLINGS = ("uniform", "lognormal")


def lognormal_timestep_cdf(alphas_cumprod, P_mean, P_std):
    """The cumulative probabilities of timesteps t = 0..T-1 such that ln σ_t ~ N(P_mean, P_std²),
    σ_t = sqrt((1 - abar_t) / abar_t): EDM's noise distribution (Karras et al. 2022, Table 1)
    on DDPM's timesteps. Timestep t takes the normal's mass between the midpoints of its
    ln σ and its neighbours' (t = 0 all below, t = T-1 all above)."""
    abar = alphas_cumprod.double()
    log_sigma = 0.5 * (torch.log1p(-abar) - torch.log(abar))
    edges = (log_sigma[1:] + log_sigma[:-1]) / 2  # increasing in t
    below = torch.distributions.Normal(P_mean, P_std).cdf(edges)
    return torch.cat([below, torch.ones(1, dtype=below.dtype)]).float()


class Objective(torch.nn.Module):
    """An objective as the training step calls it: `terms(net, x0)` draws the noise on x0's device (no host
    sync) and returns the loss's named terms, fp32 scalars; the loss is their sum (`loss`). A new term is
    one more entry in an objective's `terms`: the step sums it into the loss, and train.py prints and logs
    each term (the printed line, tensorboard's loss/NAME, run.json's final_loss_terms) where there are several.

    Each objective's own terms come from `draw_terms`; `terms` adds those of its `readers`, called after the
    network's forward call, each returning {name: term} (loss_terms.py's terms on a block's output).
    `noise_draws`: the unit noise of each image is the nearest of this many draws (nearest_noise; 1: one draw).
    """

    noise_draws = 1
    readers = ()

    def terms(self, net, x0):
        terms = self.draw_terms(net, x0)
        for read in self.readers:
            terms |= read()
        return terms

    def noise_like(self, x0):
        """The unit Gaussian noise paired with the batch `x0`: one draw, or nearest_noise of `noise_draws`."""
        return torch.randn_like(x0) if self.noise_draws == 1 else nearest_noise(x0, self.noise_draws)

    def loss(self, net, x0):
        return total_loss(self.terms(net, x0))

    forward = loss


def nearest_noise(x0, k):
    """For each image of `x0`, the nearest (L2 over the flattened image) of k unit Gaussian noise draws of its
    shape: immiscible diffusion's KNN coupling (Li et al. 2025, yhli123/Immiscible-Diffusion). argmin and gather
    on the device: no host sync, capturable. The distance is ‖n‖² - 2 n·x (‖x‖² is the same for every draw),
    in fp32 whatever the autocast."""
    draws = torch.randn((k, *x0.shape), device=x0.device, dtype=x0.dtype)
    flat = draws.flatten(2).float()
    with torch.autocast(x0.device.type, enabled=False):
        distance = flat.square().sum(-1) - 2 * torch.einsum("kbd,bd->kb", flat, x0.flatten(1).float())
    nearest = distance.argmin(0)
    return draws[nearest, torch.arange(len(x0), device=x0.device)]


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


def total_loss(terms):
    """The loss: the sum of an objective's terms (the one term itself where there is one)."""
    parts = list(terms.values())
    return sum(parts[1:], parts[0])


class DDPMObjective(Objective):
    """The DDPM objective as the training step calls it: `terms(net, x0)` draws the noise and
    the timesteps on x0's device (no host sync) and returns `ddpm_loss` as its one term, "ddpm".

    Timesteps are uniform (Ho et al. 2020), or with `timestep_sampling="lognormal"`
    drawn so that ln σ_t ~ N(P_mean, P_std²), as EDM draws σ: most training then
    goes to the middle noise levels, where shapes form, instead of the half of
    the uniform draws (linear betas) at σ > 3, which teach little more than
    the colour of the image. The draw inverts the CDF with `searchsorted`, so
    it is capturable in a CUDA graph.

    A module so that objectives with trained parts (EDM's learned loss
    weighting) go through the step alike; this one has none.
    """

    def __init__(self, noise_scheduler, snr_gamma=None, timestep_sampling="uniform", P_mean=P_MEAN, P_std=P_STD):
        super().__init__()
        self.num_train_timesteps = noise_scheduler.config.num_train_timesteps
        self.prediction_type = noise_scheduler.config.prediction_type
        self.snr_gamma = snr_gamma
        self.register_buffer("alphas_cumprod", noise_scheduler.alphas_cumprod.clone(), persistent=False)
        cdf = lognormal_timestep_cdf(self.alphas_cumprod, P_mean, P_std) if timestep_sampling == "lognormal" else None
        self.register_buffer("timestep_cdf", cdf, persistent=False)

    def timesteps(self, n, device):
        if self.timestep_cdf is None:
            return torch.randint(0, self.num_train_timesteps, (n,), device=device)
        u = torch.rand(n, device=device)
        return torch.searchsorted(self.timestep_cdf, u, right=True).clamp_(max=self.num_train_timesteps - 1)

    def draw_terms(self, net, clean_images):
        noise = self.noise_like(clean_images)
        timesteps = self.timesteps(clean_images.shape[0], clean_images.device)
        return {"ddpm": self.loss_at(net, clean_images, timesteps, noise)}

    def loss_at(self, net, clean_images, timesteps, noise):
        """The loss at given timesteps (one per image) and noise."""
        return ddpm_loss(net, clean_images, noise, timesteps, self.alphas_cumprod, self.prediction_type, self.snr_gamma)


def ddpm_objective(noise_scheduler, args):
    """train.py's and the speed ladder's DDPMObjective: from the flags --snr_gamma, --timestep_sampling, --P_mean_std."""
    return DDPMObjective(noise_scheduler, args.snr_gamma, args.timestep_sampling, *args.P_mean_std)


# --- the training step's fast path (shared by train.py and python -m bench) ---------


def fused_adamw_available(parameters):
    """Whether torch has a fused AdamW kernel for every parameter's device and dtype."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    return all(p.device.type in devices and p.is_floating_point() for p in parameters)


def prepare_for_training(unet, channels_last=False, fused_adam=False, also=(), foreach=True, **adamw):
    """Put `unet` in the memory format it trains in and build its AdamW; returns the optimizer.

    channels_last (NHWC) converts the parameters in place, so checkpoints and
    the saved pipeline see the same module. AdamW is fused (one kernel reads
    each parameter, gradient and moment once per step) when `fused_adam` and
    torch has the kernel for the device, else foreach (a few multi-tensor
    kernels); never the per-parameter loop, unless `foreach` is None: then
    torch picks, as diffusers' example builds its AdamW (the speed ladder's
    yardstick). `also`: more parameters to train (EDM's learned loss
    weighting). `adamw`: lr, betas, weight_decay, eps.
    """
    if channels_last:
        unet.to(memory_format=torch.channels_last)
    parameters = list(unet.parameters()) + list(also)
    if fused_adam and fused_adamw_available(parameters):
        return torch.optim.AdamW(parameters, fused=True, **adamw)
    return torch.optim.AdamW(parameters, foreach=foreach, **adamw)


# --- the EDM objective (Karras et al. 2022, "EDM"; Karras et al. 2024, "EDM2") -------

SIGMA_DATA = 0.5  # EDM Table 1: the data's standard deviation, for images in [-1, 1]
LOSS_WEIGHTINGS = ("uncertainty", "edm")

# What a UNet2DModel gets as its timestep: UNET_C_NOISE_SCALE * c_noise, c_noise = ln(σ)/4.
# Its sinusoidal embedding was made for DDPM's t in [0, 1000): over the linear
# schedule, c_noise(σ_t) runs from -1.15 (t = 0, σ = 0.01) to 1.26 (t = 999, σ = 157),
# about 414 timesteps per unit of c_noise. 400 keeps that resolution, so the
# embedding tells noise levels apart as finely as it tells DDPM's timesteps apart
# (EDM's sampling range σ in [0.002, 80] then spans t from -620 to +440; a shift
# would change nothing, a sinusoid pair only rotates and the next linear layer
# absorbs that). Unscaled, c_noise spans 2.6 units: the lower half of the
# embedding's frequencies (periods of 100 to 10000 units) would barely move.
UNET_C_NOISE_SCALE = 400.0


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


def c_noise_scale_for(net):
    """UNET_C_NOISE_SCALE for a UNet2DModel or a DiT (also under DDP or torch.compile), else 1.

    Both embed DDPM's t in [0, 1000) with the same sinusoids, so both get the scale; EDM2's
    networks (and any other network) take c_noise = ln(σ)/4 itself into their Fourier features.
    Training asks it once, of the bare network, when the objective is built (training.build):
    the step calls the network through wrappers this function does not look through
    (compiling.RegionalNetwork).
    """
    return UNET_C_NOISE_SCALE if isinstance(unwrapped(net), (UNet2DModel, DiT)) else 1.0


def edm_precondition(net, x, sigma, sigma_data=SIGMA_DATA, c_noise_scale=1.0):
    """The denoiser D(x; σ) = c_skip x + c_out F(c_in x; c_noise), EDM Table 1 / EDM2 eq. 7.

    c_skip = σd² / (σ² + σd²), c_out = σ σd / sqrt(σ² + σd²),
    c_in = 1 / sqrt(σ² + σd²), c_noise = ln(σ) / 4 (times `c_noise_scale` for the
    network). `sigma` is a number or one value per image. The skip and output
    arithmetic is fp32 whatever precision the network runs in (as EDM's Precond).
    """
    x = x.float()
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).reshape(-1, 1, 1, 1).expand(len(x), 1, 1, 1)
    c_skip = sigma_data**2 / (sigma**2 + sigma_data**2)
    c_out = sigma * sigma_data / (sigma**2 + sigma_data**2).sqrt()
    c_in = 1 / (sigma**2 + sigma_data**2).sqrt()
    c_noise = sigma.flatten().log() / 4
    F_x = net(c_in * x, c_noise * c_noise_scale, return_dict=False)[0]
    return c_skip * x + c_out * F_x.float()


class EDMObjective(Objective):
    """EDM's training loss, with EDM2's learned uncertainty weighting; `loss(net, x0)` is one step's loss,
    the sum of its terms: "edm", the weighted ‖D - y‖², and with the uncertainty weighting "edm_logvar", u(σ).

    σ: ln σ ~ N(P_mean, P_std²); y = x0, n ~ N(0, σ² I); D = edm_precondition(net, y + n, σ).
    λ(σ) = (σ² + σd²) / (σ σd)²                        (EDM Table 1: unit effective weight)
    weighting 'edm':         λ(σ) ‖D - y‖²             (EDM eq. 2 with Table 1's λ)
    weighting 'uncertainty': λ(σ) / e^u(σ) ‖D - y‖² + u(σ)   (EDM2 eq. 21)

    `c_noise_scale`: what c_noise is multiplied by before the network takes it, c_noise_scale_for(network)
    of the bare network (UNET_C_NOISE_SCALE for a UNet2DModel or a DiT, 1 for EDM2's networks). It is
    decided when the objective is built, not from the wrapper the step calls the network through.

    u(σ) is a magnitude-preserving Fourier-feature head on c_noise = ln(σ)/4, as
    NVlabs/edm2's Precond.logvar_fourier/logvar_linear; its optimum is
    e^u = λ(σ) E‖D - y‖²: it learns the loss's level at each σ and divides it out,
    so every σ contributes alike. Its parameters train with the network's
    (pass `objective.parameters()` to the optimizer), live in checkpoints (the
    module's state_dict) and never in the saved pipeline, which holds the network alone.

    ‖D - y‖² is the mean over pixels, as ddpm_loss's F.mse_loss. NVlabs sums over
    pixels (and adds u per pixel): that is C·H·W times this loss with the same
    minimiser e^u = λ·(pixel mean), a constant Adam does not see; the mean keeps
    --max_grad_norm meaning the same for both objectives.
    """

    def __init__(
        self, P_mean=P_MEAN, P_std=P_STD, sigma_data=SIGMA_DATA, weighting="uncertainty", c_noise_scale=1.0,
        logvar_channels=128,
    ):  # fmt: skip
        super().__init__()
        if weighting not in LOSS_WEIGHTINGS:
            raise ConfigError(f"unknown loss weighting '{weighting}': choose {' or '.join(LOSS_WEIGHTINGS)}")
        if not P_std > 0:
            raise ConfigError(f"--P_mean_std: P_std must be positive (got {P_std})")
        if not sigma_data > 0:
            raise ConfigError(f"sigma_data must be positive (got {sigma_data})")
        self.P_mean, self.P_std, self.sigma_data, self.weighting = P_mean, P_std, sigma_data, weighting
        self.c_noise_scale = c_noise_scale  # c_noise_scale_for(the bare network), chosen once by whoever builds this
        if weighting == "uncertainty":  # EDM2's magnitude-preserving pieces (edm2.py)
            self.logvar_fourier = edm2.MPFourier(logvar_channels)
            self.logvar_linear = edm2.MPConv(logvar_channels, 1, kernel=())

    def weight(self, sigma):
        """λ(σ) = (σ² + σd²) / (σ σd)², EDM Table 1."""
        return (sigma**2 + self.sigma_data**2) / (sigma * self.sigma_data) ** 2

    def logvar(self, sigma):
        """u(σ), one value per entry of `sigma` (EDM2 eq. 21)."""
        c_noise = sigma.float().flatten().log() / 4
        return self.logvar_linear(self.logvar_fourier(c_noise)).float().flatten()

    def draw_terms(self, net, x0):
        """The batch means of the loss's terms at fresh σ and noise (drawn on x0's device)."""
        x0 = x0.float()
        sigma = (torch.randn(len(x0), device=x0.device) * self.P_std + self.P_mean).exp()
        noise = self.noise_like(x0)
        return self.terms_at(net, x0, sigma, noise)

    def terms_at(self, net, x0, sigma, noise):
        """The terms at given σ (one per image) and unit noise `noise` (scaled by σ here)."""
        x0, sigma = x0.float(), sigma.float().flatten()
        noisy = x0 + noise.float() * sigma.view(-1, 1, 1, 1)
        denoised = edm_precondition(net, noisy, sigma, self.sigma_data, self.c_noise_scale)
        per_image = ((denoised - x0) ** 2).mean(dim=tuple(range(1, x0.ndim)))
        if self.weighting == "edm":
            return {"edm": (self.weight(sigma) * per_image).mean()}
        u = self.logvar(sigma)
        return {"edm": (self.weight(sigma) / u.exp() * per_image).mean(), "edm_logvar": u.mean()}

    def loss_at(self, net, x0, sigma, noise):
        """The loss at given σ and noise: the sum of `terms_at`."""
        return total_loss(self.terms_at(net, x0, sigma, noise))


# --- flow matching ------------------------------------------------------------------------
# The rectified-flow objective of SiT (Ma et al. 2024) and SD3 (Esser et al. 2024), in diffusers'
# FlowMatchEulerDiscreteScheduler's convention: x_σ = (1 - σ) x0 + σ ε, the network predicts
# v = ε - x0 and takes t = σ · 1000.

OBJECTIVES = ("ddpm", "edm", "flow")
FLOW_P_MEAN, FLOW_P_STD = 0.0, 1.0  # SD3's logit-normal(0, 1), its best-ranked formulation (Esser et al. 2024, Table 1)


def parse_objective(text):
    """'ddpm', 'edm', 'flow' or 'flow:SHIFT' -> (kind, shift); shift None but for flow (1 when not given)."""
    kind, _, shift = str(text).partition(":")
    if kind not in OBJECTIVES or (shift and kind != "flow"):
        raise ConfigError(f"--objective {text}: choose ddpm, edm, flow or flow:SHIFT (SD3's timestep shift, e.g. flow:3)")
    if kind != "flow":
        return kind, None
    try:
        value = float(shift) if shift else 1.0
    except ValueError:
        value = float("nan")
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(f"--objective {text}: the shift must be a number greater than 0 (1 is no shift)")
    return kind, value


def objective_kind(objective):
    """'ddpm', 'edm' or 'flow' of an --objective value (None: ddpm, a run that did not record it)."""
    return parse_objective(objective or "ddpm")[0]


def flow_shift(objective):
    """The SD3 shift of a flow --objective (1 for plain 'flow'); None for ddpm and edm."""
    return parse_objective(objective or "ddpm")[1]


def canonical_objective(objective):
    """'flow:3.0' -> 'flow:3', 'flow:1' -> 'flow': one spelling per meaning, as runs record and compare it."""
    kind, shift = parse_objective(objective)
    return kind if shift in (None, 1.0) else f"flow:{shift:g}"


def shift_sigmas(sigma, shift):
    """SD3's timestep shift (Esser et al. 2024, eq. 23): σ' = s σ / (1 + (s - 1) σ); s > 1 moves noise levels up."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def make_flow_scheduler(shift=1.0):
    """diffusers' FlowMatchEulerDiscreteScheduler for a flow run: its Euler sampler, and what a flow run's
    DDPMPipeline holds, so that `DDPMPipeline.from_pretrained(run)()` samples as train.py's grids do."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=shift)


class FlowObjective(Objective):
    """Flow matching (rectified flow): `loss(net, x0)` = ‖net(x_σ, 1000 σ) - (ε - x0)‖², mean over pixels,
    its one term "flow".

    σ is drawn logit-normal(P_mean, P_std) (SD3's default (0, 1)), or uniform in [0, 1) with
    `timestep_sampling="uniform"` (SiT's), then shifted by `shift` (shift_sigmas), as the
    sampler's schedule is. Drawn on x0's device, so the step needs no host sync.

    `c_noise`: the network takes an EDM2 network's c_noise = logit(σ)/4 instead of t = 1000 σ
    (flow_timestep). It is takes_c_noise(network) of the bare network, decided when the objective
    is built, not from the wrapper the step calls the network through.
    """

    def __init__(self, shift=1.0, timestep_sampling="lognormal", P_mean=FLOW_P_MEAN, P_std=FLOW_P_STD, c_noise=False,
                 contrast=0.0):  # fmt: skip
        super().__init__()
        if timestep_sampling not in TIMESTEP_SAMPLINGS:
            raise ConfigError(f"unknown --timestep_sampling '{timestep_sampling}': choose {' or '.join(TIMESTEP_SAMPLINGS)}")
        self.shift, self.timestep_sampling, self.P_mean, self.P_std = shift, timestep_sampling, P_mean, P_std
        self.c_noise = c_noise
        self.contrast = contrast  # ΔFM's λ (loss_terms.py's deltafm): 0, no "deltafm" term

    def sigmas(self, n, device):
        if self.timestep_sampling == "uniform":
            sigma = torch.rand(n, device=device)
        else:
            sigma = torch.sigmoid(torch.randn(n, device=device) * self.P_std + self.P_mean)
        return shift_sigmas(sigma, self.shift)

    def draw_terms(self, net, x0):
        x0 = x0.float()
        sigma, noise = self.sigmas(len(x0), x0.device), self.noise_like(x0)
        if self.contrast:
            return self.terms_at(net, x0, sigma, noise)
        return {"flow": self.loss_at(net, x0, sigma, noise)}

    def predict(self, net, x0, sigma, noise):
        """The network's velocity at x_σ and its target noise - x0 (σ one per image), fp32."""
        x0, noise, sigma = x0.float(), noise.float(), sigma.float().flatten()
        s = sigma.view(-1, *([1] * (x0.ndim - 1)))
        prediction = net((1 - s) * x0 + s * noise, flow_timestep(sigma, self.c_noise), return_dict=False)[0]
        return prediction.float(), noise - x0

    def loss_at(self, net, x0, sigma, noise):
        """The loss at given σ (one per image) and noise."""
        return F.mse_loss(*self.predict(net, x0, sigma, noise))

    def terms_at(self, net, x0, sigma, noise):
        """"flow", and with `contrast` λ contrastive flow matching's "deltafm" (Stoica et al. 2025, ΔFM:
        gstoica27/DeltaFM): -λ ‖v - u_j‖², u_j the target of another image of the batch (the batch's targets
        rolled by one), so that flow + deltafm = ‖v - u_i‖² - λ ‖v - u_j‖²."""
        prediction, target = self.predict(net, x0, sigma, noise)
        terms = {"flow": F.mse_loss(prediction, target)}
        if self.contrast:
            terms["deltafm"] = -self.contrast * F.mse_loss(prediction, target.roll(1, 0))
        return terms


def unwrapped(net):
    """The network inside functools.partial (class labels), torch.compile's and DDP's wrappers."""
    net = getattr(net, "func", net)
    net = getattr(net, "_orig_mod", net)
    return getattr(net, "module", net)


def saves_pipeline(config):
    """Whether a run saves a diffusers DDPMPipeline (a UNet2DModel with DDPM or flow), or its network alone in
    unet/ (EDM's objective, or an EDM2 network: no diffusers pipeline samples them)."""
    return config.get("objective") != "edm" and family(config["model"])[0].saves_pipeline


# An EDM2 network takes c_noise = ln(σ_EDM) / 4 (EDM2 eq. 7). On the flow path x_σ / (1 - σ) = x0 + σ_EDM ε with
# σ_EDM = σ / (1 - σ), so a flow run gives it c_noise = logit(σ) / 4: the same noise level, the same input
# scale to its Fourier features. σ is held inside (FLOW_SIGMA_EDGE, 1 - FLOW_SIGMA_EDGE): σ = 1 (pure noise,
# the sampler's first step) would be an infinite σ_EDM; the edge is σ_EDM ≈ 10^4, past EDM's σ_max of 80.
FLOW_SIGMA_EDGE = 1e-4


def takes_c_noise(network):
    """Whether `network`, the bare network as built, takes EDM2's c_noise = ln(σ_EDM)/4 as its time input
    (an EDM2 network) rather than a timestep on DDPM's scale of 0 to 1000 (a UNet2DModel or a DiT)."""
    return isinstance(network, EDM2UNet)


def flow_timestep(sigma, c_noise=False):
    """What a network takes for a flow noise level σ: t = 1000 σ, as FlowMatchEulerDiscreteScheduler gives a
    UNet2DModel or a DiT; with `c_noise` (an EDM2 network, takes_c_noise), c_noise = logit(σ) / 4."""
    if c_noise:
        sigma = sigma.clamp(FLOW_SIGMA_EDGE, 1 - FLOW_SIGMA_EDGE)
        return (sigma / (1 - sigma)).log() / 4
    return sigma * NUM_TRAIN_TIMESTEPS


class FlowTime(torch.nn.Module):
    """An EDM2 network as a flow sampler calls a network, net(x, t = 1000 σ): it gets flow_timestep's c_noise."""

    def __init__(self, net):
        super().__init__()
        self.net, self.config = net, net.config

    def forward(self, x, t, return_dict=False, **kwargs):
        sigma = torch.as_tensor(t, dtype=torch.float32, device=x.device).reshape(-1) / NUM_TRAIN_TIMESTEPS
        return self.net(x, flow_timestep(sigma.expand(len(x)), c_noise=True), return_dict=False, **kwargs)


def flow_sigma_distribution(args):
    """What a flow run's σ draw is, as resume compares it (None for other objectives): 'uniform' or
    'logit_normal(m,s)'. The shift is in --objective."""
    if objective_kind(args.get("objective")) != "flow":
        return None
    if args.get("timestep_sampling") == "uniform":
        return "uniform"
    mean, std = args.get("P_mean_std") or (FLOW_P_MEAN, FLOW_P_STD)
    return f"logit_normal({float(mean):g},{float(std):g})"


def load_network(path):
    """The network saved with `save_pretrained` in folder `path` (config.json + weights), in eval mode.

    A diffusers UNet2DModel, or edm2.EDM2UNet or dit.DiT when the config's _class_name says so.
    """
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{path}: no config.json, so no saved network")
    name = json.loads(config_file.read_text()).get("_class_name")
    if name == "EDM2UNet":
        return EDM2UNet.from_pretrained(str(path)).eval()
    if name in ("DiTTransformer2DModel", "DiT"):
        return DiT.from_pretrained(str(path)).eval()
    return UNet2DModel.from_pretrained(str(path)).eval()
