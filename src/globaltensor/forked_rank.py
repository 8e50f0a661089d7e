"""Ranks forked from the launcher (``python -m globaltensor.launch --start-method fork``).

A rank started by exec imports torch and globaltensor itself: seconds of CPU per rank, paid by
every rank of every job. With ``fork`` the launcher imports them once and forks each rank from
itself; the rank then runs the script as ``python -u script.py`` would -- in a session of its
own, stdin from /dev/null, stdout and stderr to the launcher's pipes (written through), the
rank's environment, ``sys.argv`` and ``sys.path[0]`` the script's, signals at their defaults --
and ends as the interpreter would: non-daemon threads joined, ``atexit`` handlers run, the
exit status the script's (``SystemExit``'s code, 1 after an uncaught exception, printed by
``sys.excepthook``).

What differs from exec: the ranks share the launcher's hash seed (``PYTHONHASHSEED``), so set
iteration orders agree across ranks where exec'd ranks would differ; modules the launcher
imported are not re-imported (environment variables they read at import are the launcher's,
which the ranks' environment extends only by the rank variables); and a rank leaves by
``os._exit`` after those duties, without the interpreter's finalization (module teardown, C++
static destructors) -- a check of a clean exit runs its ranks by exec. Forking happens before
the launcher starts any thread of its own or touches CUDA.

:class:`ForkedRank` offers what the launcher uses of ``subprocess.Popen``: ``pid``, ``stdout``,
``stderr``, ``poll()``, ``wait()`` and ``returncode`` (negative: killed by that signal).
"""
from __future__ import annotations

import atexit
import io
import os
import runpy
import signal
import sys
import threading
import traceback
from typing import List, Optional


def preload() -> None:
    """Import what every rank would: torch and globaltensor (the launcher's own imports stay lazy)."""
    import globaltensor  # noqa: F401


class ForkedRank:
    """A rank forked from this process, running ``target`` (a script path, or a module with ``module``)."""

    def __init__(self, target: str, module: bool, args: List[str], env: dict):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(_child(target, module, args, env, out_w, err_w))
        os.close(out_w)
        os.close(err_w)
        self.pid = pid
        self.stdout = os.fdopen(out_r, "rb")
        self.stderr = os.fdopen(err_r, "rb")
        self.returncode: Optional[int] = None
        # one reaper at a time, as subprocess.Popen: a thread blocked in wait() and a poll() elsewhere
        # would race for the child, the loser's waitpid failing (ECHILD)
        self._reaping = threading.Lock()

    def poll(self) -> Optional[int]:
        """The exit status, or None while it runs (or while another thread's wait() reaps it)."""
        if self.returncode is None and self._reaping.acquire(blocking=False):
            try:
                if self.returncode is None:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            finally:
                self._reaping.release()
        return self.returncode

    def wait(self) -> int:
        with self._reaping:
            if self.returncode is None:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _child(target: str, module: bool, args: List[str], env: dict, out_w: int, err_w: int) -> int:
    """The rank's side of the fork: set up as a fresh ``python -u`` would be, run, return the status."""
    try:
        os.setsid()
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True,
                                      errors="backslashreplace")
        os.environ.clear()
        os.environ.update(env)
    except BaseException:
        return 1
    code = _run(target, module, args)
    _finish()
    return code


def _run(target: str, module: bool, args: List[str]) -> int:
    sys.argv = [target, *args]
    try:
        if module:
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        return 0
    except SystemExit as e:
        return _exit_status(e.code)
    except BaseException:
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:
            traceback.print_exc()
        return 1


def _exit_status(code) -> int:
    """``sys.exit(code)``'s status, as the interpreter gives it: None 0, an int itself, else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish() -> None:
    """The interpreter's exit duties: join non-daemon threads, run ``atexit`` handlers, flush."""
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
