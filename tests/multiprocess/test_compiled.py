"""gt.compile in a process world: 4 launched gloo processes, each running its own rank's tasks.

One launch of ``_compiled_program.py equal`` runs, on every rank side by side, the eager and the
compiled version of forwards with boxing (1-D and 2x2, uneven sizes), training steps (SGD with
momentum, AdamW, ZeroOptimizer; a Megatron-planned MLP and hand-placed parameters on a 2x2 data x
tensor placement), dropout, ``g.pipeline`` and 2-stage pipeline parallelism with
``micro_batches=4``; every rank compares its own pieces and reports one record per section.

Three more launches fail on purpose: an op raising in the graph on every rank (a GraphError on
every rank within seconds, a recapture that works, then a non-zero exit naming the op), on rank 0
only while its peers wait in an all-gather (rank 0's process dies of its GraphError; the others
leave the all-gather with a GraphError naming the collective and rank 0's failing op, well before
the collective timeout), and on rank 0 only with rank 0 staying alive (the others fail after the
collective timeout, naming the collective and rank 0's failing op).
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

PROGRAM = Path(__file__).with_name("_compiled_program.py")
FAIL_ALL_TIMEOUT_S = 20   # the fail-all job's collective timeout
RECORD = re.compile(r"^\[rank (\d+)\] GT (.*)$")
N = 4
OP = "gt_mp_compiled.maybe_fail"
SECTIONS = {  # section -> the fewest checks a rank must have run in it
    "forward_1d": 20, "forward_2x2": 20, "training": 300, "hand_placed": 40, "dropout": 40,
    "pipeline": 40, "pipeline_parallel": 30,
}


def records(result) -> dict:
    """``{(section, rank): record}`` from the job's ``GT {json}`` lines."""
    out = {}
    for line in result.stdout.splitlines():
        m = RECORD.match(line)
        if m:
            rec = json.loads(m.group(2))
            out[(rec["section"], int(m.group(1)))] = rec
    return out


def section_problems(recs: dict, name: str, min_checks: int) -> list:
    """What is wrong with a section's records: a rank that never finished it, raised, failed checks."""
    problems = []
    counts = set()
    for r in range(N):
        rec = recs.get((name, r))
        if rec is None:
            problems.append(f"{name}: rank {r} never finished the section")
        elif "error" in rec:
            problems.append(f"{name}: rank {r} raised:\n{rec['error']}")
        else:
            problems += [f"{name}: rank {r}: {f}" for f in rec["failures"]]
            if rec["checks"] < min_checks:
                problems.append(f"{name}: rank {r} ran {rec['checks']} checks, expected at least {min_checks}")
            counts.add(rec["checks"])
    if len(counts) > 1:
        problems.append(f"{name}: the ranks ran different numbers of checks: {sorted(counts)}")
    return problems


def test_compiled_equals_eager_on_4_processes(launch):
    job = launch(PROGRAM, N, args=["equal"], check=False, timeout=150)
    recs = records(job)
    problems = [] if job.returncode == 0 else [f"the job exited with {job.returncode}"]
    for name, min_checks in SECTIONS.items():
        problems += section_problems(recs, name, min_checks)
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:60]) + "\n\n" + job.describe()


def _error_records(job, section: str) -> dict:
    recs = records(job)
    missing = [r for r in range(N) if (section, r) not in recs]
    assert not missing, f"ranks {missing} never reported how the failing call ended\n" + job.describe()
    return {r: recs[(section, r)] for r in range(N)}


def _assert_op_error(rec: dict, rank: int, job, within_s: float) -> None:
    """The record of a call that failed in the custom op on ``rank``: a GraphError naming op and rank, within
    the job's collective timeout ``within_s`` (a failure that waited on another stream would take that)."""
    msg = rec["graph_error"]
    assert msg is not None, f"rank {rank}: expected gt.GraphError, got {rec['other']}\n" + job.describe()
    assert OP in msg and f"rank {rank}" in msg and "injected failure" in msg, \
        f"rank {rank}: the GraphError does not name the op, the rank and the op's message: {msg}"
    assert rec["cause"] == "InjectedFailure", f"rank {rank}: the op's exception is not chained: {rec['cause']}"
    assert rec["seconds"] < within_s, f"rank {rank}: the GraphError took {rec['seconds']} s, not less than the " \
        f"collective timeout ({within_s} s)"


