"""The diffusion objectives (DDPM, EDM, flow matching) with their losses and samplers, and the loss's extra terms."""
