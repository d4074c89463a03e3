"""The training step (step.py): the same arithmetic as the loop it replaced, the CUDA-graph
split, the rule that picks the compile mode, and the compile cache."""

import argparse
import copy
import math

import pytest
import torch

from ddpm_train.perf import compiling
from ddpm_train.data import batches
from ddpm_train.training import ema as posthoc_ema
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.training import optimizer as optimizers
from ddpm_train.training import step as steps
from ddpm_train.errors import ConfigError, RunError, error_line

CPU = torch.device("cpu")


def tiny_parts(seed=0, ema_kind="standard", fused=True):
    """A tiny UNet, its objective, AdamW, a warm-up schedule and an EMA: what train.py builds."""
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel

    torch.manual_seed(seed)
    unet = models.build_network("tiny", 16)
    objective = objectives.DDPMObjective(objectives.make_noise_scheduler())
    optimizer = optimizers.build("adamw", unet, fused, lr=1e-3, betas=(0.95, 0.999), weight_decay=1e-6, eps=1e-8)
    lr_scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=10)
    if ema_kind == "power":
        ema = posthoc_ema.PowerEMA(unet.parameters(), [0.05, 0.1])
    else:
        ema = EMAModel(unet.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=0.75, foreach=True)
    return unet, objective, optimizer, lr_scheduler, ema


def image_batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8, generator=g) for _ in range(n)]


def shadows(ema):
    return ema.shadows[0] if hasattr(ema, "shadows") else ema.shadow_params


def assert_same_change(after, reference, start, rel):
    """Two runs' weights changed alike: |(after - start) - (reference - start)| / |reference - start| < rel,
    over all tensors at once. On a GPU, element-wise checks fail by design: AdamW moves a weight by about
    its learning rate whatever its gradient's size, so a gradient near zero that rounds to the other sign
    in another kernel (Inductor's fusions, cuDNN's choice, TF32) moves that weight the other way
    (the first GPU run, BENCHMARKS.md). A wrong step (a learning rate 10% off, a
    skipped update) moves the whole vector and fails."""
    change = torch.cat([(a - s).detach().flatten().double() for a, s in zip(after, start)])
    wanted = torch.cat([(r - s).detach().flatten().double() for r, s in zip(reference, start)])
    error = ((change - wanted).norm() / wanted.norm()).item()
    assert error < rel, f"relative difference of the weights' change {error:.2e} (allowed {rel:.0e})"


def the_old_loop(images_per_step, seed=0):
    """The body of train.py's loop before the step function (commit 2a757ba), without accelerate."""
    unet, objective, optimizer, lr_scheduler, ema = tiny_parts(seed)
    guard = steps.NonFiniteGuard(optimizer, "skip", CPU)
    alphas_cumprod = objectives.make_noise_scheduler().alphas_cumprod
    torch.manual_seed(123)
    losses = []
    for step, images in enumerate(images_per_step, 1):
        clean = batches.to_model_input(images, True)
        noise = torch.randn_like(clean)
        timesteps = torch.randint(0, 1000, (clean.shape[0],))
        loss = objectives.ddpm_loss(unet, clean, noise, timesteps, alphas_cumprod, "epsilon")
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        guard.check(loss, grad_norm, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        lr_scheduler.step()
        ema.step(unet.parameters())
    return unet, ema, losses


def test_the_step_gives_the_loss_weights_and_ema_of_the_loop_it_replaced():
    images = image_batches(3)
    old_unet, old_ema, old_losses = the_old_loop(images)

    unet, objective, optimizer, lr_scheduler, ema = tiny_parts()
    guard = steps.NonFiniteGuard(optimizer, "skip", CPU)
    step = steps.TrainStep(unet, unet, objective, optimizer, lr_scheduler, ema, guard, 1.0, True)
    phases = []
    step.mark = phases.append
    torch.manual_seed(123)
    losses = [step([b], i + 1)[0]["loss"] for i, b in enumerate(images)]

    assert torch.equal(torch.stack(losses), torch.stack(old_losses))
    for a, b in zip(unet.parameters(), old_unet.parameters()):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(shadows(ema), shadows(old_ema)))
    assert phases[:4] == ["forward", "backward", "optimizer", "ema"]
    assert guard.count() == 0

    without_ema = steps.TrainStep(unet, unet, objective, optimizer, lr_scheduler, None, guard, 1.0, True)
    phases.clear()
    without_ema.mark = phases.append
    without_ema([images[0]], 4)
    assert phases == ["forward", "backward", "optimizer"]  # no ema part in "where the time went"


