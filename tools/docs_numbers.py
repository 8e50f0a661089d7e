"""The numbers the docs print -- bytes, collectives, reports -- made by running the code that prints them.

    make docs-numbers                                      # rewrite every generated region
    PYTHONPATH=src python tools/docs_numbers.py --check    # print the regions that differ, exit 1 if any
    PYTHONPATH=src python tools/docs_numbers.py --only explain --check

A region is the text between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->`` in a
page; everything else in the page stays as written. tests/docs/test_docs_numbers.py checks every
region against a fresh run, at the development pin of torch (pyproject / Makefile). Byte and
collective counts follow from the layouts alone, so they are exact on every machine (and at the
ends of the supported range; ``explain()``'s modelled memory counts what each release's autograd
saves, so it is the pin's); timings are not generated (they stay measured figures, with their date and
machine, in docs/performance.md).
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import io
import json
import logging
import re
import sys
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "examples", ROOT / "examples" / "howto", ROOT / "benchmarks", ROOT / "tests" / "docs"):
    sys.path.insert(0, str(_path))

import globaltensor as gt  # noqa: E402

S, B = gt.sbp.split, gt.sbp.broadcast
HOWTO = ROOT / "docs" / "howto.md"
PROFILING = ROOT / "docs" / "profiling.md"
MODELS = ROOT / "docs" / "models.md"
PLANNING = ROOT / "docs" / "planning.md"


def _fence(text: str, lang: str = "") -> str:
    return f"```{lang}\n{text.rstrip()}\n```"


def _quiet(fn: Callable, *args):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


# examples/howto's scripts at the default size, with their rows' names in docs/howto.md
STYLES = [("data parallel", "data_parallel"), ("tensor parallel", "tensor_parallel"), ("2-D hybrid", "hybrid_2d"),
          ("ZeRO optimizer states", "zero_optimizer"), ("FSDP-style parameters", "fsdp"),
          ("loss parallel", "loss_parallel"), ("pipeline (compiled, 4 micro-batches)", "pipeline"),
          ("mixed precision (bfloat16 autocast, GradScaler)", "mixed_precision"),
          ("expert parallel (the MoE GPT: 4 experts, top-2; the first step)", "expert_parallel"),
          ("context parallel (sequence split, ring attention)", "context_parallel")]
#: the step each script's row shows: a compiled step settles on its third call (warm-up, capture,
#: graph); expert parallelism's bytes follow the routing, which from the second step on depends on
#: float32 updates that differ between CPUs -- its row is the first step's, routed from the
#: initialisation alone (the closest call there, 1e-5 between a token's 2nd and 3rd router
#: probabilities, is hundreds of times a forward's float32 rounding)
STEPS = 3
FIRST_STEP_ONLY = {"expert_parallel"}


def style_bytes() -> str:
    """docs/howto.md's table: the bytes and collectives of one step of each how-to."""
    rows = ["| style | bytes sent per step | collectives per step |", "|---|---|---|"]
    with gt.simulate(4):
        for label, script in STYLES:
            steps = 1 if script in FIRST_STEP_ONLY else STEPS
            result = _quiet(importlib.import_module(script).run, ["--steps", str(steps)])
            rows.append(f"| {label} | {result.bytes_sent[-1]:,} | {result.collectives[-1]} |")
    return "\n".join(rows)


def explain() -> str:
    """docs/howto.md's ``plan.explain()`` (examples/gpt.py's GPT on 2x2, batch 8 x 16), its module
    table cut after the first layer."""
    from gpt import GPT, GPTConfig, make_batch
    with gt.simulate(4):
        torch.manual_seed(0)
        model, cfg = GPT(GPTConfig()), GPTConfig()
        idx, targets = make_batch(cfg, 8, 16, torch.Generator().manual_seed(0))
        plan = gt.nn.auto_plan(model, gt.placement("cpu", ranks=[[0, 1], [2, 3]]), (idx, targets),
                               step=lambda m, i, t: m.loss(i, t).backward(), optimizer=torch.optim.AdamW)
        lines = plan.explain().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| module"))
    end = next(i for i in range(head, len(lines)) if not lines[i].startswith("|"))
    kept = [line for line in lines[head + 2:end] if line.startswith(("| (outside", "| blocks.0"))]
    return _fence("\n".join(lines[:head + 2] + kept + ["| ... |"] + lines[end:]))


