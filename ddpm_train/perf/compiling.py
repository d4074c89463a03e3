"""How the training step is compiled or captured: the plan, regional compilation, the step's CUDA graph,
the fallbacks and the compile cache.

`--compile_mode` says how step.TrainStep runs on a GPU:

- `default`, `max-autotune`...: torch.compile of the network (forward and
  backward through AOTAutograd); the optimizer and EMA stay eager, a few
  multi-tensor kernels each.
- `reduce-overhead`: the same, with the network's forward and backward
  replayed as CUDA graphs by torch.compile.
- `step-graph`: the network compiled (`default`), then forward, backward,
  clipping, the optimizer and the EMA captured together in one CUDA graph
  (`StepGraph`); what must change between steps (the learning rate, the EMA
  decay) is written into device tensors before each replay.
- `eager-graph`: nothing compiled; the eager step (forward, backward,
  clipping, the optimizer and the EMA) captured in one CUDA graph as
  `step-graph` captures it. No compile to wait for, and no launch gaps: for a
  short run of a launch-bound step.
- `auto` (the default on a CUDA GPU; elsewhere `off`, eager): picks one of
  these by `plan_compile`, a rule taken from measurements, and says why.

`FastStep` runs the step in the planned mode and falls back to the next one
where compiling or capturing fails.
"""

import contextlib
import copy
import json
import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_leaves, tree_map

from ddpm_train.networks import model as models
from ddpm_train.training import optimizer as optimizers
from ddpm_train.perf import profiling
from ddpm_train import sizes
from ddpm_train.errors import ConfigError, RunError, error_line

# What --compile_mode accepts; the torch.compile modes pass through unchanged.
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
STEP_GRAPH_MODES = ("step-graph", "eager-graph")  # StepGraph captures the whole step, around the compiled network or not
COMPILE_MODES = ("auto", *TORCH_COMPILE_MODES, *STEP_GRAPH_MODES)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune", *STEP_GRAPH_MODES)
INDUCTOR_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile makes the graphs (and may skip some)


def compiles(mode):
    """Whether a step mode (None, "off" or "eager": eager) runs the network through torch.compile."""
    return mode not in (None, "off", "eager", "eager-graph")

# Below this many FLOPs per micro-batch and process, a step is bound by kernel
# launches rather than by the GPU, and CUDA graphs pay: a UNet step launches tens of
# milliseconds of kernels, which the GPU's own work hides once it passes ~10 TFLOP
# at the MFU ref128 reaches. adm64 (below it) and ref128 (above it) on an H100 are
# the measurements that place it (BENCHMARKS.md, Speed on a GPU: the first H100 record).
LAUNCH_BOUND_FLOPS = 10e12


def choose_compile_mode(args, device, num_processes, flops_per_micro_batch):
    """(compile mode or None for eager, why) for the flags at hand.

    `args`: compile_mode, gradient_accumulation_steps, mixed_precision,
    on_fault and fused_adam, as config.resolve gives them (fused_adam: a
    setting, config.SETTINGS, that `python -m bench` varies).
    """
    if args.compile_mode == "off":
        return None, "eager (--compile_mode off)"
    cuda = device.type == "cuda"
    requested = args.compile_mode
    blockers = graph_blockers(args, device, num_processes, requested)
    if requested != "auto":
        if requested in CUDA_GRAPH_MODES and blockers:
            raise ConfigError(f"--compile_mode {requested} cannot capture CUDA graphs here: {blockers[0]}; use --compile_mode default")
        return requested, f"--compile_mode {requested}"
    if not cuda:
        return "default", "auto: default (CUDA graphs need a CUDA GPU)"
    tflop = flops_per_micro_batch / 1e12
    if flops_per_micro_batch >= LAUNCH_BOUND_FLOPS:
        return "default", f"auto: default ({tflop:.3g} TFLOP per micro-batch keeps the GPU busy; CUDA graphs would not pay)"
    if blockers:
        return "default", f"auto: default, CUDA graphs off ({blockers[0]})"
    return "reduce-overhead", f"auto: reduce-overhead, CUDA graphs ({tflop:.3g} TFLOP per micro-batch is bound by kernel launches)"


# --- how the network is compiled, and whether it pays ----------------------------------

SCOPE_WORDS = {"regional": "each repeated block once", "whole": "the whole network"}


