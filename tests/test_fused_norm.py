"""fused_norm.py's GroupNorm(+SiLU) kernels against F.group_norm + F.silu, and its UNet hooks.

On the CPU the kernels run in Triton's interpreter. TRITON_INTERPRET=1 must be
set before `@triton.jit` runs, i.e. before fused_norm is first imported, and
pytest imports every test module into one process (test_train imports
train.py, which may import fused_norm). So the CPU checks run in one child
process, this file run as a script with the interpreter on and every kernel
output poisoned with NaN first; the tests below assert on what it reports.
With CUDA the same checks run natively in bf16 against an fp32 reference,
in process.
"""

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

# (N, C, H, W, groups, silu): every channel width the presets' norms see
# (16..512, and concatenations such as 48 and 384 in the up path), groups of
# 8 and 32 (1 to 64 channels per group, powers of two or not), odd and 1x1
# spatial sizes. The child shrinks the tiles to 64 elements, so these span
# several position and channel blocks with partial edges.
CASES = [
    (2, 16, 5, 7, 8, True),
    (2, 32, 5, 7, 32, True),
    (1, 48, 9, 9, 8, True),
    (2, 64, 6, 5, 32, False),
    (1, 96, 3, 5, 32, True),
    (1, 128, 7, 3, 8, True),
    (1, 256, 4, 3, 32, False),
    (1, 384, 3, 3, 32, True),
    (1, 512, 5, 3, 8, True),
    (2, 64, 1, 1, 8, True),
]


def random_cases(seed=0, count=3):
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        groups = rng.choice((8, 32))
        channels = rng.choice([c for c in (16, 32, 48, 64, 96, 128, 256, 512) if c % groups == 0])
        cases.append((rng.randint(1, 3), channels, rng.randint(1, 9), rng.randint(1, 9), groups, rng.random() < 0.7))
    return cases


def kernel_errors(case, dtype, device, ref_dtype, loc=5.0, scale=3.0, seed=0):
    """Run forward and backward through the kernels and the reference; return relative errors.

    x ~ N(loc, scale^2) in channels_last; the reference is F.group_norm
    (+F.silu) in `ref_dtype` on the same (rounded) values. Errors are
    max |kernel - reference| / max(1, max |reference|) per output.
    """
    from ddpm_train.networks import fused_norm

    N, C, H, W, groups, silu = case
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, C, H, W, generator=gen, dtype=torch.float64) * scale + loc).to(dtype)
    weight = torch.randn(C, generator=gen, dtype=torch.float64)
    bias = torch.randn(C, generator=gen, dtype=torch.float64)
    dy = torch.randn(N, C, H, W, generator=gen, dtype=torch.float64).to(dtype)
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def run(x, weight, bias, dy, fused):
        # Fresh leaves: .to() may return its input, and the two runs must not share gradients.
        x = x.to(device).clone(memory_format=torch.channels_last).requires_grad_()
        weight, bias = (t.to(device).clone().requires_grad_() for t in (weight, bias))
        if fused:
            assert fused_norm.kernel_applies(x, weight, bias)
            y = fused_norm.group_norm_silu(x, groups, weight, bias, 1e-6, silu)
        else:
            y = F.group_norm(x, groups, weight, bias, 1e-6)
            y = F.silu(y) if silu else y
        y.backward(dy.to(device))
        return y, x.grad, weight.grad, bias.grad

    got = run(x, weight.to(param_dtype), bias.to(param_dtype), dy, fused=True)
    ref = run(x.to(ref_dtype), weight.to(ref_dtype), bias.to(ref_dtype), dy.to(ref_dtype), fused=False)
    result = {
        "dtypes": [str(t.dtype) for t in got],
        "channels_last": [t.is_contiguous(memory_format=torch.channels_last) for t in got[:2]],
        "nan": sum(int(torch.isnan(t).sum()) for t in got),
    }
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), got, ref):
        b = b.detach().double().cpu()
        result[name] = float((a.detach().double().cpu() - b).abs().max() / max(1.0, float(b.abs().max())))
    return result


