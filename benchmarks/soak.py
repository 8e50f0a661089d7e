"""A real training run's length: 10,000 steps with flat memory, flat time, no new decisions or captures.

    .venv/bin/python benchmarks/soak.py [--steps 10000] [--quick]

The GPT of examples/gpt.py on a 2x2 placement (data x Megatron tensor) of 4 simulated ranks, float64,
trained as a run is: torch's default AdamW (on CPU its single-tensor path, whose step size and bias
corrections are new Python numbers at every step), a linear warm-up then cosine decay of the learning
rate (``SequentialLR``), ``clip_grad_norm_(1.0)``, a DCP checkpoint every 1,000 steps -- eagerly, then
``gt.compile``d (one graph; the schedule's learning rates read by it at each run). Every 500 steps it
records the process's resident memory, the dispatch cache's size and misses (those of the training
steps apart from those of the checkpoints' own ops, made once at the first), the compiled function's
captures and the median step time of the steps since the last record. Then it resumes from the last
checkpoint but one in new objects (model, optimizer, schedule from the checkpoint) and runs to the end
again: losses and parameters must equal the uninterrupted run's exactly (float64; the compiled resume
captures at its first call, so that every step it runs is a graph run, as the uninterrupted run's were).
The same run, 1,000 steps, on 2 gloo processes (a 1x2 placement), and a comparison of the default
single-tensor AdamW step with ``foreach=True``, beside plain torch's difference between the two.

Goals (#43), after step 500: resident memory grows < 10 MB to the end; no step misses the cache, and
its size is flat once the first checkpoint has added the checkpoint's decisions; no capture; the step
time at the end within 5 % of step 500's -- judged on the trend of the records' median step times (a
Theil-Sen line through them, robust to the odd record a busy machine slows); the resumed run equal to
the uninterrupted one; the default AdamW step <= 1.1x (the foreach step
+ plain torch's difference between them).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import _harness as H

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

RECORD_EVERY, CHECKPOINT_EVERY = 500, 1000
BATCH, SEQ = 8, 16


def cadence(steps: int) -> tuple:
    """Steps between records and between checkpoints: 500 and 1,000, or a quarter and a half of a
    shorter run (so that it records at least 4 times and resumes from a checkpoint before its end)."""
    return min(RECORD_EVERY, max(steps // 4, 1)), min(CHECKPOINT_EVERY, max(steps // 2, 1))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _setup(world: int):
    """This process's world (4 simulated ranks, or the launched one) and the run's placement."""
    import globaltensor as gt
    if world == 0:
        gt.simulate(4)
        return gt.placement("cpu", [[0, 1], [2, 3]])
    return gt.placement("cpu", [list(range(world))])


def _training(placement, steps: int, foreach=None):
    """The model, optimizer, schedule and step function of the run (float64)."""
    import torch
    import globaltensor.nn as gnn
    from gpt import TENSOR_PARALLEL, GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig()).double()
    gnn.distribute_module(model, placement, gnn.megatron_plan(**TENSOR_PARALLEL, axis=1, ndim=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=foreach)
    warmup = max(steps // 20, 1)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps - warmup, 1), eta_min=1e-5)],
        milestones=[warmup])

    def step(idx, targets):
        loss = model.loss(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return model, opt, sched, step


def _batch(step: int, placement):
    """Step ``step``'s batch: the same on every rank and in every run (seeded by the step)."""
    import torch
    import globaltensor as gt
    from gpt import GPTConfig, make_batch
    idx, targets = make_batch(GPTConfig(), BATCH, SEQ, torch.Generator().manual_seed(step))
    sbp = (gt.sbp.split(0), gt.sbp.broadcast)
    return gt.distribute(idx, placement, sbp), gt.distribute(targets, placement, sbp)


def _save(path: str, model, opt, sched, step: int) -> None:
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    import globaltensor as gt
    if gt.rank() == 0:
        with open(os.path.join(path, "run.json"), "w") as f:
            json.dump({"step": step, "sched": sched.state_dict()}, f)