def test_a_non_finite_step_is_skipped_inside_the_fused_optimizer():
    unet, objective, optimizer, lr_scheduler, ema = tiny_parts()
    guard = steps.NonFiniteGuard(optimizer, "skip", CPU)
    assert guard.on_device
    step = steps.TrainStep(unet, unet, objective, optimizer, lr_scheduler, ema, guard, 1.0, True)
    step(image_batches(1))
    before = [p.detach().clone() for p in unet.parameters()]
    objective.alphas_cumprod[:] = float("nan")  # every loss is now NaN
    loss = step(image_batches(1, seed=2))[0]["loss"]
    assert not torch.isfinite(loss)
    assert guard.count() == 1
    assert all(torch.equal(a, b) for a, b in zip(unet.parameters(), before))


@pytest.mark.parametrize("ema_kind", ["standard", "power"])
def test_the_graph_split_trains_as_the_plain_step(ema_kind):
    """StepGraph without a GPU runs the host part and the device part (tensor learning
    rate, EMA decay written into a tensor) exactly as it would around a graph replay."""
    images = image_batches(5)
    results = []
    for graphed in (False, True):
        unet, objective, optimizer, lr_scheduler, ema = tiny_parts(ema_kind=ema_kind)
        start = [p.detach().clone() for p in unet.parameters()] + [s.clone() for s in shadows(ema)]
        step = steps.TrainStep(unet, unet, objective, optimizer, lr_scheduler, ema, None, 1.0, True)
        if graphed:
            step = compiling.StepGraph(step, warmup_steps=2, capture=False)
        torch.manual_seed(123)
        losses = torch.stack([step([b])[0]["loss"] for b in images])
        results.append((losses, [p.detach().clone() for p in unet.parameters()], [s.clone() for s in shadows(ema)],
                        lr_scheduler.get_last_lr()[0], ema.optimization_step))  # fmt: skip
    (l0, p0, s0, lr0, t0), (l1, p1, s1, lr1, t1) = results
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)  # the graph reads it from the device
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert_same_change(p1 + s1, p0 + s0, start, rel=1e-4)  # tensor and float learning rates round apart
    assert float(lr1) == pytest.approx(lr0) and t1 == t0 == 5


def test_eager_graph_runs_the_uncompiled_network_in_the_graph_split_and_falls_back_to_eager(monkeypatch):
    """--compile_mode eager-graph: StepGraph around the network itself (nothing compiled), training as the eager
    step; a capture that raises (its 4th call, after 3 warm-up steps) falls back to eager from the same state."""
    images = image_batches(6)
    results = []
    for mode, fail in ((None, False), ("eager-graph", False), ("eager-graph", True)):
        unet, objective, optimizer, lr_scheduler, ema = tiny_parts()
        said = []
        fast = compiling.FastStep(steps.TrainStep(unet, unet, objective, optimizer, lr_scheduler, ema, None, 1.0, True),
                              mode, CPU, say=said.append)  # fmt: skip
        if mode:
            assert isinstance(fast.current, compiling.StepGraph) and fast.current.step.net is unet
        if fail:
            def capture(micro_batches):
                torch.randn(100)
                raise RuntimeError("operation not permitted when stream is capturing")

            monkeypatch.setattr(fast.current, "_prepare", capture)
        torch.manual_seed(123)
        losses = torch.stack([fast([b])[0]["loss"] for b in images])
        results.append((losses, [p.detach().clone() for p in unet.parameters()], fast.mode, said))
    (l0, p0, _, _), (l1, p1, mode1, said1), (l2, p2, mode2, said2) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert_same_change(p1, p0, [p.detach() for p in tiny_parts()[0].parameters()], rel=1e-4)
    assert mode1 == "eager-graph" and not said1
    assert torch.equal(l2, l0) and all(torch.equal(a, b) for a, b in zip(p2, p0))
    assert mode2 is None and said2 == ["--compile_mode eager-graph failed (RuntimeError: operation not permitted when "
                                       "stream is capturing); falling back to eager"]  # fmt: skip


