"""The library under the scripts a user runs (train.py, sample.py, flops.py, ema.py, memory.py, profiling.py).

    errors, config, sizes   the two error kinds and their one line; every flag, preset and check; image sizes
    data/                   images and their sources, batches; VAE latents and captions, each encoded once and cached
    networks/               the network families and presets (UNet, EDM2, DiT), FP8, fused kernels, --init_from
    diffusion/              the objectives (DDPM, EDM, flow), their samplers, the loss's extra terms
    training/               the one builder, the step, optimizers, EMA, checkpoints, resume, run folders, the
                            processes' agreement
    perf/                   compiling the step, FLOPs and the peak table, memory, profiling
    evaluation/             sampling and guidance, FID/KID, the copy check, the shape score

Imports go down docs/layout.md's layers (tests/test_layout.py); importing the package itself imports nothing.
"""