def choose_compile_scope(args, device=None, total_steps=None, step_s=None, compile_s=None, mode=None):
    """("regional" or "whole", why): the `compile_scope` setting where one is given (`python -m bench`
    varies it); the whole network under gradient checkpointing; else by the run's length: each repeated
    block compiled once where that compile's head start (`compile_s`: scope -> predicted seconds) is more
    than its slower steps (CompileCosts.regional_step_cost of `step_s`, the compiled step) cost in `total_steps`
    steps; the whole network, the faster step, for a long run or one whose length or step is unknown, and
    in a `mode` whose CUDA graphs torch.compile makes (one graph per compiled call: the launches of the glue
    between blocks would stay)."""
    if args.gradient_checkpointing:  # a checkpointed block is recomputed outside its compiled call
        return "whole", "whole network (gradient checkpointing recomputes the blocks)"
    given = getattr(args, "compile_scope", "auto")
    if given not in (None, "auto"):
        return given, f"{given} (compile_scope {given})"
    if mode in INDUCTOR_GRAPH_MODES:
        return "whole", "whole network (its CUDA graphs replay every launch of the step)"
    if device is None or not total_steps or step_s is None or compile_s is None:
        return "whole", "whole network"
    sooner = compile_s["whole"] - compile_s["regional"]
    if sooner <= 0:
        return "whole", "whole network"
    cost = models.family(args.model)[0].compile_costs.regional_step_cost[device_kind(device)] * step_s
    if total_steps * cost < sooner:
        return "regional", (f"each repeated block compiled once ({sooner:.0f} s sooner than the whole network, "
                            f"whose faster step would repay that after {sooner / cost:,.0f} steps)")  # fmt: skip
    return "whole", (f"whole network (its faster step repays its {sooner:.0f} s longer compile after "
                     f"{sooner / cost:,.0f} of this run's {total_steps:,} steps)")  # fmt: skip


WARM_COMPILE_FRACTION = 0.11
SAVED_SHARE_CUDA_GRAPHS = 0.8  # a launch-bound step replayed as CUDA graphs
EAGER_GRAPH_CAPTURE_S = 5


def device_kind(device):
    """"cuda" or "cpu": the device type the cost tables are measured on."""
    return "cuda" if device.type == "cuda" else "cpu"


class CompilePlan(NamedTuple):
    """What `choose_compile_mode` decided: the mode (None: eager), the scope and the line that says why."""

    mode: object
    scope: str
    why: str


def predicted_compile_s(device, family, scope, warm_s=None):
    """(seconds, words): a cold compile's from CompileCosts.cold_compile_s, or this machine's own record of the same
    graphs (`warm_s`, from `remembered_compile_s`: Inductor's cache holds them)."""
    if warm_s is not None:
        return warm_s * WARM_COMPILE_FRACTION, "warm cache"
    return models.FAMILIES[family].compile_costs.cold_compile_s[(device_kind(device), scope)], "cold cache"


def predicted_eager_s(device, family, flops_per_step, peak_flops):
    """The eager step's seconds, predicted; None where nothing predicts it (a GPU whose peak flops.py does
    not know)."""
    if device.type == "cuda":
        if not peak_flops:
            return None
        costs = models.FAMILIES[family].compile_costs
        return max(flops_per_step / (peak_flops * costs.eager_mfu), costs.eager_launch_floor_s)
    return flops_per_step / models.FAMILIES[family].compile_costs.cpu_eager_flops


def predicted_saving_s(device, family, mode, flops_per_step, peak_flops):
    """Seconds a step in `mode` saves over the eager step, predicted; None where nothing predicts it."""
    eager_s = predicted_eager_s(device, family, flops_per_step, peak_flops)
    if eager_s is None:
        return None
    if device.type == "cuda":
        return eager_s * (SAVED_SHARE_CUDA_GRAPHS if mode in CUDA_GRAPH_MODES else models.FAMILIES[family].compile_costs.saved_share)
    return eager_s * models.FAMILIES[family].compile_costs.cpu_saved_share


def predicted_graph_s(family, flops_per_step, peak_flops):
    """The eager step's seconds replayed as one CUDA graph (`eager-graph`), predicted on a GPU of `peak_flops`:
    no less than the eager step's kernels take (a graph removes the gaps between launches, not the kernels)."""
    costs = models.FAMILIES[family].compile_costs
    kernels_s = flops_per_step / (peak_flops * costs.eager_mfu)
    return max(kernels_s, flops_per_step / (peak_flops * costs.graph_mfu) + costs.graph_floor_s)


