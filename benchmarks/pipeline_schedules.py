"""Pipeline schedules side by side: GPipe, 1F1B, interleaved 1F1B, zero bubble (ZB-H1) and zbv (ZB-V), on
gloo processes (one stage each) and on simulated stages, at p = 2 and 4 stages and m = 8 and 16
micro-batches.

    .venv/bin/python benchmarks/pipeline_schedules.py [--quick] [--procs 2,4] [--simulated] [--cuts] [--rows 32]

The model: a chain of ``LAYERS`` blocks (Linear D->4D, GELU, Linear 4D->D, residual) and a linear
head, its blocks cut into stages by ``gt.nn.pipeline_stages`` (interleaved: 2 chunks per stage in
turn; zbv: 2 per stage down the stages and back up, the head on the first), trained with SGD on a
mean-squared loss; every schedule's losses must equal GPipe's. Per schedule:

- step: the median time of a compiled step (after the warm-up and the capture);
- bubble: from the timeline of one step, each rank's idle fraction of its compute stream over the
  step's span (first task to last, over every rank), averaged over the ranks; beside it the ideal:
  the schedule's own bubble at unit durations (``schedules.bubble``: ``(p - 1) / (m + p - 1)`` for
  GPipe and 1F1B, about that over ``v`` interleaved, less for the zero-bubble schedules);
- activations: per stage, the most bytes its micro-batches' forward tasks held at once
  (``measure_memory=True``, the arguments aside), as a fraction of GPipe's; 1F1B's bound is
  ``(p - s) / m`` of GPipe's plus one micro-batch, the zero-bubble schedules' ``p / m`` on every stage
  plus one (zbv's of GPipe's on zbv's cut).

With ``--cuts``: the cut's effect. The same chain with a head of ``HEAD_WIDE`` outputs (the weights
of two blocks, as a large vocabulary's head outweighs a layer), under 1F1B, cut with as many blocks
per stage (``cut="even"``: the head's stage the slowest) and by weights (``cut="params"``: that stage
gives blocks to the others).

Processes run one rank each on this machine's cores (p = 4 on 2 cores shares them: times and
bubbles there measure the machine as much as the schedule); simulated stages run every rank's
streams as threads of one process (``streams="rank"``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import _harness as H

D, LAYERS, ROWS = 256, 8, 32           # width, blocks, rows per micro-batch
HEAD_WIDE = 16 * D                     # --cuts: the head's outputs (D x 16D weights: two blocks' worth)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
#: pipeline_stages' cut per schedule: 2 chunks a stage in turn, or in a V
CUTS = {"interleaved_1f1b": dict(chunks_per_stage=2), "zbv": dict(chunks_per_stage=2, v_shape=True)}


def _model(head: int = D):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.head = nn.Linear(D, head)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)
    torch.manual_seed(0)
    return Chain()


def _bubble(timeline: list, ranks: list) -> float:
    """Each rank's idle share of its compute stream over one call's span, averaged over ``ranks``: the
    time its compute tasks ran (a send a process runs on its compute stream, which may wait for its
    receiver, not counted) over the span from the call's first task to its last on any rank."""
    last = max(it for _, _, it, _, _ in timeline)
    tasks = [(s, name, t0, t1) for s, name, it, t0, t1 in timeline if it == last]
    start, end = min(t[2] for t in tasks), max(t[3] for t in tasks)
    idle = []
    for r in ranks:
        busy = sum(t1 - t0 for s, name, t0, t1 in tasks if s == f"r{r}:compute" and "send_recv" not in name)
        idle.append(1.0 - busy / (end - start))
    return statistics.mean(idle)


