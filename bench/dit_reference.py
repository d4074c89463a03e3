"""The reference DiT training step: facebookresearch/DiT's train.py's, timed on one device (bench/on_gpu.sh dit).

    python bench/dit_reference.py [--ext .ext/DiT] [--batch 64] [--steps 30] [--warmup 5] [--json FILE]
    python bench/dit_reference.py --tiny --cpu --steps 2 --warmup 1     # on_gpu.sh's CPU mode

Their code is fetched into .ext/DiT (models.py, diffusion/, train.py of facebookresearch/DiT), carried to the
GPU machine and never committed. This imports it and takes their step as their train.py's loop does:
DiT-XL/2 at 32x32x4 with 1000 classes and learn_sigma (8 channels out), their diffusion's training_losses
(MSE plus the VLB term for the learned variance), AdamW(lr=1e-4, weight_decay=0) over the DDP-wrapped
model (here DDP of one process), their update_ema every step and loss.item() every step, in fp32 with
TF32 on (their train.py sets it at import, as importing it here does). One thing is left out: their
loop encodes each image batch through SD's VAE; this trains on one batch of random latents instead,
as our speed ladder's `dit` workload does and fast-DiT's train.py does on pre-extracted features.

It prints one line and writes --json with a train.py run.json's fields (median_step_time_s, images_per_s,
mfu, ...) that bench/pack_summary.py reads. FLOPs are their network's own, counted on the meta device
(flops.count_flops); MFU is against the dense bf16 peak (the project's targets' denominator), and
against the TF32 peak their fp32 step runs at.
"""

import argparse
import importlib
import json
import os
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddpm_train.perf import flops  # noqa: E402  (ours: the project root first on the path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Time facebookresearch/DiT's training step.")
    p.add_argument("--ext", default=str(ROOT / ".ext" / "DiT"), help="the folder holding their models.py, diffusion/, train.py")
    p.add_argument("--model", default="DiT-XL/2", help="their DiT_models name")
    p.add_argument("--latent_size", type=int, default=32, help="latent side (256px through SD's VAE: 32)")
    p.add_argument("--num_classes", type=int, default=1000)
    p.add_argument("--batch", type=int, default=64, help="images per step (their global batch 256 is 32 per GPU on 8)")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--tiny", action="store_true", help="a 2-block, 32-wide DiT of their class on 8x8x4 latents (CPU mode)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (gloo) even with a GPU")
    p.add_argument("--json", default=None, help="write the numbers here (a run.json's fields)")
    return p.parse_args(argv)


def import_theirs(ext):
    """Their modules: models (DiT_models, DiT), diffusion (create_diffusion), train (update_ema, requires_grad)."""
    if not (Path(ext) / "models.py").exists():
        sys.exit(f"dit_reference: no {Path(ext) / 'models.py'}: fetch facebookresearch/DiT into {ext} (never committed)")
    sys.path.insert(0, str(ext))
    try:
        import timm  # noqa: F401  (their models.py's one dependency beyond torch, diffusers and torchvision)
    except ImportError:
        sys.exit("dit_reference: facebookresearch/DiT's models.py needs timm: pip install timm")
    # theirs, from ext, by name: their train.py shares our train.py's name (tests/test_layout.py reads
    # import statements as the project's modules)
    their_models = importlib.import_module("models")
    their_train = importlib.import_module("train")  # sets TF32 on at import, as their script does
    create_diffusion = importlib.import_module("diffusion").create_diffusion

    return their_models, their_train, create_diffusion


def build(their_models, args, device):
    import torch

    if args.tiny:
        return their_models.DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=2,
                                num_classes=args.num_classes).to(device)  # fmt: skip
    return their_models.DiT_models[args.model](input_size=args.latent_size, num_classes=args.num_classes).to(device)


def count_flops(their_models, args, batch):
    """Forward and backward FLOPs of their network on one batch, counted on the meta device."""
    import torch

    with torch.device("meta"):
        net = build(their_models, args, "meta")
    side = 8 if args.tiny else args.latent_size
    x = torch.empty(batch, 4, side, side, device="meta")
    t = torch.zeros(batch, dtype=torch.long, device="meta")
    y = torch.zeros(batch, dtype=torch.long, device="meta")
    return flops.count_flops(lambda: net(x, t, y).float().square().mean().backward())


