"""python -m bench: the speed ladder, a sweep (--sweep) or the quality ladder (--quality)."""

import sys

from ddpm_train import errors  # noqa: I001 (first: the standard library only)

errors.quit_on_ctrl_c("bench")  # while torch and diffusers import: one line, not their traceback

from bench import speed  # noqa: E402

errors.ctrl_c_raises()  # imported: speed.command's own handling from here
sys.exit(speed.command())