def unet_checks(batch=2):
    """The tiny UNet with and without use_fused_norm: same output, gradients, state dict."""
    import copy

    from diffusers import DDPMPipeline, UNet2DModel
    from diffusers.models.resnet import ResnetBlock2D

    from ddpm_train.networks import fused_norm
    from ddpm_train.networks import model
    from ddpm_train.diffusion import objectives

    calls = []
    original = fused_norm._fwd

    def counting_fwd(*args):
        calls.append(args[0].shape)
        return original(*args)

    fused_norm._fwd = counting_fwd
    torch.manual_seed(0)
    stock = model.build_network("tiny", 16).double().train().to(memory_format=torch.channels_last)
    fused = fused_norm.keep_channels_last(fused_norm.use_fused_norm(copy.deepcopy(stock)))
    x = torch.randn(batch, 3, 16, 16, dtype=torch.float64).to(memory_format=torch.channels_last)
    t = torch.randint(0, 1000, (batch,))
    results = {}
    for name, unet in (("stock", stock), ("fused", fused)):
        out = unet(x, t).sample
        out.square().mean().backward()
        results[name] = (out, {n: p.grad for n, p in unet.named_parameters()})
    (out_s, grads_s), (out_f, grads_f) = results["stock"], results["fused"]
    report = {
        "kernel_calls": len(calls),
        "fused_blocks": sum(type(m) is fused_norm.FusedResnetBlock2D for m in fused.modules()),
        "output_err": float((out_f - out_s).detach().abs().max()),
        "grad_err": max(float((grads_f[n] - grads_s[n]).abs().max()) for n in grads_s),
        "same_keys": list(fused.state_dict()) == list(stock.state_dict()),
        "same_values": all(torch.equal(a, b) for a, b in zip(fused.state_dict().values(), stock.state_dict().values())),
    }

    with tempfile.TemporaryDirectory() as tmp:
        fused.save_pretrained(Path(tmp, "unet"))
        loaded = UNet2DModel.from_pretrained(Path(tmp, "unet")).double()
        pipeline = DDPMPipeline(unet=fused, scheduler=objectives.make_noise_scheduler())
        pipeline.save_pretrained(Path(tmp, "pipeline"))
        reloaded = DDPMPipeline.from_pretrained(Path(tmp, "pipeline")).unet.double()
    fused.eval()
    with torch.no_grad():
        out_eval = fused(x, t).sample
        report["roundtrip"] = [
            {
                "same_state_dict": list(m.state_dict()) == list(stock.state_dict())
                and all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), stock.state_dict().values())),
                "stock_classes": not any(isinstance(sub, fused_norm.FusedResnetBlock2D) for sub in m.modules()),
                "output_err": float((m.eval()(x, t).sample - out_eval).abs().max()),
            }
            for m in (loaded, reloaded)
        ]
    fused_norm._fwd = original
    return report


def nchw_saved_tensors(unet, batch):
    """Image-shaped tensors that a training forward saves for backward in NCHW rather than NHWC."""
    x = torch.randn(batch, 3, 16, 16).to(memory_format=torch.channels_last)
    t = torch.randint(0, 1000, (batch,))
    found = []

    def pack(saved):
        # Attention saves [B, heads, tokens, head_dim]; images here are square.
        image = saved.dim() == 4 and saved.shape[1] > 1 and saved.shape[2] == saved.shape[3] > 1
        if image and not saved.is_contiguous(memory_format=torch.channels_last):
            found.append(f"{tuple(saved.shape)} from {type(saved.grad_fn).__name__}")
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved):
        out = unet.train()(x, t).sample
    out.square().mean().backward()
    return found, out.is_contiguous(memory_format=torch.channels_last)


