"""python memory.py: what a command holds in memory, its tensors tracked by where they were made (ddpm_train/perf/memory.py)."""

from ddpm_train.perf import memory  # noqa: E402

if __name__ == "__main__":
    memory.main(memory.parse_args())