def plan_compile(args, device, num_processes, flops_per_micro_batch, total_steps=None, peak_flops=None, remembered=None):
    """The step's CompilePlan: `choose_compile_mode`'s mode, `choose_compile_scope`'s scope (by the run's
    length), and, for --compile_mode auto and a run of known length, whichever of eager, the eager step
    captured (`eager-graph`) and the compiled step is predicted to end the run soonest: its `total_steps`
    times each one's predicted step, plus the predicted compile or capture (`peak_flops`:
    the device's, flops.py's; `remembered(mode, scope)`: the cold compile seconds this machine recorded
    for the same step, whose graphs Inductor's cache then holds, or None).
    """
    mode, why = choose_compile_mode(args, device, num_processes, flops_per_micro_batch)
    if mode is None:
        return CompilePlan(None, "whole", why)
    if mode == "eager-graph":
        return CompilePlan(mode, "whole", why)  # nothing is compiled
    family = models.family_name(args.model)
    predicted = {scope: predicted_compile_s(device, family, scope, remembered and remembered(mode, scope))
                 for scope in ("whole", "regional")}  # fmt: skip
    per_step = flops_per_micro_batch * args.gradient_accumulation_steps
    eager_s = predicted_eager_s(device, family, per_step, peak_flops)
    saving_s = predicted_saving_s(device, family, mode, per_step, peak_flops)
    compiled_s = None if eager_s is None else eager_s - saving_s
    scope, scope_why = choose_compile_scope(args, device, total_steps, compiled_s,
                                            {scope: seconds for scope, (seconds, _) in predicted.items()}, mode)  # fmt: skip
    compile_s, cache = predicted[scope]
    if args.compile_mode != "auto" or saving_s is None or not total_steps:
        return CompilePlan(mode, scope, f"{why}; {scope_why}")
    # auto, for a run of known length: whichever of eager, the eager step captured and compiling ends it soonest
    seconds = {None: total_steps * eager_s, mode: compile_s + total_steps * compiled_s}
    if not graph_blockers(args, device, num_processes):  # a CUDA GPU, one process, ...
        seconds["eager-graph"] = EAGER_GRAPH_CAPTURE_S + total_steps * predicted_graph_s(family, per_step, peak_flops)
    best = min(seconds, key=seconds.get)
    compile_words = f"compiling ({mode}, {SCOPE_WORDS[scope]}) would take about {compile_s:.0f} s ({cache})"
    if best == "eager-graph":
        return CompilePlan(best, "whole", (
            f"auto: eager-graph (the eager step captured in one CUDA graph, about {seconds[best]:.0f} s for this run's "
            f"{total_steps:,} steps against {seconds[mode]:.0f} s compiled and {seconds[None]:.0f} s eager): {compile_words}; "
            f"--compile_mode {mode} compiles anyway"))  # fmt: skip
    if best is None:
        return CompilePlan(None, scope, (
            f"auto: eager: {compile_words}, more than it saves in this run's {total_steps:,} steps (about "
            f"{saving_s * total_steps:.0f} s, {saving_s * 1e3:.3g} ms a step); --compile_mode {mode} compiles anyway"))  # fmt: skip
    why += f"; compile about {compile_s:.0f} s ({cache}), saves about {saving_s * total_steps:.0f} s in {total_steps:,} steps"
    return CompilePlan(mode, scope, f"{why}; {scope_why}")


def graph_blockers(args, device, num_processes, mode="eager-graph"):
    """Why this run cannot capture CUDA graphs in `mode` (empty: it can); a step graph (STEP_GRAPH_MODES) holds the
    optimizer too."""
    found = []
    if device.type != "cuda":
        found.append("CUDA graphs need a CUDA GPU")
    if num_processes > 1:
        found.append(f"{num_processes} processes (gradients are all-reduced between steps)")
    if args.gradient_accumulation_steps > 1:
        found.append("--gradient_accumulation_steps above 1")
    if args.mixed_precision == "fp16":
        found.append("fp16's loss scaler reads the gradients on the host")
    if args.on_fault == "stop":
        found.append("--on_fault stop reads the loss on the host every step")
    if not args.fused_adam:
        found.append("AdamW not fused (the non-finite skip happens inside the fused optimizer)")
    host_reads = optimizers.OPTIMIZERS[getattr(args, "optimizer", "adamw")].host_reads
    if mode in STEP_GRAPH_MODES and host_reads:
        found.append(f"--optimizer {args.optimizer} ({host_reads})")
    return found


def start_compile_workers(device, compile_mode):
    """Start Inductor's compile workers now, on a CUDA device whose step compiles (`compile_mode`: the planned
    mode, not "eager" or "off"), so that they are up by the first step. Inductor starts them only when its first
    graph reaches it, and compiles each Triton kernel it writes before they are up in this process, one at a
    time: with regional compilation that can be the whole forward graph's kernels. torch's own call
    (`maybe_warm_pool`, as vLLM makes it before its first compile), which TORCH_WARM_POOL=0 turns off; the
    CPU's kernels are C++, not compiled by these workers. True where it started them."""
    if device.type != "cuda" or not compiles(compile_mode):
        return False
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # a torch without it: Inductor starts them itself
        return False
    try:
        maybe_warm_pool()
    except Exception:  # noqa: BLE001  (a pool that cannot start here fails in the compile, whose failure falls back to eager)
        return False
    return True


def compile_network(model, mode, force_layout=False, scope="whole"):
    """What the step calls: `model` itself (mode None), torch.compile of it (scope "whole"), or
    `model` with each of its repeated blocks compiled once (scope "regional": RegionalNetwork).

    Call it after accelerate's `prepare`, so that the compiled graph holds the
    autocast and any DDP wrapper; keep using `model` itself for checkpoints,
    EMA and saving (never the compiled wrapper). Shapes are static: the batch
    never changes within a run, and dynamic shapes would give up kernels
    specialised to it. `step-graph` compiles in the default mode: the
    capture of the whole step is StepGraph's. `force_layout`: see
    `inductor_settings`. `eager-graph` compiles nothing: StepGraph captures the eager network.
    """
    if not compiles(mode):
        return model
    profiling.quiet_known_compile_warnings()
    inductor_settings(force_layout)
    mode = "default" if mode == "step-graph" else mode
    if scope == "regional":
        return RegionalNetwork(model, mode)
    return torch.compile(model, mode=mode, dynamic=False)


