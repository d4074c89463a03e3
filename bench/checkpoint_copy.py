"""train.py with its checkpoints' host copy chosen, whatever the device: `copy` writes the large files from a
copy in host memory beside training (checkpoint.HostCopy), `wait` has the steps wait while accelerate's
save_state writes them (train.py's default where checkpoint.HOST_COPY_DEVICES does not name the device). For
measuring one against the other: bench/on_gpu.sh's dit part; on a CPU, BENCHMARKS.md's Speed on a CPU.

    python bench/checkpoint_copy.py copy|wait TRAIN_PY_FLAGS...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import checkpoint  # noqa: E402
import train  # noqa: E402


def main(argv):
    if not argv or argv[0] not in ("copy", "wait"):
        sys.exit("usage: python bench/checkpoint_copy.py copy|wait TRAIN_PY_FLAGS...")
    copy = argv[0] == "copy"
    checkpoint.host_copy_for = lambda device: checkpoint.HostCopy() if copy else None
    train.main(train.parse_args(argv[1:]))


if __name__ == "__main__":
    main(sys.argv[1:])
