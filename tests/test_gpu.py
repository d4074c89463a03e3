"""The GPU paths as train.py wires them: the whole-step CUDA graph around the compiled
network under accelerate's bf16 autocast, a NaN under capture, a step-graph run resumed,
and torch.compile's CUDA graphs through main with skips made errors. They skip without a GPU."""

import json
import shutil

import pytest
import torch

from ddpm_train.perf import compiling
from ddpm_train.diffusion import loss_terms
from ddpm_train.networks import model as models
from ddpm_train.diffusion import objectives
from ddpm_train.training import step as steps
from test_step import assert_same_change, batches, shadows, tiny_parts
from test_train import run, tensors_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def wired_step(mode, nan_scale=None, objective_of=None):
    """tiny_parts on the GPU, prepared by accelerate (bf16) and built as train.py builds the step; `objective_of`:
    the objective built from the network instead of tiny_parts' DDPM."""
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16")
    unet, objective, optimizer, lr_scheduler, ema = tiny_parts()
    objective = objective_of(unet) if objective_of else objective
    objective.to(CUDA)
    model, optimizer = accelerator.prepare(unet, optimizer)
    ema.to(CUDA)
    if nan_scale is not None:  # the loss times a device scalar: a NaN written there makes that step's loss NaN
        terms = objective.terms
        objective.terms = lambda net, x0: {name: term * nan_scale for name, term in terms(net, x0).items()}
    guard = steps.NonFiniteGuard(optimizer, "skip", CUDA)
    step = steps.TrainStep(model, model, objective, optimizer, lr_scheduler, ema, guard, 1.0, True, accelerator=accelerator)
    return compiling.FastStep(step, mode, CUDA), unet, ema, guard


@pytest.mark.parametrize("graph_mode", ["step-graph", "eager-graph"])
def test_the_captured_bf16_step_compiled_or_not_trains_as_the_eager_one(graph_mode):
    images = [b.to(CUDA) for b in batches(6)]
    results = []
    for mode in (None, graph_mode):
        fast, unet, ema, guard = wired_step(mode)
        start = [p.detach().clone() for p in unet.parameters()]
        torch.manual_seed(123)
        losses = torch.stack([fast([b], i + 1)[0]["loss"] for i, b in enumerate(images)])
        assert fast.mode == mode and not fast.fallbacks
        results.append((losses, [p.detach().clone() for p in unet.parameters()], [s.clone() for s in shadows(ema)],
                        guard.count()))  # fmt: skip
    (l0, p0, s0, g0), (l1, p1, s1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=2e-2, atol=2e-3)  # bf16, and Inductor's fusions round apart
    assert_same_change(p1, p0, start, rel=5e-2)
    assert_same_change(s1, s0, start, rel=5e-2)  # the EMA starts at the weights
    assert g0 == g1 == 0


def assert_terms_train_alike_captured(graph_mode, objective_of, varying):
    """Six steps of wired_step(objective_of) eager and under `graph_mode`: each term of the loss and the weights
    follow the eager step's, and the term `varying` differs from replay to replay (computed anew each time)."""
    images = [b.to(CUDA) for b in batches(6)]
    results = []
    for mode in (None, graph_mode):
        fast, unet, ema, guard = wired_step(mode, objective_of=objective_of)
        start = [p.detach().clone() for p in unet.parameters()]
        torch.manual_seed(123)
        losses = [fast([b], i + 1)[0] for i, b in enumerate(images)]
        assert fast.mode == mode and not fast.fallbacks
        results.append(({name: torch.stack([l[name] for l in losses]) for name in losses[0]},
                        [p.detach().clone() for p in unet.parameters()]))  # fmt: skip
    (t0, p0), (t1, p1) = results
    assert len(set(t1[varying].tolist())) > 1
    assert list(t1) == list(t0)
    for name in t0:
        torch.testing.assert_close(t1[name], t0[name], rtol=2e-2, atol=2e-3, msg=name)
    assert_same_change(p1, p0, start, rel=5e-2)


@pytest.mark.parametrize("graph_mode", ["step-graph", "eager-graph"])
def test_a_term_on_a_blocks_output_trains_alike_under_a_cuda_graph(graph_mode):
    """models.BlockOutputs under a captured step: the middle block's term (test_block_outputs) replays with the
    rest of the step, and the loss, the term and the weights follow the eager step's."""
    from test_block_outputs import WithMiddleBlock

    assert_terms_train_alike_captured(graph_mode, WithMiddleBlock, "middle")


