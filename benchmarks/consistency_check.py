"""The cost of the cross-rank consistency check (gt.set_check) and of arrival tracking.

    .venv/bin/python benchmarks/consistency_check.py [--quick]

1. 2 gloo processes, 64x64 fp32 pieces: the per-op time of add (S(0)+S(0)), relu (S(0)),
   mm (S(0) @ B) and a boxing S(0)->B, with the check off and on, interleaved. On, every op
   and every boxing first all-gathers one small vector of hashes over the world.
2. 4 simulated ranks in one process, the same ops: on, each op compares the ranks' views in
   place (no collective), hashing replicated pieces.
3. What the check costs when off: the guard ``if CHECK.enabled:`` alone, in nanoseconds; and
   what every collective of a process world pays to record its arrival (ArrivalBoard.enter and
   leave), in microseconds.
"""
from __future__ import annotations

import argparse
import timeit

import _harness as H

OPS = ["add", "relu", "mm", "S(0)->B"]


def _settings(quick: bool) -> dict:
    return dict(warmup=10, repeats=5, inner=50) if quick else dict(warmup=30, repeats=15, inner=200)


def _fns(gt, a, b, w):
    import torch
    return {"add": lambda: a + b, "relu": lambda: torch.relu(a), "mm": lambda: a @ w,
            "S(0)->B": lambda: a.to_global(sbp=gt.sbp.broadcast)}


def _checked(fn):
    from globaltensor.observe.consistency import CHECK

    def run():
        CHECK.enabled = True
        try:
            fn()
        finally:
            CHECK.enabled = False
    return run


def _measure(gt, placement, quick: bool, sync: bool) -> list:
    import torch
    S, B = gt.sbp.split, gt.sbp.broadcast
    k, n = 64, placement.size
    torch.manual_seed(0)
    fns = _fns(gt, gt.distribute(torch.randn(k * n, k), placement, S(0)),
               gt.distribute(torch.randn(k * n, k), placement, S(0)), gt.distribute(torch.randn(k, k), placement, B))
    rows = []
    for op in OPS:
        t = H.timed_many({"off": fns[op], "on": _checked(fns[op])}, sync=sync, **_settings(quick))
        rows.append(dict(op=op, **t))
    return rows


def _worker_procs(rank: int, world: int, quick: bool):
    import globaltensor as gt
    return _measure(gt, gt.placement("cpu", list(range(world))), quick, sync=True)


def _worker_sim(rank: int, world: int, quick: bool):
    import globaltensor as gt
    gt.simulate(4)
    return _measure(gt, gt.placement("cpu", [0, 1, 2, 3]), quick, sync=False)


def _worker_guard(rank: int, world: int, quick: bool):
    from globaltensor.comm.arrivals import ArrivalBoard
    from globaltensor.observe.consistency import CHECK

    class NoStore:
        def set(self, key, value):
            pass
    n = 200_000 if quick else 2_000_000
    guard = min(timeit.repeat("if CHECK.enabled: pass", globals={"CHECK": CHECK}, number=n, repeat=5)) / n
    empty = min(timeit.repeat("pass", number=n, repeat=5)) / n
    board = ArrivalBoard(NoStore(), 0)
    key = (0, 1)
    m = n // 10
    arrival = min(timeit.repeat("board.leave(key); board.enter('all_gather', key)",
                                globals={"board": board, "key": key}, number=m, repeat=5)) / m
    board.stop()
    return dict(guard=guard - empty, arrival=arrival)


def _table(rows, title: str) -> str:
    body = [(r["op"], H.fmt(r["off"], 1e6, 1), H.fmt(r["on"], 1e6, 1), H.fmt(r["on"] - r["off"], 1e6, 1),
             H.fmt(r["off"].min, 1e6, 1), H.fmt(r["on"].min, 1e6, 1)) for r in rows]
    return H.table(["op", "off us", "on us", "check us", "off min", "on min"], body, title)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    print(H.header("consistency check"))
    print(_table(H.spawn(_worker_procs, 2, args.quick), "\n## 2 gloo processes, 64x64 pieces (median, us per op)"))
    print(_table(H.spawn(_worker_sim, 0, args.quick), "\n## 4 simulated ranks, 64x64 pieces (median, us per op)"))
    g = H.spawn(_worker_guard, 0, args.quick)
    print(f"\nwith the check off, each op and boxing pays its guard: {g['guard'] * 1e9:.0f} ns;"
          f"\neach collective of a process world records its arrival: {g['arrival'] * 1e6:.2f} us")


if __name__ == "__main__":
    main()