def child_main():
    """The CPU checks, in the Triton interpreter (run as a script, see the module docstring)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(ROOT))
    import numpy

    from ddpm_train.networks import fused_norm

    numpy.seterr(over="ignore")  # the interpreter's exp(-z) overflows to inf for z << 0; SiLU(z) is then -0

    fused_norm.FORCE_KERNEL = True
    fused_norm.POISON_OUTPUTS = True
    fused_norm.TILE_ELEMENTS = 64
    f64 = torch.float64
    report = {
        "fp64": [kernel_errors(c, f64, "cpu", f64) for c in CASES + random_cases()],
        # fp32 statistics of data far from zero: a merge of E[x^2] - E[x]^2 would lose the variance.
        "large_mean_fp32": kernel_errors((2, 64, 9, 7, 8, True), torch.float32, "cpu", f64, loc=1e3, scale=1.0),
        # Every group constant: variance 0, rstd = 1/sqrt(eps).
        "constant_fp64": kernel_errors((2, 32, 3, 5, 8, True), f64, "cpu", f64, loc=2.0, scale=0.0),
        "bf16": kernel_errors((2, 48, 5, 7, 8, True), torch.bfloat16, "cpu", torch.float32),
    }
    fused_norm.TILE_ELEMENTS = 4096
    report["unet"] = unet_checks()
    print(json.dumps(report))


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_forward_and_backward_match_fp64_reference(interpreted):
    for case, errors in zip(CASES + random_cases(), interpreted["fp64"]):
        for name in ("y", "dx", "dweight", "dbias"):
            assert errors[name] < 1e-10, (case, name, errors)
        assert errors["dtypes"] == ["torch.float64"] * 4, (case, errors)
        assert errors["channels_last"] == [True, True], (case, errors)


def test_every_output_element_is_written(interpreted):
    # The child fills every buffer the kernels write with NaN before launching them.
    results = interpreted["fp64"] + [interpreted[k] for k in ("large_mean_fp32", "constant_fp64", "bf16")]
    assert [r["nan"] for r in results] == [0] * len(results)


def test_fp32_statistics_survive_a_large_mean(interpreted):
    errors = interpreted["large_mean_fp32"]
    assert all(errors[k] < 1e-3 for k in ("y", "dx", "dweight", "dbias")), errors  # a NaN error fails too


def test_constant_groups_give_bias_and_finite_gradients(interpreted):
    errors = interpreted["constant_fp64"]
    assert all(errors[k] < 1e-10 for k in ("y", "dx", "dweight", "dbias")), errors  # a NaN error fails too


def test_bf16_input_keeps_dtypes_and_reduces_in_fp32(interpreted):
    errors = interpreted["bf16"]
    assert errors["dtypes"] == ["torch.bfloat16", "torch.bfloat16", "torch.float32", "torch.float32"]
    # y and dx are rounded to bf16 (8 bits); dweight and dbias sum in fp32.
    assert errors["y"] < 1e-2 and errors["dx"] < 1e-2, errors
    assert errors["dweight"] < 1e-4 and errors["dbias"] < 1e-4, errors


def test_use_fused_norm_keeps_the_unet(interpreted):
    unet = interpreted["unet"]
    # tiny: 8 ResNet blocks x 2 norms, and the final norm, all through the kernels.
    assert unet["fused_blocks"] == 8 and unet["kernel_calls"] == 17, unet
    assert unet["output_err"] < 1e-10 and unet["grad_err"] < 1e-10, unet
    assert unet["same_keys"] and unet["same_values"], unet


def test_save_pretrained_and_pipeline_load_plain_diffusers(interpreted):
    for loaded in interpreted["unet"]["roundtrip"]:
        assert loaded["same_state_dict"] and loaded["stock_classes"], loaded
        assert loaded["output_err"] < 1e-10, loaded


def test_training_saves_only_channels_last_activations():
    """In process, without the kernels: the norms fall back to F.group_norm, which keeps
    NHWC on the CPU (on CUDA it returns NCHW, and the kernels are what keep NHWC there).
    Batch 64 reaches Upsample2D's NCHW copy, which diffusers applies from 64 up."""
    from ddpm_train.networks import fused_norm
    from ddpm_train.networks import model

    torch.manual_seed(0)
    unet = model.build_network("tiny", 16).to(memory_format=torch.channels_last)
    stock_nchw, _ = nchw_saved_tensors(unet, batch=64)
    # The probe sees diffusers' own NCHW copies (conv_shortcut's input, the upsampled image)...
    assert any("Clone" in s for s in stock_nchw) and any("Upsample" in s for s in stock_nchw), stock_nchw
    fused_norm.keep_channels_last(fused_norm.use_fused_norm(unet))
    assert not fused_norm.kernel_applies(torch.empty(1, 8, 2, 2), unet.conv_norm_out.weight, unet.conv_norm_out.bias)
    fused_nchw, output_nhwc = nchw_saved_tensors(unet, batch=64)
    # ...and none are left with use_fused_norm + keep_channels_last.
    assert fused_nchw == [] and output_nhwc, fused_nchw


