"""benchmarks/gpu.py's report and verdicts, run on made-up timings: the GPU rows are measured only on a
lent GPU machine (tools/gpu_check.sh), so their table and verdict code must be right before one is at
hand -- every row the worker measures is read, every goal judged."""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_gpu_report_reads_every_row_and_judges_every_goal(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu
    keys = ["plain", "dt", "gt", "gtc", "gtg", "tc_plain", "tc_gt", "plain fwd+bwd", "gt fwd+bwd", "tc_plain fwd+bwd",
            "tc_gt fwd+bwd", "plain step", "gt step"]
    rows = {size: {k: 0.010 for k in keys} for size in gpu.SIZES}
    rows[gpu.SMALL]["gtg"] = 0.006                       # 0.6x plain: the CUDA graphs goal met at n_embd 256
    rows[gpu.LARGE]["gtc"] = 0.011                       # 1.1x plain: the compiled goal short at n_embd 1024
    res = {"device": "a made-up GPU", "rows": rows}
    gpu.report(res)
    out = capsys.readouterr().out
    assert "gt CUDA graphs ms" in out and "a made-up GPU" in out
    verdicts = gpu.verdicts(res)
    assert len(verdicts) == len(gpu.GOALS)
    assert any(v.startswith("VERDICT met gt compiled with CUDA graphs <= 0.7x") for v in verdicts), verdicts
    assert any(v.startswith("VERDICT short gt compiled step <= 1.05x") for v in verdicts), verdicts
    sys.modules.pop("gpu", None)