def test_a_batch_that_does_not_fit_the_graphs_buffers_is_a_run_error():
    """After the warm-up the step's shapes are fixed: a smaller batch is one line naming the shapes."""
    unet, objective, optimizer, lr_scheduler, ema = tiny_parts()
    step = compiling.StepGraph(steps.TrainStep(unet, unet, objective, optimizer, lr_scheduler, ema, None, 1.0, True),
                           warmup_steps=1, capture=False)  # fmt: skip
    for b in image_batches(2):  # the warm-up, then the step that makes the static buffers
        step([b])
    with pytest.raises(RunError) as e:
        step([image_batches(1)[0][:3]])
    assert "(4, 3, 16, 16)" in str(e.value) and "(3, 3, 16, 16)" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_the_captured_step_trains_as_the_eager_step_on_a_gpu():
    cuda = torch.device("cuda")
    images = [b.to(cuda) for b in image_batches(6)]
    results = []
    for capture in (False, True):
        unet, objective, optimizer, lr_scheduler, ema = tiny_parts()
        unet.to(cuda), objective.to(cuda), ema.to(cuda)
        start = [p.detach().clone() for p in unet.parameters()]
        optimizer = optimizers.build("adamw", unet, True, lr=1e-3, betas=(0.95, 0.999), weight_decay=1e-6, eps=1e-8)
        lr_scheduler = type(lr_scheduler)(optimizer, lr_scheduler.lr_lambdas[0])
        guard = steps.NonFiniteGuard(optimizer, "skip", cuda)
        step = compiling.StepGraph(steps.TrainStep(unet, unet, objective, optimizer, lr_scheduler, ema, guard, 1.0, True),
                               warmup_steps=2, capture=capture)  # fmt: skip
        torch.manual_seed(123)
        losses = torch.stack([step([b])[0]["loss"] for b in images])
        assert (step.graph is not None) == capture
        results.append((losses, [p.detach().clone() for p in unet.parameters()], guard.count()))
    (l0, p0, g0), (l1, p1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-5)
    assert_same_change(p1, p0, start, rel=1e-3)  # fp32 weights, TF32 convolutions
    assert g0 == g1 == 0


def flags(**changes):
    """What choose_compile_mode reads of a resolved configuration (fused_adam: a config.SETTINGS)."""
    base = dict(compile_mode="auto", gradient_accumulation_steps=1, mixed_precision="bf16", on_fault="skip",
                fused_adam=True)  # fmt: skip
    return argparse.Namespace(**(base | changes))


CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    "args, device, processes, tflop, mode, words",
    [
        (flags(), CUDA, 1, 1.47 / 32 * 32, "reduce-overhead", "bound by kernel launches"),  # adm64, batch 32
        (flags(), CUDA, 1, 4.78, "reduce-overhead", "bound by kernel launches"),  # ddpm32, batch 128
        (flags(), CUDA, 1, 23.83, "default", "keeps the GPU busy"),  # ref128, batch 64
        (flags(), CUDA, 2, 1.47, "default", "2 processes"),
        (flags(gradient_accumulation_steps=2), CUDA, 1, 1.47, "default", "accumulation"),
        (flags(mixed_precision="fp16"), CUDA, 1, 1.47, "default", "fp16"),
        (flags(on_fault="stop"), CUDA, 1, 1.47, "default", "--on_fault stop"),
        (flags(), CPU, 1, 0.001, "default", "need a CUDA GPU"),
        (flags(compile_mode="off"), CUDA, 1, 1.47, None, "eager (--compile_mode off)"),
        (flags(compile_mode="max-autotune-no-cudagraphs"), CUDA, 1, 1.47, "max-autotune-no-cudagraphs", "--compile_mode"),
        (flags(compile_mode="step-graph"), CUDA, 1, 1.47, "step-graph", "--compile_mode step-graph"),
    ],
)
def test_auto_picks_cuda_graphs_only_for_launch_bound_steps_that_can_be_captured(args, device, processes, tflop, mode, words):
    chosen, why = compiling.choose_compile_mode(args, device, processes, tflop * 1e12)
    assert chosen == mode and words in why


def test_asking_for_cuda_graphs_where_they_cannot_be_captured_is_a_config_error():
    with pytest.raises(ConfigError, match="--compile_mode reduce-overhead cannot capture CUDA graphs here: 2 processes"):
        compiling.choose_compile_mode(flags(compile_mode="reduce-overhead"), CUDA, 2, 1e12)
    with pytest.raises(ConfigError, match="need a CUDA GPU"):
        compiling.choose_compile_mode(flags(compile_mode="step-graph"), CPU, 1, 1e12)