def _assert_collective_error(rec: dict, rank: int, job) -> None:
    """The record of a rank left waiting in the all-gather: a GraphError naming the collective and rank, and
    rank 0 as the rank that did not arrive, with the op that failed there."""
    msg = rec["graph_error"]
    assert msg is not None, f"rank {rank}: expected gt.GraphError, got {rec['other']}\n" + job.describe()
    assert f"globaltensor: rank {rank}: collective all_gather over ranks [0, 1, 2, 3] failed" in msg, \
        f"rank {rank}: the GraphError does not name the collective and the rank: {msg}"
    assert re.search(rf"task \S*all_gather\S*@r{rank} \(op all_gather, rank {rank}\)", msg), \
        f"rank {rank}: the GraphError does not name the collective's task: {msg}"
    # rank 0 did not arrive, and why; a peer still computing on a busy machine may be named beside it
    assert re.search(r"ranks \[0(, \d)*\] did not arrive \(rank 0: it failed: GraphError: globaltensor: task ", msg) \
        and OP in msg, f"rank {rank}: the GraphError does not name the op that failed on rank 0: {msg}"


def test_op_raising_on_every_rank_is_a_graph_error_on_every_rank(launch):
    job = launch(PROGRAM, N, args=["fail-all"], check=False, collective_timeout=FAIL_ALL_TIMEOUT_S, timeout=90)
    errors = _error_records(job, "fail_all_error")
    for r, rec in errors.items():
        _assert_op_error(rec, r, job, FAIL_ALL_TIMEOUT_S)
    problems = section_problems(records(job), "fail_all", 5)     # the recapture after the failure
    assert not problems, "\n".join(problems) + "\n\n" + job.describe()
    # then the op fails again and the GraphError is left uncaught: the job fails, naming the op
    assert job.returncode == 1, "expected exit code 1\n" + job.describe()
    assert re.search(r"globaltensor\.launch: rank \d exited with code 1", job.stderr), job.describe()
    # the op's label, then the SBP signature its decision chose
    assert re.search(rf"GraphError: globaltensor: task \S+ \(op {re.escape(OP)}\.default \(S\(0\)\) -> S\(0\), rank \d\) "
                     rf"raised in the compiled graph: InjectedFailure", job.stderr), job.describe()
    assert "not_reached" not in job.stdout, job.describe()


def _launch_rank0_failure(launch, mode: str, collective_timeout_s: float):
    """Launch ``mode`` (the op raising on rank 0 only) and check how the failing call ended on each rank:
    on rank 0 a GraphError naming the op, on the others one naming the all-gather they waited in.
    Returns the job and ``{rank: record}``."""
    job = launch(PROGRAM, N, args=[mode], check=False, collective_timeout=collective_timeout_s, timeout=90,
                 launcher_args=["--grace", "15"])
    errors = _error_records(job, "fail_rank0_error")
    _assert_op_error(errors[0], 0, job, collective_timeout_s)
    for r in range(1, N):
        _assert_collective_error(errors[r], r, job)
    return job, errors


def test_op_raising_on_rank_0_only_fails_the_others_once_rank_0_exits(launch):
    timeout_s = 20
    job, errors = _launch_rank0_failure(launch, "fail-rank0", timeout_s)
    for r in range(1, N):
        # they leave when rank 0's process is gone, not at the collective timeout
        assert errors[r]["seconds"] < timeout_s, \
            f"rank {r} waited {errors[r]['seconds']} s in the all-gather (timeout {timeout_s} s)\n" + job.describe()
    assert job.returncode == 1, job.describe()
    assert "globaltensor.launch: rank 0 exited with code 1" in job.stderr, job.describe()


def test_op_raising_on_rank_0_alive_fails_the_others_at_the_collective_timeout(launch):
    timeout_s = 6
    job, errors = _launch_rank0_failure(launch, "fail-rank0-alive", timeout_s)
    ended = time.time()
    sleep = records(job)[("rank0_sleeps", 0)]
    for r in range(1, N):
        # at the collective timeout, and not waiting for rank 0's sleep
        assert timeout_s - 1 <= errors[r]["seconds"] < sleep["seconds"], \
            f"rank {r} left the all-gather after {errors[r]['seconds']} s (timeout {timeout_s} s)\n" + job.describe()
    assert job.returncode == 1, job.describe()
    assert re.search(r"globaltensor\.launch: rank [123] exited with code 1; terminated ranks \[0", job.stderr), \
        job.describe()
    assert ended - sleep["at"] < sleep["seconds"], f"the job ended {ended - sleep['at']:.1f} s after rank 0 began " \
        f"to sleep {sleep['seconds']} s: the launcher waited for it\n" + job.describe()
