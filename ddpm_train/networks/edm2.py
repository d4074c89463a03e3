"""The EDM2 networks: magnitude-preserving layers and the Config C, E and G U-Nets.

Karras et al. (2024), "Analyzing and Improving the Training Dynamics of
Diffusion Models", arXiv 2312.02696: section 2, Table 1, appendices B and C.
Equation numbers below are theirs. Written after NVlabs/edm2
(training/networks_edm2.py) and FutureXiang/edm2 (model/block[CEG].py), whose
CIFAR-10 network size (128 channels, multipliers 1,2,2,2, attention at 16x16
and in the middle, 39.5M parameters) the presets in model.py use.

C, E and G are one class, `EDM2UNet`, with the switches of `CONFIGS`:

    C  streamlined ADM: no biases, a constant-1 input channel, Fourier noise
       embedding, GroupNorm without mean subtraction or learned scale (an RMS
       norm), cosine attention. (The learned loss weighting u(sigma), also C,
       is the objective's: objectives.EDMObjective, built of this module's pieces.)
    E  + forced weight normalisation of every conv and linear layer (eq. 66);
       its inverse-square-root learning-rate decay is the training loop's.
    G  + pixel norm instead of GroupNorm, magnitude-preserving SiLU, sum,
       concatenation and Fourier features, and zero-initialised gains on the
       output and on each block's conditioning.

The forward pass has UNet2DModel's signature; `timestep` is EDM's noise
conditioning c_noise = ln(sigma) / 4. The preconditioning lives with the
objective, not here.
"""

import math

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.unets.unet_2d import UNet2DOutput
from torch import nn

# The switches, side by side. A value given to EDM2UNet overrides its config's.
CONFIGS = {
    "C": dict(
        forced_weight_norm=False,
        pixel_norm=False,
        mp_fixed_function=False,
        zero_init_gains=False,
        embedding_layers=2,
        clip_act=0,
    ),
    "E": dict(
        forced_weight_norm=True,
        pixel_norm=False,
        mp_fixed_function=False,
        zero_init_gains=False,
        embedding_layers=2,
        clip_act=256,
    ),
    "G": dict(
        forced_weight_norm=True,
        pixel_norm=True,
        mp_fixed_function=True,
        zero_init_gains=True,
        embedding_layers=1,
        clip_act=256,
    ),
}
SWITCHES = tuple(CONFIGS["C"])


# --- magnitude-preserving pieces ------------------------------------------------------


def normalize(x, dim=None, eps=1e-4):
    """`x` scaled to unit RMS over `dim` (all but the first by default).

    Over a weight's rows this is the weight normalisation of eq. (47)/(66):
    each row ends at norm sqrt(fan_in). Over channels it is pixel norm, over a
    group of channels an RMS GroupNorm, over a head's channels cosine attention.
    """
    if dim is None:
        dim = list(range(1, x.ndim))
    norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.float32)
    norm = torch.add(eps, norm, alpha=math.sqrt(norm.numel() / x.numel()))
    return x / norm.to(x.dtype)


