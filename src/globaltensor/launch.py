"""Multi-process launcher: ``python -m globaltensor.launch --nproc-per-node N script.py args...``.

Starts N copies of a Python script (or, with ``-m``, a module) on this machine, each with
the torchrun-compatible environment MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK and
LOCAL_RANK, from which globaltensor's process world initialises itself. Every line a rank
writes is echoed with a ``[rank N] `` prefix on the launcher's stdout or stderr.

The launcher hosts the job's store (a ``torch.distributed.TCPStore`` on MASTER_PORT, as
torchrun's agent does; the ranks connect to it as clients, ``TORCHELASTIC_USE_AGENT_STORE``):
it outlives every rank, so when a rank dies the others can still read from it who did not
arrive at a collective and why (comm/arrivals.py) -- with rank 0 hosting it, rank 0's death
would take that away.

The job fails fast: as soon as one rank exits non-zero or dies by a signal, the others are
sent SIGTERM, then SIGKILL after a grace period, and the launcher exits non-zero naming the
rank and how it ended. ``--timeout`` bounds the whole job the same way.

``--start-method fork`` imports torch and globaltensor once in the launcher and forks the ranks
from it, each then starting in a fraction of a second instead of importing torch (forked_rank.py
says what differs from a fresh interpreter); ``spawn``, the default, execs each rank.

Exit status: 0 when every rank exits 0; else the failed rank's exit code (128 + N when it
died by signal N), 124 on ``--timeout``, 128 + N when the launcher itself gets signal N.
"""
from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, List, Optional, Sequence

from .forked_rank import ForkedRank, preload

POLL_S = 0.05
#: how close two ranks' ends must be for a signal's to be reported before an error's (:func:`_cause`)
SAME_END_S = 0.25

TIMEOUT_EXIT = 124


class _Stop(Exception):
    """Raised from a signal handler so that the launcher tears its ranks down before exiting."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# -- arguments ----------------------------------------------------------------------------
def _number(text: str, kind, accept, expected: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not accept(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def _port(text: str) -> int:
    return _number(text, int, lambda v: 1 <= v <= 65535, "a port in 1..65535")


def _seconds(text: str) -> float:
    return _number(text, float, lambda v: 0 < v < float("inf"), "a positive number of seconds")


def _non_negative_seconds(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v < float("inf"), "a non-negative number of seconds")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m globaltensor.launch",
        description="Run N processes of a script with the torchrun environment variables set; "
                    "fail fast when any of them fails.")
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc", type=_positive_int, required=True,
                   metavar="N", help="number of processes (ranks) to start")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1",
                   help="MASTER_ADDR (default: 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=_port, default=None,
                   help="MASTER_PORT (default: a free port)")
    p.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="kill the whole job after this many seconds and exit non-zero")
    p.add_argument("--grace", type=_non_negative_seconds, default=5.0, metavar="SECONDS",
                   help="seconds between SIGTERM and SIGKILL when tearing the job down (default: 5)")
    p.add_argument("--start-method", "--start_method", dest="start_method", choices=("spawn", "fork"),
                   default="spawn",
                   help="spawn: each rank a fresh interpreter (default); fork: import torch and globaltensor "
                        "once here and fork the ranks from this process, which saves each rank the import")
    p.add_argument("-m", "--module", action="store_true",
                   help="treat the target as a module name, run as `python -m module`")
    p.add_argument("script", help="the Python script (or, with -m, the module) to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed on to the script")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.module and not os.path.isfile(args.script):
        parser.error(f"script not found: {args.script}")
    return args


# -- environment --------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it; rank 0 binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rank_env(base: dict, rank: int, world_size: int, master_addr: str, master_port: int) -> dict:
    env = dict(base)
    env.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), WORLD_SIZE=str(world_size),
               RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
               GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world_size),
               TORCHELASTIC_USE_AGENT_STORE="True")
    return env


def host_store(master_port: int, world_size: int):
    """The job's store, served from this process until it exits (the ranks' connections retry until
    it is up, so the ranks start while torch loads here)."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    return TCPStore("0.0.0.0", master_port, world_size, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=60))


def command(args: argparse.Namespace) -> List[str]:
    """The ranks' command line; ``-u`` so that their lines reach the launcher as they are written."""
    target = ["-m", args.script] if args.module else [args.script]
    return [sys.executable, "-u", *target, *args.script_args]


# -- processes ----------------------------------------------------------------------------
def start_rank(cmd: List[str], env: dict) -> subprocess.Popen:
    """Start one rank in its own session, so that teardown reaches any processes it spawns too."""
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def pump(rank: int, src: IO[bytes], dst: IO[bytes], lock: threading.Lock) -> None:
    """Copy ``src`` to ``dst`` line by line, each line prefixed with ``[rank N] ``.

    If ``dst`` breaks (say the reader of a pipe went away), keep reading ``src`` anyway, so
    that the rank never blocks on a full pipe.
    """
    prefix = f"[rank {rank}] ".encode()
    broken = False
    for line in iter(src.readline, b""):
        if broken:
            continue
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            try:
                dst.write(prefix + line)
                dst.flush()
            except (OSError, ValueError):
                broken = True
    src.close()


def start_pumps(procs: List[subprocess.Popen]) -> List[threading.Thread]:
    lock = threading.Lock()
    threads = []
    for rank, proc in enumerate(procs):
        for src, dst in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            t = threading.Thread(target=pump, args=(rank, src, dst, lock), daemon=True)
            t.start()
            threads.append(t)
    return threads


