"""``gt.local_map``'s per-call overhead, beside one eager op's and DTensor's ``local_map``.

    .venv/bin/python benchmarks/local_map.py [--quick]

A 64x64 fp32 piece per rank, split on rows, and ``relu`` -- a function that needs no boxing:
local torch on the piece; ``torch.relu`` of the global tensor (one eager op through the
dispatcher); ``gt.local_map(torch.relu, (S(0),), S(0))``; DTensor's
``local_map(torch.relu, [Shard(0)], ([Shard(0)],))``. Overheads are times over local torch's,
their ratios paired per round. Goal (#32): local_map's overhead at most 2x one eager op's
(measured in 2 processes and on 4 simulated ranks).
"""
from __future__ import annotations

import argparse
import statistics
import time

import _harness as H

GOAL = 2.0


def _settings(quick: bool) -> dict:
    return dict(warmup=20, repeats=5, inner=100) if quick else dict(warmup=50, repeats=21, inner=300)


def _paired(x, base, local) -> float:
    """Median over rounds of (x - local) / (base - local), from the same round."""
    return statistics.median((a - c) / (b - c) for a, b, c in zip(x.rounds, base.rounds, local.rounds))


def _worker_procs(rank: int, world: int, quick: bool):
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from torch.distributed.tensor.experimental import local_map as dt_local_map

    import globaltensor as gt

    k = 64
    torch.manual_seed(0)
    A = torch.randn(k * world, k)
    p = gt.placement("cpu", ranks=list(range(world)))
    mesh = init_device_mesh("cpu", (world,))
    la, ga, da = A[rank * k:(rank + 1) * k].clone(), gt.distribute(A, p, gt.sbp.split(0)), \
        distribute_tensor(A, mesh, [Shard(0)])
    mapped = gt.local_map(torch.relu, (gt.sbp.split(0),), gt.sbp.split(0))
    dt_mapped = dt_local_map(torch.relu, out_placements=[Shard(0)], in_placements=([Shard(0)],), device_mesh=mesh)
    fns = {"local": lambda: torch.relu(la), "gt_op": lambda: torch.relu(ga), "gt_map": lambda: mapped(ga),
           "dt_map": lambda: dt_mapped(da)}
    for name in ("gt_op", "gt_map"):
        if not torch.equal(fns[name]().to_local(), fns["local"]()):
            raise AssertionError(f"{name}: differs from local torch")
    if not torch.equal(fns["dt_map"]().to_local(), fns["local"]()):
        raise AssertionError("DTensor local_map: differs from local torch")
    return H.timed_many(fns, **_settings(quick))


def _worker_sim(rank: int, world: int, quick: bool):
    import torch

    import globaltensor as gt

    n, k = 4, 64
    gt.simulate(n)
    A = torch.randn(k * n, k)
    ga = gt.distribute(A, gt.placement("cpu", ranks=list(range(n))), gt.sbp.split(0))
    pieces = [A[i * k:(i + 1) * k].clone() for i in range(n)]
    mapped = gt.local_map(torch.relu, (gt.sbp.split(0),), gt.sbp.split(0))
    if not torch.equal(mapped(ga).full_tensor(), torch.relu(A)):
        raise AssertionError("simulated local_map: wrong result")

    def local4():
        for x in pieces:
            torch.relu(x)
    fns = {"local": local4, "gt_op": lambda: torch.relu(ga), "gt_map": lambda: mapped(ga)}
    return H.timed_many(fns, **_settings(quick), sync=False)


def measure(quick: bool) -> dict:
    """Both runs (run_all's job): ``{"procs": timings, "sim": timings}``."""
    return {"procs": H.spawn(_worker_procs, 2, quick), "sim": H.spawn(_worker_sim, 0, quick)}


def rows(procs, sim) -> list:
    """(what, local_map us, peer us, ratio of overheads) for the summary and run_all."""
    out = []
    for label, t in (("2 procs", procs), ("4 simulated ranks", sim)):
        out.append((f"local_map(relu) overhead vs one eager op, {label}", t["gt_map"] - t["local"],
                    t["gt_op"] - t["local"], _paired(t["gt_map"], t["gt_op"], t["local"]), "eager op"))
    out.append(("local_map(relu) overhead vs DTensor's local_map, 2 procs", procs["gt_map"] - procs["local"],
                procs["dt_map"] - procs["local"], _paired(procs["gt_map"], procs["dt_map"], procs["local"]),
                "DTensor local_map"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    args = ap.parse_args(argv)
    print(H.header("local_map"))
    t0 = time.time()
    res = measure(args.quick)
    procs, sim = res["procs"], res["sim"]
    print(H.table(["", "local", "gt op", "gt local_map", "DTensor local_map"],
                  [["2 procs, us/call"] + [H.fmt(procs[k], 1e6, 1) for k in ("local", "gt_op", "gt_map", "dt_map")],
                   ["4 sim ranks, us/call"] + [H.fmt(sim[k], 1e6, 1) for k in ("local", "gt_op", "gt_map")] + ["n/a"]],
                  "relu of a 64x64 fp32 piece per rank, median of the rounds (slowest rank)"))
    print()
    for what, ours, peer, ratio, peer_name in rows(procs, sim):
        goal = f"goal <= {GOAL}x: {'met' if ratio <= GOAL else 'short'}" if peer_name == "eager op" else \
            ("below DTensor's" if ratio < 1 else "above DTensor's")
        print(f"{what}: {H.fmt(ours, 1e6, 1)} us vs {peer_name} {H.fmt(peer, 1e6, 1)} us = {ratio:.2f}x ({goal})")
    print(f"\n(total {time.time() - t0:.0f} s; load average at the end {H.load_average()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