def repeated_blocks(model):
    """The modules of `model` (or of the network inside accelerate's or DDP's wrapper) that its class names
    in `_repeated_blocks`, diffusers' declaration for ModelMixin.compile_repeated_blocks."""
    network = getattr(model, "module", model)
    modules = dict(network.named_modules())
    return [modules[name] for name in models.block_names(network)]


# Regional compilation keeps one compiled graph per block class and shape: a UNet's blocks come in
# more shapes (channels, resolution, skip inputs) than Dynamo's default 8 graphs per function.
REGIONAL_RECOMPILE_LIMIT = 64


def dense_inputs(call):
    """`call` with its tensor arguments in a dense layout (contiguous, or channels_last as they came): Dynamo
    guards on strides, so a block whose input arrives as a strided view (DiT's first block, after the patch
    embedding's transpose) would compile a second graph, its forward and backward, for the one block."""

    def dense(x):
        if torch.is_tensor(x) and not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)):
            return x.contiguous()
        return x

    def run(*args, **kwargs):
        return call(*map(dense, args), **{k: dense(v) for k, v in kwargs.items()})

    return run


class RegionalNetwork:
    """`model` whose repeated blocks run compiled while the step calls it (regional compilation).

    Each block gets torch.compile of its call, as `nn.Module.compile` (and diffusers'
    `compile_repeated_blocks`) would make it; Dynamo keeps one graph per block class and
    shape, so DiT-XL/2's 28 transformer blocks compile once, not 28 times, and the rest of the
    network (embeddings, the final layer) runs eager. Unlike `nn.Module.compile`, the compiled
    calls are set on the blocks only for the duration of a call: the same network sampling
    grids in eval mode, at another batch and without gradients, runs eager rather than
    compiling graphs for every batch it meets. The backward of a compiled block is AOTAutograd's,
    recorded during the call, so it needs nothing set afterwards.
    """

    def __init__(self, model, mode="default"):
        self.model = model
        self.blocks = repeated_blocks(model)
        if not self.blocks:
            raise ConfigError(f"{type(getattr(model, 'module', model)).__name__} declares no repeated blocks to compile "
                              "regionally: compile it whole")  # fmt: skip
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, REGIONAL_RECOMPILE_LIMIT)
        self.compiled = [dense_inputs(torch.compile(block._call_impl, mode=mode, dynamic=False)) for block in self.blocks]

    def __call__(self, *args, **kwargs):
        for block, call in zip(self.blocks, self.compiled):
            block._compiled_call_impl = call
        try:
            return self.model(*args, **kwargs)
        finally:
            for block in self.blocks:
                block._compiled_call_impl = None


def inductor_settings(force_layout=False):
    """Process-wide Inductor settings for compiling the UNet's step; called by compile_network.

    `force_layout` (`python -m bench`'s force_layout row only, not a train.py flag yet):
    Inductor's layout optimisation (decide_layout_opt) keeps channels_last
    through a training graph only if no convolution has out_channels * 2 <=
    in_channels; every UNet preset's conv_out (128 -> 3 for ref128) has, so the
    whole graph falls back to NCHW. This keeps channels_last on regardless
    (as TORCHINDUCTOR_FORCE_LAYOUT_OPT=1 does, which is honoured either way).
    """
    from torch._inductor import config
    from torch._inductor.scheduler import Scheduler

    # Inductor's loop reindexing after fusion, without the memory-coalescing
    # guard of pytorch PR #191134 (the fix for pytorch#189488), makes the
    # conv -> GroupNorm -> SiLU graphs of these UNets several times slower. A
    # torch that has the reindexing but not the guard gets it turned off, unless
    # TORCHINDUCTOR_LOOP_REINDEXING_AFTER_FUSION says otherwise (2.14.1, which
    # requirements.txt pins, has both; the GPU image's 2.11 has neither).
    if (
        hasattr(config, "loop_reindexing_after_fusion")
        and not hasattr(Scheduler, "_reindexing_regresses_memory_coalescing")
        and "TORCHINDUCTOR_LOOP_REINDEXING_AFTER_FUSION" not in os.environ
    ):
        config.loop_reindexing_after_fusion = False
    # Set either way, as it is process-wide: a ladder row after force_layout must not inherit it.
    config.force_layout_optimization = force_layout or os.environ.get("TORCHINDUCTOR_FORCE_LAYOUT_OPT") == "1"


