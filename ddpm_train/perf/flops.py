"""FLOPs per training step, the GPU peak table, and utilization.

    python flops.py --image_size 128 --train_batch_size 64            # the reference model
    python flops.py --model adm64 --image_size 64 --train_batch_size 32 --json

FLOPs are counted by `torch.utils.flop_counter.FlopCounterMode` on a copy of
the model on the meta device: no memory, no arithmetic, a second or two even
for the 113.7M reference model at batch 64. It counts matrix multiplies,
convolutions and attention, not norms, activations or the optimizer.

Attention: on the meta device scaled_dot_product_attention runs its math path,
whose matmuls are counted (QK^T and AV forward, twice that backward), as CUDA's
fused attention kernels are counted on a GPU. torch's table has no formula for a
CPU's fused kernel (aten._scaled_dot_product_flash_attention_for_cpu) and counts
it as 0: 228.9 instead of 237.3 GFLOP/img forward for DiT-XL/2 at 32x32x4, 372.17
instead of 372.30 forward and backward for the reference model. count_flops adds
one (CPU_ATTENTION), the math path's matmuls, so a count on a CPU's tensors
equals the meta device's.

MFU counts the model's FLOPs once; HFU counts what the hardware executes,
which under gradient checkpointing includes the recomputed forward passes.
"""

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from ddpm_train.networks import dit
from ddpm_train.networks import model as models
from ddpm_train import sizes
from ddpm_train.errors import ConfigError, OneLineParser, one_line_errors


def _attention_flops(query, key, value, *args, out_shape=None, **kwargs):
    """QK^T and AV: 2*L*S*E multiply-adds each per head (torch's sdpa_flop_count)."""
    return sdpa_flop_count(query, key, value)


def _attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs):
    """The math path's backward: two matmuls per forward matmul (torch's formula for CUDA's flash
    backward counts its recompute of QK^T too, hardware FLOPs)."""
    return 2 * sdpa_flop_count(query, key, value)


# FLOP formulas for the attention kernels torch's FlopCounterMode has none for, by op: a CPU's.
CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
}


