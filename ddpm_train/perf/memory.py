"""What a run holds in memory: the bytes of its tensors, counted, estimated and measured.

    python memory.py count dit-xl2 --image_size 32 --channels 4 --batch_size 64 --precision bf16
    python memory.py trace train.py --model dit-tiny ...   # a run's live tensors on the CPU, by region
    python memory.py trace -m bench --workload dit-tiny    # the same of the speed ladder

- `LiveTensors`: a TorchDispatchMode that counts the bytes of tensor storage alive (each storage once,
  uncounted when torch frees it), by the region of code that made it, and keeps the peak and what was
  alive at it. It sees what runs eagerly on a CPU or the meta device; `trace` runs a script under it.
- `count_step`: the bytes one eager forward and backward hold, counted on the meta device with CUDA
  autocast's casts and fused attention (`AutocastLike`): within 3% of an H100's eager peak.
- `plan`, `plan_line`, `end_line`: what train.py says at its start (weights, gradients, AdamW, EMA,
  activations) and at its end (the peak measured on a GPU). docs/performance.md, Memory.
"""

import argparse
import contextlib
import functools
import os
import runpy
import sys
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ddpm_train.networks import dit
from ddpm_train.networks import model as models
from ddpm_train.training import optimizer as optimizers
from ddpm_train import sizes
from ddpm_train.errors import ConfigError, OneLineParser

GIB = 2**30


class LiveTensors(TorchDispatchMode):
    """Bytes of tensor storage alive, each storage counted once, by the region that made it.

    Inside `with tracker:` every tensor an operator returns is looked at: a storage not
    seen before is counted (its nbytes) under the region running then (`running(name)`),
    and uncounted when torch frees it (a weakref.finalize on the storage). A storage made
    before the tracker started is counted the first time an operator returns a view of it.
    `peak` is the most bytes alive at once, `at_peak` the bytes alive then by region,
    `peak_region` what was running; `region_peaks[name]` is the same for the time `name`
    ran. `device_type` counts only storages on that device ("cuda", "cpu", "meta").
    """

    def __init__(self, device_type=None, region_of=None):
        super().__init__()
        self.device_type = device_type
        self.region_of = region_of  # () -> the region running, where the caller does not say (stack_region)
        self.region = "start"
        self.by_region = Counter()  # bytes alive now, by the region that made them
        self.now = self.peak = 0
        self.peak_region, self.at_peak = None, {}
        self.region_peaks = {}  # running region -> (most bytes alive while it ran, alive by region then)
        self._alive = {}  # storage -> (bytes, region)

    @contextlib.contextmanager
    def running(self, region):
        before, self.region = self.region, region
        try:
            yield
        finally:
            self.region = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.see(t)
        return out

    def see(self, tensor, region=None):
        """Count `tensor`'s storage (once) under `region` (default: the one running)."""
        if self.device_type is not None and tensor.device.type != self.device_type:
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._alive:
            return
        running = self.region_of() if self.region_of else self.region
        nbytes, region = storage.nbytes(), region or running
        self._alive[key] = (nbytes, region)
        weakref.finalize(storage, self._freed, key)
        self.by_region[region] += nbytes
        self.now += nbytes
        if self.now > self.peak:
            self.peak, self.peak_region, self.at_peak = self.now, running, self._snapshot()
        top = self.region_peaks.get(running)
        if top is None or self.now > top[0]:
            self.region_peaks[running] = (self.now, self._snapshot())

    def _snapshot(self):
        return {name: n for name, n in self.by_region.items() if n}

    def _freed(self, key):
        nbytes, region = self._alive.pop(key)
        self.by_region[region] -= nbytes
        self.now -= nbytes


# --- the activations of a step, counted on the meta device ---------------------------------------------

F = torch.nn.functional
# What CUDA autocast runs in bf16/fp16 (its lower-precision list) and in fp32 (its fp32 list), of the ops these
# networks call. The meta device has no autocast: AutocastLike casts as CUDA's does, above autograd, so that what
# the backward keeps is what it keeps on a GPU (a linear's bf16 input, a LayerNorm's fp32 output).
LOWER_PRECISION_OPS = {
    F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
    torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm, torch.addmm, torch.Tensor.addmm,
    F.scaled_dot_product_attention,
}  # fmt: skip
FP32_OPS = {
    F.layer_norm, F.group_norm, F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax,
    torch.Tensor.log_softmax, torch.exp, torch.Tensor.exp, torch.pow, torch.Tensor.pow, torch.rsqrt,
    torch.Tensor.rsqrt, torch.log, torch.Tensor.log, F.mse_loss, torch.norm, torch.Tensor.norm, torch.cumsum,
    torch.Tensor.cumsum, F.softplus,
}  # fmt: skip


