"""python profiling.py: a run's logged scalars drawn as plots (ddpm_train/perf/profiling.py)."""

from ddpm_train import errors  # noqa: I001 (first: the standard library only)

if __name__ == "__main__":  # a Ctrl-C while torch imports: one line, not its traceback
    errors.quit_on_ctrl_c("profiling.py")

import sys

from ddpm_train.perf import profiling  # noqa: E402

if __name__ == "__main__":
    errors.ctrl_c_raises()  # imported: main's own handling from here
    sys.exit(profiling.main(profiling.parse_args()))
