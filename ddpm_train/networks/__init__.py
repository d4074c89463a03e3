"""The networks: the families and their presets (diffusers' UNets, EDM2's, DiT), FP8 layers, fused kernels and --init_from."""
