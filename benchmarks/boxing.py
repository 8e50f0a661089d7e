"""Boxing: globaltensor vs DTensor vs the raw torch.distributed collective, side by side.

    .venv/bin/python benchmarks/boxing.py [--quick] [--size N]

For 2 and 4 gloo processes and a 4 MB logical fp32 tensor (1024x1024), the time of each 1-D
conversion in globaltensor (``x.to_global(sbp=...)``, ``x`` built once outside the timing),
DTensor (``redistribute`` on a 1-D DeviceMesh("cpu")) and the raw collective that moves
the same bytes on preallocated buffers (all_gather_single, all_reduce, all_to_all_single,
reduce_scatter_single, a slice copy), with the pack or unpack copy its target piece needs
(S(0)->S(1) packs column blocks, S(1)->S(0) unpacks them); each raw result is checked
against globaltensor's piece. Then on 4 processes: 2-D conversions (a 2x2
placement vs a 2x2 DeviceMesh, raw = the hand-written collective on the sub-groups), and
moves between placements beside hand-written send/recv (DTensor cannot move a tensor
between meshes). Every globaltensor result is checked against DTensor's (or the expected
value) once, outside the timing.
"""
from __future__ import annotations

import argparse
import sys
import time

import _harness as H


def _settings(quick: bool) -> dict:
    """Rounds, and how long one lasts: as many back-to-back conversions as fill it (the same count
    for every side of a comparison, see ``_harness.inner_for``)."""
    return dict(warmup=1, repeats=3, round_s=0.002) if quick else dict(warmup=3, repeats=31, round_s=0.01)


def _timed(fns: dict, cfg: dict) -> dict:
    return H.timed_many(fns, warmup=cfg["warmup"], repeats=cfg["repeats"], inner=H.inner_for(fns, cfg["round_s"]))


ONE_D = ["S(0)->B", "P->B", "S(0)->S(1)", "P->S(0)", "B->S(0)", "S(1)->S(0)", "S(0)->P"]
RAW_NAME = {"S(0)->B": "all_gather", "P->B": "all_reduce", "S(0)->S(1)": "pack+all_to_all",
            "P->S(0)": "reduce_scatter", "B->S(0)": "slice copy", "S(1)->S(0)": "all_to_all+unpack",
            "S(0)->P": "zero-pad copy"}