class StepGraph:
    """A TrainStep whose device work is captured once in a CUDA graph and replayed.

    The first `warmup_steps` calls run `step` as it is (they compile the
    network and let the optimizer create its state; they are real steps).
    The next call records `step.descend` and the EMA update into one CUDA
    graph; it and every later call copy the batch into the graph's input
    buffers, write the EMA's decay into a device tensor and replay. The
    learning rate lives in a device tensor that the LR scheduler fills after
    each step, the random numbers come from the CUDA generator the graph
    advances on every replay, and the fused optimizer skips a non-finite step
    on the device, so replays train exactly as the eager step does.

    With `capture=False` it runs the same split (host part, device part)
    without a graph: what the CPU tests check against TrainStep.
    """

    def __init__(self, step, warmup_steps=3, capture=True):
        self.step, self.warmup_steps, self.capture = step, warmup_steps, capture
        self.calls = 0
        self.graph = None
        self.ema = GraphEMA(step.ema) if step.ema is not None else None
        self.static_batches = self.static_losses = None
        self.side_stream = None  # one for every warm-up step, so the allocator reuses its blocks

    def __call__(self, micro_batches, step_number=None):
        self.calls += 1
        if self.calls <= self.warmup_steps:
            return self._on_side_stream(lambda: self.step(micro_batches, step_number))
        if self.static_batches is None:
            self._prepare(micro_batches)
        self._check_shapes(micro_batches)
        for static, batch in zip(self.static_batches, micro_batches, strict=True):
            for buffer, tensor in zip(_tensors(static), _tensors(batch), strict=True):  # images, and labels
                buffer.copy_(tensor, non_blocking=True)
        if self.ema is not None:
            self.ema.advance()
        if self.graph is not None:
            self.graph.replay()
            losses = self.static_losses
        else:
            losses = self._device_work(step_number)
        if self.ema is not None:
            self.ema.after()
        self.step.lr_scheduler.step()  # fills the learning-rate tensor the next replay reads
        self.step.mark("step")
        return [{name: value.clone() for name, value in terms.items()} for terms in losses]

    def _check_shapes(self, micro_batches):
        """The batch must fit the static buffers: say so in one line, not in copy_'s error."""
        shapes = lambda batches: [tuple(t.shape) for b in batches for t in _tensors(b)]  # noqa: E731
        expected, got = shapes(self.static_batches), shapes(micro_batches)
        if got != expected:
            raise RunError(
                f"the step's CUDA graph was captured for micro-batch tensors of shapes {expected} and was "
                f"given {got}: every batch must have the full --train_batch_size"
            )

    def _device_work(self, step_number=None):
        """What the graph holds. No phase marks inside: an event recorded in a capture would be
        replayed with it, and the breakdown times the whole step as one phase ("step")."""
        mark, self.step.mark = self.step.mark, lambda phase: None
        try:
            losses = self.step.descend(self.static_batches, step_number)
            if self.ema is not None:
                self.ema.apply(self.step.model.parameters())
        finally:
            self.step.mark = mark
        return losses

    def _prepare(self, micro_batches):
        """Static inputs, tensor learning rates, then (on a GPU) the capture."""
        self.static_batches = [tree_map(torch.clone, b) for b in micro_batches]
        optimizer = getattr(self.step.optimizer, "optimizer", self.step.optimizer)  # accelerate wraps it
        device = _tensors(self.static_batches[0])[0].device
        for group in optimizer.param_groups:
            # On the step's device, whatever it was: accelerate loads a resumed optimizer's
            # state with map_location="cpu", and a fused CUDA AdamW reads a CPU learning
            # rate with .item(), which a capture would freeze into the graph.
            lr = group["lr"]
            group["lr"] = lr.to(device) if isinstance(lr, torch.Tensor) else torch.tensor(float(lr), device=device)
            group["capturable"] = self.capture
        if self.ema is not None:
            self.ema.to(device)
        if not self.capture:
            return
        self.graph = torch.cuda.CUDAGraph()
        self.step.optimizer.zero_grad(set_to_none=True)
        # torch.cuda.graph synchronizes and empties the allocator's cache as it enters: the blocks the
        # warm-up freed on the side stream go back to the GPU before the graph's pool takes as much
        # again (test_gpu's test_the_capture_keeps_no_second_copy_of_the_warm_ups_memory).
        # thread_local: a DataLoader's pin-memory thread may call CUDA while this thread captures
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.static_losses = self._device_work()

    def _on_side_stream(self, work):
        """Warm-up before a capture runs on a side stream, as torch.cuda.graphs asks."""
        if not self.capture:
            return work()
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream()
        self.side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side_stream):
            result = work()
        torch.cuda.current_stream().wait_stream(self.side_stream)
        return result


def _tensors(batch):
    """A micro-batch's tensors: (images,), (images, labels), or (images, a captioned batch's embeddings, mask)."""
    return tuple(tree_leaves(batch))


