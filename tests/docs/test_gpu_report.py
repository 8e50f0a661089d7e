"""benchmarks/gpu.py's report and verdicts, run on made-up timings: the GPU rows are measured only on a
lent GPU machine (tools/gpu_check.sh), so their table and verdict code must be right before one is at
hand -- every row the worker measures is read, every goal judged."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_gpu_report_reads_every_row_and_judges_every_goal(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu
    keys = ["plain", "dt", "gt", "gtc", "gtg", "tc_plain", "tc_gt", "thin", "plain fwd+bwd", "gt fwd+bwd",
            "thin fwd+bwd", "tc_plain fwd+bwd", "tc_gt fwd+bwd", "plain step", "gt step", "thin step"]
    rows = {size: {k: 0.010 for k in keys} for size in gpu.SIZES}
    rows[gpu.SMALL]["thin step"] = 0.015                 # the thin subclass's AdamW step 1.5x plain's
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
    adamw = next(v for v in verdicts if "AdamW" in v)
    assert "a thin subclass: n_embd 256: 1.50x, n_embd 1024: 1.00x" in adamw, adamw
    sys.modules.pop("gpu", None)


def test_the_thin_floor_steps_as_plain_torch(monkeypatch):
    """gpu.py's floor row: subclass_floor.py's thin subclass trains the GPT with AdamW(foreach=True) to
    plain torch's parameters (float64, so exactly: the same kernels on the same values)."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(BENCH.parent / "examples"))
    from gpt import GPT, GPTConfig, make_batch
    from subclass_floor import thin_parameters, thin_training_class
    Thin = thin_training_class()
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    plain = GPT(cfg).double()
    thin = thin_parameters(copy.deepcopy(plain), Thin)
    idx, tgt = make_batch(cfg, 2, 16, torch.Generator().manual_seed(1))
    sides = [(plain, idx, tgt), (thin, Thin(idx), Thin(tgt))]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m, _, _ in sides]
    for _ in range(3):
        for (model, i, t), opt in zip(sides, opts):
            model.loss(i, t).backward()
            opt.step()
            opt.zero_grad()
    assert all(type(s["exp_avg"]) is Thin for s in opts[1].state.values())
    for p, q in zip(thin.parameters(), plain.parameters()):
        torch.testing.assert_close(p._piece, q, rtol=0, atol=0)
    sys.modules.pop("subclass_floor", None)