class SmallNet(torch.nn.Module):
    """Conv, GroupNorm, SiLU, conv: a network small enough to compile in seconds, with UNet2DModel's call."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(4, 8), torch.nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x, t, return_dict=False):
        h = torch.nn.functional.silu(self.norm(self.a(x))) * (1 + t.float().view(-1, 1, 1, 1) / 1000)
        return (self.b(h),)


@pytest.mark.slow
def test_the_compiled_step_matches_the_eager_one_and_a_second_compile_comes_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.compiler.reset()
    images = image_batches(2)
    runs = []
    for mode in (None, "default", "default"):
        torch.manual_seed(0)
        net = SmallNet()
        objective = objectives.DDPMObjective(objectives.make_noise_scheduler())
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        step = steps.TrainStep(compiling.compile_network(net, mode), net, objective, optimizer, lr_scheduler, None, None, 1.0, True)
        clock = compiling.FirstStepClock(CPU)
        torch.manual_seed(1)
        with clock.measure():
            first = step([images[0]])[0]["loss"]
        losses = [first, step([images[1]])[0]["loss"]]
        runs.append((torch.stack(losses), [p.detach().clone() for p in net.parameters()], clock))
        torch.compiler.reset()  # forget the compiled code in memory: only the disk cache remains

    (eager_losses, eager_weights, _), (losses, weights, first_compile), (_, _, second_compile) = runs
    torch.testing.assert_close(losses, eager_losses, rtol=1e-4, atol=1e-5)
    for a, b in zip(weights, eager_weights):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    compiled = lambda clock, kind: clock.after[kind] - clock.counters_before[kind]  # noqa: E731
    assert compiled(first_compile, "fx_misses") > 0 and compiled(first_compile, "fx_hits") == 0
    assert compiled(second_compile, "fx_hits") > 0 and compiled(second_compile, "fx_misses") == 0
    assert "cached for the next run" in first_compile.line
    assert "served from the compile cache" in second_compile.line
    assert first_compile.cold and not second_compile.cold  # only a cold compile's seconds are remembered


@pytest.mark.slow
def test_compile_artifacts_are_saved_and_loaded_only_where_they_can_hit(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.compiler.reset()
    net = torch.compile(torch.nn.Linear(4, 4), dynamic=False)
    net(torch.randn(2, 4)).sum().backward()
    path = tmp_path / "compile_cache.bin"
    assert compiling.save_compile_artifacts(path, CPU) and path.stat().st_size > 0
    assert compiling.load_compile_artifacts(path, CPU) == f"loaded compile artifacts from {path}"
    assert compiling.load_compile_artifacts(tmp_path / "missing.bin", CPU) is None
    # another torch version (or GPU) made it: its keys cannot hit here, so it is not "loaded"
    monkeypatch.setattr(torch, "__version__", "2.0.0")
    line = compiling.load_compile_artifacts(path, CPU)
    assert line.startswith(f"not using {path}: it is from torch ") and "this is torch 2.0.0 on cpu; compiling afresh" in line
    (tmp_path / "garbage.bin").write_bytes(b"not a cache")
    assert "unknown origin" in compiling.load_compile_artifacts(tmp_path / "garbage.bin", CPU)
    torch.compiler.reset()


def test_graph_skips_are_read_with_their_reasons():
    """Inductor's skip is off-by-default logging plus a counter: GraphSkips reads both."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    skips = compiling.GraphSkips()
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)")
    counters["inductor"]["cudagraph_skips"] += 1  # what Inductor does for a graph on a CPU device: no message
    assert skips.close() == ["skipping cudagraphs due to mutated inputs (1 instances)", "reason not logged"]
    assert compiling.GraphSkips().close() == []


