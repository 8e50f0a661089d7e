"""Eager per-op overhead: globaltensor vs DTensor vs local torch, side by side.

    .venv/bin/python benchmarks/eager_overhead.py [--quick] [--only procs|sim]

1. 2 gloo processes, 64x64 fp32 pieces: the per-op time of add (S(0)+S(0)), relu (S(0)) and
   mm (S(0) @ B) -- ops that need no communication -- for local torch on the piece, a thin
   Python wrapper subclass (the floor of the approach), DTensor (Shard(0)/Replicate on a
   1-D DeviceMesh) and globaltensor; the overhead over local torch and the ratios of
   overheads, paired per round. Goal (#9): gt's overhead at most 1.2x the thin subclass's
   (the floor, measured in the same run) and below DTensor's.
2. The cost of a new shape: the first call of add and mm on inputs of a shape never seen
   before (a cache miss: rule, signature choice, boxing plans, output meta). Goal: < 0.5 ms.
3. 4 simulated ranks in one process: ``gt.simulate(4)`` next to DTensor on LocalTensorMode
   (torch.distributed._local_tensor, over a fake process group), and 4x the local op, in
   one process, interleaved. Goal: gt at most a quarter of LocalTensorMode's time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import _harness as H

OPS = ["add", "relu", "mm"]


def _thin_class():
    """The floor of any Python ``__torch_dispatch__`` wrapper subclass: unwrap, call, rewrap."""
    import torch

    class Thin(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        @staticmethod
        def __new__(cls, piece):
            t = torch.Tensor._make_wrapper_subclass(cls, piece.shape, dtype=piece.dtype, device=piece.device)
            t._piece = piece
            return t

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return Thin(func(*[a._piece if type(a) is Thin else a for a in args], **(kwargs or {})))
    return Thin


def _settings(quick: bool) -> dict:
    return dict(warmup=20, repeats=5, inner=100) if quick else dict(warmup=50, repeats=21, inner=300)


def _op_fns(a, b, w):
    import torch
    return {"add": lambda: a + b, "relu": lambda: torch.relu(a), "mm": lambda: a @ w}


# ------------------------------------------------------------------------------------ 2 processes
def _worker_procs(rank: int, world: int, quick: bool, n_shapes: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    import globaltensor as gt

    S, B = gt.sbp.split, gt.sbp.broadcast
    cfg = _settings(quick)
    k = 64
    torch.manual_seed(0)
    A, Bt, W = torch.randn(k * world, k), torch.randn(k * world, k), torch.randn(k, k)
    p = gt.placement("cpu", ranks=list(range(world)))
    mesh = init_device_mesh("cpu", (world,))

    la, lb = A[rank * k:(rank + 1) * k].clone(), Bt[rank * k:(rank + 1) * k].clone()
    ga, gb, gw = gt.distribute(A, p, S(0)), gt.distribute(Bt, p, S(0)), gt.distribute(W, p, B)
    da, db, dw = (distribute_tensor(A, mesh, [Shard(0)]), distribute_tensor(Bt, mesh, [Shard(0)]),
                  distribute_tensor(W, mesh, [Replicate()]))
    Thin = _thin_class()
    local, gfn, dfn = _op_fns(la, lb, W), _op_fns(ga, gb, gw), _op_fns(da, db, dw)
    thin = _op_fns(Thin(la), Thin(lb), Thin(W))
    rows = []
    for op in OPS:
        g, d, l = gfn[op](), dfn[op](), local[op]()
        if g.sbp != (S(0),) or d.placements != (Shard(0),):
            raise AssertionError(f"{op}: unexpected output layout gt {g.sbp} DTensor {d.placements}")
        if not (torch.allclose(g.to_local(), l) and torch.allclose(d.to_local(), l)):
            raise AssertionError(f"{op}: results differ from local torch")
        t = H.timed_many({"local": local[op], "thin": thin[op], "dt": dfn[op], "gt": gfn[op]}, **cfg)
        rows.append(dict(op=op, **t))

    # a new shape: the first call on inputs of a shape not seen before (inputs built outside)
    def first_call(make, op):
        times = []
        for i in range(n_shapes):
            m = k + 1 + i
            x, y, z = make(m)
            dist.barrier()
            t0 = time.perf_counter()
            (x + y) if op == "add" else (x @ z)
            times.append(time.perf_counter() - t0)
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return sorted(t.tolist())[len(times) // 2]

    def make_gt(m):
        return (gt.randn(m * world, k, placement=p, sbp=S(0)), gt.randn(m * world, k, placement=p, sbp=S(0)),
                gt.randn(k, m, placement=p, sbp=B))

    def make_dt(m):
        return (distribute_tensor(torch.randn(m * world, k), mesh, [Shard(0)]),
                distribute_tensor(torch.randn(m * world, k), mesh, [Shard(0)]),
                distribute_tensor(torch.randn(k, m), mesh, [Replicate()]))

    def make_local(m):
        return torch.randn(m, k), torch.randn(m, k), torch.randn(k, m)

    miss = []
    for op in ["add", "mm"]:
        miss.append(dict(op=op, local=first_call(make_local, op), gt=first_call(make_gt, op),
                         dt=first_call(make_dt, op)))
    return dict(rows=rows, miss=miss)


# ------------------------------------------------------------------------------------ simulated
def _worker_sim(rank: int, world: int, quick: bool):
    """One process: gt.simulate(4), DTensor on LocalTensorMode(4) (over a fake process group)
    and 4x the local op, their rounds interleaved. LocalTensorMode is entered once per block
    of ops (entering it costs about as much as one op, spread over the block)."""
    import torch
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import globaltensor as gt

    n, k = 4, 64
    cfg = _settings(quick)
    block = 20 if quick else 50           # ops per timed call
    torch.manual_seed(0)
    A, Bt, W = torch.randn(k * n, k), torch.randn(k * n, k), torch.randn(k, k)
    expected = _op_fns(A, Bt, W)

    gt.simulate(n)
    S, B = gt.sbp.split, gt.sbp.broadcast
    p = gt.placement("cpu", ranks=list(range(n)))
    gfns = _op_fns(gt.distribute(A, p, S(0)), gt.distribute(Bt, p, S(0)), gt.distribute(W, p, B))
    local = _op_fns(A[:k].clone(), Bt[:k].clone(), W)

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    mode = LocalTensorMode(n)
    with mode:
        mesh = init_device_mesh("cpu", (n,))
        lfns = _op_fns(distribute_tensor(A, mesh, [Shard(0)]), distribute_tensor(Bt, mesh, [Shard(0)]),
                       distribute_tensor(W, mesh, [Replicate()]))
        for op in OPS:
            got = lfns[op]().full_tensor()
            got = got.reconcile() if hasattr(got, "reconcile") else got
            if not torch.allclose(got, expected[op](), atol=1e-5):
                raise AssertionError(f"LocalTensorMode {op}: wrong result")
    for op in OPS:
        if not torch.allclose(gfns[op]().full_tensor(), expected[op](), atol=1e-5):
            raise AssertionError(f"simulated gt {op}: wrong result")

    results = {}
    for op in OPS:
        def gt_block(f=gfns[op]):
            for _ in range(block):
                f()

        def ltm_block(f=lfns[op]):
            with mode:
                for _ in range(block):
                    f()

        def local4(f=local[op]):
            for _ in range(block * n):
                f()
        t = H.timed_many({"gt": gt_block, "ltm": ltm_block, "local4": local4}, warmup=2, repeats=cfg["repeats"],
                         inner=max(1, cfg["inner"] // block), sync=False)
        results[op] = {key: H.Timing(v / block, v.min / block) for key, v in t.items()}
    dist.destroy_process_group()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--only", choices=["procs", "sim"], help="run only the 2-process part or the simulated part")
    args = ap.parse_args(argv)
    print(H.header("eager_overhead"))
    cfg = _settings(args.quick)
    print(f"64x64 fp32 pieces; microseconds per op, median of {cfg['repeats']} rounds of {cfg['inner']} calls "
          f"(slowest rank); lower is better\n")
    t0 = time.time()
    if args.only != "sim":
        _report_procs(H.spawn(_worker_procs, 2, args.quick, 5 if args.quick else 15))
    if args.only != "procs":
        _report_sim(H.spawn(_worker_sim, 0, args.quick))
    print(f"\n(total {time.time() - t0:.0f} s; load average at the end {H.load_average()})")
    return 0


def _paired_overhead(x, local, peer) -> float:
    """Median over rounds of (x - local) / (peer - local), both taken in the same round."""
    return statistics.median((a - c) / (b - c) for a, b, c in zip(x.rounds, peer.rounds, local.rounds))


def _report_procs(res) -> None:
    rows = []
    ok_overhead = True
    for r in res["rows"]:
        og, od = r["gt"] - r["local"], r["dt"] - r["local"]
        ogm, odm = r["gt"].min - r["local"].min, r["dt"].min - r["local"].min
        ok_overhead &= (_paired_overhead(r["gt"], r["local"], r["thin"]) <= 1.2
                        and _paired_overhead(r["gt"], r["local"], r["dt"]) < 1.0)
        rows.append([r["op"], H.fmt(r["local"], 1e6, 1), H.fmt(r["thin"], 1e6, 1), H.fmt(r["dt"], 1e6, 1),
                     H.fmt(r["gt"], 1e6, 1), H.fmt(od, 1e6, 1), H.fmt(og, 1e6, 1), H.ratio(og, od),
                     f"{_paired_overhead(r['gt'], r['local'], r['thin']):.2f}x",
                     " / ".join(H.fmt(r[k].min, 1e6, 1) for k in ("local", "thin", "dt", "gt")),
                     H.ratio(ogm, odm)])
    print(H.table(["op", "local us", "thin subclass us", "DTensor us", "gt us", "DTensor overhead", "gt overhead",
                   "overhead gt/DTensor", "overhead gt/thin (paired)", "min local / thin / DT / gt",
                   "overhead gt/DT (min)"],
                  rows,
                  "## Per-op time, 2 gloo processes (add: S0+S0, relu: S0, mm: S0 @ B; no communication)"))
    print("thin subclass: a minimal Python __torch_dispatch__ wrapper (unwrap, call, rewrap) -- the floor of\n"
          "any Python wrapper subclass; DTensor's cached ops take a C++ fast path and skip Python dispatch.")
    print(f"goal: gt overhead <= 1.2x the thin subclass's and < DTensor's (paired) -> "
          f"{'MET' if ok_overhead else 'MISSED'}\n")

    rows = []
    ok_miss = True
    for r in res["miss"]:
        ok_miss &= r["gt"] < 0.5e-3
        rows.append([r["op"], H.fmt(r["local"], 1e3, 3), H.fmt(r["dt"], 1e3, 3), H.fmt(r["gt"], 1e3, 3),
                     H.ratio(r["gt"], r["dt"])])
    print(H.table(["op", "local ms", "DTensor ms", "gt ms", "gt/DTensor"], rows,
                  "## First call on a new shape (cache miss), 2 gloo processes, median over shapes"))
    print(f"goal: gt cache miss < 0.5 ms -> {'MET' if ok_miss else 'MISSED'}\n")


def _report_sim(sim) -> None:
    rows = []
    ok_sim = True
    for op in OPS:
        g, lt, l4 = sim[op]["gt"], sim[op]["ltm"], sim[op]["local4"]
        ok_sim &= g <= 0.25 * lt
        rows.append([op, H.fmt(l4, 1e6, 1), H.fmt(lt, 1e6, 1), H.fmt(g, 1e6, 1), H.ratio(g, lt),
                     H.fmt(g - l4, 1e6, 1), H.fmt(lt - l4, 1e6, 1), H.ratio(g.min, lt.min)])
    print(H.table(["op", "4x local us", "LocalTensorMode us", "gt.simulate(4) us", "gt/LTM", "gt overhead",
                   "LTM overhead", "gt/LTM (min)"], rows, "## 4 simulated ranks in one process, 64x64 pieces"))
    print(f"goal: gt.simulate(4) <= 0.25x LocalTensorMode -> {'MET' if ok_sim else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