class _FlashLike(torch.autograd.Function):
    """Attention as a fused (flash or memory-efficient) kernel holds it: the output, and for the backward
    q, k, v, the output and one fp32 log-sum-exp per query; never the attention matrix, which the meta
    device's SDPA (two matmuls and a softmax) would keep."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        torch.empty(q.shape, dtype=torch.float32, device=q.device)  # the kernel's fp32 dq accumulator
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class AutocastLike(torch.overrides.TorchFunctionMode):
    """CUDA autocast's casts, for a device that has none (the meta device): the ops of LOWER_PRECISION_OPS take
    their floating inputs in `dtype` (a parameter cast once, as autocast caches it), those of FP32_OPS in fp32.
    `dtype` None casts nothing (an fp32 run). Attention runs as _FlashLike either way."""

    def __init__(self, dtype=None):
        super().__init__()
        self.dtype, self.cache = dtype, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.dtype is not None and func in LOWER_PRECISION_OPS:
            args, kwargs = self._cast((args, kwargs), self.dtype)
        elif self.dtype is not None and func in FP32_OPS:
            args, kwargs = self._cast((args, kwargs), torch.float32)
        if func is F.scaled_dot_product_attention:
            return _FlashLike.apply(*args[:3])
        return func(*args, **kwargs)

    def _cast(self, tree, dtype):
        def cast(t):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == dtype:
                return t
            if t.is_leaf and t.requires_grad:  # a parameter: autocast keeps one cast per region
                key = (id(t), dtype)
                if key not in self.cache:
                    self.cache[key] = t.to(dtype)
                return self.cache[key]
            return t.to(dtype)

        return tree_map(cast, tree)


# count_step's counts by their arguments (a process that starts several runs counts each network once).
_COUNTED = {}


def count_step(model_name, image_size, batch_size, channels=3, precision="no", gradient_checkpointing=False, text=None,
               routing=None):  # fmt: skip
    """{'peak', 'gradients'}: the most bytes one eager forward and backward of `batch_size` inputs hold at
    once beyond the weights (the gradients included, as they are made), and the gradients' bytes, counted on
    the meta device (no memory, no arithmetic) with CUDA autocast's casts where `precision` is bf16, fp16 or fp8
    and attention as a fused kernel holds it (AutocastLike). The loss is the output's mean square, in fp32.
    `text`: a captioned run's embeddings' (width, tokens), a batch of which the step holds; `routing`: --token_routing's
    share, a DiT's routed blocks holding the tokens they take (flops.network_flops)."""
    key = (model_name, image_size, batch_size, channels, precision, bool(gradient_checkpointing), text and tuple(text),
           routing or None)  # fmt: skip
    if key not in _COUNTED:
        _COUNTED[key] = _count_step(*key)
    return dict(_COUNTED[key])


def _count_step(model_name, image_size, batch_size, channels, precision, gradient_checkpointing, text, routing):
    net = models.build_network(model_name, image_size, device="meta", channels=channels, text_dim=text and text[0])
    if routing:
        net.routing = dit.routing(routing, len(net.transformer_blocks))
    # fp8: torchao's Float8Linear keeps its input and weight for the backward in the autocast's bf16 and casts to
    # FP8 inside the matmul, so the step holds what a bf16 step holds (fp8.py)
    dtype = dict(bf16=torch.bfloat16, fp16=torch.float16, fp8=torch.bfloat16).get(precision)
    if gradient_checkpointing:  # the backward recomputes each block under the same casts
        net.enable_gradient_checkpointing(functools.partial(_checkpoint, dtype))
    net.train()
    tracker = LiveTensors("meta")
    for t in (*net.parameters(), *net.buffers()):
        tracker.see(t, "weights")
    weights = tracker.now
    x = torch.empty(batch_size, channels, *sizes.height_width(image_size), device="meta")
    t = torch.zeros(batch_size, dtype=torch.long, device="meta")
    with tracker:
        captioned = models.stand_in_captions(batch_size, text)  # the batch's caption rows, held as its images are
        with AutocastLike(dtype) as casts:
            out = net(x, t, return_dict=False, **captioned)[0]
            casts.cache.clear()  # autocast's cache ends with its region; the backward keeps what it saved
            out.float().square().mean().backward()
        del out
    gradients = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    return dict(peak=tracker.peak - weights, gradients=gradients)


def _checkpoint(dtype, block, *args):
    """torch.utils.checkpoint of `block` whose forward, and recompute in the backward, cast as AutocastLike."""

    def run(*inputs):
        with AutocastLike(dtype):
            return block(*inputs)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)