def _run(p: int, m: int, schedule: str, repeats: int, simulated: bool, cut: str = "even", head: int = D,
         rows: int = ROWS) -> dict:
    import torch

    import globaltensor as gt

    B = gt.sbp.broadcast
    stages = [gt.placement("cpu", [r]) for r in range(p)]
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(m * rows, D, generator=gen), torch.randn(m * rows, head, generator=gen)
    gx = gt.distribute(x, stages[0], B)
    out = {}
    # zbv's memory is held against GPipe's on zbv's own cut (GPipe's last stage on the usual cut takes
    # each backward as soon as its forward is done, so it holds fewer than m there)
    kinds = ("timed", "traced", "measured") + (("baseline",) if schedule == "zbv" else ())
    for kind in kinds:
        model = _model(head)
        out["cut"] = gt.nn.pipeline_stages(model, stages, cut=cut, **CUTS.get(schedule, {}))
        gy = gt.distribute(y, model.head.weight.placement, B)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(a, b):
            loss = ((model(a) - b) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        g = gt.compile(step, micro_batches=m, schedule="gpipe" if kind == "baseline" else schedule,
                       timeline=kind == "traced", measure_memory=kind in ("measured", "baseline"),
                       streams="rank" if simulated else None)
        losses = [g(gx, gy).full_tensor().item() for _ in range(3)]
        if kind == "timed":
            out["losses"] = losses
            times = []
            for _ in range(repeats):
                if not simulated:
                    torch.distributed.barrier()
                t0 = time.perf_counter()
                g(gx, gy).full_tensor()
                times.append(time.perf_counter() - t0)
            out["step"] = statistics.median(times)
        elif kind == "traced":
            out["bubble"] = _bubble(g._graph().runtime.timeline, list(range(p)) if simulated else [gt.rank()])
        elif kind == "baseline":
            out["gpipe activations"] = g.peak_activation_bytes_by_rank
            continue
        else:
            out["activations"] = g.peak_activation_bytes_by_rank
        out["plan"] = g.plan.pipeline or schedule
    return out


def _configs(p: int, quick: bool) -> list:
    ms = (8,) if quick else (8, 16)
    return [(m, s) for m in ms for s in SCHEDULES]


def _worker(rank: int, world: int, quick: bool, rows: int = ROWS) -> dict:
    """One stage per process: every schedule at m = 8 and 16; per config, every rank's numbers."""
    import torch.distributed as dist
    repeats = 3 if quick else 7
    results = {}
    for m, schedule in _configs(world, quick):
        mine = _run(world, m, schedule, repeats, simulated=False, rows=rows)
        every = [None] * world
        dist.all_gather_object(every, mine)
        results[(m, schedule)] = {
            "losses": every[0]["losses"], "step": max(e["step"] for e in every),
            "bubble": statistics.mean(e["bubble"] for e in every),
            "activations": {r: e["activations"].get(r, 0) for r, e in enumerate(every)}, "plan": every[0]["plan"]}
        if "gpipe activations" in mine:
            results[(m, schedule)]["gpipe activations"] = {r: e["gpipe activations"].get(r, 0) for r, e in enumerate(every)}
    return results


def _worker_cuts(rank: int, world: int, quick: bool, rows: int = ROWS) -> dict:
    """--cuts: 1F1B over the wide-headed chain, cut evenly and by weights; per cut, every rank's numbers."""
    import torch.distributed as dist
    results = {}
    for cut in ("even", "params"):
        mine = _run(world, 8, "1f1b", 3 if quick else 7, simulated=False, cut=cut, head=HEAD_WIDE, rows=rows)
        every = [None] * world
        dist.all_gather_object(every, mine)
        results[cut] = {"losses": every[0]["losses"], "step": max(e["step"] for e in every),
                        "bubble": statistics.mean(e["bubble"] for e in every),
                        "blocks": [sum(n.startswith("blocks.") for n in names) for names in every[0]["cut"].values()]}
    return results


def report_cuts(p: int, results: dict) -> str:
    even = results["even"]
    if any(abs(a - b) > 1e-4 * max(1.0, abs(b)) for a, b in zip(results["params"]["losses"], even["losses"])):
        raise AssertionError(f"p={p}: the losses cut by weights {results['params']['losses']} differ from {even['losses']}")
    rows = [[cut, " ".join(map(str, r["blocks"])), f"{r['step'] * 1e3:.1f} ms", f"{r['step'] / even['step']:.2f}x",
             f"{r['bubble']:.3f}"] for cut, r in results.items()]
    return H.table(["cut", "blocks per stage", "step", "vs even", "bubble"], rows,
                   f"## 1F1B, {p} stages, m = 8, a head of {HEAD_WIDE} outputs (gloo processes)")


def measure_simulated(p: int, quick: bool, rows: int = ROWS) -> dict:
    import globaltensor as gt
    results = {}
    with gt.simulate(p):
        for m, schedule in _configs(p, quick):
            results[(m, schedule)] = _run(p, m, schedule, 3 if quick else 5, simulated=True, rows=rows)
    return results


def _ideal(schedule: str, p: int, m: int) -> float:
    from globaltensor import schedules
    return schedules.bubble(schedule, p, m, CUTS.get(schedule, {}).get("chunks_per_stage", 1))


def report(p: int, where: str, results: dict) -> str:
    rows = []
    for (m, schedule), r in results.items():
        gpipe = results[(m, "gpipe")]
        if any(abs(a - b) > 1e-4 * max(1.0, abs(b)) for a, b in zip(r["losses"], gpipe["losses"])):
            raise AssertionError(f"{schedule}, p={p}, m={m}: losses {r['losses']} differ from GPipe's {gpipe['losses']}")
        ideal = _ideal(schedule, p, m)
        base = r.get("gpipe activations", gpipe["activations"])
        act = [r["activations"].get(s, 0) / max(base.get(s, 1), 1) for s in range(p)]
        bound = ([(p - s + 1) / m for s in range(p)] if schedule == "1f1b" else
                 [(p + 1) / m] * p if schedule in ("zero_bubble", "zbv") else None)
        rows.append([m, schedule, f"{r['step'] * 1e3:.1f} ms", f"{r['step'] / gpipe['step']:.2f}x",
                     f"{r['bubble']:.3f}", f"{ideal:.3f}",
                     " ".join(f"{a:.2f}" for a in act),
                     " ".join(f"{b:.2f}" for b in bound) if bound else "-",
                     "met" if bound is None or all(a <= b for a, b in zip(act, bound)) else "short"])
    return H.table(["m", "schedule", "step", "vs GPipe", "bubble", "ideal", "activations per stage / GPipe's",
                    "bound", "memory"], rows, f"## {p} stages, {where}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="m = 8 only, fewer repeats")
    ap.add_argument("--procs", default="2,4", help="process counts (one stage each), comma-separated")
    ap.add_argument("--simulated", action="store_true", help="also 2 and 4 simulated stages in this process")
    ap.add_argument("--rows", type=int, default=ROWS, help=f"rows per micro-batch (default {ROWS})")
    ap.add_argument("--cuts", action="store_true", help="only the cut's effect: 1F1B, a wide head, cut evenly and by weights")
    args = ap.parse_args(argv)
    print(H.header("pipeline"))
    print(f"a chain of {LAYERS} blocks (Linear {D}->{4 * D}, GELU, Linear {4 * D}->{D}) and a head, float32, "
          f"{args.rows} rows per micro-batch, SGD\n")
    if args.cuts:
        for p in (int(v) for v in args.procs.split(",") if v):
            print(report_cuts(p, H.spawn(_worker_cuts, p, args.quick, args.rows, timeout=1800)) + "\n", flush=True)
        return 0
    for p in (int(v) for v in args.procs.split(",") if v):
        print(report(p, "gloo processes", H.spawn(_worker, p, args.quick, args.rows, timeout=3600)) + "\n", flush=True)
    if args.simulated:
        for p in (2, 4):
            print(report(p, "simulated (streams='rank')", measure_simulated(p, args.quick, args.rows)) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
