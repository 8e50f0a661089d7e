"""Shared test helpers.

Launching: the session fixture ``launch`` gives :func:`launch`, ``launch(script, nproc)``, which
runs a Python script -- source text or a path -- under ``python -m globaltensor.launch`` with
``nproc`` gloo processes on 127.0.0.1 and a free port, a low collective timeout and a hard
time limit, and returns a :class:`LaunchResult`. With ``check=True`` a failed job fails the
test with the job's output, whose lines name their rank. The suite never hangs on a job: the
launcher's own ``--timeout`` ends it first, and past that the launcher itself is stopped.
The fixture ``launch_tools`` gives the lower-level helpers (``run_job``, ``job_env``, ``free_port``).
"""
from __future__ import annotations

import getpass
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Union

import pytest
import torch

import globaltensor as gt

# One thread per test process: the suite runs two workers on two cores, and a launched job's
# ranks get OMP_NUM_THREADS=1 likewise (job_env); more threads only spin against each other.
torch.set_num_threads(1)

# Inductor's caches do not key a compiled graph by ATEN_CPU_CAPABILITY: with torch 2.13, a graph
# compiled under this machine's avx512 and found again under ATEN_CPU_CAPABILITY=avx2 computes
# garbage, and under "default" fails to compile. A run that forces a capability (the suite is
# tried under each) keeps caches of its own; its launched jobs inherit the setting.
if os.environ.get("ATEN_CPU_CAPABILITY"):
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}"))

COLLECTIVE_TIMEOUT_S = 20
JOB_TIMEOUT_S = 120
OUTPUT_TAIL_LINES = 150


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchResult:
    returncode: int
    stdout: str = field(repr=False)
    stderr: str = field(repr=False)
    elapsed: float
    command: List[str]

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def lines(self, rank: int) -> List[str]:
        """The stdout lines of ``rank``, without their ``[rank N] `` prefix."""
        prefix = f"[rank {rank}] "
        return [line[len(prefix):] for line in self.stdout.splitlines() if line.startswith(prefix)]

    def records(self, ranks: Sequence[int], prefix: str = "GT ") -> list:
        """The JSON records ``ranks`` printed as ``GT {json}`` lines, rank by rank."""
        return [json.loads(line[len(prefix):]) for r in ranks for line in self.lines(r) if line.startswith(prefix)]

    def one_record_each(self, ranks: Sequence[int], prefix: str = "GT ") -> list:
        """:meth:`records` of ``ranks``, failing the test (with the job's output) unless each printed one."""
        records = self.records(ranks, prefix)
        assert len(records) == len(ranks), f"{len(records)} records from ranks {list(ranks)}\n" + self.describe()
        return records

    def describe(self, tail: int = OUTPUT_TAIL_LINES) -> str:
        def last(text):
            lines = [line if len(line) <= 400 else line[:400] + " [...]" for line in text.splitlines()]
            cut = len(lines) - tail
            return ("[... %d lines ...]\n" % cut if cut > 0 else "") + "\n".join(lines[-tail:])
        return (f"command: {' '.join(self.command)}\nexit code {self.returncode} after {self.elapsed:.1f} s\n"
                f"--- stdout ---\n{last(self.stdout)}\n--- stderr ---\n{last(self.stderr)}")

    def check(self) -> "LaunchResult":
        if self.returncode != 0:
            pytest.fail("launched job failed\n" + self.describe(), pytrace=False)
        return self


def run_job(cmd: Sequence[str], *, env: Optional[Dict[str, str]] = None, timeout: float = JOB_TIMEOUT_S,
            cwd: Optional[str] = None) -> LaunchResult:
    """Run ``cmd`` with a hard time limit; past it, SIGTERM (so a launcher tears its ranks down), then SIGKILL."""
    start = time.monotonic()
    proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace")
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        err += f"\n[test harness] killed the job after its hard limit of {timeout:g} s\n"
    return LaunchResult(proc.returncode, out, err, time.monotonic() - start, list(cmd))


def job_env(collective_timeout: float = COLLECTIVE_TIMEOUT_S, extra: Optional[Dict[str, str]] = None) -> dict:
    """This environment without any inherited rank variables, one thread per process, a low collective timeout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(GT_COLLECTIVE_TIMEOUT=str(collective_timeout), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def _script_path(script: Union[str, Path], workdir: str) -> str:
    """``script`` as a file: a path that exists is used as is, anything else is taken as source text."""
    if isinstance(script, Path) or (isinstance(script, str) and "\n" not in script and os.path.isfile(script)):
        return str(script)
    path = os.path.join(workdir, "job.py")
    Path(path).write_text(script)
    return path


def launch(script: Union[str, Path], nproc: int, *, args: Sequence[str] = (), check: bool = True,
           collective_timeout: float = COLLECTIVE_TIMEOUT_S, timeout: float = JOB_TIMEOUT_S,
           env: Optional[Dict[str, str]] = None, launcher_args: Sequence[str] = (),
           start_method: str = "fork") -> LaunchResult:
    """Run ``script`` under ``python -m globaltensor.launch`` with ``nproc`` gloo ranks on 127.0.0.1.

    The launcher's ``--timeout`` is ``timeout``; the harness stops the launcher 30 s after that.
    ``start_method``: the ranks forked from the launcher by default -- it imports torch and
    globaltensor once, where each exec'd rank would import them again (about 5 s of CPU a rank
    here, the largest part of most launched tests); tests/launch runs the launcher both ways, and
    the 2-process world test and the CUDA lane's clean-exit job exec their ranks (``"spawn"``), so
    that fresh interpreters, with their own hash seeds and their finalization at exit, stay covered.
    """
    with tempfile.TemporaryDirectory(prefix="gt-launch-") as workdir:
        path = _script_path(script, workdir)
        cmd = [sys.executable, "-m", "globaltensor.launch", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--timeout", str(timeout),
               "--start-method", start_method, *launcher_args, path, *args]
        result = run_job(cmd, env=job_env(collective_timeout, env), timeout=timeout + 30, cwd=workdir)
    return result.check() if check else result


@pytest.fixture(scope="session")
def launch_tools():
    """The lower-level helpers, for tests that run a launcher (or torchrun) command of their own."""
    return SimpleNamespace(free_port=free_port, job_env=job_env, run_job=run_job, LaunchResult=LaunchResult)


@pytest.fixture(scope="session", name="launch")
def _launch_fixture():
    """The :func:`launch` function, for tests (module-scoped fixtures included) that take it as a fixture."""
    return launch


@pytest.fixture
def float64():
    """float64 by default for the test, and the global random factories seeded: "equal" then
    means equal up to the last bits (and exactly where only data moves)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    gt.manual_seed(0)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@pytest.fixture