class GraphEMA:
    """An EMA update split for a CUDA graph: the host works out the decay, the graph applies it.

    Works with diffusers' EMAModel (one average, decay with warm-up) and
    ema.PowerEMA (one average per width). `advance()` moves the EMA's step
    count on and writes each average's weight (1 - decay) into a device
    tensor; `apply(parameters)` is the update itself, shadow += w (p - shadow),
    all device work; `after()` does what the EMA does after an update on the
    host (PowerEMA's snapshots).
    """

    def __init__(self, ema):
        self.ema = ema
        self.power = hasattr(ema, "gammas")
        self.weights = torch.zeros(len(self._shadows()))

    def _shadows(self):
        return self.ema.shadows if self.power else [self.ema.shadow_params]

    def to(self, device):
        self.weights = self.weights.to(device)

    def advance(self):
        self.ema.optimization_step += 1
        t = self.ema.optimization_step
        if self.power:
            decays = self.ema.decays(t)
        else:
            decays = [self.ema.get_decay(t)]
            self.ema.cur_decay_value = decays[0]
        for i, decay in enumerate(decays):
            self.weights[i].fill_(1 - decay)  # a fill kernel: no host sync

    @torch.no_grad()
    def apply(self, parameters):
        parameters = [p.detach() for p in parameters]
        for i, shadow in enumerate(self._shadows()):
            difference = torch._foreach_sub([p.to(s.dtype) for p, s in zip(parameters, shadow)], shadow)
            torch._foreach_mul_(difference, self.weights[i])
            torch._foreach_add_(shadow, difference)

    def after(self):
        if self.power:
            self.ema.snapshot_if_due()


def build_step(step, mode, device):
    """`step` as the run calls it: wrapped in a StepGraph for --compile_mode step-graph and eager-graph."""
    if mode in STEP_GRAPH_MODES:
        return StepGraph(step, capture=device.type == "cuda")
    return step


# The mode to try when compiling or capturing the step in a mode raises (None: eager).
FALLBACK = {
    "step-graph": "reduce-overhead",
    "eager-graph": None,
    "reduce-overhead": "default",
    "max-autotune": "default",
    "max-autotune-no-cudagraphs": "default",
    "default": None,
}

# The calls in which a mode may still fail for being compiled or captured: the
# first compiles forward and backward; reduce-overhead's CUDA graph trees warm up
# on the next and record on the one after; step-graph captures after its warm-up.
TRIAL_CALLS = 3


class FastStep:
    """The step in the fastest mode that works: one whose compile or capture raises falls back.

    `step` is a TrainStep whose `net` is the uncompiled model; `mode` is a
    --compile_mode (None: eager) and `scope` what of the network it compiles
    (compile_network: "whole" or "regional"). An exception in a mode's first
    calls (its compile, reduce-overhead's recording, step-graph's capture) puts back what
    the call may have touched (the random generators, the gradients, the EMA's
    step count: the weights and the optimizer change only at its end), rebuilds
    the step in the next mode (step-graph -> reduce-overhead -> default ->
    eager; eager-graph -> eager), says so in one line through `say` and runs the call again, so
    training goes on from the same state. Later exceptions are the run's own.
    `fallbacks` and `graph_skips` are what run.json records.

    With several processes (`num_processes`, by default the step's
    accelerator's) there is no fallback: each process would decide alone, and
    one falling back to another mode would train beside ranks in another, or
    wait on collectives they no longer make. The error is then a RunError
    saying which flags to rerun with.
    """

    def __init__(self, step, mode, device, say=print, num_processes=None, scope="whole"):
        self.base, self.device, self.say, self.scope = step, device, say, scope
        self.num_processes = num_processes or process_count(step.accelerator)
        self.fallbacks = []
        self.graph_skips = []
        self._use(mode)

    @property
    def mode_name(self):
        return self.mode or "eager"

    def _use(self, mode):
        self.mode, self.calls = mode, 0
        step = copy.copy(self.base)
        step.net = compile_network(self.base.model, mode, scope=self.scope)
        self.current = build_step(step, mode, self.device)
        if mode is None:
            self.trial_calls = 0
        elif isinstance(self.current, StepGraph):
            self.trial_calls = self.current.warmup_steps + 1  # the capture is the call after the warm-up
        else:
            self.trial_calls = TRIAL_CALLS
        self.skips = GraphSkips() if mode in INDUCTOR_GRAPH_MODES and self.device.type == "cuda" else None

    def __call__(self, micro_batches, step_number=None):
        if self.calls >= self.trial_calls:
            return self.current(micro_batches, step_number)
        state = self._state()
        try:
            losses = self.current(micro_batches, step_number)
        except (ConfigError, RunError):
            raise
        except Exception as e:
            if self.num_processes > 1:
                instead = "--compile_mode off" if self.mode == "default" else "--compile_mode default or off"
                raise RunError(
                    f"--compile_mode {self.mode} failed ({error_line(e)}); with {self.num_processes} processes "
                    f"one cannot fall back alone: rerun with {instead}"
                ) from e
            self._restore(state)
            self._fall_back(e)
            return self(micro_batches, step_number)
        self.calls += 1
        if self.calls == self.trial_calls and self.skips is not None:
            self.graph_skips, self.skips = self.skips.close(), None
            if self.graph_skips:
                self.say(f"CUDA graphs: Inductor skipped {len(self.graph_skips)} graph(s), which run without them: "
                         f"{self.graph_skips[0]}")  # fmt: skip
        return losses

    def _state(self):
        ema = self.base.ema
        return dict(
            cpu_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None,
            ema_step=getattr(ema, "optimization_step", None),
        )

    def _restore(self, state):
        torch.set_rng_state(state["cpu_rng"])
        if state["cuda_rng"] is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        if state["ema_step"] is not None:
            self.base.ema.optimization_step = state["ema_step"]
        self.base.optimizer.zero_grad(set_to_none=True)

    def _fall_back(self, error):
        if self.skips is not None:
            self.skips.close()  # stop listening: the next mode opens its own
        failed, to = self.mode, FALLBACK[self.mode]
        self.fallbacks.append(dict(mode=failed, error=error_line(error), fell_back_to=to or "eager"))
        self.say(f"--compile_mode {failed} failed ({error_line(error)}); falling back to {to or 'eager'}")
        torch.compiler.reset()  # forget the failed mode's compiled code and graphs
        self._use(to)