def test_inductor_sees_each_kernel_write_only_its_outputs():
    """torch.compile functionalises the kernels by what Inductor's TTIR analysis says they write;
    a parameter taken as written fails the compiled UNet's build on a GPU (the first GPU run, BENCHMARKS.md:
    the backward kernels' store addresses came out of a call that took w_ptr). The analysis
    needs only a target, so a Hopper one stands in for the GPU here."""
    import triton
    from torch._higher_order_ops import triton_kernel_wrap
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from ddpm_train.networks import fused_norm

    if not isinstance(fused_norm._stats_kernel, JITFunction):
        pytest.skip("fused_norm was imported under TRITON_INTERPRET")
    N, C, H, W, G = 2, 32, 8, 8, 8
    HW, CG = H * W, C // G
    block_hw, block_c = fused_norm._blocks(HW, C)
    tile = lambda *shape: torch.randn(*shape)  # noqa: E731
    x, dy, y, dx = (tile(N, C, H, W).to(memory_format=torch.channels_last) for _ in range(4))
    w, b, mean, rstd, ka, kb = tile(C), tile(C), tile(N, G), tile(N, G), tile(N, G), tile(N, G)
    parts = tile(N, triton.cdiv(HW, block_hw), C), tile(N, triton.cdiv(HW, block_hw), C)
    sizes = dict(HW=HW, C=C, BLOCK_HW=block_hw, BLOCK_C=block_c)
    norm = dict(w_ptr=w, b_ptr=b, mean_ptr=mean, rstd_ptr=rstd, G=G, CG=CG, SILU=True, **sizes)
    launches = {
        "_stats_kernel": (dict(x_ptr=x, mean_ptr=parts[0], m2_ptr=parts[1], **sizes), {"mean_ptr", "m2_ptr"}),
        "_apply_kernel": (dict(x_ptr=x, y_ptr=y, **norm), {"y_ptr"}),
        "_bwd_reduce_kernel": (dict(x_ptr=x, dy_ptr=dy, dzx_ptr=parts[0], dz_ptr=parts[1], **norm), {"dzx_ptr", "dz_ptr"}),
        "_bwd_dx_kernel": (dict(x_ptr=x, dy_ptr=dy, dx_ptr=dx, ka_ptr=ka, kb_ptr=kb, **norm), {"dx_ptr"}),
    }
    analyse = getattr(triton_kernel_wrap, "identify_accessed_tensors", None)
    if analyse is None:
        pytest.skip("this torch has no identify_accessed_tensors")

    class Hopper:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    before = driver._active  # reset_active() would make the default driver, which a CPU lacks
    driver.set_active(Hopper())
    try:
        for name, (kwargs, outputs) in launches.items():
            kernel = getattr(fused_norm, name)
            kwargs = {k: kwargs[k] for k in kernel.arg_names}
            writes = {dep.name for dep in analyse(kernel, kwargs, {}).read_writes.writes}
            assert writes == outputs, (name, writes)
    finally:
        driver._active = before


# --- natively on a GPU -----------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("case", CASES + random_cases() + [(8, 128, 32, 32, 32, True), (4, 512, 16, 16, 32, True)])
def test_cuda_bf16_matches_fp32_reference(case):
    errors = kernel_errors(case, torch.bfloat16, "cuda", torch.float32)
    assert errors["nan"] == 0 and errors["channels_last"] == [True, True], errors
    assert errors["y"] < 2e-2 and errors["dx"] < 2e-2, errors
    assert errors["dweight"] < 1e-2 and errors["dbias"] < 1e-2, errors


@cuda
def test_cuda_compiled_unet_keeps_channels_last():
    from ddpm_train.networks import fused_norm
    from ddpm_train.networks import model

    torch.manual_seed(0)
    unet = model.build_network("tiny", 16, device="cuda").to(memory_format=torch.channels_last)
    fused_norm.keep_channels_last(fused_norm.use_fused_norm(unet))
    x = torch.randn(64, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last)
    t = torch.randint(0, 1000, (64,), device="cuda")
    compiled = torch.compile(unet, fullgraph=True)
    with torch.autocast("cuda", torch.bfloat16):
        out = compiled(x, t).sample
        expected = unet(x, t).sample
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.float(), expected.float(), atol=5e-2, rtol=5e-2)
    out.float().square().mean().backward()
    assert all(p.grad is not None for p in unet.parameters())
    assert unet.conv_in.weight.grad.is_contiguous(memory_format=torch.channels_last)


if __name__ == "__main__":
    child_main()