@pytest.mark.parametrize("graph_mode", ["step-graph", "eager-graph"])
def test_the_loss_terms_train_alike_under_a_cuda_graph(graph_mode):
    """--loss_terms under a captured step (loss_terms.py): flow with dispersive on the mid-block, ΔFM and the
    immiscible coupling (argmin and gather on the device) replay with the step, and the loss, each term and the
    weights follow the eager step's."""

    def objective_of(unet):
        terms = loss_terms.parse("dispersive:0.25,deltafm:0.05,immiscible:8")
        return loss_terms.attach(objectives.FlowObjective(), unet, models.FAMILIES["unet"], terms)

    assert_terms_train_alike_captured(graph_mode, objective_of, "dispersive")


def test_a_nan_under_capture_leaves_the_weights_as_they_were():
    scale = torch.ones((), device=CUDA)
    fast, unet, ema, guard = wired_step("step-graph", nan_scale=scale)
    images = [b.to(CUDA) for b in batches(7)]
    for i, b in enumerate(images[:5]):  # 3 warm-up steps, the capture, one replay
        fast([b], i + 1)
    assert fast.current.graph is not None
    before = [p.detach().clone() for p in unet.parameters()]
    scale.fill_(float("nan"))
    loss = fast([images[5]], 6)[0]["loss"]
    assert not torch.isfinite(loss)
    assert all(torch.equal(a, b) for a, b in zip(unet.parameters(), before))
    assert guard.count() == 1
    scale.fill_(1.0)
    fast([images[6]], 7)
    assert not all(torch.equal(a, b) for a, b in zip(unet.parameters(), before))  # the next step trains again


@pytest.mark.parametrize("release", [True, False])
def test_the_capture_keeps_no_second_copy_of_the_warm_ups_memory(monkeypatch, release):
    """StepGraph's warm-up runs on a side stream; the activations it frees stay in the allocator's
    cache, and the capture allocates the graph's private pool, about as large, beside them unless
    the cache is emptied in between (torch.cuda.graph does it on entering, after a synchronize).

    With a batch of 512 the tiny UNet's activations (~600 MB) dwarf its weights and Adam state (~3 MB).
    `cached`: what the warm-up left reserved beyond what is allocated. `left`: what an
    empty_cache after the capture still releases, that is, the cache that outlived the capture
    (the graph's pool is not released while the graph lives). Released, `left` is near 0; not
    released, it is about `cached`. `release=False` is the control: with torch.cuda.empty_cache a
    no-op during the capture the same measurement must see the warm-up's cache still there, which
    shows that the check would catch a StepGraph (or a torch) that stopped releasing it.
    """
    import gc

    empty_cache = torch.cuda.empty_cache
    gc.collect()
    torch.cuda.synchronize()
    empty_cache()  # the earlier tests' cache out of the way
    unet, objective, optimizer, _, _ = tiny_parts()
    unet.to(CUDA), objective.to(CUDA)
    optimizer = type(optimizer)(unet.parameters(), lr=1e-3, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    step = steps.TrainStep(unet, unet, objective, optimizer, schedule, None, None, 1.0, True)
    graph = compiling.StepGraph(step, warmup_steps=2)
    images = torch.randint(0, 256, (512, 3, 16, 16), dtype=torch.uint8, device=CUDA)
    for _ in range(2):
        graph([images])
    torch.cuda.synchronize()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert cached > 100 * 2**20, f"the warm-up left only {cached / 2**20:.0f} MiB cached: the check would mean nothing"
    if not release:
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    graph([images])  # the capture and its first replay
    assert graph.graph is not None
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    empty_cache()
    left = reserved - torch.cuda.memory_reserved()
    words = f"{left / 2**20:.0f} MiB of the {cached / 2**20:.0f} MiB the warm-up left cached outlived the capture"
    assert (left < cached / 4) if release else (left > cached * 3 / 4), words


def test_a_resumed_graph_reads_the_learning_rate_the_schedule_writes(tmp_path):
    """accelerate loads optimizer state to the CPU: the learning rate must go back to the GPU,
    or the capture freezes it (the scheduler would fill a tensor no replay reads)."""
    images = [b.to(CUDA) for b in batches(10)]

    def parts():
        unet, objective, optimizer, _, _ = tiny_parts()
        unet.to(CUDA), objective.to(CUDA)
        optimizer = type(optimizer)(unet.parameters(), lr=1e-3, fused=True)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / 10)  # falls to 0 at step 10
        step = steps.TrainStep(unet, unet, objective, optimizer, schedule, None, None, 1.0, False)
        return compiling.StepGraph(step, warmup_steps=2), unet, optimizer, schedule

    straight, unet_a, _, _ = parts()
    start = [p.detach().clone() for p in unet_a.parameters()]
    torch.manual_seed(0)
    for b in images:
        straight([b])

    first, unet_b, optimizer, schedule = parts()
    torch.manual_seed(0)
    for b in images[:5]:
        first([b])
    torch.save(dict(optimizer=optimizer.state_dict(), schedule=schedule.state_dict(), unet=unet_b.state_dict(),
                    rng=torch.cuda.get_rng_state()), tmp_path / "state.pt")  # fmt: skip
    saved = torch.load(tmp_path / "state.pt", map_location="cpu", weights_only=False)  # as accelerate loads it
    resumed, unet_c, optimizer, schedule = parts()
    unet_c.load_state_dict(saved["unet"])
    optimizer.load_state_dict(saved["optimizer"])
    schedule.load_state_dict(saved["schedule"])
    torch.cuda.set_rng_state(saved["rng"])
    for b in images[5:]:
        resumed([b])
    assert resumed.graph is not None and optimizer.param_groups[0]["lr"].device.type == "cuda"
    assert_same_change(list(unet_c.parameters()), list(unet_a.parameters()), start, rel=1e-3)


