"""gt.comm_profile in 4 launched processes: every process attributes every rank's collectives as the
simulated world does, and the rows add up to gt.comm_stats(); GLOBALTENSOR_LOG=info logs the boxings."""
import json
import re
import sys
from collections import Counter
from pathlib import Path

import globaltensor as gt

sys.path.insert(0, str(Path(__file__).parent))
from _comm_profile_program import summary  # noqa: E402

PROGRAM = Path(__file__).with_name("_comm_profile_program.py")


def test_launched_profiles_match_the_simulated_one(launch):
    with gt.simulate(4):
        simulated = summary()
    job = launch(PROGRAM, 4, env={"GLOBALTENSOR_LOG": "info"})
    for rank in range(4):
        line = next(l for l in job.lines(rank) if l.startswith("PROFILE "))
        launched = json.loads(line[len("PROFILE "):])
        assert launched == simulated, f"rank {rank}"
    rows = simulated["rows"]
    assert sum((Counter(r["bytes_per_rank"]) for r in rows), Counter()) == Counter(simulated["stats_per_rank"])
    assert simulated["profile_per_rank"] == simulated["stats_per_rank"]
    assert sorted(r["collective"] for r in rows for _ in range(r["calls"])) == simulated["stats_ops"]
    assert {r["op"] for r in rows} >= {"to_global", "gradient bucket"} and {r["module"] for r in rows} >= {"Net", "Global"}
    assert any(r["collective"] == "send_recv" for r in rows)       # the loss moved to ranks 1 and 2 and back
    for rank in range(4):        # each process logs its boxings: every op of the profile has some
        logged = re.findall(rf"^\[rank {rank}\] globaltensor\.boxing INFO: ([^:]+): .* B in all", job.stderr, re.M)
        boxed = {r["op"] for r in rows if r["op"] != "gradient bucket"}    # a bucket is no boxing
        assert boxed <= set(logged), f"rank {rank}"
