"""The processes of a run agreeing: work that one process does while the others wait, stopping together
where one fails or a signal reached one, and the choices every process takes from the main one.

A run of one process agrees with itself: nothing here waits or sends anything then. With several,
the waits for the main process's work are in a gloo group of their own (`Processes.main_work_group`),
whose timeout is MAIN_WORK_WAIT, not the steps' (train.STEP_WAIT).
"""

from datetime import timedelta

import torch

from ddpm_train.errors import ConfigError, RunError

# With several processes, how long a process may wait for the main process's work between steps (grids, FID/KID's
# reference statistics, the pipeline; an evaluation's samples, a share each, gathered to it), in a gloo group of its
# own: FID over 50,000 samples of a large network on one GPU takes hours, and the wait fires only when a process hangs
# (one that dies ends it at once). A latent run's encoding waits in a group of its own too (folders.ENCODE_WAIT).
MAIN_WORK_WAIT = timedelta(hours=12)
# That group is held here, not by the run, which lives on in reference cycles after train.main returns: a group still
# referenced after destroy_process_group keeps its gloo threads into the interpreter's shutdown, where tearing
# them down can abort the process (SIGABRT, "terminate called without an active exception"; pytorch PR 179291).
# end_process_group drops it.
_MAIN_WORK = {}

# With several processes, how often they agree on whether a signal asked them to stop.
STOP_CHECK_STEPS = 10


class Abandoned(Exception):
    """The main process's work between steps (an evaluation's samples), left for a stop signal."""


def end_process_group():
    """Destroy torch.distributed's process group, if this process is in one. Left alive at exit,
    gloo's worker thread can still hold the last all-reduce when the interpreter shuts down, and
    the process aborts ("terminate called without an active exception", SIGABRT)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _MAIN_WORK.clear()  # its threads end now, while the interpreter is whole


class Processes:
    """The processes of `accelerator`'s run, agreeing. Work only the main process does goes through
    `on_main_process`, so that a failure there stops every process; `stop_requested` is every process's
    one answer to whether a signal asked them to stop; `from_main` hands the main process's choices to
    the others."""

    def __init__(self, accelerator):
        self.accelerator, self.device = accelerator, accelerator.device
        self.world, self.rank, self.is_main = accelerator.num_processes, accelerator.process_index, accelerator.is_main_process
        _MAIN_WORK.clear()
        if self.world > 1:
            _MAIN_WORK["group"] = torch.distributed.new_group(backend="gloo", timeout=MAIN_WORK_WAIT)

    @property
    def main_work_group(self):
        """The group in which the others wait for the main process's work between steps (_MAIN_WORK); None on one process."""
        return _MAIN_WORK.get("group")

    def from_main(self, values):
        """`values` (a list, changed in place), the main process's on every process; returned."""
        if self.world > 1:
            torch.distributed.broadcast_object_list(values, src=0, group=self.main_work_group)
        return values

    def on_main_process(self, work):
        """Runs `work()` on the main process while the others wait (see `_together`)."""
        self._together(work, self.is_main)

    def on_every_process(self, work):
        """Runs `work()` on every process, each waiting at the end for the others (see `_together`)."""
        self._together(work, True)

    def _together(self, work, here):
        """Runs `work()` where `here` is true, then every process meets. If the work failed on any process,
        every process stops (the one it failed on with its error) rather than the others waiting forever.
        Work left for a stop signal (Abandoned) is no failure."""
        error = None
        if here:
            try:
                work()
            except Abandoned:
                pass
            except (RunError, ConfigError) as e:
                error = e
        self.stop_together(error, 1)  # also the barrier

    def stop_together(self, error, code):
        """Every process stops where one failed (`error`, raised there; the others exit with `code` and say
        nothing: that one says why), rather than the others waiting for it at their next collective."""
        failed = torch.tensor(float(error is not None))
        if self.world > 1:  # in the group that waits long enough for the main process's work
            torch.distributed.all_reduce(failed, group=self.main_work_group)
        if error is not None:
            raise error
        if failed.item():
            raise SystemExit(code)

    def stop_requested(self, signals, step, now=False):
        """Whether to stop after `step`. Processes must agree, or one would wait in save_state for
        the others forever: with several, they compare notes every STOP_CHECK_STEPS steps (and where
        `now`: every process asks at the same point), and all stop if a signal reached any of them."""
        if self.world == 1:
            return signals.requested
        if step % STOP_CHECK_STEPS and not now:
            return False
        totals = self.accelerator.reduce(torch.tensor(signals.tally(), device=self.device), reduction="sum")
        return signals.agree(totals.tolist())