def test_a_failing_mode_falls_back_to_the_next_from_the_same_state(monkeypatch):
    """A mode whose calls raise in its trial falls back; the state it touched is put back."""
    images = image_batches(3)
    results = []
    for fail in (False, True):
        unet, objective, optimizer, lr_scheduler, ema = tiny_parts()
        said = []
        fast = compiling.FastStep(steps.TrainStep(unet, unet, objective, optimizer, lr_scheduler, ema, None, 1.0, True),
                              None, CPU, say=said.append)  # fmt: skip
        if fail:  # as if eager were a compiled mode whose second call fails half-way (after the noise is drawn)
            fast.mode, fast.trial_calls = "reduce-overhead", 3
            real = fast.current.descend

            def descend(micro_batches, step_number=None):
                if fast.calls == 1 and fast.mode == "reduce-overhead":
                    torch.randn(100)
                    ema.optimization_step += 7
                    raise RuntimeError("capture failed\nmore detail")
                return real(micro_batches, step_number)

            monkeypatch.setattr(fast.current, "descend", descend)
            monkeypatch.setattr(compiling, "compile_network", lambda model, mode, scope="whole": model)  # 'default' is eager here
        torch.manual_seed(123)
        losses = torch.stack([fast([b])[0]["loss"] for b in images])
        results.append((losses, [p.detach().clone() for p in unet.parameters()], [s.clone() for s in shadows(ema)]))
    (l0, p0, s0), (l1, p1, s1) = results
    assert torch.equal(l1, l0)
    assert all(torch.equal(a, b) for a, b in zip(p1 + s1, p0 + s0))
    assert said == ["--compile_mode reduce-overhead failed (RuntimeError: capture failed); falling back to default"]
    assert fast.fallbacks == [dict(mode="reduce-overhead", error="RuntimeError: capture failed", fell_back_to="default")]
    assert fast.mode == "default" and ema.optimization_step == 3


@pytest.mark.parametrize("processes", [1, 2])
def test_with_several_processes_a_failing_mode_is_a_run_error_not_a_fallback(monkeypatch, processes):
    """One process may not fall back alone: the others would train in another mode (or hang in
    collectives it no longer makes). With one, the compile that raises falls back to eager."""

    def compile_network(model, mode, scope="whole"):  # every compiled mode raises in its first call
        def net(*args, **kwargs):
            if mode is not None:
                raise RuntimeError("inductor failed\nmore detail")
            return model(*args, **kwargs)

        return net

    monkeypatch.setattr(compiling, "compile_network", compile_network)
    unet, objective, optimizer, lr_scheduler, ema = tiny_parts()
    step = steps.TrainStep(unet, unet, objective, optimizer, lr_scheduler, ema, None, 1.0, True)
    said = []
    fast = compiling.FastStep(step, "default", CPU, say=said.append, num_processes=processes)
    if processes == 1:
        assert torch.isfinite(fast(image_batches(1))[0]["loss"])
        assert fast.mode is None and said == ["--compile_mode default failed (RuntimeError: inductor failed); falling back to eager"]
        return
    with pytest.raises(RunError) as e:
        fast(image_batches(1))
    assert str(e.value) == ("--compile_mode default failed (RuntimeError: inductor failed); with 2 processes one cannot "
                            "fall back alone: rerun with --compile_mode off")  # fmt: skip
    assert not said and not fast.fallbacks
    step.accelerator = argparse.Namespace(num_processes=2)  # what train.py passes: accelerate's count
    assert compiling.FastStep(step, "default", CPU).num_processes == 2


def test_the_bottom_of_an_error_chain_is_named():
    try:
        try:
            raise ValueError("the real reason\nline two")
        except ValueError as e:
            raise RuntimeError("backend='inductor' raised:") from e
    except RuntimeError as e:
        assert error_line(e) == "ValueError: the real reason"