def test_a_step_graph_run_resumed_matches_an_uninterrupted_one(tmp_path, capsys):
    flags = ["--max_train_steps", 10, "--checkpointing_steps", 5, "--save_images_epochs", 100, "--compile_mode", "step-graph"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, *flags)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "checkpoint-5", resumed / "checkpoints" / "checkpoint-5")
    capsys.readouterr()
    run(resumed, *flags)  # --resume (the default): from the newest checkpoint
    assert "checkpoint-5 at step 5" in capsys.readouterr().out  # "resumed from .../checkpoint-5 at step 5"
    for folder in (straight, resumed):
        manifest = json.loads((folder / "run.json").read_text())
        assert manifest["step_compile_mode"] == "step-graph" and not manifest["compile_fallbacks"]
    a, _ = tensors_of(straight / "unet")
    b, _ = tensors_of(resumed / "unet")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("model", ["tiny", "edm2tiny"])
def test_reduce_overhead_through_main_captures_every_graph(tmp_path, model):
    """With cudagraph_or_error, a graph Inductor would skip is an error; the fallback would
    then record it, so an empty record means every graph ran as a CUDA graph."""
    from torch._inductor import config

    torch.compiler.reset()
    with config.patch({"triton.cudagraph_or_error": True}):
        run(tmp_path, "--model", model, "--max_train_steps", 6, "--save_images_epochs", 100, "--compile_mode", "reduce-overhead")
    torch.compiler.reset()
    manifest = json.loads((tmp_path / "run.json").read_text())
    assert manifest["step_compile_mode"] == "reduce-overhead"
    assert manifest["compile_fallbacks"] == [] and manifest["cuda_graph_skips"] == []


def test_fids_statistics_made_and_scored_on_the_gpu_are_the_cpus():
    """The reference's sums and the generated images' on the device (where train.py and sample.py make them),
    KID's rows and the scores back on the host: what the CPU makes, to the features' float32 rounding."""
    from ddpm_train.data import shapes
    from ddpm_train.evaluation import metrics
    from test_metrics import TinyFeatures

    images = shapes.make_shapes(64, 16, seed=1)
    scores = {}
    for device in ("cpu", "cuda"):
        statistics = metrics.statistics_of_share(images[:40], TinyFeatures(), device, 8)
        reference = statistics.reference({})
        assert all(value.device.type == "cpu" for value in reference.fid_state.values())
        generated = metrics.Generated()
        for features, _ in metrics.embedded(TinyFeatures(), ((b, None) for b in images[40:].split(8)), device):
            generated.add(features)
        scores[device] = generated.scores(reference, device)
    assert scores["cuda"] == pytest.approx(scores["cpu"], rel=1e-4)