def one_process_group(cuda):
    """DDP of one process, as their train.py runs on one GPU (torchrun --nproc_per_node=1)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def main(args):
    their_models, their_train, create_diffusion = import_theirs(args.ext)
    import torch
    from copy import deepcopy

    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    one_process_group(cuda)
    torch.manual_seed(0)
    if cuda:
        torch.cuda.set_device(device)

    # their train.py's main(), less the data, the VAE and the logging
    model = build(their_models, args, "cpu")
    ema = deepcopy(model).to(device)
    their_train.requires_grad(ema, False)
    model = DDP(model.to(device), device_ids=[0] if cuda else None)
    diffusion = create_diffusion(timestep_respacing="")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    their_train.update_ema(ema, model.module, decay=0)
    model.train()
    ema.eval()

    side = 8 if args.tiny else args.latent_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 4, side, side, generator=g).to(device)  # their x = vae.encode(x).latent_dist.sample().mul_(0.18215)
    y = torch.randint(0, args.num_classes, (args.batch,), generator=g).to(device)

    def step():  # their loop's body
        t = torch.randint(0, diffusion.num_timesteps, (x.shape[0],), device=device)
        model_kwargs = dict(y=y)
        loss_dict = diffusion.training_losses(model, x, t, model_kwargs)
        loss = loss_dict["loss"].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        their_train.update_ema(ema, model.module)
        return loss.item()  # running_loss += loss.item(): a host sync every step

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    started = datetime.now(timezone.utc).isoformat()  # run.json's start_time: pack_summary's "1st step s" is the launch to here
    first = time.perf_counter()
    losses = [step()]
    first_step_s = time.perf_counter() - first
    for _ in range(max(args.warmup - 1, 0)):
        losses.append(step())
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        losses.append(step())  # .item() waited for the device: the wall time is the step's
        times.append(time.perf_counter() - start)

    step_s = statistics.median(times)
    flop = count_flops(their_models, args, args.batch)
    gpu_name = torch.cuda.get_device_name(device) if cuda else None
    peak_bf16, peak_tf32 = (flops.lookup_peak(gpu_name, p)[1] for p in ("bf16", "tf32"))
    params = sum(p.numel() for p in model.module.parameters() if p.requires_grad)
    result = dict(
        start_time=started,
        reference="facebookresearch/DiT train.py's step" + (f" (commit {(Path(args.ext) / 'COMMIT').read_text().strip()})"
                                                            if (Path(args.ext) / "COMMIT").exists() else ""),  # fmt: skip
        model="tiny DiT of their class" if args.tiny else args.model,
        trainable_params=params,
        batch=args.batch,
        device=gpu_name or "cpu",
        step_compile_mode="reference: eager fp32/TF32, DDP x1",
        compile_s=None,
        first_step_s=first_step_s,
        step_times_s=times,
        median_step_time_s=step_s,
        images_per_s=args.batch / step_s,
        model_flops_per_step=flop,
        achieved_tflops=flop / step_s / 1e12,
        mfu=flop / step_s / peak_bf16 if peak_bf16 else None,
        mfu_tf32=flop / step_s / peak_tf32 if peak_tf32 else None,
        peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        losses=losses,
        mean_loss=sum(losses) / len(losses),
    )
    mfu = "MFU n/a (no known peak)" if result["mfu"] is None else (
        f"MFU {100 * result['mfu']:.1f}% of the bf16 peak, {100 * result['mfu_tf32']:.1f}% of TF32's")  # fmt: skip
    print(f"{result['reference']}: {result['model']} ({params:,} trainable), batch {args.batch} on {result['device']}: "
          f"{1e3 * step_s:.4g} ms/step | {result['images_per_s']:.1f} img/s | {flop / 1e12:.4g} TFLOP/step | "
          f"{result['achieved_tflops']:.4g} TFLOP/s | {mfu} | mean loss {result['mean_loss']:.4f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main(parse_args()))