def _worker(rank: int, world: int, size: int, quick: bool, with_2d: bool):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    import globaltensor as gt

    S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
    cfg = _settings(quick)
    torch.manual_seed(0)
    full = torch.randn(size, size)
    n = size // world

    def gt_sbp(name):
        return {"S(0)": S(0), "S(1)": S(1), "B": B, "P": P}[name]

    def dt_pl(name):
        return {"S(0)": Shard(0), "S(1)": Shard(1), "B": Replicate(), "P": Partial()}[name]

    # ---------------------------------------------------------------- 1-D
    p = gt.placement("cpu", ranks=list(range(world)))
    mesh = init_device_mesh("cpu", (world,))

    def gt_input(name):
        if name == "P":
            return full.to_global(placement=p, sbp=P)
        return gt.distribute(full, p, gt_sbp(name))

    def dt_input(name):
        if name == "P":
            return DTensor.from_local(full, mesh, [Partial()], run_check=False)
        return distribute_tensor(full, mesh, [dt_pl(name)])

    # raw: the collective on buffers set up outside the timing, with only the copies the result
    # needs; like the others it returns a fresh tensor holding the target piece and leaves its
    # input intact (an in-place all_reduce works on a fresh copy).
    def raw_fn(conv):
        piece0 = full.narrow(0, rank * n, n).contiguous()
        piece1 = full.narrow(1, rank * n, n).contiguous()
        if conv == "S(0)->B":
            def f():
                out = torch.empty(size, size)
                dist.all_gather_single(out, piece0)
                return out
            return f
        if conv == "P->B":
            def f():
                buf = full.clone()
                dist.all_reduce(buf)
                return buf
            return f
        if conv == "S(0)->S(1)":
            # rank j gets the column block j of each row piece: one strided copy packs them (into
            # a send buffer kept across calls); the blocks received back to back are the result
            send = torch.empty(world, n, n)

            def f():
                send.copy_(piece0.view(n, world, n).transpose(0, 1))
                recv = torch.empty(size, n)
                dist.all_to_all_single(recv, send)
                return recv
            return f
        if conv == "S(1)->S(0)":
            # the row blocks of a column piece go as they lie; the blocks received (into a buffer
            # kept across calls) are the result's column blocks: one strided copy unpacks them
            recv = torch.empty(world, n, n)

            def f():
                dist.all_to_all_single(recv, piece1)
                out = torch.empty(n, size)
                out.view(n, world, n).copy_(recv.transpose(0, 1))
                return out
            return f
        if conv == "P->S(0)":
            def f():
                out = torch.empty(n, size)
                dist.reduce_scatter_single(out, full)
                return out
            return f
        if conv == "B->S(0)":
            return lambda: full.narrow(0, rank * n, n).clone()
        if conv == "S(0)->P":
            def pad():          # zeros either side of the block, the block copied once
                z = full.new_empty(size, size)
                z.narrow(0, 0, rank * n).zero_()
                z.narrow(0, (rank + 1) * n, size - (rank + 1) * n).zero_()
                z.narrow(0, rank * n, n).copy_(piece0)
                return z
            return pad
        raise KeyError(conv)

    def raw_a2a_sum():
        # P->S: an all-to-all of the parts and a local sum (what beats gloo's reduce-scatter)
        def f():
            recv = torch.empty_like(full)
            dist.all_to_all_single(recv, full)
            out = torch.add(recv[:n], recv[n:2 * n])
            for i in range(2, world):
                out.add_(recv[i * n:(i + 1) * n])
            return out
        return f

    rows = []
    for conv in ONE_D:
        a, b = conv.split("->")
        x = gt_input(a)
        target = gt_sbp(b)
        got = x.to_global(sbp=target)
        d = dt_input(a)
        dt_fn, note = None, ""
        try:
            dres = d.redistribute(mesh, [dt_pl(b)])
            dt_fn = lambda: d.redistribute(mesh, [dt_pl(b)])  # noqa: E731
            ok = torch.allclose(got.full_tensor(), dres.full_tensor(), rtol=1e-5, atol=1e-4)
        except Exception as e:  # DTensor may not support a conversion (S->P)
            note = f"DTensor: {type(e).__name__}"
            want = full * world if a == "P" else full
            ok = torch.allclose(got.full_tensor(), want, rtol=1e-5, atol=1e-4)
        if not ok:
            raise AssertionError(f"{world} ranks {conv}: globaltensor's result differs from DTensor's")
        fns = {"gt": lambda: x.to_global(sbp=target), "dt": dt_fn, "raw": raw_fn(conv)}
        if conv == "P->S(0)":
            fns["alt"] = raw_a2a_sum()
        for k in ("raw", "alt"):
            if k in fns and not torch.allclose(fns[k](), got.to_local(), rtol=1e-5, atol=1e-4):
                raise AssertionError(f"{world} ranks {conv}: the raw baseline's result is not the target piece")
        t = _timed(fns, cfg)
        rows.append(dict(world=world, conv=conv, gt=t["gt"], dt=t["dt"], raw=t["raw"], raw_name=RAW_NAME[conv],
                         note=note))
        if conv == "P->S(0)":
            rows.append(dict(world=world, conv="P->S(0)", gt=t["gt"], dt=t["dt"], raw=t["alt"],
                             raw_name="all_to_all+sum", note="alt raw"))

    if not with_2d:
        return dict(one_d=rows)

    # ---------------------------------------------------------------- 2-D (2x2)
    assert world == 4
    p2 = gt.placement("cpu", ranks=[[0, 1], [2, 3]])
    mesh2 = init_device_mesh("cpu", (2, 2))
    coord = p2.coord(rank)
    h = size // 2
    # raw sub-groups: axis 0 groups (0,2),(1,3); every rank creates every group in one order
    axis0 = {g: dist.new_group(list(g)) for g in [(0, 2), (1, 3)]}
    my_axis0 = axis0[(0, 2) if coord[1] == 0 else (1, 3)]

    def gt2(nd):
        if any(v.is_partial for v in nd):
            # a local piece per rank: the split axes cut `full`, the partial axes keep it
            piece = full
            for a, v in enumerate(nd):
                if v.is_split:
                    piece = piece.narrow(v.dim, coord[a] * h, h)
            return piece.contiguous().to_global(placement=p2, sbp=nd, shape=(size, size))
        return gt.distribute(full, p2, nd)

    def dt2(pls):
        if any(isinstance(v, Partial) for v in pls):
            piece = full
            for a, v in enumerate(pls):
                if isinstance(v, Shard):
                    piece = piece.narrow(v.dim, coord[a] * h, h)
            return DTensor.from_local(piece.contiguous(), mesh2, pls, run_check=False)
        return distribute_tensor(full, mesh2, pls)

    def raw2(name):
        i, j = coord
        if name == "(S0,S1)->(B,B)":
            piece = full[i * h:(i + 1) * h, j * h:(j + 1) * h].contiguous()

            def f():
                out = torch.empty(4 * h, h)
                dist.all_gather_single(out, piece)
                return out.view(2, 2, h, h).permute(0, 2, 1, 3).reshape(size, size)
            return "all_gather world 1 MB + reorder", f
        if name == "(P,P)->(B,B)":
            def f():
                buf = full.clone()
                dist.all_reduce(buf)
                return buf
            return "all_reduce world 4 MB", f
        if name == "(S0,B)->(B,S1)":
            piece = full[i * h:(i + 1) * h]

            def f():
                mine = piece[:, j * h:(j + 1) * h].contiguous()
                out = torch.empty(size, h)
                dist.all_gather_single(out, mine, group=my_axis0)
                return out
            return "slice + all_gather pairs 1 MB", f
        if name == "(P,S0)->(B,S0)":
            piece = full[j * h:(j + 1) * h]

            def f():
                buf = piece.clone()
                dist.all_reduce(buf, group=my_axis0)
                return buf
            return "all_reduce pairs 2 MB", f
        raise KeyError(name)

    two_d = [("(S0,S1)->(B,B)", (S(0), S(1)), (B, B), [Shard(0), Shard(1)], [Replicate(), Replicate()]),
             ("(P,P)->(B,B)", (P, P), (B, B), [Partial(), Partial()], [Replicate(), Replicate()]),
             ("(S0,B)->(B,S1)", (S(0), B), (B, S(1)), [Shard(0), Replicate()], [Replicate(), Shard(1)]),
             ("(P,S0)->(B,S0)", (P, S(0)), (B, S(0)), [Partial(), Shard(0)], [Replicate(), Shard(0)])]
    rows2 = []
    for name, src, dst, dsrc, ddst in two_d:
        x = gt2(src)
        got = x.to_global(sbp=dst)
        d = dt2(dsrc)
        dres = d.redistribute(mesh2, ddst)
        if not torch.allclose(got.full_tensor(), dres.full_tensor(), rtol=1e-5, atol=1e-4):
            raise AssertionError(f"2-D {name}: globaltensor's result differs from DTensor's")
        raw_name, fn = raw2(name)
        t = _timed({"gt": lambda: x.to_global(sbp=dst), "dt": lambda: d.redistribute(mesh2, ddst), "raw": fn}, cfg)
        rows2.append(dict(conv=name, gt=t["gt"], dt=t["dt"], raw=t["raw"], raw_name=raw_name))

    # ---------------------------------------------------------------- moves between placements
    p01 = gt.placement("cpu", ranks=[0, 1])
    p23 = gt.placement("cpu", ranks=[2, 3])
    p4 = gt.placement("cpu", ranks=[0, 1, 2, 3])

    def raw_01_to_23():
        piece = full[:h].contiguous() if rank in (0, 2) else full[h:].contiguous()

        def f():
            buf = piece if rank < 2 else torch.empty(h, size)
            op = dist.P2POp(dist.isend, buf, rank + 2) if rank < 2 else dist.P2POp(dist.irecv, buf, rank - 2)
            for w in dist.batch_isend_irecv([op]):
                w.wait()
            return buf
        return f

    def raw_s0_to_2d():
        # 1-D S(0) over 4 (256-row pieces) -> (S0,S1) on 2x2: ranks 2k, 2k+1 swap column halves
        q = size // 4
        piece = full[rank * q:(rank + 1) * q]
        partner = rank ^ 1
        keep = rank % 2

        def f():
            send = piece[:, (1 - keep) * h:(2 - keep) * h].contiguous()
            out = torch.empty(h, h)
            recv = out[(1 - keep) * q:(2 - keep) * q]
            ops = [dist.P2POp(dist.isend, send, partner), dist.P2POp(dist.irecv, recv, partner)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            out[keep * q:(keep + 1) * q].copy_(piece[:, keep * h:(keep + 1) * h])
            return out
        return f

    def raw_b_to_superset():
        def f():
            buf = full if rank < 2 else torch.empty(size, size)
            op = dist.P2POp(dist.isend, buf, rank + 2) if rank < 2 else dist.P2POp(dist.irecv, buf, rank - 2)
            for w in dist.batch_isend_irecv([op]):
                w.wait()
            return buf
        return f

    moves = [
        ("[0,1] S(0) -> [2,3] S(0)", lambda: gt.distribute(full, p01, S(0)), p23, S(0), raw_01_to_23,
         "send/recv 0->2, 1->3 (2 MB)", full),
        ("[0..3] S(0) -> [[0,1],[2,3]] (S0,S1)", lambda: gt.distribute(full, p4, S(0)), p2, (S(0), S(1)),
         raw_s0_to_2d, "isend/irecv pairs (0.5 MB) + local copy", full),
        ("[0,1] B -> [0,1,2,3] B", lambda: gt.distribute(full, p01, B), p4, B, raw_b_to_superset,
         "send/recv 0->2, 1->3 (4 MB)", full),
    ]
    rows3 = []
    for name, make, dst_p, dst_sbp, raw, raw_name, want in moves:
        x = make()
        got = x.to_global(placement=dst_p, sbp=dst_sbp)
        if rank in dst_p:
            ok = torch.equal(got.to_global(sbp=(B,) * dst_p.ndim).to_local(), want)
        else:
            ok = True
        ok = H.slowest(0.0 if ok else 1.0) == 0.0
        if not ok:
            raise AssertionError(f"move {name}: wrong result")
        t = _timed({"gt": lambda: x.to_global(placement=dst_p, sbp=dst_sbp), "raw": raw()}, cfg)
        rows3.append(dict(conv=name, gt=t["gt"], raw=t["raw"], raw_name=raw_name))
    return dict(one_d=rows, two_d=rows2, moves=rows3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--size", type=int, default=1024, help="logical tensor is SIZE x SIZE fp32 (default 1024: 4 MB)")
    ap.add_argument("--worlds", default="2,4", help="comma-separated process counts for the 1-D table")
    args = ap.parse_args(argv)
    print(H.header("boxing"))
    cfg = _settings(args.quick)
    print(f"logical tensor {args.size}x{args.size} fp32 = {args.size * args.size * 4 / 2**20:.0f} MB; ms per "
          f"conversion, median of {cfg['repeats']} rounds of about {cfg['round_s'] * 1e3:.0f} ms (slowest rank); "
          "lower is better\n")
    t0 = time.time()
    one_d, two_d, moves = [], [], []
    for w in [int(v) for v in args.worlds.split(",")]:
        res = H.spawn(_worker, w, args.size, args.quick, w == 4)
        one_d += res["one_d"]
        two_d += res.get("two_d", [])
        moves += res.get("moves", [])

    def mins(r, *keys):
        return " / ".join(H.fmt(r[k].min) if r.get(k) is not None else "-" for k in keys)

    def rmin(a, b):
        return H.ratio(a.min, b.min) if a is not None and b is not None else "-"

    rows = [[r["world"], r["conv"], H.fmt(r["gt"]), H.fmt(r["dt"]) if r["dt"] else "n/a", H.fmt(r["raw"]),
             r["raw_name"], H.ratio(r["gt"], r["dt"]), H.ratio(r["gt"], r["raw"]), mins(r, "gt", "dt", "raw"),
             rmin(r["gt"], r["dt"]), rmin(r["gt"], r["raw"]), r["note"]] for r in one_d]
    print(H.table(["ranks", "conversion", "gt ms", "DTensor ms", "raw ms", "raw collective", "gt/DTensor",
                   "gt/raw", "min gt / DT / raw", "gt/DT (min)", "gt/raw (min)", "note"], rows,
                  "## 1-D conversions (medians; then the fastest rounds)"))
    if two_d:
        rows = [[r["conv"], H.fmt(r["gt"]), H.fmt(r["dt"]), H.fmt(r["raw"]), r["raw_name"],
                 H.ratio(r["gt"], r["dt"]), H.ratio(r["gt"], r["raw"]), mins(r, "gt", "dt", "raw"),
                 rmin(r["gt"], r["dt"]), rmin(r["gt"], r["raw"])] for r in two_d]
        print()
        print(H.table(["2x2 conversion", "gt ms", "DTensor ms", "raw ms", "hand-written", "gt/DTensor", "gt/raw",
                       "min gt / DT / raw", "gt/DT (min)", "gt/raw (min)"],
                      rows, "## 2-D conversions, 4 ranks (placement [[0,1],[2,3]] / DeviceMesh (2,2))"))
    if moves:
        rows = [[r["conv"], H.fmt(r["gt"]), "n/a (cannot move between meshes)", H.fmt(r["raw"]), r["raw_name"],
                 H.ratio(r["gt"], r["raw"]), mins(r, "gt", "raw"), rmin(r["gt"], r["raw"])] for r in moves]
        print()
        print(H.table(["move", "gt ms", "DTensor", "raw ms", "hand-written", "gt/raw", "min gt / raw",
                       "gt/raw (min)"], rows,
                      "## Moves between placements, 4 ranks"))
    print(f"\n(total {time.time() - t0:.0f} s; load average at the end {H.load_average()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