def world4():
    """A 4-rank simulated world for the test."""
    with gt.simulate(4) as w:
        yield w


@pytest.fixture
def p1(world4):
    """Placement of 4 ranks in a row, in a 4-rank simulated world."""
    return gt.placement("cpu", [0, 1, 2, 3])


@pytest.fixture
def p2(world4):
    """A 2x2 placement, in a 4-rank simulated world."""
    return gt.placement("cpu", [[0, 1], [2, 3]])


# Tests that run at the development pin only (`make test`), not at the ends of the torch range
# (`make test-compat` deselects the ``pin_only`` marker): their subject is the library's own process
# management (the launcher's command line, teardown and failure propagation) and thread scheduling,
# or they repeat on launched processes what another test checks on a simulated world and a 4-process
# one (the 2-process world, whose ranks are fresh interpreters: at the ends, torchrun's test starts
# such ranks). What exercises torch itself -- ops, autograd, Dynamo, gloo's collectives and
# timeouts, torchrun, DCP, DTensor -- runs at every end. They take about a third of the suite's
# time, which CI's three runs could not afford. The docs print the development pin's numbers
# (tools/docs_numbers.py); auto_plan's memory model counts the tensors a release's autograd saves for
# the backward, which differ from release to release, so the explain() region is checked at the pin.
PIN_ONLY = (
    "tests/launch/test_launch.py::test_success_sets_env_and_prefixes_every_line",
    "tests/launch/test_launch.py::test_nonzero_exit_ends_the_job_fast",
    "tests/launch/test_launch.py::test_death_by_signal_ends_the_job_fast",
    "tests/launch/test_launch.py::test_rank_ignoring_sigterm_is_killed_after_the_grace_period",
    "tests/launch/test_launch.py::test_timeout_kills_the_job_and_names_running_ranks",
    "tests/launch/test_launch.py::test_sigterm_to_the_launcher_stops_its_ranks",
    "tests/launch/test_launch.py::test_module_mode_default_port_and_given_addr",
    "tests/launch/test_launch.py::test_a_forked_rank_runs_and_ends_as_a_fresh_interpreter_would",
    "tests/launch/test_launch.py::test_argument_error_exits_2_from_the_command_line",
    "tests/multiprocess/test_failures.py::test_rank_calling_sys_exit_ends_the_job_before_the_collective_timeout",
    "tests/multiprocess/test_process_world.py::test_process_world[2proc]",
    "tests/multiprocess/test_compiled.py::test_op_raising_",
    "tests/multiprocess/test_killed_rank.py::test_killed_rank_ends_a_compiled_launched_job",
    "tests/multiprocess/test_comm_profile_launched.py::",
    "tests/multiprocess/test_same_program.py::",
    "tests/training/test_demo_launch.py::",
    "tests/docs/test_examples.py::",
    "tests/docs/test_notebook.py::",
    "tests/actor_rt/test_deadlock_freedom.py::",
    "tests/actor_rt/test_flow_control.py::",
    "tests/actor_rt/test_simulated_scale.py::",
    "tests/boxing/test_repeated_launched.py::",
    "tests/docs/test_docs_numbers.py::test_the_region_is_what_the_code_prints[explain]",
    # torchtitan's models: installed at the pin only (Makefile: TITAN; test-compat leaves out the tests
    # that import them: NOT_TITAN)
    "tests/docs/test_docs_numbers.py::test_the_region_is_what_the_code_prints[titan-tp]",
    # DTensor's own collectives differ by release (its clipping reduces 4 bytes at 2.9.1, 84 at 2.13)
    "tests/docs/test_docs_numbers.py::test_the_region_is_what_the_code_prints[peer-plans]",
    # torch.distributed.pipelining's buffers differ by release: 2.13 makes a receive buffer per
    # micro-batch ahead and keeps it (as the code has since PiPPy, and as plan_at_scale's TORCHTITAN
    # takes it for torchtitan's runs of 2024-12), 2.15 receives into tensors made as messages come;
    # at 2.9.1 its stages' first exchange over gloo fails (a size mismatch, without this library too)
    "tests/multiprocess/test_pipelining_buffers.py::",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(PIN_ONLY):
            item.add_marker(pytest.mark.pin_only)