def count_flops(fn):
    """Total FLOPs of everything `fn()` runs, by FlopCounterMode, a CPU's attention kernels included."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        fn()
    return counter.get_total_flops()


# network_flops' counts by their arguments, which fix the network (a preset's name) and its input: a process
# that starts several runs (the test suite) counts each network once. Counting walks every
# operation in Python, seconds for a network whose step takes milliseconds on a CPU.
_COUNTED = {}


def network_flops(model_name, image_size, batch_size, gradient_checkpointing=False, channels=3, routing=None, text=None):
    """{'params', 'flops_fwd', 'flops_fwdbwd'} of one training micro-batch, counted on the meta device.

    flops_fwdbwd is the forward and backward pass as executed: with
    `gradient_checkpointing` it includes the recomputed forward passes; with `routing` (--token_routing's
    value) a DiT's routed blocks on the tokens they take. flops_fwd is sampling's: every token.
    `image_size` and `channels` are the network's input: a latent run's latents (the VAE's
    channels at the image size over its factor). `text`: a captioned run's embeddings' (width, tokens), which its
    network's cross-attention reads.
    """
    key = (model_name, image_size, batch_size, bool(gradient_checkpointing), channels, routing or None, text and tuple(text))
    if key not in _COUNTED:
        _COUNTED[key] = _count_network_flops(*key)
    return dict(_COUNTED[key])


def _count_network_flops(model_name, image_size, batch_size, gradient_checkpointing, channels, routing, text):
    net = models.build_network(model_name, image_size, device="meta", channels=channels, text_dim=text and text[0])
    if gradient_checkpointing:
        net.enable_gradient_checkpointing()
    if routing:
        net.routing = dit.routing(routing, len(net.transformer_blocks))
    x = torch.empty(batch_size, channels, *sizes.height_width(image_size), device="meta")
    t = torch.zeros(batch_size, dtype=torch.long, device="meta")
    captioned = models.stand_in_captions(batch_size, text)

    def forward():
        return net(x, t, return_dict=False, **captioned)[0]

    with torch.no_grad():
        fwd = count_flops(forward)
    fwdbwd = count_flops(lambda: forward().float().square().mean().backward())
    return dict(params=sum(p.numel() for p in net.parameters()), flops_fwd=fwd, flops_fwdbwd=fwdbwd)


def step_flops(model_name, image_size, batch_size, gradient_checkpointing=False, channels=3, routing=None, text=None):
    """Model and hardware FLOPs of one optimizer step of `batch_size` images (on one device): the
    denoiser's, at its input's size and channels, its tokens routed as `routing` says (network_flops); a
    latent run's VAE is not in them.

    model_flops: forward + backward, counted once (for MFU).
    hardware_flops: what runs, with checkpointing's recompute (for HFU).
    """
    model = network_flops(model_name, image_size, batch_size, channels=channels, routing=routing, text=text)
    hardware = network_flops(model_name, image_size, batch_size, True, channels, routing, text) if gradient_checkpointing else model
    return dict(params=model["params"], model_flops=model["flops_fwdbwd"], hardware_flops=hardware["flops_fwdbwd"])


# --- peaks ------------------------------------------------------------------------

# Dense (no sparsity) peak TFLOP/s from NVIDIA's datasheets, by precision.
# fp16/bf16 are the tensor-core rates with fp32 accumulation, as PyTorch uses; fp8 too (torch._scaled_mm
# accumulates in fp32), on the GPUs with FP8 tensor cores (compute capability 8.9 and above): half the
# datasheets' "with sparsity" figure. The RTX 4090's are the Ada whitepaper's fp32-accumulate rates.
# Patterns are tried in order against torch.cuda.get_device_name().
PEAK_TFLOPS = [
    # (pattern, GPU, {precision: TFLOP/s})
    (r"H100.*PCIe", "H100 PCIe", dict(bf16=756.5, fp16=756.5, tf32=378.0, fp32=51.2, fp8=1513.0)),
    (r"H100.*NVL", "H100 NVL", dict(bf16=835.5, fp16=835.5, tf32=417.5, fp32=60.0, fp8=1670.5)),
    (r"H100", "H100 SXM", dict(bf16=989.4, fp16=989.4, tf32=494.7, fp32=66.9, fp8=1978.9)),
    (r"H200.*NVL", "H200 NVL", dict(bf16=835.5, fp16=835.5, tf32=417.5, fp32=60.0, fp8=1670.5)),
    (r"H200", "H200 SXM", dict(bf16=989.4, fp16=989.4, tf32=494.7, fp32=66.9, fp8=1978.9)),
    (r"\bA100\b", "A100", dict(bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5)),
    # AWS's A10G has no datasheet of its own; these are the A10's.
    (r"\bA10G?\b", "A10/A10G", dict(bf16=125.0, fp16=125.0, tf32=62.5, fp32=31.2)),
    (r"\bL40S\b", "L40S", dict(bf16=362.05, fp16=362.05, tf32=183.0, fp32=91.6, fp8=733.0)),
    (r"\bL4\b", "L4", dict(bf16=121.0, fp16=121.0, tf32=60.0, fp32=30.3, fp8=242.5)),
    (r"RTX 4090", "RTX 4090", dict(bf16=165.2, fp16=165.2, tf32=82.6, fp32=82.6, fp8=330.3)),
]


def lookup_peak(device_name, precision):
    """(GPU, dense peak FLOP/s) for a device name and precision; (None, None) when unknown.

    precision: 'fp32', 'tf32', 'bf16', 'fp16' or 'fp8' (None for a GPU without FP8 tensor cores).
    """
    for pattern, gpu, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name or ""):
            return gpu, peaks[precision] * 1e12 if precision in peaks else None
    return None, None


def describe_peak(device, mixed_precision, allow_tf32):
    """(peak FLOP/s per device or None, words saying what it is), from PEAK_TFLOPS.

    An fp8 run's MFU is against the bf16 peak, the project's denominator (its norms, attention and
    the layers kept out of FP8 run in bf16); the words add the FP8 peak beside it."""
    precision = matmul_precision(mixed_precision, allow_tf32 and device.type == "cuda")
    if device.type != "cuda":
        return None, f"peak unknown for {device.type} {mixed_precision if mixed_precision == 'fp8' else precision}"
    name = torch.cuda.get_device_name(device)
    _, peak = lookup_peak(name, precision)
    if peak is None:
        return None, f"peak unknown for {name} {precision} (not in flops.py's PEAK_TFLOPS)"
    words = f"peak {name} {precision} {peak / 1e12:g} TFLOP/s"
    if mixed_precision == "fp8":
        _, fp8_peak = lookup_peak(name, "fp8")
        words += f" (fp8 run: MFU against bf16's; the fp8 peak {fp8_peak / 1e12:g})" if fp8_peak else " (fp8 run: MFU against bf16's)"
    return peak, words


def matmul_precision(mixed_precision, allow_tf32):
    """The precision matmuls and convolutions run in, for the peak lookup: an fp8 run's denominator is bf16's."""
    if mixed_precision in ("bf16", "fp16"):
        return mixed_precision
    if mixed_precision == "fp8":
        return "bf16"
    return "tf32" if allow_tf32 else "fp32"


def utilization(model_flops, hardware_flops, step_time_s, peak_flops):
    """Achieved FLOP/s and MFU/HFU (fractions; None without a known peak)."""
    achieved = model_flops / step_time_s
    if not peak_flops:
        return dict(achieved_flops=achieved, mfu=None, hfu=None)
    return dict(
        achieved_flops=achieved, mfu=achieved / peak_flops, hfu=hardware_flops / step_time_s / peak_flops
    )


# --- timing -------------------------------------------------------------------------


def median(values):
    return statistics.median(values)


def time_mark(cuda):
    """A point in time: on a GPU a CUDA event recorded in the stream (the host does
    not wait for it), on a CPU a clock reading (there the work is synchronous)."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds_between(start, end):
    """Seconds between two `time_mark`s (for events, once `end` has completed)."""
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3