def _profiled_example() -> dict:
    """Run docs/profiling.md's example block as the page gives it; its names after."""
    from doc_blocks import blocks
    block = next(b for b in blocks(PROFILING) if "comm_profile" in b.code and "GPTConfig" in b.code)
    names: dict = {"__name__": "__doc_block__"}
    with gt.simulate(4):
        exec(compile(block.code.replace('sys.path.insert(0, "examples")', "pass"), str(PROFILING), "exec"), names)
    return names


def profile_table() -> str:
    return _fence(_profiled_example()["prof"].table(by=("op", "phase")))


def profile_tree() -> str:
    return _fence(_profiled_example()["prof"].tree())


def profile_event() -> str:
    """One event of the example's ``prof.to_json()``: the first all-reduce of the forward's residual add."""
    events = json.loads(_profiled_example()["prof"].to_json())["events"]
    event = next(e for e in events if e["op"] == "aten.add" and e["phase"] == "forward")
    fields = ",\n ".join(f"{json.dumps(key)}: {json.dumps(value)}" for key, value in event.items())
    return _fence("{" + fields + "}", "json")


def compiled_profile() -> str:
    """4 calls of a compiled data-parallel MLP step with SGD, profiled: the warm-up's gradient reads,
    then the graph's runs, and the capture's collectives apart."""
    with gt.simulate(4):
        torch.manual_seed(0)
        p = gt.placement("cpu", ranks=[0, 1, 2, 3])
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
        gt.nn.distribute_module(model, p)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        compiled = gt.compile(step)
        x = gt.distribute(torch.randn(8, 6), p, S(0))
        with gt.comm_profile(model) as prof:
            for _ in range(4):
                compiled(x)
        return _fence(prof.table() + "\n" + prof.table(captured=True))