def test_inductor_settings_turn_loop_reindexing_off_only_without_the_coalescing_guard(monkeypatch):
    from torch._inductor import config
    from torch._inductor import scheduler

    # monkeypatch restores every config value and class this test changes
    monkeypatch.setattr(config, "force_layout_optimization", False)
    monkeypatch.delenv("TORCHINDUCTOR_LOOP_REINDEXING_AFTER_FUSION", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_FORCE_LAYOUT_OPT", raising=False)
    if hasattr(config, "loop_reindexing_after_fusion"):  # torch 2.11 (the GPU image's) has neither it nor the guard
        monkeypatch.setattr(config, "loop_reindexing_after_fusion", True)
        compiling.inductor_settings()  # this torch has the guard (pytorch PR #191134): left on
        assert hasattr(scheduler.Scheduler, "_reindexing_regresses_memory_coalescing")
        assert config.loop_reindexing_after_fusion and not config.force_layout_optimization

        class WithoutTheGuard:  # a torch with the reindexing but not the guard
            pass

        monkeypatch.setattr(scheduler, "Scheduler", WithoutTheGuard)
        monkeypatch.setenv("TORCHINDUCTOR_LOOP_REINDEXING_AFTER_FUSION", "1")
        compiling.inductor_settings()  # the user chose: left alone
        assert config.loop_reindexing_after_fusion
        monkeypatch.delenv("TORCHINDUCTOR_LOOP_REINDEXING_AFTER_FUSION")
        compiling.inductor_settings()
        assert config.loop_reindexing_after_fusion is False
    else:
        compiling.inductor_settings()  # nothing to turn off, and no error
        assert not hasattr(config, "loop_reindexing_after_fusion")

    compiling.inductor_settings(force_layout=True)
    assert config.force_layout_optimization is True
    compiling.inductor_settings()  # process-wide: the next compile without it turns it off again
    assert config.force_layout_optimization is False


def test_with_several_processes_the_objectives_own_gradients_are_averaged():
    """EDM's u(sigma) head is outside the DDP wrapper: the step all-reduces its gradients itself."""
    import contextlib

    class TwoProcesses:  # the parts of accelerate's Accelerator the step uses
        num_processes, sync_gradients = 2, True
        reduced = []

        def accumulate(self, model):
            return contextlib.nullcontext()

        def backward(self, loss):
            loss.backward()

        def clip_grad_norm_(self, parameters, max_norm):
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

        def reduce(self, tensor, reduction):
            self.reduced.append((tensor.shape, reduction))
            return tensor

    torch.manual_seed(0)
    unet = models.build_network("tiny", 16)
    objective = objectives.EDMObjective(logvar_channels=8)
    optimizer = torch.optim.AdamW([*unet.parameters(), *objective.parameters()], lr=1e-3)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accelerator = TwoProcesses()
    step = steps.TrainStep(unet, unet, objective, optimizer, lr_scheduler, None, None, 1.0, True, accelerator=accelerator)
    step(image_batches(1))
    assert accelerator.reduced == [(p.shape, "mean") for p in objective.parameters()]  # the head's, not the network's


# --- regional compilation and whether a compile pays ------------------------------------


def trace_only(monkeypatch):
    """step.py's torch.compile with Dynamo's eager backend: the graphs are traced and cached as Inductor's
    would be, in a second rather than minutes, and they compute exactly what the network does."""
    real = torch.compile
    monkeypatch.setattr(steps.torch, "compile", lambda fn, mode=None, dynamic=None: real(fn, backend="eager", dynamic=dynamic))
    torch.compiler.reset()


def graphs_made():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_compile_workers_start_early_on_a_gpu_whose_step_may_compile_and_not_elsewhere(monkeypatch):
    """On a CUDA device whose step compiles, Inductor's compile workers are started at once (torch's
    maybe_warm_pool); not on a CPU, whose kernels are C++, and not for an eager step."""
    import torch._inductor.async_compile as async_compile

    started = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: started.append(True))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compiling.start_compile_workers(cuda, "auto") and compiling.start_compile_workers(cuda, "default")
    assert len(started) == 2
    assert not compiling.start_compile_workers(cpu, "default") and not compiling.start_compile_workers(cuda, "eager")
    assert not compiling.start_compile_workers(cuda, "off") and not compiling.start_compile_workers(cuda, "eager-graph")
    assert len(started) == 2

    def cannot_start():
        raise OSError("[Errno 11] Resource temporarily unavailable")

    monkeypatch.setattr(async_compile, "maybe_warm_pool", cannot_start)  # the run goes on: the compile's fallback decides
    assert not compiling.start_compile_workers(cuda, "default")


def test_the_compile_timers_are_read_where_torch_has_them_and_nothing_breaks_where_it_has_not(monkeypatch):
    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setitem(dynamo_utils.compilation_time_metrics, "a test's timer", [1.0, 0.5])
    before = compiling.compile_phase_totals()
    assert before["a test's timer"] == 1.5
    dynamo_utils.compilation_time_metrics["a test's timer"].append(0.25)
    assert compiling.compile_phases(before, compiling.compile_phase_totals()) == {"a test's timer": 0.25}
    monkeypatch.delattr(dynamo_utils, "compilation_time_metrics")  # a torch without the table: the clock still runs
    assert compiling.compile_phase_totals() == {}