class StepTimer:
    """Wall time of each training step, without a device sync per step.

    `step_done()` marks the end of a step: a CUDA event on a GPU (recorded in
    the stream, so the host does not wait), a clock reading on a CPU, where
    work is synchronous. `collect()` waits for the last mark once and returns
    the step times since the previous collect. The first `warmup_steps` steps
    (compilation, allocator warm-up) are not timed, nor is anything between
    `restart()` and the next step (sampling, checkpointing).
    """

    def __init__(self, device, warmup_steps=5):
        self.cuda = device.type == "cuda"
        self.warmup_steps = warmup_steps
        self.steps_seen = 0
        self.last = None
        self.pending = []  # (start mark, end mark) of steps not yet collected
        self.all_times = []  # every timed step of the run, in seconds

    def _mark(self):
        return time_mark(self.cuda)

    def restart(self):
        """The next step starts now: time spent since the last step is not a step's."""
        self.last = self._mark()

    def step_done(self):
        now = self._mark()
        self.steps_seen += 1
        if self.last is not None and self.steps_seen > self.warmup_steps:
            self.pending.append((self.last, now))
        self.last = now

    def collect(self):
        """Seconds per step for the steps since the last collect (syncs the device once)."""
        if self.cuda and self.pending:
            self.pending[-1][1].synchronize()
        times = [seconds_between(start, end) for start, end in self.pending]
        self.pending = []
        self.all_times.extend(times)
        return times


def loss_words(loss, terms=None):
    """'loss 0.1234', with each term of the loss after it where it has several: 'loss 0.1 (edm 0.2, edm_logvar -0.1)'."""
    words = f"loss {loss:.4f}"
    if terms and len(terms) > 1:
        words += " (" + ", ".join(f"{name} {value:.4f}" for name, value in terms.items()) + ")"
    return words


def format_perf_line(step, total_steps, loss, step_time_s, images_per_step, model_flops, perf, peak_words, world=1,
                     peak_memory_gib=None, terms=None):  # fmt: skip
    """The line users quote: time, throughput, FLOPs, utilization, the peak behind it, and peak memory; the loss
    with its terms (loss_words)."""
    parts = [
        f"step {step}/{total_steps}",
        loss_words(loss, terms),
        f"{step_time_s:.4g} s/step",
        f"{images_per_step / step_time_s:.1f} img/s",
        f"{model_flops / 1e12:.4g} TFLOP/step",
        f"{perf['achieved_flops'] / 1e12:.4g} TFLOP/s",
    ]
    if world > 1:
        parts[-1] += f" ({perf['achieved_flops'] / world / 1e12:.4g} per device x {world})"
    if perf["mfu"] is None:
        parts.append("MFU/HFU n/a")
    else:
        parts.append(f"MFU {100 * perf['mfu']:.1f}% HFU {100 * perf['hfu']:.1f}%")
    parts.append(peak_words)
    if peak_memory_gib is not None:
        parts.append(f"peak mem {peak_memory_gib:.2f} GiB")
    return " | ".join(parts)


