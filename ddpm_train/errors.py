"""The two errors every module raises, and the one place that turns them into a line and an exit code.

ConfigError: a bad flag, path or combination (exit code 2): the message says what to change.
RunError: training cannot go on (disk full, a non-finite loss with --on_fault stop; exit code 1).

Every command line tool parses with OneLineParser and runs its work under `one_line_errors(prog)`:
no traceback and no usage block, one line on stderr that says what to change.
"""

import argparse
import contextlib
import logging
import os
import signal
import sys

# Harmless lines two libraries log when torchao (--mixed_precision fp8) is installed, on every import of
# diffusers (which imports torchao): torch's deprecation of torchao's enum registration, and diffusers 0.42.1
# looking for a torchao class (NF4Tensor) that torchao 0.18.0 moved. Quieted here, the module every other
# imports first (model.py and rundir.py import it before diffusers), so that a run's output starts with its own line.
for _name in ("torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
    logging.getLogger(_name).setLevel(logging.ERROR)


class ConfigError(Exception):
    """A bad flag, path or combination: reported as one line, exit code 2."""


class RunError(Exception):
    """Training cannot go on (disk full, non-finite loss): one line, exit code 1."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, exit code 2, no usage block: the message says what to change.
    `source` names where the flags came from (a --config file) when it is not the command line."""

    def __init__(self, *args, source="", **kwargs):
        super().__init__(*args, **kwargs)
        self.source = source

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {self.source}{message} (see --help)\n")


def first_line(error, limit=160):
    """The first line of an exception's message (its type's name where it has none), cut at `limit` characters."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


def error_line(error):
    """'Type: first line' of the exception at the bottom of a chain, for a one-line error that quotes a library's
    (torch.compile wraps the backend's own error in a BackendCompilerFailed whose first line names only the backend)."""
    while True:
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if inner is None or inner is error:
            break
        error = inner
    return f"{type(error).__name__}: {first_line(error, None)}" if str(error).strip() else type(error).__name__


def fail(prog, message, code=2):
    """Print `prog: error: message` as the one line on stderr and exit with `code`."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(code) from None


@contextlib.contextmanager
def one_line_errors(prog, interrupted=None):
    """ConfigError -> one line and exit code 2, RunError -> one line and exit code 1; with `interrupted` (what a
    Ctrl-C leaves, in words), a Ctrl-C, or an error it caused on its way out (caused_by_ctrl_c), -> one line and
    exit code 130."""
    try:
        yield
    except ConfigError as e:  # and its subclasses (autoencoder.DownloadNeeded)
        fail(prog, e, 2)
    except RunError as e:
        fail(prog, e, 1)
    except BaseException as error:
        if interrupted is None or not caused_by_ctrl_c(error):
            raise
        print(f"{prog}: interrupted: {interrupted}", file=sys.stderr)
        raise SystemExit(130) from None


def caused_by_ctrl_c(error):
    """Whether `error` is a Ctrl-C's KeyboardInterrupt, or an error it caused on its way out (raised inside tqdm's
    lock, it leaves "cannot release un-acquired lock")."""
    while error is not None:
        if isinstance(error, KeyboardInterrupt):
            return True
        error = error.__context__
    return False


def quit_on_ctrl_c(prog):
    """A command's first act, before it imports torch and diffusers (seconds): a Ctrl-C then exits at once, in
    one line, not with Python's traceback from inside an import. `ctrl_c_raises` ends it, once imported."""

    def quit(signum, frame):
        sys.stderr.write(f"{prog}: interrupted while starting: nothing was written\n")
        os._exit(130)

    signal.signal(signal.SIGINT, quit)


def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt again (Python's own), for the command's handling."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