def process_count(accelerator=None):
    """How many processes train together: the accelerator's, else torch.distributed's world (1 without)."""
    if accelerator is not None:
        return accelerator.num_processes
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_world_size() if distributed else 1


class GraphSkips:
    """The CUDA graphs Inductor skipped while this object was open, with its reasons.

    Inductor counts a skip in counters["inductor"]["cudagraph_skips"] and
    writes why to its `cudagraphs` log, which is off unless TORCH_LOGS asks
    for it: this listens to that log directly. `close()` returns one reason
    per skip ('reason not logged' where Inductor counted without saying).
    """

    LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"

    def __init__(self):
        from torch._dynamo.utils import counters

        self.counters = counters
        self.start = counters["inductor"]["cudagraph_skips"]
        self.reasons = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.reasons.append(record.getMessage())
        self.logger = logging.getLogger(self.LOGGER)
        self.level = self.logger.level
        if self.logger.getEffectiveLevel() > logging.WARNING:
            self.logger.setLevel(logging.WARNING)
        self.logger.addHandler(self.handler)

    def close(self):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        count = self.counters["inductor"]["cudagraph_skips"] - self.start
        reasons = [r for r in self.reasons if r.startswith("skipping cudagraphs")][:count]
        return reasons + ["reason not logged"] * (count - len(reasons))


# --- the fast start: timing the compile, keeping its artifacts ------------------------


def compile_counters():
    """Inductor's FX-graph and AOTAutograd cache hits and misses so far in this process."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    aot = counters["aot_autograd"]
    return dict(
        fx_hits=inductor["fxgraph_cache_hit"],
        fx_misses=inductor["fxgraph_cache_miss"],
        aot_hits=aot["autograd_cache_hit"],
        aot_misses=aot["autograd_cache_miss"],
    )


# The first line of compile_cache.bin: what made it. Inductor's cache keys hold the torch
# version and the device, so a cache from another of either cannot hit.
COMPILE_CACHE_HEADER = b"train.py compile cache "


def compile_origin(device):
    """What a compile cache must come from to be of use here: torch's version and the device."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return dict(torch=torch.__version__, device=name)


def load_compile_artifacts(path, device):
    """Load compile artifacts a previous run saved (torch.compiler's mega-cache), so that a
    run resumed on a fresh machine need not compile again. Returns a line saying what
    happened, or None when there was no cache to load."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    header, _, artifacts = blob.partition(b"\n")
    try:
        origin = json.loads(header.removeprefix(COMPILE_CACHE_HEADER)) if header.startswith(COMPILE_CACHE_HEADER) else None
    except ValueError:
        origin = None
    here = compile_origin(device)
    if origin != here:
        made = f"torch {origin['torch']} on {origin['device']}" if isinstance(origin, dict) and len(origin) == 2 else "an unknown origin"
        return f"not using {path}: it is from {made}, this is torch {here['torch']} on {here['device']}; compiling afresh"
    try:
        loaded = torch.compiler.load_cache_artifacts(artifacts) is not None
    except Exception:  # damaged: compile afresh
        loaded = False
    return f"loaded compile artifacts from {path}" if loaded else f"could not read {path}; compiling afresh"


def save_compile_artifacts(path, device):
    """Write this process's compile artifacts (FX graphs, AOTAutograd, autotuning) to `path`,
    after a header saying which torch and device made them."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    blob, _ = saved
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(COMPILE_CACHE_HEADER + json.dumps(compile_origin(device)).encode() + b"\n" + blob)
    tmp.replace(path)
    return True


# Inductor's on-disk cache outlives a run: which steps it holds graphs for, and how long each took to
# compile cold, is kept beside it in this file, so that the next run of the same step predicts a warm compile.
COMPILE_RECORD_FILE = "train_py_compiles.json"


