"""Fused GroupNorm(+SiLU) for channels_last (NHWC) activations, as Triton kernels.

Why: in the compiled channels_last ref128 step on an H100 the GroupNorm, SiLU,
add and cast kernels and the layout copies between them took most of the step's
time (BENCHMARKS.md, Speed on a GPU). Each ResNet block normalises twice
and applies SiLU after each norm; one kernel that reads x once and writes
SiLU(GroupNorm(x)) once, in the convolutions' own layout, replaces the norm,
activation and cast kernels and the copies between layouts.

How the work is split (NHWC memory is [N, H*W, C], a group is C/G adjacent
channels over every position; the same split as apex's NHWC group_norm and
ONNX Runtime's diffusion GroupNorm, written anew):

  forward   1. `_stats_kernel`, grid (H*W blocks, C blocks, N): each program
               loads a [BLOCK_HW, BLOCK_C] tile (rows of contiguous channels,
               so loads coalesce), reduces it over positions in fp32 (fp64 for
               fp64 inputs) and writes, per channel, the block's mean and M2
               (sum of squared deviations from that mean, Welford-style).
            2. Per (sample, group), the partials are merged with Chan's
               parallel formula in a few small torch ops (tensors of N x
               blocks x C, ~1-6% of the activation's bytes): a merge of means
               and M2s, never E[x^2] - E[x]^2, so a large mean cannot cancel
               the variance away. Inductor fuses these ops into its own kernels.
            3. `_apply_kernel`, same grid: (x - mean) * rstd * w + b, then
               SiLU, in fp32, stored in x's dtype. Saves mean and rstd only.
  backward  1. `_bwd_reduce_kernel` recomputes xhat, z = w*xhat + b and the
               SiLU derivative from x (nothing but x, mean, rstd is saved) and
               writes per-(sample, block, channel) partial sums of dz*xhat and
               dz; torch sums them into dweight, dbias and the two per-group
               sums that the input gradient needs.
            2. `_bwd_dx_kernel` recomputes dz again and writes
               dx = rstd * (w*dz - mean_g(w*dz) - xhat * mean_g(w*dz*xhat)).
  No atomics: partials go to their own slots and are reduced by torch, so
  results are deterministic and the Triton interpreter can run every kernel.

Registration: both passes are `torch.library.triton_op`s ("ddpm::..."), so
torch.compile traces into them, sees the kernels and schedules them with its
own; `triton_op` registers the traceable body as the fake (meta) kernel, so no
separate fake implementation is needed. `register_autograd` connects them.

Where it is used: `group_norm_silu` runs the kernels for a CUDA channels_last
input with an affine norm (or on any device when `FORCE_KERNEL` is set, which
the CPU tests do under TRITON_INTERPRET=1) and F.group_norm(+F.silu)
otherwise. `use_fused_norm(unet)` routes a diffusers UNet2DModel's training
forward through it without touching parameters or the state dict:

  - every ResnetBlock2D becomes `FusedResnetBlock2D` (a subclass, by class
    swap). Its forward is diffusers' forward with norm1+SiLU and norm2+SiLU as
    one call each. Overriding the block's forward is the clean cut: diffusers
    applies `self.nonlinearity` both after the norms and to the time embedding,
    so the activation module cannot simply be removed, and wrapping the norm
    alone could not fuse the SiLU. In eval mode, or with a non-SiLU activation,
    the block runs diffusers' own forward unchanged. In training the block
    also skips diffusers' `input_tensor.contiguous()` before `conv_shortcut`
    when the input is channels_last (it exists to avoid a DDP stride warning
    with contiguous parameters, and would turn NHWC back into NCHW).
  - `conv_norm_out` becomes `GroupNormSiLU` (an nn.GroupNorm subclass with the
    same weight and bias) and `conv_act` an nn.Identity; the pair computes
    SiLU(GroupNorm(x)) as before, in any mode.

`keep_channels_last(unet)` separately swaps diffusers' Upsample2D for a
subclass without the `.contiguous()` it applies at batch >= 64 (a workaround
for an old upsample_nearest NHWC bug, diffusers issue #984), so activations
stay NHWC through the up path; the guard for more than 2**31 output elements
stays.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op
from torch.library import wrap_triton as _wrap_triton

# Run the Triton kernels for any input, on any device (the CPU tests set it,
# with TRITON_INTERPRET=1 in the environment before this module is imported).
FORCE_KERNEL = os.environ.get("FUSED_NORM_FORCE_KERNEL") == "1"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def wrap_triton(kernel):
    """torch's wrap_triton; an interpreted kernel (TRITON_INTERPRET=1) as it is, which torch 2.11 refuses
    to wrap and later torches hand back unwrapped themselves."""
    return kernel if INTERPRETED else _wrap_triton(kernel)


# Fill every buffer the kernels write with NaN first (tests): an element a
# kernel forgets to write then shows up in the result.
POISON_OUTPUTS = False
# Elements per tile (BLOCK_HW x BLOCK_C). Tests shrink it so that tiny shapes
# still span several position and channel blocks.
TILE_ELEMENTS = 4096


# --- kernels ---------------------------------------------------------------------
# x is NHWC-dense: element (n, c, p) of the [N, C, H*W] view is at n*HW*C + p*C + c.
# Statistics and gradients accumulate in the partial buffers' dtype (fp32, or
# fp64 for fp64 inputs). The interpreter cannot reduce bf16, so loads are cast
# to that dtype before any arithmetic; rstd comes from torch (no libdevice).


@triton.jit
def _tile(pid_hw, pid_c, n, HW, C, BLOCK_HW: tl.constexpr, BLOCK_C: tl.constexpr):
    hw = pid_hw * BLOCK_HW + tl.arange(0, BLOCK_HW)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    mask = (hw < HW)[:, None] & c_mask[None, :]
    offsets = n.to(tl.int64) * HW * C + hw.to(tl.int64)[:, None] * C + c[None, :]
    return c, c_mask, mask, offsets


@triton.jit
def _normalize(x, c, c_mask, n, w_ptr, b_ptr, mean_ptr, rstd_ptr, G, CG):
    """xhat and z = w * xhat + b for a tile; mean/rstd are per (n, group)."""
    acc = mean_ptr.dtype.element_ty
    g = n * G + c // CG
    mean = tl.load(mean_ptr + g, mask=c_mask, other=0.0)
    rstd = tl.load(rstd_ptr + g, mask=c_mask, other=0.0)
    w = tl.load(w_ptr + c, mask=c_mask, other=0.0).to(acc)
    b = tl.load(b_ptr + c, mask=c_mask, other=0.0).to(acc)
    xhat = (x - mean[None, :]) * rstd[None, :]
    return xhat, xhat * w[None, :] + b[None, :], w, rstd


@triton.jit
def _stats_kernel(x_ptr, mean_ptr, m2_ptr, HW, C, BLOCK_HW: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_hw, pid_c, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, c_mask, mask, offsets = _tile(pid_hw, pid_c, n, HW, C, BLOCK_HW, BLOCK_C)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(mean_ptr.dtype.element_ty)
    count = tl.minimum(HW - pid_hw * BLOCK_HW, BLOCK_HW)
    mean = tl.sum(x, axis=0) / count
    d = tl.where(mask, x - mean[None, :], 0.0)
    slot = (n * tl.num_programs(0) + pid_hw).to(tl.int64) * C + c
    tl.store(mean_ptr + slot, mean, mask=c_mask)
    tl.store(m2_ptr + slot, tl.sum(d * d, axis=0), mask=c_mask)


@triton.jit
def _apply_kernel(
    x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, HW, C, G, CG,
    SILU: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_hw, pid_c, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, c_mask, mask, offsets = _tile(pid_hw, pid_c, n, HW, C, BLOCK_HW, BLOCK_C)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(mean_ptr.dtype.element_ty)
    _, z, _, _ = _normalize(x, c, c_mask, n, w_ptr, b_ptr, mean_ptr, rstd_ptr, G, CG)
    if SILU:
        z = z / (1.0 + tl.exp(-z))
    tl.store(y_ptr + offsets, z.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grad_tile(
    x_ptr, dy_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n, c, c_mask, mask, offsets, G, CG, SILU: tl.constexpr,
):
    """Load this program's x and dy tiles, recompute xhat from x and return dL/dz with it.

    xhat and dz are zero outside the tile; also returns w and rstd. The tile's indices come in
    from `_tile`, not out of here: Inductor's mutation analysis (torch.compile) traces a store's
    address back through a call's arguments, so an address computed from what a call taking
    w_ptr returned made w (a parameter) look written, and the compiled UNet failed to build
    ("a leaf Variable that requires grad is being used in an in-place operation"; the first GPU run, BENCHMARKS.md).
    """
    acc = mean_ptr.dtype.element_ty
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(acc)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(acc)
    xhat, z, w, rstd = _normalize(x, c, c_mask, n, w_ptr, b_ptr, mean_ptr, rstd_ptr, G, CG)
    if SILU:
        s = 1.0 / (1.0 + tl.exp(-z))
        dy = dy * s * (1.0 + z * (1.0 - s))
    xhat, dz = tl.where(mask, xhat, 0.0), tl.where(mask, dy, 0.0)
    return xhat, dz, w, rstd


@triton.jit
def _bwd_reduce_kernel(
    x_ptr, dy_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, dzx_ptr, dz_ptr, HW, C, G, CG,
    SILU: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_hw, pid_c, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, c_mask, mask, offsets = _tile(pid_hw, pid_c, n, HW, C, BLOCK_HW, BLOCK_C)
    xhat, dz, _, _ = _grad_tile(x_ptr, dy_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n, c, c_mask, mask, offsets, G, CG, SILU)
    slot = (n * tl.num_programs(0) + pid_hw).to(tl.int64) * C + c
    tl.store(dzx_ptr + slot, tl.sum(dz * xhat, axis=0), mask=c_mask)
    tl.store(dz_ptr + slot, tl.sum(dz, axis=0), mask=c_mask)


@triton.jit
def _bwd_dx_kernel(
    x_ptr, dy_ptr, dx_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, ka_ptr, kb_ptr, HW, C, G, CG,
    SILU: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_hw, pid_c, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, c_mask, mask, offsets = _tile(pid_hw, pid_c, n, HW, C, BLOCK_HW, BLOCK_C)
    xhat, dz, w, rstd = _grad_tile(x_ptr, dy_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n, c, c_mask, mask, offsets, G, CG, SILU)
    g = n * G + c // CG
    ka = tl.load(ka_ptr + g, mask=c_mask, other=0.0)  # rstd * mean_g(w dz xhat)
    kb = tl.load(kb_ptr + g, mask=c_mask, other=0.0)  # rstd * mean_g(w dz)
    dx = rstd[None, :] * w[None, :] * dz - kb[None, :] - xhat * ka[None, :]
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# --- launch ----------------------------------------------------------------------


def _blocks(HW, C):
    """Tile sizes: up to 64 channels (128 B of bf16 per row), TILE_ELEMENTS in all.

    Not tuned on a GPU yet; the split only needs enough programs (H*W blocks x
    C blocks x N) to fill the machine, which ref128's shapes give many times over.
    """
    block_c = min(triton.next_power_of_2(C), 64)
    block_hw = min(triton.next_power_of_2(HW), max(16, TILE_ELEMENTS // block_c))
    return block_hw, block_c


def _acc_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _empty(shape, like, dtype=None, channels_last=False):
    kwargs = dict(dtype=dtype or like.dtype, device=like.device)
    if channels_last:
        kwargs["memory_format"] = torch.channels_last
    out = torch.empty(shape, **kwargs)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def _nhwc(t):
    return t.contiguous(memory_format=torch.channels_last)


@triton_op("ddpm::group_norm_silu_fwd", mutates_args=())
def _fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, num_groups: int, eps: float, silu: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = _nhwc(x)
    N, C, H, W = x.shape
    HW, G, CG = H * W, num_groups, C // num_groups
    block_hw, block_c = _blocks(HW, C)
    grid = (triton.cdiv(HW, block_hw), triton.cdiv(C, block_c), N)
    acc = _acc_dtype(x)
    part_mean = _empty((N, grid[0], C), x, acc)
    part_m2 = _empty((N, grid[0], C), x, acc)
    wrap_triton(_stats_kernel)[grid](x, part_mean, part_m2, HW, C, BLOCK_HW=block_hw, BLOCK_C=block_c)

    # Chan et al.'s merge of (count, mean, M2) over blocks and a group's channels.
    count = (HW - torch.arange(grid[0], device=x.device, dtype=acc) * block_hw).clamp(max=block_hw)
    count = count.view(1, -1, 1, 1)
    part_mean, part_m2 = part_mean.view(N, grid[0], G, CG), part_m2.view(N, grid[0], G, CG)
    total = HW * CG
    mean = (part_mean * count).sum((1, 3)) / total
    m2 = (part_m2 + count * (part_mean - mean[:, None, :, None]) ** 2).sum((1, 3))
    rstd = torch.rsqrt(m2 / total + eps)

    y = _empty(x.shape, x, channels_last=True)
    wrap_triton(_apply_kernel)[grid](
        x, y, weight, bias, mean, rstd, HW, C, G, CG, SILU=silu, BLOCK_HW=block_hw, BLOCK_C=block_c
    )
    return y, mean, rstd


@triton_op("ddpm::group_norm_silu_bwd", mutates_args=())
def _bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
    mean: torch.Tensor, rstd: torch.Tensor, silu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, dy = _nhwc(x), _nhwc(dy)
    N, C, H, W = x.shape
    G = mean.shape[1]
    HW, CG = H * W, C // G
    block_hw, block_c = _blocks(HW, C)
    grid = (triton.cdiv(HW, block_hw), triton.cdiv(C, block_c), N)
    acc = mean.dtype
    part_dzx = _empty((N, grid[0], C), x, acc)
    part_dz = _empty((N, grid[0], C), x, acc)
    wrap_triton(_bwd_reduce_kernel)[grid](
        x, dy, weight, bias, mean, rstd, part_dzx, part_dz, HW, C, G, CG,
        SILU=silu, BLOCK_HW=block_hw, BLOCK_C=block_c,
    )
    dzx, dz = part_dzx.sum(1), part_dz.sum(1)  # [N, C]
    w = weight.to(acc)
    total = HW * CG
    ka = rstd * (dzx * w).view(N, G, CG).sum(2) / total
    kb = rstd * (dz * w).view(N, G, CG).sum(2) / total

    dx = _empty(x.shape, x, channels_last=True)
    wrap_triton(_bwd_dx_kernel)[grid](
        x, dy, dx, weight, bias, mean, rstd, ka, kb, HW, C, G, CG,
        SILU=silu, BLOCK_HW=block_hw, BLOCK_C=block_c,
    )
    return dx, dzx.sum(0).to(weight.dtype), dz.sum(0).to(bias.dtype)


def _setup_context(ctx, inputs, output):
    x, weight, bias, _, _, silu = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.silu = silu


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = _bwd(dy, x, weight, bias, mean, rstd, ctx.silu)
    return dx, dweight, dbias, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


def kernel_applies(x, weight, bias):
    """Whether `group_norm_silu` runs the Triton kernels for these arguments."""
    if x.dim() != 4 or weight is None or bias is None:
        return False
    return FORCE_KERNEL or (x.is_cuda and x.is_contiguous(memory_format=torch.channels_last))


def group_norm_silu(x, num_groups, weight, bias, eps, silu):
    """SiLU(GroupNorm(x)) (`silu`) or GroupNorm(x): fused kernels where they apply.

    The kernels return x's dtype (bf16 under autocast, where F.group_norm
    would return fp32); every consumer in the UNet is a convolution, which
    casts to bf16 anyway, so the values the next layer sees are the same.
    """
    if kernel_applies(x, weight, bias):
        return _fwd(x, weight, bias, num_groups, eps, silu)[0]
    y = F.group_norm(x, num_groups, weight, bias, eps)
    return F.silu(y) if silu else y


# --- diffusers UNet2DModel -------------------------------------------------------

from diffusers.models.resnet import ResnetBlock2D  # noqa: E402
from diffusers.models.upsampling import Upsample2D  # noqa: E402


class FusedResnetBlock2D(ResnetBlock2D):
    """diffusers' ResnetBlock2D whose training forward fuses each norm with its SiLU.

    Same modules, parameters and state dict; `use_fused_norm` turns a block
    into one by swapping its class. The forward mirrors diffusers 0.42.1's.
    """

    def forward(self, input_tensor, temb, *args, **kwargs):
        if not self.training or not isinstance(self.nonlinearity, nn.SiLU) or args or kwargs:
            return super().forward(input_tensor, temb, *args, **kwargs)

        def norm(module, h, silu):
            return group_norm_silu(h, module.num_groups, module.weight, module.bias, module.eps, silu)

        hidden_states = norm(self.norm1, input_tensor, True)
        if self.upsample is not None:
            if hidden_states.shape[0] >= 64:
                input_tensor = input_tensor.contiguous()
                hidden_states = hidden_states.contiguous()
            input_tensor = self.upsample(input_tensor)
            hidden_states = self.upsample(hidden_states)
        elif self.downsample is not None:
            input_tensor = self.downsample(input_tensor)
            hidden_states = self.downsample(hidden_states)

        hidden_states = self.conv1(hidden_states)
        if self.time_emb_proj is not None:
            if not self.skip_time_act:
                temb = self.nonlinearity(temb)
            temb = self.time_emb_proj(temb)[:, :, None, None]

        if self.time_embedding_norm == "scale_shift":
            if temb is None:
                raise ValueError("`temb` should not be None when `time_embedding_norm` is scale_shift")
            time_scale, time_shift = torch.chunk(temb, 2, dim=1)
            hidden_states = norm(self.norm2, hidden_states, False)
            hidden_states = self.nonlinearity(hidden_states * (1 + time_scale) + time_shift)
        else:
            if self.time_embedding_norm == "default" and temb is not None:
                hidden_states = hidden_states + temb
            hidden_states = norm(self.norm2, hidden_states, True)

        hidden_states = self.dropout(hidden_states)
        hidden_states = self.conv2(hidden_states)

        if self.conv_shortcut is not None:
            # diffusers makes this contiguous in training (a DDP stride warning
            # with NCHW parameters); an NHWC input stays NHWC, like the parameters.
            if not input_tensor.is_contiguous(memory_format=torch.channels_last):
                input_tensor = input_tensor.contiguous()
            input_tensor = self.conv_shortcut(input_tensor)

        return (input_tensor + hidden_states) / self.output_scale_factor


class GroupNormSiLU(nn.GroupNorm):
    """nn.GroupNorm followed by SiLU, through `group_norm_silu`; same parameters."""

    def forward(self, x):
        return group_norm_silu(x, self.num_groups, self.weight, self.bias, self.eps, True)


def use_fused_norm(unet):
    """Route `unet`'s ResNet-block norms (+SiLU) and its final norm (+SiLU) through the kernels.

    In place, by swapping module classes: the parameters, their names and the
    state dict do not change, so checkpoints, save_pretrained and
    DDPMPipeline.from_pretrained work as before (a loaded pipeline gets plain
    diffusers modules). Call it before torch.compile. Returns `unet`.
    """
    for module in unet.modules():
        if type(module) is ResnetBlock2D:
            module.__class__ = FusedResnetBlock2D
    if type(getattr(unet, "conv_norm_out", None)) is nn.GroupNorm and type(unet.conv_act) is nn.SiLU:
        unet.conv_norm_out.__class__ = GroupNormSiLU
        unet.conv_act = nn.Identity()
    return unet


class ChannelsLastUpsample2D(Upsample2D):
    """diffusers' Upsample2D without the NCHW copy it makes at batch >= 64."""

    def forward(self, hidden_states, output_size=None, *args, **kwargs):
        if args or kwargs or self.norm is not None or self.use_conv_transpose or not self.interpolate:
            return super().forward(hidden_states, output_size, *args, **kwargs)
        # pytorch#141831, kept from diffusers: NHWC nearest upsampling fails past 2**31 elements.
        scale_factor = 2 if output_size is None else max(f / s for f, s in zip(output_size, hidden_states.shape[-2:]))
        if hidden_states.numel() * scale_factor > 2**31:
            hidden_states = hidden_states.contiguous()
        if output_size is None:
            hidden_states = F.interpolate(hidden_states, scale_factor=2.0, mode="nearest")
        else:
            hidden_states = F.interpolate(hidden_states, size=output_size, mode="nearest")
        if self.use_conv:
            conv = self.conv if self.name == "conv" else self.Conv2d_0
            hidden_states = conv(hidden_states)
        return hidden_states


def keep_channels_last(unet):
    """Swap `unet`'s Upsample2D modules for `ChannelsLastUpsample2D` (in place; same state dict)."""
    for module in unet.modules():
        if type(module) is Upsample2D:
            module.__class__ = ChannelsLastUpsample2D
    return unet
