"""The DataLoaders this project makes: their workers leave stop signals to the main process, which ends them; their
base seeds come from a generator of their own."""

import atexit
import signal
import weakref

import torch


def loader_generator(seed, epoch):
    """A DataLoader's own generator: its workers' base seed is drawn from it, not from torch's global one. A
    loader made without one draws from the global generator, so that streaming, or drawing latents ahead in
    workers, would change the noise every later step draws, where preloading or drawing in process does not:
    with it, every way of reading the data leaves the training noise as it is (a resume may switch them)."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch) + 7)


# The iterators with workers of every DataLoader `iterate` started and stop_workers has not ended.
_WITH_WORKERS = weakref.WeakSet()


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _ignore_stop_signals(worker_id):
    """A DataLoader worker's first act: SIGTERM and SIGINT are the main process's to act on. A cluster that
    preempts a job signals every one of its processes, and a terminal's Ctrl-C goes to the whole process group:
    a worker that died of it made the main process fail at once ("DataLoader worker ... is killed by signal:
    Terminated", raised by torch's SIGCHLD handler) before it had saved the step's checkpoint. The main process ends its workers itself
    (stop_workers); a worker whose main process died notices within seconds and ends (torch's watchdog)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # one that came since the fork (blocked: iterate) is discarded


def iterate(loader):
    """iter(loader) for every DataLoader this project makes: its workers leave SIGTERM and SIGINT to this process
    (_ignore_stop_signals), and stop_workers ends them if they still run then."""
    if not loader.num_workers:
        return iter(loader)
    loader.worker_init_fn = _ignore_stop_signals  # read as the workers start (a persistent loader's: once)
    # Blocked while the workers are forked (they inherit the mask): a signal between a worker's fork and its
    # _ignore_stop_signals would kill it; here it waits until the workers are started, then is this process's.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        iterator = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    _WITH_WORKERS.add(iterator)
    return iterator


def stop_workers():
    """End the workers of every DataLoader iterated through `iterate` (train.main's last act, and any process's at
    exit: they ignore SIGTERM, which multiprocessing's own exit sends them before it waits for them)."""
    for iterator in list(_WITH_WORKERS):
        iterator._shutdown_workers()  # what the iterator does at its end and when deleted
    _WITH_WORKERS.clear()


atexit.register(stop_workers)  # after multiprocessing's exit handler, so run before it