def compile_key(args, device, mode, scope):
    """What decides a step's compiled graphs: torch, the device, the network and its input (classes, or captions'
    embeddings), the batch, the precision, the tokens routed, the loss's extra terms, the optimizer and how it is
    compiled."""
    shape = sizes.with_channels(getattr(args, "latent_size", None) or args.image_size, models.network_channels(vars(args)))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    text = getattr(args, "text_dim", None) and f"{args.text_dim}x{args.text_length}"
    return (f"torch {torch.__version__} | {name} | {args.model} {shape} | classes "
            f"{bool(args.class_conditional)} | captions {text or None} | batch {args.train_batch_size} | "
            f"{args.mixed_precision} | routing {args.token_routing or None} | loss terms {args.loss_terms or None} | "
            f"{args.optimizer} | {mode} {scope} | checkpointing {bool(args.gradient_checkpointing)}")  # fmt: skip


def compile_record_path():
    """The record in Inductor's cache folder (TORCHINDUCTOR_CACHE_DIR, or its default under /tmp)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / COMPILE_RECORD_FILE


def remembered_compile_s(key, path=None):
    """The cold compile seconds this machine recorded for `key`, or None (never compiled, or no record)."""
    try:
        return float(json.loads((path or compile_record_path()).read_text())[key])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remember_compile(key, seconds, path=None):
    """Record a compile of `key` (the first, cold one: a later, warm compile keeps the cold figure)."""
    path = path or compile_record_path()
    try:
        record = json.loads(path.read_text())
        record = record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        record = {}
    if key in record:
        return
    record[key] = round(seconds, 1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError:  # a read-only cache folder: the next run predicts a cold compile
        pass


def cache_hits_and_misses(before, after):
    """The FX-graph and AOTAutograd cache hits and misses between two compile_counters()."""
    hits = (after["fx_hits"] - before["fx_hits"]) + (after["aot_hits"] - before["aot_hits"])
    misses = (after["fx_misses"] - before["fx_misses"]) + (after["aot_misses"] - before["aot_misses"])
    return hits, misses


def describe_compile(seconds, before, after):
    """One line on the first compiled step: how long, and whether the caches served it."""
    hits, misses = cache_hits_and_misses(before, after)
    if hits and not misses:
        source = "served from the compile cache"
    elif hits:
        source = f"{hits} graph(s) from the compile cache, {misses} compiled; cached for the next run"
    else:
        source = "cached for the next run"
    return f"compiled the step in {seconds:.1f} s; {source}"


# The compile timers a ladder row's line shows where they ran, in the order a compile passes them: Inductor's import,
# Dynamo's trace of the forward (which holds the rest of it), AOTAutograd's joint graph, the backend's share,
# Inductor's lowering, fusion and code, the waits for kernels compiled by its workers (C++ files on a CPU), the
# backward's compile, and the GPU's kernel autotuning at the first run. The JSON keeps every timer.
COMPILE_PHASES_SHOWN = (
    "inductor_import", "_compile.compile_inner", "aot_trace_joint_graph", "OutputGraph.call_user_compiler",
    "GraphLowering.run", "Scheduler.__init__", "GraphLowering.codegen", "async_compile.wait",
    "PyCodeCache.load_by_key_path", "compile_file", "compile_fx.<locals>.bw_compiler",
    "CachingAutotuner.benchmark_all_configs",
)  # fmt: skip


def compile_phase_totals():
    """{phase: seconds so far}: torch's own timers of Dynamo, AOTAutograd and Inductor (dynamo_timed), summed; {} from
    a torch without them (a private table: the run must not depend on it)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    return {name: sum(times) for name, times in compilation_time_metrics.items()}


def compile_phases(before, after):
    """torch's compile timers between two `compile_phase_totals`, in seconds, longest first (nested: Dynamo's
    holds its backend's, and so on; summed over threads, so a timer of parallel work can pass the wall time);
    {} where nothing compiled."""
    spent = {name: after[name] - before.get(name, 0.0) for name in after}
    longest = sorted((item for item in spent.items() if item[1] >= 0.01), key=lambda item: -item[1])
    return {name: round(seconds, 2) for name, seconds in longest}


class FirstStepClock:
    """Times the first (compiling) step with the host clock, synchronized at both ends."""

    def __init__(self, device):
        self.device = device

    @contextlib.contextmanager
    def measure(self):
        self.counters_before, phases_before = compile_counters(), compile_phase_totals()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - t0
        self.after = compile_counters()
        self.phases = compile_phases(phases_before, compile_phase_totals())  # run.json's compile_phases_s
        self.line = describe_compile(self.seconds, self.counters_before, self.after)
        # some graph compiled afresh (a regional compile's repeated blocks hit the cache within a cold run)
        self.cold = cache_hits_and_misses(self.counters_before, self.after)[1] > 0
