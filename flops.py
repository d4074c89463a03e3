"""python flops.py: the FLOPs, parameters and MFU of a preset's training step (ddpm_train/perf/flops.py)."""

from ddpm_train import errors  # noqa: I001 (first: the standard library only)

if __name__ == "__main__":  # a Ctrl-C while torch imports: one line, not its traceback
    errors.quit_on_ctrl_c("flops.py")

import sys

from ddpm_train.perf import flops  # noqa: E402

if __name__ == "__main__":
    errors.ctrl_c_raises()  # imported: main's own handling from here
    sys.exit(flops.main(flops.parse_args()))
