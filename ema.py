"""python ema.py: a run's EMA weights reconstructed post hoc at another width (ddpm_train/training/ema.py)."""

from ddpm_train import errors  # noqa: I001 (first: the standard library only)

if __name__ == "__main__":  # a Ctrl-C while torch imports: one line, not its traceback
    errors.quit_on_ctrl_c("ema.py")

from ddpm_train.training import ema  # noqa: E402

if __name__ == "__main__":
    errors.ctrl_c_raises()  # imported: main's own handling from here
    ema.main(ema.parse_args())