# --- the other open issues' capabilities on CUDA (issue 67, item 3) ---------------------------------------------


@pytest.mark.parametrize("model, channels", [("tiny", 1), ("edm2tiny", 4), ("dit-tiny", 1)])
def test_a_grayscale_or_rgba_set_trains_compiled_on_the_gpu(tmp_path, model, channels):
    """A 16-bit grayscale set (one channel) or an RGBA one (four) through main on the GPU, its step as auto plans it:
    uint16 batches reach the compiled step, the network takes the data's channels, the grid keeps its mode."""
    from test_pixels import gray16, rgb, write

    folder = write(tmp_path / "set", gray16(16) if channels == 1 else rgb(16, channels=4))
    run(tmp_path / "run", "--dataset", folder, "--model", model, "--max_train_steps", 4, "--train_batch_size", 4)
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert saved["image_channels"] == channels and not manifest["compile_fallbacks"]
    from PIL import Image

    with Image.open(tmp_path / "run" / "samples" / "0000.png") as grid:
        assert grid.mode == {1: "L", 4: "RGBA"}[channels]


@pytest.mark.parametrize("model", ["tiny", "edm2tiny", "dit-tiny"])
def test_a_non_square_run_of_each_family_trains_compiled_and_resumes_on_the_gpu(tmp_path, model):
    """--image_size 24x16 through main on the GPU, its step as auto plans it (compiled or captured at that one shape):
    no fallback, wide grids, and a run resumed at step 2 ends with the weights of one that went straight on (to the
    GPU's rounding; bit-exact on the CPU: tests/test_sizes.py)."""
    from PIL import Image

    flags = ["--model", model, "--image_size", "24x16", "--max_train_steps", 4, "--checkpointing_steps", 2,
             "--train_batch_size", 4]  # fmt: skip
    run(tmp_path / "straight", *flags)
    assert not json.loads((tmp_path / "straight" / "run.json").read_text())["compile_fallbacks"]
    with Image.open(tmp_path / "straight" / "samples" / "0000.png") as grid:  # TINY's 4 samples: 2 by 2 cells of 24x16
        assert grid.size == (2 * 24 + 3 * 2, 2 * 16 + 3 * 2)
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "checkpoint-2", tmp_path / "resumed" / "checkpoints" / "checkpoint-2")
    run(tmp_path / "resumed", *flags)
    a, _ = tensors_of(tmp_path / "straight" / "unet")
    b, _ = tensors_of(tmp_path / "resumed" / "unet")
    assert a.keys() == b.keys()
    for key in a:  # as the step-graph resume above: a GPU's kernels need not add in one order
        torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=1e-5)


def test_a_run_started_from_another_runs_weights_trains_on_the_gpu(tmp_path, capsys):
    """--init_from a run of this project, on the GPU, compiled as auto plans it: it starts from those weights."""
    run(tmp_path / "source", "--max_train_steps", 2, "--save_images_epochs", 100)
    capsys.readouterr()
    run(tmp_path / "tuned", "--init_from", tmp_path / "source", "--max_train_steps", 2, "--save_images_epochs", 100)
    assert f"initialized from {tmp_path / 'source'}" in capsys.readouterr().out
    assert not json.loads((tmp_path / "tuned" / "run.json").read_text())["compile_fallbacks"]


def test_the_copy_search_on_the_gpu_finds_what_the_cpu_finds():
    from ddpm_train.data import shapes
    from ddpm_train.evaluation import copies

    images = shapes.make_shapes(300, 16, seed=2)
    samples = torch.cat([images[:8], shapes.make_shapes(8, 16, seed=3)])
    found = {device: copies.search(samples, copies.TrainingImages(images.to(device)), flips=True, device=device)
             for device in ("cpu", "cuda")}  # fmt: skip
    assert torch.equal(found["cuda"].indices.cpu(), found["cpu"].indices)
    torch.testing.assert_close(found["cuda"].distances.cpu(), found["cpu"].distances, rtol=1e-4, atol=1e-6)
