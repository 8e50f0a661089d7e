"""The process world in 2- and 4-process gloo jobs, against the simulated world and a single rank.

One launch per world size runs ``_rank_program.py`` (many checks batched); the checks below
read its ``GT {json}`` records. Byte counts and random tensors are recomputed here, in this
process, on a simulated world of the same size.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import globaltensor as gt
from launched_values import logical

PROGRAM = Path(__file__).with_name("_rank_program.py")
RECORD = re.compile(r"^\[rank (\d+)\] GT (.*)$")
SECTIONS = ["world", "conversions", "random", "from_local", "subset", "local_map", "expert_parallel", "ring_attention"]


class Job:
    def __init__(self, n, result):
        self.n = n
        self.result = result
        self.records = {}  # (section, rank) -> record
        for line in result.stdout.splitlines():
            m = RECORD.match(line)
            if m:
                rec = json.loads(m.group(2))
                self.records[(rec["section"], int(m.group(1)))] = rec

    def section(self, name):
        """``{rank: record}`` of a section every rank finished, else the test fails with the job's output."""
        got = {r: self.records.get((name, r)) for r in range(self.n)}
        for r, rec in got.items():
            if rec is None or "error" in rec:
                why = "never finished" if rec is None else "raised:\n" + rec["error"]
                raise AssertionError(f"section {name!r} on rank {r} {why}")
        return got

    def checked(self, name):
        """The section's records, after asserting that no rank recorded a failed check."""
        recs = self.section(name)
        failures = [f"rank {r}: {f}" for r, rec in recs.items() for f in rec["failures"]]
        assert not failures, f"{len(failures)} failed checks in {name!r}:\n" + "\n".join(failures[:40])
        assert all(rec["checks"] > 0 for rec in recs.values()), f"section {name!r} ran no checks"
        return recs


# The rank program's inputs, rebuilt here (kept in step with _rank_program.py).
SBPS = {"S0": gt.sbp.split(0), "S1": gt.sbp.split(1), "B": gt.sbp.broadcast, "P": gt.sbp.partial_sum}
SHAPES = [(8, 6), (7, 5), (3, 1)]
RANDOM_SHAPES = [(7, 5), (3, 1)]
SEED = 1234


def check_job_succeeded(job):
    assert job.result.returncode == 0, f"the job exited with {job.result.returncode}"
    for name in SECTIONS:
        job.section(name)


def check_rank_and_world_size(job):
    recs = job.checked("world")
    assert {r: (rec["rank"], rec["world_size"]) for r, rec in recs.items()} == {r: (r, job.n) for r in range(job.n)}


def check_conversion_pieces_and_numpy(job):
    recs = job.checked("conversions")
    # 2 placements x shapes x 16 pairs, each checking source piece, shape, sbp, piece, numpy()
    assert min(rec["checks"] for rec in recs.values()) >= 2 * len(SHAPES) * 16 * 5


def simulated_stats(n):
    stats = {}
    with gt.simulate(n):
        placements = {"all": gt.placement("cpu", ranks=list(range(n))),
                      "reversed": gt.placement("cpu", ranks=list(reversed(range(n))))}
        for pname, plc in placements.items():
            for salt, shape in enumerate(SHAPES):
                full = logical(shape, salt)
                for aname, a in SBPS.items():
                    for bname, b in SBPS.items():
                        x = gt.distribute(full, plc, a)
                        with gt.comm_stats() as st:
                            x.to_global(sbp=b)
                        stats[f"{pname} {shape} {aname}->{bname}"] = {
                            "bytes": st.bytes_sent, "ops": st.ops(),
                            "per_rank": {str(r): v for r, v in sorted(st.per_rank.items())}}
    return stats


def check_comm_stats_match_simulated_world(job):
    recs = job.section("conversions")
    expected = simulated_stats(job.n)
    for r, rec in recs.items():
        got = rec["stats"]
        assert set(got) == set(expected), f"rank {r}: converted a different set of cases"
        wrong = {k: (got[k], expected[k]) for k in expected if got[k] != expected[k]}
        assert not wrong, (f"rank {r}: comm_stats differ from the simulated world's (process, simulated):\n"
                           + "\n".join(f"{k}: {v}" for k, v in list(wrong.items())[:20]))
    # the counting is not trivially zero: S->B moves (p-1)/p of the tensor in the ring
    assert expected["all (8, 6) S0->B"]["bytes"] == 8 * 6 * 4 * (job.n - 1) // job.n


def check_random_factories_match_simulated_and_single_rank(job):
    recs = job.checked("random")
    mismatches = []
    for fname in ("randn", "rand"):
        factory = getattr(gt, fname)
        for shape in RANDOM_SHAPES:
            with gt.simulate(1):
                gt.manual_seed(SEED)
                one = factory(*shape, placement=gt.placement("cpu", ranks=[0]), sbp=gt.sbp.broadcast).numpy()
            for sname, sbp in SBPS.items():
                key = f"{fname} {shape} {sname}"
                with gt.simulate(job.n):
                    gt.manual_seed(SEED)
                    sim = factory(*shape, placement=gt.placement("cpu", ranks=list(range(job.n))), sbp=sbp).numpy()
                np.testing.assert_array_equal(sim, one, err_msg=f"simulated {key} differs from 1 rank")
                for r, rec in recs.items():
                    got = np.asarray(rec["values"][key], dtype=np.float32)
                    if got.shape != one.shape or not np.array_equal(got, one):
                        mismatches.append(f"rank {r} {key}")
    assert not mismatches, "process-world random tensors differ from the single-rank ones: " + ", ".join(mismatches)
    assert len({json.dumps(rec["values"]["randn (7, 5) S0"]) for rec in recs.values()}) == 1


def check_to_global_from_uneven_local_pieces(job):
    job.checked("from_local")


def check_subset_placement(job):
    job.checked("subset")


def check_local_map(job):
    job.checked("local_map")


def check_expert_parallel(job):
    job.checked("expert_parallel")


def check_ring_attention(job):
    job.checked("ring_attention")


CHECKS = [check_job_succeeded, check_rank_and_world_size, check_conversion_pieces_and_numpy,
          check_comm_stats_match_simulated_world, check_random_factories_match_simulated_and_single_rank,
          check_to_global_from_uneven_local_pieces, check_subset_placement, check_local_map,
          check_expert_parallel, check_ring_attention]


@pytest.mark.parametrize("n", [2, 4], ids=lambda n: f"{n}proc")
def test_process_world(n, launch):
    """One launch, every check; a failure names each check that failed, then the job's output.

    (One test per world size rather than one per check: under pytest-xdist a module-scoped
    fixture would launch the same job again on every worker that gets one of the checks.)
    """
    # two fresh interpreters (conftest.launch: other launched tests fork their ranks), four forked
    job = Job(n, launch(PROGRAM, n, check=False, start_method="spawn" if n == 2 else "fork"))
    failed = []
    for check in CHECKS:
        try:
            check(job)
        except AssertionError as e:
            failed.append(f"--- {check.__name__}: {e}")
    assert not failed, "\n".join(failed) + "\n\n" + job.result.describe()