# --- the preset table -------------------------------------------------------------

PRESET_TABLE_START = "<!-- generated by `python flops.py --presets docs/training.md`: model.PRESETS, counted -->"
PRESET_TABLE_END = "<!-- end of the generated table -->"


def preset_table():
    """docs/training.md's preset table: each UNet and EDM2 preset's image size, parameters, forward+backward
    GFLOP per image at that size, and its description (a DiT's are docs/dit.md's, at its latents' size)."""
    rows = ["| `--model` | image size | parameters | GFLOP/img fwd+bwd | what it is |", "|---|---|---|---|---|"]
    for name, preset in models.PRESETS.items():
        if models.FAMILIES[preset.family].transformer:
            continue
        counted = network_flops(name, preset.image_size, 1)
        rows.append(f"| `{name}` | {preset.image_size} | {counted['params']:,} | {counted['flops_fwdbwd'] / 1e9:.2f} | "
                    f"{preset.description} |")  # fmt: skip
    return "\n".join([PRESET_TABLE_START, "", *rows, "", PRESET_TABLE_END])


def with_preset_table(text):
    """`text` with the generated preset table in place of the one between its markers."""
    start, end = text.index(PRESET_TABLE_START), text.index(PRESET_TABLE_END) + len(PRESET_TABLE_END)
    return text[:start] + preset_table() + text[end:]


# --- CLI -----------------------------------------------------------------------------


def parse_args(argv=None):
    p = OneLineParser(description="FLOPs per training step of a model preset.")
    p.add_argument("--model", default="auto", help="preset name, or auto (picked by --image_size as in train.py)")
    p.add_argument("--image_size", default="128", help="image side in pixels, or width x height (96x64); a latent run: "
                   "its latents'")  # fmt: skip
    p.add_argument("--channels", type=int, default=3,
                   help="input channels: 3 for images, a VAE's latent channels for a latent run (4 for SD's VAE)")
    p.add_argument("--train_batch_size", type=int, default=64, help="images per step")
    p.add_argument(
        "--gradient_checkpointing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="count the recomputed forward passes too (hardware FLOPs)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (FLOP, not GFLOP)")
    p.add_argument("--presets", metavar="FILE", help="write the preset table into FILE between its markers "
                   "(docs/training.md) and count nothing else")  # fmt: skip
    return p.parse_args(argv)


def main(args):
    with one_line_errors("flops.py", interrupted="stopped: nothing was written"):
        if args.presets:
            page = Path(args.presets)
            text = page.read_text() if page.is_file() else ""
            if PRESET_TABLE_START not in text or PRESET_TABLE_END not in text:
                raise ConfigError(f"--presets {args.presets}: no preset table's markers in it; use docs/training.md")
            page.write_text(with_preset_table(text))
            return 0
        if args.train_batch_size < 1:
            raise ConfigError(f"--train_batch_size must be at least 1 (got {args.train_batch_size})")
        if args.channels < 1:
            raise ConfigError(f"--channels must be at least 1 (got {args.channels})")
        size = sizes.parse(args.image_size)
        name = models.resolve_model_name(args.model, size)
        per_image = network_flops(name, size, 1, args.gradient_checkpointing, args.channels)
    # FLOPs are linear in the batch (tests/test_flops.py checks it), so count one image and scale.
    result = dict(
        model=name,
        image_size=size,
        channels=args.channels,
        train_batch_size=args.train_batch_size,
        gradient_checkpointing=args.gradient_checkpointing,
        params=per_image["params"],
        flops_per_image_fwd=per_image["flops_fwd"],
        flops_per_image_fwdbwd=per_image["flops_fwdbwd"],
        flops_per_step=per_image["flops_fwdbwd"] * args.train_batch_size,
    )
    if args.json:
        print(json.dumps(result))
    else:
        shape = sizes.spelled(size) if args.channels == 3 else sizes.with_channels(size, args.channels)
        print(f"model {name} at {shape}, batch {args.train_batch_size}")
        print(f"parameters                 {result['params']:,}")
        print(f"forward           GFLOP/img {result['flops_per_image_fwd'] / 1e9:.2f}")
        print(f"forward+backward  GFLOP/img {result['flops_per_image_fwdbwd'] / 1e9:.2f}")
        print(f"training step     TFLOP     {result['flops_per_step'] / 1e12:.2f}")
    return 0