def group_rms_norm(x, max_groups=32, min_channels_per_group=4):
    """Config C's GroupNorm: no mean subtraction, no learned scale."""
    groups = max(1, min(max_groups, x.shape[1] // min_channels_per_group))
    return normalize(x.reshape(x.shape[0], groups, -1), dim=2).reshape(x.shape)


def mp_silu(x):
    """SiLU scaled back to unit magnitude for unit-variance normal input, eq. (81)."""
    return F.silu(x) / 0.596


def mp_sum(a, b, t=0.5):
    """(1-t) a + t b, scaled to keep unit magnitude, eq. (88), in the wider of the two dtypes.

    Under CUDA autocast the residual stream can be fp32 while the branch is bf16 (a
    convolution's output), and lerp takes no mixed dtypes.
    """
    dtype = torch.promote_types(a.dtype, b.dtype)
    return a.to(dtype).lerp(b.to(dtype), t) / math.sqrt((1 - t) ** 2 + t ** 2)


def mp_cat(a, b, dim=1, t=0.5):
    """Concatenation in which `b` contributes a fraction t, at unit magnitude, eq. (103)."""
    na, nb = a.shape[dim], b.shape[dim]
    c = math.sqrt((na + nb) / ((1 - t) ** 2 + t ** 2))
    return torch.cat([a * (c / math.sqrt(na) * (1 - t)), b * (c / math.sqrt(nb) * t)], dim=dim)


def add(a, b, t, mp):
    """The sum of two branches: magnitude-preserving (G) or plain (C, E)."""
    return mp_sum(a, b, t) if mp else a + b


def cat(a, b, t, mp):
    return mp_cat(a, b, t=t) if mp else torch.cat([a, b], dim=1)


class MPFourier(nn.Module):
    """Fourier features cos(2 pi (f x + phi)), f ~ N(0, 1), phi ~ U(0, 1).

    A cosine of a uniform phase has mean square 1/2: `mp` scales it by sqrt(2)
    to unit magnitude, eq. (75).
    """

    def __init__(self, num_channels, mp=True):
        super().__init__()
        self.scale = math.sqrt(2) if mp else 1.0
        self.register_buffer("freqs", 2 * math.pi * torch.randn(num_channels))
        self.register_buffer("phases", 2 * math.pi * torch.rand(num_channels))

    def forward(self, x):
        y = torch.outer(x.to(torch.float32), self.freqs.to(torch.float32)) + self.phases.to(torch.float32)
        return (y.cos() * self.scale).to(x.dtype)


class MPConv(nn.Module):
    """A bias-free convolution (`kernel` (k, k)) or linear layer (`kernel` ()).

    forced_weight_norm (Config E, eq. 66): in training mode every forward pass
    first rescales each stored weight row to norm sqrt(fan_in), so optimizer
    steps cannot grow the weights; the layer then uses normalize(w)/sqrt(fan_in),
    rows of unit norm, so unit-variance input gives unit-variance output
    (eq. 47). Without it (Config C) the stored weight is used as it is,
    He-uniform initialised to the same unit gain.
    """

    def __init__(self, in_channels, out_channels, kernel, forced_weight_norm=True):
        super().__init__()
        self.out_channels = out_channels
        self.forced_weight_norm = forced_weight_norm
        shape = (out_channels, in_channels, *kernel)
        fan_in = in_channels * math.prod(kernel)
        if forced_weight_norm:
            weight = torch.randn(shape)
        else:
            weight = (torch.rand(shape) * 2 - 1) * math.sqrt(3 / fan_in)
        self.weight = nn.Parameter(weight)

    def forward(self, x, gain=1):
        w = self.weight.to(torch.float32)
        if self.forced_weight_norm:
            if self.training:
                with torch.no_grad():
                    self.weight.copy_(normalize(w))  # forced: the stored weight itself
            w = normalize(w)  # and differentiably, so gradients stay orthogonal to w
            w = w / math.sqrt(w[0].numel())
        w = (w * gain).to(x.dtype)
        if w.ndim == 2:
            return x @ w.t()
        return F.conv2d(x, w, padding=w.shape[-1] // 2)


# --- the block ---------------------------------------------------------------------------


class Block(nn.Module):
    """A U-Net encoder ("enc") or decoder ("dec") block with optional self-attention.

    NVlabs' Block (their Figure 21) with Config C/E's norms as a switch:
    pixel_norm=False puts an RMS GroupNorm before each of the residual branch's
    SiLUs and keeps the skip connection on the block's input (ADM's order);
    pixel_norm=True (G) normalises the encoder's main path instead, after its
    1x1 skip convolution, and the residual branch starts from there.
    """

    def __init__(
        self,
        in_channels,
        out_channels,
        emb_channels,
        flavor="enc",
        resample="keep",
        attention=False,
        channels_per_head=64,
        dropout=0.0,
        res_balance=0.3,
        attn_balance=0.3,
        *,
        forced_weight_norm,
        pixel_norm,
        mp_fixed_function,
        zero_init_gains,
        clip_act,
    ):
        super().__init__()
        if attention and out_channels % channels_per_head:
            raise ValueError(f"{out_channels} channels do not split into heads of {channels_per_head}")
        self.flavor, self.resample, self.dropout = flavor, resample, dropout
        self.res_balance, self.attn_balance, self.clip_act = res_balance, attn_balance, clip_act
        self.pixel_norm, self.mp = pixel_norm, mp_fixed_function
        self.act = mp_silu if mp_fixed_function else F.silu
        self.num_heads = out_channels // channels_per_head if attention else 0
        self.skip_first = flavor == "enc" and pixel_norm
        conv = lambda cin, cout, kernel: MPConv(cin, cout, kernel, forced_weight_norm)  # noqa: E731
        self.emb_gain = nn.Parameter(torch.zeros([])) if zero_init_gains else None
        self.conv_res0 = conv(out_channels if self.skip_first else in_channels, out_channels, (3, 3))
        self.emb_linear = conv(emb_channels, out_channels, ())
        self.conv_res1 = conv(out_channels, out_channels, (3, 3))
        self.conv_skip = conv(in_channels, out_channels, (1, 1)) if in_channels != out_channels else None
        if self.num_heads:
            self.attn_qkv = conv(out_channels, out_channels * 3, (1, 1))
            self.attn_proj = conv(out_channels, out_channels, (1, 1))

    def norm(self, x):
        return x if self.pixel_norm else group_rms_norm(x)

    def forward(self, x, emb):
        if self.resample == "down":
            x = F.avg_pool2d(x, 2)
        elif self.resample == "up":
            x = F.interpolate(x, scale_factor=2, mode="nearest")
        if self.skip_first:
            if self.conv_skip is not None:
                x = self.conv_skip(x)
            x = normalize(x, dim=1)  # pixel norm

        # Residual branch; the embedding scales its channels by 1 + linear(emb).
        y = self.conv_res0(self.act(self.norm(x)))
        c = self.emb_linear(emb, gain=1 if self.emb_gain is None else self.emb_gain) + 1
        y = self.act(self.norm(y) * c[:, :, None, None].to(y.dtype))
        if self.training and self.dropout:
            y = F.dropout(y, p=self.dropout)
        y = self.conv_res1(y)
        if not self.skip_first and self.conv_skip is not None:
            x = self.conv_skip(x)
        x = add(x, y, self.res_balance, self.mp)

        # Cosine self-attention: q, k and v normalised per head.
        if self.num_heads:
            b, ch, h, w = x.shape
            qkv = self.attn_qkv(x).reshape(b, self.num_heads, -1, 3, h * w)
            q, k, v = (t.transpose(2, 3) for t in normalize(qkv, dim=2).unbind(3))
            y = F.scaled_dot_product_attention(q, k, v)  # softmax(q k^T / sqrt(d)) v
            y = self.attn_proj(y.transpose(2, 3).reshape(b, ch, h, w))
            x = add(x, y, self.attn_balance, self.mp)

        if self.clip_act:
            x = x.clamp(-self.clip_act, self.clip_act)
        return x


# --- the U-Net ---------------------------------------------------------------------------


class EDM2UNet(ModelMixin, ConfigMixin):
    """The EDM2 U-Net of Config C, E or G (`edm2_config`), as a diffusers model.

    Per level of `channel_mult`: `num_blocks` encoder blocks and
    `num_blocks` + 1 decoder blocks, with a down/up block between levels
    (BigGAN-style resampling inside a residual block) and two decoder blocks
    in the middle, the first with attention; `attention_levels` (0 = full
    resolution) get attention in every non-resampling block. Each switch of
    `CONFIGS` may be given to override the config's value; the resolved
    switches are what config.json records.
    """

    _repeated_blocks = ("Block",)  # compiled once per shape and reused (regional compilation, compiling.RegionalNetwork)

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(
        self,
        sample_size=32,
        in_channels=3,
        out_channels=3,
        edm2_config="G",
        channels=128,
        channel_mult=(1, 2, 2, 2),
        num_blocks=2,
        attention_levels=(1,),
        channels_per_head=64,
        emb_channels=None,
        num_classes=0,
        dropout=0.0,
        res_balance=0.3,
        attn_balance=0.3,
        concat_balance=0.5,
        label_balance=0.5,
        forced_weight_norm=None,
        pixel_norm=None,
        mp_fixed_function=None,
        zero_init_gains=None,
        embedding_layers=None,
        clip_act=None,
    ):
        args = locals()
        super().__init__()
        if edm2_config not in CONFIGS:
            raise ValueError(f"unknown edm2_config '{edm2_config}': choose one of {', '.join(CONFIGS)}")
        s = {k: CONFIGS[edm2_config][k] if args[k] is None else args[k] for k in SWITCHES}
        self.register_to_config(**s)
        self.mp, self.pixel_norm = s["mp_fixed_function"], s["pixel_norm"]
        self.concat_balance, self.label_balance = concat_balance, label_balance
        self.act = mp_silu if self.mp else F.silu
        self.gradient_checkpointing = False

        def conv(cin, cout, kernel):
            return MPConv(cin, cout, kernel, s["forced_weight_norm"])

        cblock = [channels * m for m in channel_mult]
        cemb = emb_channels or 4 * channels
        block_kwargs = dict(
            channels_per_head=channels_per_head,
            dropout=dropout,
            res_balance=res_balance,
            attn_balance=attn_balance,
            forced_weight_norm=s["forced_weight_norm"],
            pixel_norm=s["pixel_norm"],
            mp_fixed_function=self.mp,
            zero_init_gains=s["zero_init_gains"],
            clip_act=s["clip_act"],
        )

        # Noise (and class) embedding.
        self.emb_fourier = MPFourier(channels, mp=self.mp)
        self.emb_layers = nn.ModuleList(
            [conv(channels if i == 0 else cemb, cemb, ()) for i in range(s["embedding_layers"])]
        )
        self.emb_label = conv(num_classes, cemb, ()) if num_classes else None

        # Encoder: the input with a constant-1 channel (Config C's stand-in for biases). Blocks are named by their
        # level's width x height: EDM2's names (32x32_block0) on a square, 48x32_block0 on a 96x64 input.
        height, width = (sample_size, sample_size) if isinstance(sample_size, int) else sample_size
        self.enc = nn.ModuleDict()
        cout = in_channels + 1
        for level, ch in enumerate(cblock):
            res = f"{width >> level}x{height >> level}"
            if level == 0:
                self.enc[f"{res}_conv"] = conv(cout, ch, (3, 3))
                cout = ch
            else:
                self.enc[f"{res}_down"] = Block(cout, cout, cemb, "enc", "down", **block_kwargs)
            for i in range(num_blocks):
                self.enc[f"{res}_block{i}"] = Block(
                    cout, ch, cemb, "enc", attention=level in attention_levels, **block_kwargs
                )
                cout = ch

        # Decoder, taking one skip per encoder output.
        self.dec = nn.ModuleDict()
        skips = [m.out_channels if isinstance(m, MPConv) else m.conv_res1.out_channels for m in self.enc.values()]
        for level, ch in reversed(list(enumerate(cblock))):
            res = f"{width >> level}x{height >> level}"
            if level == len(cblock) - 1:
                self.dec[f"{res}_in0"] = Block(cout, cout, cemb, "dec", attention=True, **block_kwargs)
                self.dec[f"{res}_in1"] = Block(cout, cout, cemb, "dec", **block_kwargs)
            else:
                self.dec[f"{res}_up"] = Block(cout, cout, cemb, "dec", "up", **block_kwargs)
            for i in range(num_blocks + 1):
                self.dec[f"{res}_block{i}"] = Block(
                    cout + skips.pop(), ch, cemb, "dec", attention=level in attention_levels, **block_kwargs
                )
                cout = ch
        self.out_conv = conv(cout, out_channels, (3, 3))
        # G: the output starts at exactly zero and learns its scale.
        self.out_gain = nn.Parameter(torch.zeros([])) if s["zero_init_gains"] else None

    def _c_noise(self, timestep, batch, device):
        c_noise = torch.as_tensor(timestep, device=device).to(torch.float32)
        return c_noise.reshape(-1).expand(batch) if c_noise.numel() == 1 else c_noise.reshape(batch)

    def forward(self, sample, timestep, class_labels=None, return_dict=True):
        """F(c_in x; c_noise): `timestep` is c_noise = ln(sigma) / 4, [B] or a scalar.

        `class_labels`: integer labels [B] or one-hot/soft labels [B, num_classes];
        required when num_classes > 0. The integer label num_classes is the null
        label of classifier-free guidance: an all-zero one-hot, as EDM2 drops labels.
        """
        x = sample
        emb = self.emb_fourier(self._c_noise(timestep, x.shape[0], x.device))
        for i, linear in enumerate(self.emb_layers):
            emb = linear(emb)
            if i == 0 and self.emb_label is not None:
                if class_labels is None:
                    raise ValueError("this network is class-conditional: pass class_labels")
                if class_labels.ndim == 1:
                    class_labels = F.one_hot(class_labels.long(), self.config.num_classes + 1)[:, :-1]
                labels = class_labels.to(emb.dtype) * math.sqrt(self.config.num_classes)
                emb = add(emb, self.emb_label(labels), self.label_balance, self.mp)
            emb = self.act(emb)

        def run(block, *args):
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                return self._gradient_checkpointing_func(block, *args)
            return block(*args)

        x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        skips = []
        for name, block in self.enc.items():
            x = block(x) if name.endswith("_conv") else run(block, x, emb)
            skips.append(x)
        for name, block in self.dec.items():
            if "_block" in name:
                x = cat(x, skips.pop(), self.concat_balance, self.mp)
            x = run(block, x, emb)
        if not self.pixel_norm:  # C, E: ADM's output head, norm and SiLU before the last conv
            x = self.act(group_rms_norm(x))
        x = self.out_conv(x, gain=1 if self.out_gain is None else self.out_gain)

        if not return_dict:
            return (x,)
        return UNet2DOutput(sample=x)
