"""Performance: how the step is compiled, its FLOPs and the GPU peak table, its memory, and profiling."""