# --- what a run will hold, said in one line -----------------------------------------------------------


def tensor_bytes(tensors):
    """Bytes of the storages of `tensors`, each storage once."""
    seen = {}
    for t in tensors:
        seen.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())
    return sum(seen.values())


def ema_tensors(ema):
    """The tensors an EMA holds: diffusers' EMAModel one copy of the weights, ema.PowerEMA one per --ema_stds."""
    if ema is None:
        return []
    if hasattr(ema, "shadows"):
        return [t for shadow in ema.shadows for t in shadow]
    return list(ema.shadow_params)


class Plan:
    """What one process of a run will hold on its device while it trains, in bytes.

    weights, gradients, optimizer (AdamW's moments; None for another optimizer) and ema are counted from the
    run's own objects; `buckets` is DDP's gradient buckets with several processes (a second copy of the
    gradients). `step_peak` is the most one eager forward and backward of a micro-batch hold at once beyond the
    weights, the gradients as they are made included (count_step); `activations` is what of it is not the
    gradients, so that the total is the step's peak: within 3% of the GPU's when eager, above it when compiled
    (docs/performance.md, Memory).
    """

    def __init__(self, weights, gradients, optimizer, ema, step_peak, batch_size, buckets=0, ema_copies=1, host=0):
        self.weights, self.gradients, self.optimizer, self.ema = weights, gradients, optimizer, ema
        self.step_peak, self.batch_size, self.buckets, self.ema_copies = step_peak, batch_size, buckets, ema_copies
        self.host = host  # held in host memory, not on the device: a captioned run's caption table

    @property
    def state(self):
        """What stays between steps but the gradients: the weights, the optimizer's state and the EMA (what a
        checkpoint holds)."""
        return self.weights + (self.optimizer or 0) + self.ema

    @property
    def activations(self):
        return max(0, self.step_peak - self.gradients)

    @property
    def total(self):
        return self.weights + self.gradients + (self.optimizer or 0) + self.ema + self.buckets + self.activations

    def largest_batch(self, capacity):
        """The largest micro-batch that fits in `capacity` bytes, the step's peak taken to grow in proportion to
        the batch (its gradients too: a bound from below); 0 when not even the weights and their state fit."""
        room = capacity - self.state - self.buckets
        return max(0, int(room // (self.step_peak / self.batch_size)))


def plan(trained, optimizer, ema, count, batch_size, num_processes=1, host=0):
    """The Plan of a run: `trained` the tensors the step trains with (the network's parameters and buffers, the
    objective's parameters), `count` count_step's result for its micro-batch, `host` the caption table's bytes."""
    trained = list(trained)
    gradients = tensor_bytes([t for t in trained if t.requires_grad])
    copies = len(ema.shadows) if hasattr(ema, "shadows") else (1 if ema is not None else 0)
    return Plan(tensor_bytes(trained), gradients, optimizers.state_bytes(optimizer), tensor_bytes(ema_tensors(ema)),
                count["peak"], batch_size, buckets=gradients if num_processes > 1 else 0, ema_copies=copies, host=host)  # fmt: skip


def gib(n):
    return f"{n / GIB:.3g}"


def plan_line(p, capacity=None, where=None, compiled=False):
    """One line: what the run will hold, by part, in GiB; with `capacity` (the GPU's memory, bytes), whether it
    fits, and about the largest batch that does.
    `compiled`: the step is compiled, and holds less than the eager count of its activations."""
    parts = [f"weights {gib(p.weights)}", f"gradients {gib(p.gradients)}"]
    parts.append(f"optimizer {gib(p.optimizer)}" if p.optimizer is not None else "optimizer state not counted")
    if p.ema_copies:
        parts.append(f"EMA {gib(p.ema)}" + (f" ({p.ema_copies} copies)" if p.ema_copies > 1 else ""))
    if p.buckets:
        parts.append(f"DDP buckets {gib(p.buckets)}")
    parts.append(f"activations {gib(p.activations)}" + (" (eager count; compiled holds less)" if compiled else ""))
    line = f"memory: {' + '.join(parts)} = {gib(p.total)} GiB"
    host = f"; the caption table: {gib(p.host)} GiB in host memory (memory-mapped), a batch's rows on the device" if p.host else ""
    if capacity is None:
        return line + host
    line += f" of {gib(capacity)}" + (f" on {where}" if where else "")
    largest = p.largest_batch(capacity)
    if largest < 1:
        line += f"; does not fit{' eager' if compiled else ''}, not even at batch 1"
    elif largest < p.batch_size:
        line += f"; does not fit{' eager' if compiled else ''}: about batch {largest} would, with --gradient_accumulation_steps"
    else:
        line += f"; about batch {largest} would fit"
    return line + host


def end_line(p, peak_bytes):
    """The last word: the peak measured (on a GPU: torch.cuda.max_memory_allocated) beside the estimate."""
    if peak_bytes is None:
        return f"memory: peak not measured on a CPU (estimated {gib(p.total)} GiB)"
    return f"memory: peak {gib(peak_bytes)} GiB allocated (torch.cuda.max_memory_allocated), estimated {gib(p.total)} GiB"


# --- python memory.py: count a step, trace a script ----------------------------------------------------

# The region a storage is made in, for `trace`: the innermost frame on the stack whose (file, function) is here
# (function None: any function of that file). train.py's and the ladder's step, grids, EMA and checkpoints.
STACK_REGIONS = {
    ("latents.py", "load_vae"): "VAE weights",
    ("latents.py", "_encode_batch"): "VAE encode",
    ("data.py", None): "data",
    ("shapescore.py", None): "data",
    ("latents.py", "decode"): "VAE decode",
    ("ema.py", "averaged_copy"): "EMA weights, copied to sample",
    ("sample.py", "generate"): "sampling",
    ("checkpoint.py", "save"): "checkpoint",
    ("ema.py", "make_ema"): "EMA",
    ("model.py", "build_network"): "weights",
    ("step.py", "_backward"): "backward",
    ("step.py", "_clip"): "clipping",
    ("adamw.py", None): "AdamW",
    ("adam.py", None): "AdamW",
    ("training_utils.py", "step"): "EMA update",
    ("ema.py", "step"): "EMA update",
    ("step.py", "descend"): "forward",
}


def stack_region(default="other"):
    """STACK_REGIONS' label of the innermost frame it knows, else `default`."""
    frame = sys._getframe(1)
    while frame is not None:
        name = os.path.basename(frame.f_code.co_filename)
        label = STACK_REGIONS.get((name, frame.f_code.co_name)) or STACK_REGIONS.get((name, None))
        if label:
            return label
        frame = frame.f_back
    return default


def report(tracker, out=print):
    mib = lambda n: f"{n / 2**20:10.2f} MiB"  # noqa: E731
    out(f"peak {mib(tracker.peak)} of live tensors, while '{tracker.peak_region}' ran; alive then, by where made:")
    for name, n in sorted(tracker.at_peak.items(), key=lambda kv: -kv[1]):
        out(f"  {mib(n)}  {name}")
    out("the most alive while each region ran:")
    for region, (n, _) in sorted(tracker.region_peaks.items(), key=lambda kv: -kv[1][0]):
        out(f"  {mib(n)}  {region}")


def _size(text):
    try:
        return sizes.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv=None):
    p = OneLineParser(prog="memory.py", description="Count a training step's memory; trace a script's live tensors.")
    commands = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    c = commands.add_parser("count", help="one eager forward and backward of a preset, counted on the meta device")
    c.add_argument("model")
    c.add_argument("--image_size", required=True, type=_size, help="the network's input: a side, or width x height "
                   "(96x64); a latent run's latents")  # fmt: skip
    c.add_argument("--channels", type=int, default=3)
    c.add_argument("--batch_size", type=int, required=True)
    c.add_argument("--precision", choices=("no", "bf16", "fp16", "fp8"), default="no")
    c.add_argument("--gradient_checkpointing", action="store_true")
    t = commands.add_parser("trace", help="run a script (or -m module) with its arguments, its CPU tensors counted")
    t.add_argument("-m", dest="module", default=None, help="run this module as python -m does")
    t.add_argument("argv", nargs="*", help="the script and its arguments (after -m: the module's arguments)")
    args, rest = p.parse_known_args(argv)
    if args.command == "trace":
        args.argv += rest
    elif rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(args):
    if args.command == "count":
        c = count_step(args.model, args.image_size, args.batch_size, args.channels, args.precision,
                       args.gradient_checkpointing)  # fmt: skip
        print(f"{args.model} at {sizes.with_channels(args.image_size, args.channels)}, batch {args.batch_size}, "
              f"{args.precision}: the step's peak beyond the weights {gib(c['peak'])} GiB (gradients "
              f"{gib(c['gradients'])}, activations {gib(max(0, c['peak'] - c['gradients']))})")  # fmt: skip
        return c
    tracker = LiveTensors("cpu", region_of=stack_region)
    sys.argv = [args.module or args.argv[0], *(args.argv if args.module else args.argv[1:])]
    try:
        with tracker:
            if args.module:
                runpy.run_module(args.module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(args.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    report(tracker)
    return tracker
