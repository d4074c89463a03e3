"""Training: the pieces built once, the step, optimizers, EMA, checkpoints, resume, run folders and the processes' agreement."""
