"""Eager gradient buckets on 2 launched processes (gloo's async work): the same gradients, SBPs and
parameters as reducing each gradient when read, for data parallelism and ZeRO, with accumulation."""
import json
from pathlib import Path

PROGRAM = Path(__file__).with_name("_bucket_program.py")


def test_bucketed_gradients_agree_on_two_processes(launch):
    job = launch(PROGRAM, 2)
    line = next(l for l in job.lines(0) if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    for kind in ("dp", "zero"):
        r = result[kind]
        assert r["same_sbp"] and r["same_grads"] and r["same_params"], (kind, r)
    n = result["dp"]["n_params"]
    assert result["dp"]["ops_plain"] == ["all_reduce"] * n
    assert result["dp"]["ops_bucketed"] == ["all_reduce"], "one bucket, one collective"
    assert result["zero"]["ops_bucketed"].count("reduce_scatter") == 1, result["zero"]
    assert "all_reduce" not in result["zero"]["ops_bucketed"]