def log_example() -> str:
    """The boxing and signature log of ``x[8,6] S(1) @ w[6,4] S(1)``, then ``.to_global(sbp=B)``."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    logger = logging.getLogger("globaltensor")
    logger.addHandler(handler)
    try:
        with gt.simulate(4):
            p = gt.placement("cpu", ranks=[0, 1, 2, 3])
            x, w = gt.randn(8, 6, placement=p, sbp=S(1)), gt.randn(6, 4, placement=p, sbp=S(1))
            gt.set_log_level("debug")
            try:
                (x @ w).to_global(sbp=B)
            finally:
                gt.set_log_level(None)
    finally:
        logger.removeHandler(handler)
    return _fence(stream.getvalue())


def models_table() -> str:
    """docs/models.md's bytes and collectives per training step (benchmarks/models.py's rows; one
    timed step, whose time is not shown)."""
    import models
    rows = _quiet(models.measure, True, torch.float32)
    out = ["| model | plan | bytes | ideal | ratio | collectives | ideal | ratio |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['plan']} | {r['bytes']:,} | {r['ideal bytes']:,} | "
                   f"{r['bytes'] / r['ideal bytes']:.2f} | {r['collectives']} | {r['ideal collectives']} | "
                   f"{r['collectives'] / r['ideal collectives']:.2f} |")
    return "\n".join(out)


def _peer_table(bench, peer: str) -> str:
    """A peer benchmark's table (its ``_worker`` on 2 gloo processes): per plan the peer's bytes and
    collectives beside ours."""
    import _harness
    out = [f"| plan | {peer} bytes | collectives | globaltensor bytes | collectives | gt / {peer} |",
           "|---|---:|---:|---:|---:|---:|"]
    for plan, r in _harness.spawn(bench._worker, 2, timeout=300).items():
        out.append(f"| {plan} | {r['dt_bytes']:,} | {len(r['dt_ops'])} | {r['gt_bytes']:,} | {len(r['gt_ops'])} | "
                   f"{r['gt_bytes'] / r['dt_bytes']:.2f}x |")
    return "\n".join(out)


def peer_plans() -> str:
    """docs/howto.md's comparison with DTensor: benchmarks/peer_plans.py's bytes, DTensor's
    ``parallelize_module`` and ``gt.nn.distribute_module`` given the same styles on HF Llama, 2 gloo
    processes (a step's bytes are exact; the run also checks the two sides' losses agree)."""
    import peer_plans as bench
    return _peer_table(bench, "DTensor")


def titan_tp() -> str:
    """docs/howto.md's torchtitan comparison: benchmarks/titan_tp.py's bytes, torchtitan's own Llama 3
    and tensor parallelism (DTensor) beside globaltensor's translation of the plan, 2 gloo processes
    (every collective of the step counted; the run checks the two sides' losses agree)."""
    import titan_tp as bench
    return _peer_table(bench, "torchtitan")


def megatron_mfu() -> str:
    """docs/planning.md's Megatron-LM table, published against predicted (benchmarks/published_runs.py:
    plan_at_scale's model, arithmetic alone, one constant calibrated on one row)."""
    import published_runs
    return published_runs.megatron_table()


def megatron_calibration() -> str:
    """Each row of the Megatron-LM table as the calibration row, and the others' errors."""
    import published_runs
    return published_runs.calibration_sensitivity()


def titan_memory() -> str:
    """docs/planning.md's table of torchtitan's published runs: per-GPU memory, published against predicted."""
    import published_runs
    return published_runs.titan_memory_table()


REGIONS: Dict[str, Tuple[Path, Callable[[], str]]] = {
    "style-bytes": (HOWTO, style_bytes),
    "explain": (HOWTO, explain),
    "peer-plans": (HOWTO, peer_plans),
    "titan-tp": (HOWTO, titan_tp),
    "profile-table": (PROFILING, profile_table),
    "profile-tree": (PROFILING, profile_tree),
    "profile-event": (PROFILING, profile_event),
    "compiled-profile": (PROFILING, compiled_profile),
    "log-example": (PROFILING, log_example),
    "models-bytes": (MODELS, models_table),
    "megatron-mfu": (PLANNING, megatron_mfu),
    "megatron-calibration": (PLANNING, megatron_calibration),
    "titan-memory": (PLANNING, titan_memory),
}


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- generated: {re.escape(name)} -->\n)(.*?)(<!-- end generated: {re.escape(name)} -->)", re.S)


def written(name: str) -> str:
    """The region's text as the page has it (ValueError unless the page holds it once)."""
    page = REGIONS[name][0]
    found = _pattern(name).findall(page.read_text())
    if len(found) != 1:
        raise ValueError(f"{page.name}: expected the generated region {name!r} once, found it {len(found)} times")
    return found[0][1].removesuffix("\n")


def generate(name: str) -> str:
    return REGIONS[name][1]()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write; exit 1 if a region differs")
    parser.add_argument("--only", choices=sorted(REGIONS), action="append", help="these regions only")
    args = parser.parse_args(argv)
    differ = 0
    for name in args.only or REGIONS:
        page, text, now = REGIONS[name][0], written(name), generate(name)
        if text == now:
            continue
        differ += 1
        if args.check:
            print(f"{page.relative_to(ROOT)}: region {name} differs from what the code prints:")
            print("".join(difflib.unified_diff(text.splitlines(True), (now + "\n").splitlines(True), "docs", "code")))
        else:
            page.write_text(_pattern(name).sub(lambda m: m.group(1) + now + "\n" + m.group(3), page.read_text()))
            print(f"{page.relative_to(ROOT)}: rewrote {name}")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