def _load(path: str, model, opt, sched) -> int:
    import torch.distributed.checkpoint as dcp
    import globaltensor.nn as gnn
    gnn.init_optimizer_state(opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    with open(os.path.join(path, "run.json")) as f:
        run = json.load(f)
    sched.load_state_dict(run["sched"])
    return run["step"]


def _run(placement, total: int, compiled: bool, ckpt_dir: str, start: str = None) -> dict:
    """Train to step ``total`` (from the checkpoint ``start``, else from scratch); checkpoints into
    ``ckpt_dir`` every CHECKPOINT_EVERY steps; losses, final parameters and the records."""
    import torch
    import globaltensor as gt
    record_every, checkpoint_every = cadence(total)
    model, opt, sched, step_fn = _training(placement, total)
    first = _load(start, model, opt, sched) if start else 0
    run = gt.compile(step_fn, streams="device", warmup=0 if start else 1) if compiled else step_fn
    losses, records, times = [], [], []
    misses_before, checkpoint_misses = gt.dispatch_cache_info().misses, 0
    for s in range(first, total):
        idx, targets = _batch(s, placement)
        t0 = time.perf_counter()
        loss = run(idx, targets)
        sched.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())                  # a collective: every rank
        done = s + 1
        if not start and done % checkpoint_every == 0:
            before = gt.dispatch_cache_info().misses
            _save(os.path.join(ckpt_dir, f"step{done}"), model, opt, sched, done)
            checkpoint_misses += gt.dispatch_cache_info().misses - before   # its own ops' decisions, once
        if not start and done % record_every == 0:
            info = gt.dispatch_cache_info()
            records.append({"step": done, "rss_mb": _rss_mb(), "cache_size": info.size,
                            "misses": info.misses - misses_before - checkpoint_misses,
                            "checkpoint_misses": checkpoint_misses,
                            "captures": run.captures if compiled else None,
                            "step_ms": statistics.median(times[-record_every:]) * 1e3})
    with torch.no_grad():
        params = [p.full_tensor() for p in model.parameters()]       # a collective: every rank
    return {"losses": losses, "params": params, "records": records, "first": first,
            "captures": run.captures if compiled else None}


def _worker(rank: int, world: int, steps: int) -> dict:
    import torch
    torch.set_default_dtype(torch.float64)                # AdamW's step counters take it
    placement = _setup(world)
    ckpt = tempfile.mkdtemp(prefix="gt-soak-") if rank == 0 else None
    if world:
        import torch.distributed as dist
        box = [ckpt]
        dist.broadcast_object_list(box, 0)
        ckpt = box[0]
    out = {}
    try:
        for mode in ("eager", "compiled"):
            whole = _run(placement, steps, mode == "compiled", os.path.join(ckpt, mode))
            every = cadence(steps)[1]
            resume_at = (steps - 1) // every * every             # the last checkpoint before the end
            resumed = _run(placement, steps, mode == "compiled", ckpt, start=os.path.join(ckpt, mode, f"step{resume_at}"))
            tail = whole["losses"][resumed["first"]:]
            out[mode] = {"records": whole["records"], "resumed_from": resumed["first"],
                         "resume_loss_diff": max(abs(a - b) for a, b in zip(tail, resumed["losses"])),
                         "resume_param_diff": max(float((a - b).abs().max()) for a, b in
                                                  zip(whole["params"], resumed["params"])),
                         "resumed_captures": resumed["captures"], "final_loss": whole["losses"][-1]}
    finally:
        if world:
            import torch.distributed as dist
            dist.barrier()
        if rank == 0:
            shutil.rmtree(ckpt, ignore_errors=True)
    return out


def _worker_default_path(rank: int, world: int, quick: bool) -> dict:
    """AdamW's default (single-tensor on CPU) against ``foreach=True``: the whole 2x2 GPT step on 4
    simulated ranks, and plain torch's step of the same GPT on one device, rounds interleaved."""
    import torch
    torch.set_default_dtype(torch.float64)
    placement = _setup(0)
    sides = {}
    for name, foreach in (("default", None), ("foreach", True)):
        _, _, _, step = _training(placement, 100, foreach)
        batch = _batch(0, placement)
        sides[f"gt {name}"] = (step, batch)
    from gpt import GPT, GPTConfig, make_batch
    for name, foreach in (("default", None), ("foreach", True)):
        torch.manual_seed(0)
        model = GPT(GPTConfig()).double()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=foreach)
        idx, targets = make_batch(GPTConfig(), BATCH, SEQ, torch.Generator().manual_seed(0))
        sides[f"plain {name}"] = (lambda m=model, o=opt: H.sgd_step(m, o, idx, targets), ())
    fns = {k: (lambda s=s, b=b: s(*b)) for k, (s, b) in sides.items()}
    return H.timed_many(fns, warmup=3, repeats=5 if quick else 15, inner=3 if quick else 10, sync=False)