def test_regional_compilation_traces_a_repeated_block_once_and_leaves_sampling_eager(monkeypatch):
    from ddpm_train.networks import dit

    trace_only(monkeypatch)
    torch.manual_seed(0)
    net = dit.DiT(num_layers=4, num_attention_heads=2, attention_head_dim=8, in_channels=4, sample_size=8, patch_size=2)
    same = copy.deepcopy(net)
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([3, 500])
    before = graphs_made()
    regional = compiling.compile_network(net, "default", scope="regional")
    regional(x, t).sample.square().mean().backward()
    # 4 blocks, 1 graph: the first block's input, a strided view from the patch embedding, is made dense first
    assert len(regional.blocks) == 4 and graphs_made() - before == 1
    same(x, t).sample.square().mean().backward()
    for a, b in zip(net.parameters(), same.parameters()):
        assert torch.equal(a.grad, b.grad)
    # outside the step's call the blocks are plain modules: a grid sampled at another batch compiles nothing
    assert all(block._compiled_call_impl is None for block in regional.blocks)
    made = graphs_made()
    with torch.no_grad():
        net.eval()(torch.randn(3, 4, 8, 8), t[:1])
    assert graphs_made() == made


def test_regional_compilation_keeps_a_graph_for_each_of_a_unets_block_shapes(monkeypatch):
    trace_only(monkeypatch)
    torch.manual_seed(0)
    net = models.build_network("small", 32)
    before = graphs_made()
    compiling.compile_network(net, "default", scope="regional")(torch.randn(1, 3, 32, 32), torch.tensor([3])).sample.sum().backward()
    assert graphs_made() - before == 11  # 9 of them ResNet blocks': above Dynamo's default limit of 8 for one function
    with pytest.raises(ConfigError, match="declares no repeated blocks"):
        compiling.compile_network(SmallNet(), "default", scope="regional")


def plan_flags(**changes):
    base = dict(model="dit-xl2", gradient_checkpointing=False, compile_scope=None)
    return flags(**(base | changes))


H100_BF16 = 989.4e12


@pytest.mark.parametrize(
    "changes, total_steps, peak, warm_s, mode, words",
    [
        # DiT-XL/2 at batch 64 (45.56 TFLOP): 120 steps save ~7 s, less than a cold compile
        ({}, 120, H100_BF16, None, None, "auto: eager: compiling (default, each repeated block once) would take about 14 s (cold cache)"),
        # regional's head start (85 - 14 s, an H100's) against its slower step (3% of ~128 ms) decides the scope
        ({}, 5_000, H100_BF16, None, "default", "each repeated block compiled once (71 s sooner than the whole network, whose faster step would repay that after 18,593 steps)"),
        ({}, 100_000, H100_BF16, None, "default", "whole network (its faster step repays its 71 s longer compile after 18,593 of this run's 100,000 steps)"),
        ({}, 120, None, None, "default", "; whole network"),  # no peak known: nothing predicts the step or its saving
        ({}, 600, H100_BF16, 85.0, "default", "compile about 9 s (warm cache)"),  # the same 600 steps would not pay cold
        ({"compile_mode": "default"}, 10, H100_BF16, None, "default", "--compile_mode default"),  # asked for: compiled
        ({"compile_mode": "off"}, 10**6, H100_BF16, None, None, "eager (--compile_mode off)"),
        ({"gradient_checkpointing": True}, 10**6, H100_BF16, None, "default", "whole network (gradient checkpointing"),
        ({"compile_scope": "whole"}, 10**6, H100_BF16, None, "default", "whole (compile_scope whole)"),
        ({"compile_mode": "reduce-overhead"}, 10, H100_BF16, None, "reduce-overhead", "whole network (its CUDA graphs replay"),
    ],
)
def test_auto_compiles_only_where_the_run_repays_the_compile(changes, total_steps, peak, warm_s, mode, words):
    plan = compiling.plan_compile(plan_flags(**changes), CUDA, 1, 45.56e12, total_steps, peak, lambda mode, scope: warm_s)
    assert plan.mode == mode and words in plan.why, plan.why
    if mode is None and "auto" in plan.why:  # the line gives both numbers
        assert "more than it saves in this run's 120 steps (about 7 s, 59.9 ms a step)" in plan.why


