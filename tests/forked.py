"""Python child processes forked from the test process instead of started as fresh interpreters.

A fresh `python train.py` spends about 13 s of a 2-core machine importing torch, torch._dynamo
and diffusers before its first step; a child forked from a test process that has them imported
starts at once. `Forked` is a subprocess.Popen for `[sys.executable, ...]` commands (a script, -m
or -c) and `run` a subprocess.run; any other command, or a process where CUDA is initialised (a
fork could not use it), gets the real thing. The child runs the program as the interpreter would
(runpy: the script as __main__, sys.argv, the environment and folder given) and ends with
os._exit: the atexit handlers and pytest's state here belong to the parent. It computes on one
thread, as conftest gives the suite's processes: only a process on one thread forks.

A few tests still start a fresh interpreter on purpose: the command-line error test of
test_train.py, the first launch of test_faults' accelerate-launch test, bench/on_gpu.sh's."""

import contextlib
import faulthandler
import gc
import os
import runpy
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import torch

REAL_RUN = subprocess.run


def can_fork(cmd):
    """A Python command, in a process that computes on one thread (conftest's workers: a child forked
    after OpenMP ran on several could hang), has no CUDA, and whose children can still run autograd."""
    return (isinstance(cmd, (list, tuple)) and len(cmd) > 1 and cmd[0] == sys.executable
            and torch.get_num_threads() == 1 and not torch.cuda.is_initialized() and autograd_survives_fork())  # fmt: skip


_AUTOGRAD_FORKS = [True]  # False once a child forked from here could not run a backward: it stays so


def autograd_survives_fork():
    """Whether a child forked now can run a backward. Once autograd's threads have started in this process (after
    some torch.compile and training in one test worker), torch refuses a backward in any forked child ("Unable to
    handle autograd's threading in combination with fork-based multiprocessing"): a child tried once tells."""
    if _AUTOGRAD_FORKS[0]:
        pid = os.fork()
        if pid == 0:
            try:
                torch.ones(1, requires_grad=True).sum().backward()
                os._exit(0)
            except BaseException:
                os._exit(1)
        _AUTOGRAD_FORKS[0] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    return _AUTOGRAD_FORKS[0]


class Forked:
    """`cmd` ([sys.executable, program...]) in a forked child, with stdout and stderr to the files
    (or file descriptors) given, or inherited. Waited for as a Popen: wait, poll, kill, pid,
    returncode (-N when killed by signal N)."""

    def __init__(self, cmd, cwd=None, env=None, stdout=None, stderr=None):
        sys.stdout.flush(), sys.stderr.flush()
        # The child never collects what it inherits (the test process's garbage is the test process's to
        # finalize): forked children have segfaulted in their garbage collector without this (docs/testing.md).
        gc.freeze()
        self.args, self.returncode, self.pid = list(map(str, cmd)), None, os.fork()
        if self.pid == 0:
            _child(self.args[1:], cwd, env, stdout, stderr)  # never returns
        gc.unfreeze()

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _child(program, cwd, env, stdout, stderr):
    code = 1
    try:
        for fd, target in ((1, stdout), (2, stderr)):
            if target is not None:
                os.dup2(target if isinstance(target, int) else target.fileno(), fd)
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # an interpreter's own dispositions
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        faulthandler.dump_traceback_later(200)  # a child that hangs says where, to its stderr
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)  # as a fresh interpreter has them
        GradientState._reset_state()
        if program[0] == "-c":
            sys.argv = ["-c", *program[2:]]
            exec(compile(program[1], "<string>", "exec"), {"__name__": "__main__"})
        elif program[0] == "-m":
            sys.argv = [program[1], *program[2:]]
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(program)
            sys.path.insert(0, os.path.dirname(os.path.abspath(program[0])))
            runpy.run_path(program[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def run(cmd, *, cwd=None, env=None, capture_output=False, text=False, timeout=None, check=False, **kwargs):
    """subprocess.run, in a forked child where it can (can_fork): the same CompletedProcess."""
    if not can_fork(cmd) or kwargs or not capture_output:
        return REAL_RUN(cmd, cwd=cwd, env=env, capture_output=capture_output, text=text, timeout=timeout, check=check,
                        **kwargs)  # fmt: skip
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = Forked(cmd, cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            err.seek(0)
            text = err.read().decode(errors="replace")
            dump = text.find("Timeout (")  # faulthandler's stack dump at 200 s: its head says where it hung
            print(f"--- {shlex.join(child.args)[:200]}: killed after {timeout} s; its stderr:\n"
                  f"{text[dump : dump + 6000] if dump >= 0 else text[-3000:]}", file=sys.stderr)  # fmt: skip
            raise
        finally:
            child.kill()
            child.wait()
        outputs = []
        for file in (out, err):
            file.seek(0)
            data = file.read()
            outputs.append(data.decode() if text else data)
    done = subprocess.CompletedProcess(child.args, child.returncode, *outputs)
    if check:
        done.check_returncode()
    return done