def report(res: dict, steps: int, where: str) -> dict:
    """The records' table and the goals' verdicts; returns {goal: met}."""
    verdicts = {}
    for mode, r in res.items():
        rows = [[x["step"], f"{x['rss_mb']:.1f}", x["cache_size"], x["misses"], x["checkpoint_misses"],
                 "-" if x["captures"] is None else x["captures"], f"{x['step_ms']:.2f}"] for x in r["records"]]
        print(H.table(["step", "RSS MB", "cache size", "misses in steps", "misses in checkpoints", "captures",
                       "median step ms"], rows, f"## {mode}, {steps:,} steps, {where}"))
        record_every = cadence(steps)[0]
        recs = {x["step"]: x for x in r["records"]}
        base, last = recs.get(record_every), r["records"][-1] if r["records"] else None
        if base is not None and last is not None and last is not base:
            verdicts[f"{mode}: RSS growth after step {record_every} < 10 MB"] = \
                (last["rss_mb"] - base["rss_mb"] < 10, f"{last['rss_mb'] - base['rss_mb']:+.1f} MB")
            verdicts[f"{mode}: no new decision in a step after step {record_every}"] = \
                (last["misses"] == base["misses"], f"misses in steps {base['misses']} -> {last['misses']}")
            first_ckpt = next((x for x in r["records"] if x["checkpoint_misses"]), base)
            verdicts[f"{mode}: dispatch cache size flat after the first checkpoint"] = \
                (last["cache_size"] == first_ckpt["cache_size"],
                 f"size {first_ckpt['cache_size']} at step {first_ckpt['step']:,} -> {last['cache_size']}")
            if mode == "compiled":
                verdicts[f"{mode}: no capture after step {record_every}"] = \
                    (last["captures"] == base["captures"], f"captures {base['captures']} -> {last['captures']}")
            drift = _drift([(x["step"], x["step_ms"]) for x in r["records"] if x["step"] >= record_every])
            verdicts[f"{mode}: step time at {last['step']:,} within 5% of step {record_every}'s (trend)"] = \
                (drift <= 0.05, f"trend {drift:+.1%}; the last record's median {last['step_ms'] / base['step_ms']:.3f}x "
                                f"the first's")
        verdicts[f"{mode}: resumed from step {r['resumed_from']:,} equals the uninterrupted run"] = \
            (r["resume_loss_diff"] == 0 and r["resume_param_diff"] == 0,
             f"losses {r['resume_loss_diff']:.1e}, parameters {r['resume_param_diff']:.1e}")
    return verdicts


def _drift(points: list) -> float:
    """The step time's change from the first record to the last, relative to the first: the Theil-Sen
    line (the median of the slopes between every two records) through the records' median step times.
    One record's median is at the mercy of whatever else ran on the machine then; the line is not,
    and a step time that grows with the run's length shows in it."""
    if len(points) < 2:
        return 0.0
    slopes = [(b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(points) for b in points[i + 1:]]
    slope = statistics.median(slopes)
    level = statistics.median(y - slope * x for x, y in points)
    first, last = points[0][0], points[-1][0]
    return slope * (last - first) / (level + slope * first)


def report_default_path(t: dict) -> dict:
    rows = [[k, H.fmt(v)] for k, v in t.items()]
    print(H.table(["AdamW step (whole GPT step, float64)", "ms"], rows,
                  "## the default single-tensor AdamW beside foreach=True"))
    plain_gap = t["plain default"] - t["plain foreach"]
    bound = 1.1 * (t["gt foreach"] + plain_gap)
    return {"gt default <= 1.1x (gt foreach + plain's default-foreach gap)":
            (t["gt default"] <= bound, f"{H.fmt(t['gt default'])} ms vs bound {H.fmt(bound)} ms "
                                       f"(gt foreach {H.fmt(t['gt foreach'])}, plain gap {H.fmt(plain_gap)})")}


def print_verdicts(verdicts: dict) -> None:
    for goal, (met, detail) in verdicts.items():
        print(f"goal: {goal} -> {'MET' if met else 'MISSED'} ({detail})")


def measure(quick: bool = False, steps: int = 10_000, procs_steps: int = 1_000) -> dict:
    """The three runs' results (``quick``: 1,000 simulated steps and 500 on processes)."""
    steps, procs_steps = (1000, 500) if quick else (steps, procs_steps)
    return {"steps": steps, "procs_steps": procs_steps,
            "simulated": H.spawn(_worker, 0, steps, timeout=7200),
            "processes": H.spawn(_worker, 2, procs_steps, timeout=3600) if procs_steps else None,
            "default_path": H.spawn(_worker_default_path, 0, quick)}


def verdicts(res: dict) -> dict:
    """Print the tables of :func:`measure`'s results; the goals' verdicts."""
    out = report(res["simulated"], res["steps"], "4 simulated ranks (2x2)")
    if res["processes"] is not None:
        out.update({f"2 processes, {k}": v for k, v in
                    report(res["processes"], res["procs_steps"], "2 gloo processes (1x2)").items()})
    out.update(report_default_path(res["default_path"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--procs-steps", type=int, default=1_000, help="steps of the 2-process run (0: skip it)")
    ap.add_argument("--quick", action="store_true", help="1,000 simulated steps and 500 on processes")
    args = ap.parse_args(argv)
    print(H.header("soak"))
    print_verdicts(verdicts(measure(args.quick, args.steps, args.procs_steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
