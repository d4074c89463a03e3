"""The two errors every module raises; the entry points print them as one line.

ConfigError: a bad flag, path or combination (exit code 2): the message says what to change.
RunError: training cannot go on (disk full, a non-finite loss with --on_nonfinite stop; exit code 1).
"""


class ConfigError(Exception):
    """A bad flag, path or combination: reported as one line, exit code 2."""


class RunError(Exception):
    """Training cannot go on (disk full, non-finite loss): one line, exit code 1."""