def _signal_group(proc, sig: int) -> None:
    """Signal the rank's process group -- or the rank alone, where a forked rank has not yet made its
    session (forked_rank.py)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        try:
            os.kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    except PermissionError:
        pass


def terminate(procs: List[subprocess.Popen], grace: float) -> None:
    """SIGTERM every rank's process group, then SIGKILL the ones still alive after ``grace`` seconds.

    Groups of ranks that already exited are signalled too: processes they spawned may remain.
    """
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    for p in procs:
        _signal_group(p, signal.SIGKILL)
    for p in procs:
        p.wait()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


def monitor(procs: List[subprocess.Popen], timeout: Optional[float]) -> tuple:
    """Wait until every rank succeeded, one failed, or the time ran out.

    Returns ``("ok", [])``, ``("failed", [the rank that failed first])`` or ``("timeout", [ranks still
    running])``. A thread per rank waits for it, so the ranks' ends come in the order they happen: a
    rank killed, then its peer exiting on the broken collective a few milliseconds later, is reported
    as the killed rank -- a poll every few tens of milliseconds would see both at once and could not
    tell which came first.
    """
    ended: "queue.Queue" = queue.Queue()
    for r, p in enumerate(procs):
        threading.Thread(target=lambda r=r, p=p: ended.put((r, p.wait())), name=f"rank {r} waiter",
                         daemon=True).start()
    deadline = None if timeout is None else time.monotonic() + timeout
    left = set(range(len(procs)))
    while left:
        if deadline is not None and time.monotonic() >= deadline:
            return "timeout", sorted(left)
        try:
            r, code = ended.get(timeout=POLL_S)      # short waits: the launcher's signal handlers run between
        except queue.Empty:
            continue
        left.discard(r)
        if code != 0:
            return "failed", [_cause(r, code, ended)]
    return "ok", []


def _cause(r: int, code: int, ended: "queue.Queue") -> int:
    """The rank to report for a job whose rank ``r`` ended first with ``code``: ``r``, unless it exited
    with an error and another rank killed by a signal ends within :data:`SAME_END_S` -- then that one.
    On a busy machine a killed rank's waiter thread may run after its peer's, which exits on the
    collective the kill broke a few milliseconds later; a signal is the cause, the error its effect."""
    deadline = time.monotonic() + SAME_END_S
    while code > 0 and time.monotonic() < deadline:
        try:
            other, other_code = ended.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if other_code < 0:
            return other
    return r


def _exit_code_of(code: int) -> int:
    """A rank's exit status as the launcher's: the same code, or 128 + signal number (as shells do)."""
    return code if code > 0 else 128 - code


def _raise_stop(signum, frame):
    raise _Stop(signum)


class _StopOnSignals:
    """Turn SIGTERM / SIGHUP / SIGINT into :class:`_Stop` inside the block (main thread only)."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def __enter__(self):
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, _raise_stop) for s in self.SIGNALS}

    def __exit__(self, *exc):
        for s, h in self.previous.items():
            signal.signal(s, h)


def run(args: argparse.Namespace) -> int:
    """Run the job; returns the launcher's exit status."""
    port = args.master_port or free_port()
    cmd = command(args)
    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []
    try:
        with _StopOnSignals():
            if args.start_method == "fork":
                preload()
            for rank in range(args.nproc):
                env = rank_env(os.environ, rank, args.nproc, args.master_addr, port)
                procs.append(ForkedRank(args.script, args.module, args.script_args, env)
                             if args.start_method == "fork" else start_rank(cmd, env))
            pumps = start_pumps(procs)
            try:
                store = host_store(port, args.nproc)  # noqa: F841 -- served while it lives
            except RuntimeError as e:
                _say(f"cannot serve the job's store on port {port} ({e}); terminating ranks")
                terminate(procs, args.grace)
                _drain(pumps)
                return 1
            outcome, ranks = monitor(procs, args.timeout)
    except _Stop as stop:
        alive = [r for r, p in enumerate(procs) if p.poll() is None]
        _say(f"received {signal.Signals(stop.signum).name}; terminating ranks {alive}")
        terminate(procs, args.grace)
        _drain(pumps)
        return 128 + stop.signum
    except BaseException:
        terminate(procs, args.grace)
        raise

    if outcome == "ok":
        _drain(pumps)
        return 0
    alive = [r for r, p in enumerate(procs) if p.poll() is None]
    terminate(procs, args.grace)
    _drain(pumps)
    if outcome == "failed":
        for r in ranks:
            _say(f"rank {r} {describe_exit(procs[r].returncode)}" + (f"; terminated ranks {alive}" if alive else ""))
        return _exit_code_of(procs[ranks[0]].returncode)
    _say(f"timeout after {args.timeout:g} s; ranks {ranks} were still running; terminated them")
    return TIMEOUT_EXIT


def _drain(pumps: List[threading.Thread]) -> None:
    """Let the last lines through; a grandchild still holding a pipe open must not block the exit."""
    deadline = time.monotonic() + 2.0
    for t in pumps:
        t.join(max(0.0, deadline - time.monotonic()))


def _say(message: str) -> None:
    try:
        sys.stderr.write(f"globaltensor.launch: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
