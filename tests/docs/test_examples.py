"""Every how-to under examples/howto trains the small GPT at --tiny size on 4 simulated ranks, in
float64, and ends equal to the same model trained on one device, to examples/demo.py's TOLERANCE
(the bound its comment derives for this model and AdamW; the runs differ by the order of sums
only). Each prints a progress line per step as it goes."""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

import globaltensor as gt

HOWTO = Path(__file__).resolve().parents[2] / "examples" / "howto"
for _path in (HOWTO, HOWTO.parent):                # the how-tos; demo.py and gpt.py
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

SCRIPTS = ["data_parallel", "tensor_parallel", "hybrid_2d", "zero_optimizer", "fsdp", "loss_parallel", "pipeline",
           "mixed_precision", "expert_parallel", "context_parallel"]
PROGRESS = re.compile(r"^\s*(\d+)/(\d+)\s+[\d.]+\s+[\d.]+\s+[\d,]+\s+\d+\s+\d+ms$")


def test_every_howto_script_is_tested():
    assert sorted(p.stem for p in HOWTO.glob("*.py") if p.stem != "side_by_side") == sorted(SCRIPTS)


def _progress(out: str) -> list:
    return [(int(m[1]), int(m[2])) for m in map(PROGRESS.match, out.splitlines()) if m]


@pytest.mark.parametrize("name", SCRIPTS)
def test_howto_trains_as_one_device(name, capsys):
    module = importlib.import_module(name)
    with gt.simulate(4):
        result = module.run(["--tiny", "--float64"])
    out = capsys.readouterr().out
    assert result.ok, f"{name}: losses {result.loss_error:.1e}, parameters {result.parameter_error:.1e}\n{out}"
    steps = len(result.losses)
    assert steps == 3 and result.losses[-1] < result.losses[0], f"{name} did not train: {result.losses}"
    assert _progress(out) == [(i, steps) for i in range(1, steps + 1)], f"a progress line per step:\n{out}"
    assert all(b > 0 for b in result.bytes_sent), f"{name}: every step communicates: {result.bytes_sent}"
    assert "OK: float64 bound" in out


def test_loss_parallel_keeps_the_logits_split(capsys):
    import loss_parallel
    with gt.simulate(4):
        loss_parallel.run(["--tiny", "--float64", "--steps", "1"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("logits"))
    sent, gather = (int(v.replace(",", "")) for v in re.search(r"sent ([\d,]+) bytes.*would send ([\d,]+)", line).groups())
    assert "sbp (S(1),)" in line and sent < gather, line


def test_context_parallel_runs_ring_attention_and_gathers_nothing(capsys):
    import context_parallel
    with gt.simulate(4):
        context_parallel.run(["--tiny", "--float64", "--steps", "1"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("one forward"))
    ring = int(re.search(r"blocks ([\d,]+) bytes", line)[1].replace(",", ""))
    assert ring > 0 and line.endswith("besides: all_reduce (aten.nll_loss_forward), all_reduce (gradient bucket)"), line


def test_expert_parallel_moves_tokens_not_weights(capsys):
    import expert_parallel
    with gt.simulate(4):
        expert_parallel.run(["--tiny", "--float64", "--steps", "1"])
    out = capsys.readouterr().out
    sent = int(re.search(r"the token all-to-alls sent ([\d,]+) bytes", out).group(1).replace(",", ""))
    assert sent > 0 and "gate_up_proj shape (4, 64, 16) sbp (S(0),)" in out, out


def test_fsdp_gathers_weights_and_reduce_scatters_gradients(capsys):
    import fsdp
    with gt.simulate(4):
        fsdp.run(["--tiny", "--float64", "--steps", "1"])
    out = capsys.readouterr().out
    assert re.search(r"collectives of the forward: [\d,]+ bytes, all_gather x\d+", out), out
    assert re.search(r"collectives of the backward: .*all_gather x\d+.*reduce_scatter x\d+", out), out
    assert "wte.weight                   shape (32, 16)   sbp (B,)" in out, "the embedding tables stay replicated"


def test_a_howto_in_float32_reports_rounding_not_a_verdict(capsys):
    """The default precision: float32, whose differences from one device are rounding of a size
    that depends on the CPU, so the script reports them without a verdict."""
    import data_parallel
    with gt.simulate(4):
        result = data_parallel.run(["--tiny", "--steps", "2"])
    out = capsys.readouterr().out
    assert len(result.losses) == 2 and "float32: the runs differ by the order of sums" in out and "OK" not in out, out


def test_demo_prints_progress_in_its_silent_float64_run(capsys):
    """examples/demo.py's verdict run prints no table; it still reports each step as it ends."""
    import demo
    with gt.simulate(4):
        demo.train(steps=1, dtype=torch.float64, show=False)
    assert "float64 run: step 1/1 done" in capsys.readouterr().out


def test_pipeline_howto_launched_as_4_processes(launch):
    """The command line of docs/howto.md for processes: gloo ranks, stages on [0, 1] and [2, 3], the
    compiled micro-batched step; rank 0 prints the progress and the float64 verdict."""
    result = launch(HOWTO / "pipeline.py", 4, args=["--tiny", "--float64"], timeout=240, collective_timeout=120)
    lines = result.lines(0)
    assert _progress("\n".join(lines)) == [(1, 3), (2, 3), (3, 3)], result.describe()
    assert any("OK: float64 bound" in line for line in lines), result.describe()