DDPM32_TFLOP = 4.78e12  # the GPU bare run's step: ddpm32 at batch 128


@pytest.mark.parametrize(
    "changes, processes, total_steps, mode, words",
    [
        # the GPU bare run: 3,072 steps; the eager step captured ends it before a 100 s compile would repay itself
        ({}, 1, 3_072, "eager-graph", "auto: eager-graph (the eager step captured in one CUDA graph, about 144 s for "
         "this run's 3,072 steps against 161 s compiled and 307 s eager): compiling (reduce-overhead, the whole "
         "network) would take about 100 s (cold cache)"),
        ({}, 1, 100_000, "reduce-overhead", "saves about 8000 s in 100,000 steps"),  # a long run repays the compile
        ({}, 2, 3_072, "default", "2 processes"),  # nothing can be captured: compiled, as before
        ({"compile_mode": "eager-graph"}, 1, 100_000, "eager-graph", "--compile_mode eager-graph"),  # asked for
    ],
)
def test_auto_captures_the_eager_step_where_compiling_would_not_repay_itself(changes, processes, total_steps, mode, words):
    plan = compiling.plan_compile(plan_flags(model="ddpm32", **changes), CUDA, processes, DDPM32_TFLOP, total_steps, H100_BF16,
                              lambda mode, scope: None)  # fmt: skip
    assert plan.mode == mode and words in plan.why, plan.why
    assert plan.scope == "whole"


def test_the_bare_run_captures_on_an_h100_and_compiles_on_a_slower_gpu():
    """On an A100 (312 TFLOP/s bf16) the eager kernels of the bare run's step take three times an H100's: the compile
    repays itself within its 3,072 steps, as README says."""
    for peak, mode in ((H100_BF16, "eager-graph"), (312e12, "reduce-overhead")):
        plan = compiling.plan_compile(plan_flags(model="ddpm32"), CUDA, 1, DDPM32_TFLOP, 3_072, peak, lambda mode, scope: None)
        assert plan.mode == mode, plan.why


def test_a_unets_step_on_a_gpu_compiles_its_whole_network_however_short_the_run():
    """On an H100 ddpm32's regional compile was no sooner than its whole one, and its step slower: the prediction
    for a short run weighs the whole network's compile (a CPU's regional compile is still the sooner)."""
    for n, mode in ((100, None), (5_000, "default")):
        plan = compiling.plan_compile(plan_flags(model="ref128"), CUDA, 1, 45.56e12, n, H100_BF16, lambda mode, scope: None)
        assert plan.mode == mode and plan.scope == "whole", plan
    assert "compiling (default, the whole network) would take about 100 s" in compiling.plan_compile(
        plan_flags(model="ref128"), CUDA, 1, 45.56e12, 100, H100_BF16, lambda mode, scope: None).why
    assert models.UNET_COSTS.cold_compile_s[("cpu", "regional")] < models.UNET_COSTS.cold_compile_s[("cpu", "whole")]


def test_a_compiles_seconds_are_remembered_once_per_step_and_a_damaged_record_is_none(tmp_path):
    record = tmp_path / "cache" / compiling.COMPILE_RECORD_FILE
    assert compiling.remembered_compile_s("a", record) is None
    compiling.remember_compile("a", 84.71, record)
    compiling.remember_compile("a", 9.0, record)  # a warm compile later: the cold figure stays
    compiling.remember_compile("b", 30.0, record)
    assert compiling.remembered_compile_s("a", record) == 84.7 and compiling.remembered_compile_s("b", record) == 30.0
    record.write_text("{not json")
    assert compiling.remembered_compile_s("a", record) is None
    compiling.remember_compile("c", 5.0, record)  # a damaged record is started again
    assert compiling.remembered_compile_s("c", record) == 5.0


def test_every_network_family_has_its_compile_costs_in_one_record():
    """A family's compile costs live in its entry (model.Family.compile_costs), each a whole CompileCosts record:
    a family without one would fail the compile plan of every GPU run."""
    for costs in (kind.compile_costs for kind in models.FAMILIES.values()):
        assert isinstance(costs, models.CompileCosts)
        assert set(costs.cold_compile_s) == {(d, s) for d in ("cuda", "cpu") for s in ("whole", "regional")}
        assert set(costs.regional_step_cost) == {"cuda", "cpu"} and min(costs.regional_step_cost.values()) > 0
