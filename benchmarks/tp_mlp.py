"""A tensor-parallel MLP training step: globaltensor vs DTensor vs hand-written torch.distributed.

    .venv/bin/python benchmarks/tp_mlp.py [--quick] [--nproc 2] [--loss sq|mse]

The model is Linear(1024, 4096) -> ReLU -> Linear(4096, 1024), batch 64, loss mean squared
error against a fixed target, plain SGD (lr 0.01); the input requires grad (as if it came
from an earlier layer), so every version has one all-reduce in forward and one in backward.

- globaltensor: the weights are distributed with ``gt.distribute`` -- fc1's weight and
  bias split along the output features (``S(0)``, column parallel), fc2's weight along the
  input features (``S(1)``, row parallel), fc2's bias broadcast -- and the unchanged torch
  module, loss and optimizer run on global tensors; the input enters as a broadcast
  global tensor (``x.to_global(placement, B)``).
- DTensor: ``parallelize_module`` with ColwiseParallel / RowwiseParallel.
- hand-written: each rank holds its shards as plain tensors; the Megatron f/g functions put
  one all_reduce in the forward (after fc2) and one in the backward (the input's grad).

All three start from the same weights; the losses of the first steps must agree.
Goal: globaltensor's step at most 1.05x the hand-written one.
"""
from __future__ import annotations

import argparse
import sys
import time

import _harness as H

D_IN, D_HID, BATCH, LR = 1024, 4096, 64, 0.01


def model_and_data():
    """A maker of the MLP (the same weights each time) and the fixed input and target of every version."""
    import torch
    import torch.nn as nn

    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_IN))
    g = torch.Generator().manual_seed(1)
    return make_model, torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_IN, generator=g)


def megatron_model(make_model, p):
    """A fresh MLP with fc1 column parallel (S(0)), fc2 row parallel (S(1)) and its bias broadcast on
    ``p``, and its SGD."""
    import torch
    import torch.nn as nn

    import globaltensor as gt
    S, B = gt.sbp.split, gt.sbp.broadcast
    model = make_model()
    fc1, fc2 = model[0], model[2]
    fc1.weight = nn.Parameter(gt.distribute(fc1.weight.detach(), p, S(0)))
    fc1.bias = nn.Parameter(gt.distribute(fc1.bias.detach(), p, S(0)))
    fc2.weight = nn.Parameter(gt.distribute(fc2.weight.detach(), p, S(1)))
    fc2.bias = nn.Parameter(gt.distribute(fc2.bias.detach(), p, B))
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def hand_written_step(full, x, target, rank: int, world: int, loss_fn):
    """The hand-written step on this rank's shards of ``full`` (Linear -> ReLU -> Linear): fc1 split
    by output features, fc2 by input features, Megatron's f (identity forward, all_reduce backward)
    before fc1 and g (all_reduce forward) after fc2; plain SGD."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    copy_to_tp, reduce_from_tp = H.megatron_f_g()

    n = D_HID // world
    sl = slice(rank * n, (rank + 1) * n)
    w1 = nn.Parameter(full[0].weight.detach()[sl].clone())
    b1 = nn.Parameter(full[0].bias.detach()[sl].clone())
    w2 = nn.Parameter(full[2].weight.detach()[:, sl].clone())
    b2 = nn.Parameter(full[2].bias.detach().clone())
    opt = torch.optim.SGD([w1, b1, w2, b2], lr=LR)

    def step():
        xin = x.detach().requires_grad_()
        h = torch.relu(F.linear(copy_to_tp(xin), w1, b1))
        y = reduce_from_tp(F.linear(h, w2)) + b2
        loss = loss_fn(y, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    return step


def _settings(quick: bool) -> dict:
    return dict(warmup=2, repeats=5, inner=1) if quick else dict(warmup=3, repeats=41, inner=2)


def _worker(rank: int, world: int, quick: bool, loss_kind: str, check_steps: int):
    import warnings

    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import globaltensor as gt

    fallbacks = []
    warnings.simplefilter("always")
    _show = warnings.showwarning

    def catch(message, category, *a, **k):
        text = str(message)
        if "has no SBP rule" in text:
            fallbacks.append(text.split(" has no SBP rule")[0].replace("globaltensor: ", ""))
        elif "deprecated" not in text:
            _show(message, category, *a, **k)
    warnings.showwarning = catch

    cfg = _settings(quick)
    B = gt.sbp.broadcast

    make_model, x, target = model_and_data()

    def loss_fn(y, t):
        return F.mse_loss(y, t) if loss_kind == "mse" else ((y - t) ** 2).mean()

    # ---- globaltensor: distribute the weights, run the plain module
    p = gt.placement("cpu", ranks=list(range(world)))
    gtarget = target.to_global(placement=p, sbp=B)

    def make_gt():
        return megatron_model(make_model, p)

    gmodel, gopt = make_gt()

    def gt_step():
        xin = x.detach().requires_grad_()
        loss = loss_fn(gmodel(xin.to_global(placement=p, sbp=B)), gtarget)
        gopt.zero_grad()
        loss.backward()
        gopt.step()
        return loss

    # the same with the output made broadcast by hand (what RowwiseParallel's Replicate output does)
    bmodel, bopt = make_gt()

    def gt_b_step():
        xin = x.detach().requires_grad_()
        loss = loss_fn(bmodel(xin.to_global(placement=p, sbp=B)).to_global(sbp=B), gtarget)
        bopt.zero_grad()
        loss.backward()
        bopt.step()
        return loss

    # ---- DTensor: parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    dmodel = parallelize_module(make_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    dopt = torch.optim.SGD(dmodel.parameters(), lr=LR)

    def dt_step():
        xin = x.detach().requires_grad_()
        loss = loss_fn(dmodel(xin), target)
        dopt.zero_grad()
        loss.backward()
        dopt.step()
        return loss

    # ---- hand-written: local shards, Megatron f (fwd identity / bwd all_reduce) and g (the reverse)
    hand_step = hand_written_step(make_model(), x, target, rank, world, loss_fn)

    # ---- the same losses, step by step
    losses = {"gt": [], "gt_b": [], "dt": [], "hand": []}

    def value(loss):
        return float((loss.full_tensor() if getattr(loss, "is_global", False) else loss).detach())
    for _ in range(check_steps):
        losses["gt"].append(value(gt_step()))
        losses["gt_b"].append(value(gt_b_step()))
        losses["dt"].append(value(dt_step()))
        losses["hand"].append(value(hand_step()))
    for k in ("gt", "gt_b", "dt"):
        for i, (a, b) in enumerate(zip(losses[k], losses["hand"])):
            if abs(a - b) > 1e-4 * max(1.0, abs(b)):
                raise AssertionError(f"step {i}: {k} loss {a} differs from the hand-written {b}; "
                                     f"all losses {losses}")

    # ---- collectives per step
    with gt.comm_stats() as st:
        gt_step()
    with gt.comm_stats() as st_b:
        gt_b_step()
    from torch.distributed.tensor.debug import CommDebugMode
    with CommDebugMode() as cdm:
        dt_step()
    counts = dict(gt=st.ops(), gt_b=st_b.ops(), dt={str(k).split(".")[-1]: v for k, v in cdm.get_comm_counts().items()})

    t = H.timed_many({"hand": hand_step, "dt": dt_step, "gt": gt_step, "gt_b": gt_b_step}, **cfg)
    return dict(times=t, losses=losses, counts=counts, fallbacks=sorted(set(fallbacks)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--loss", choices=["sq", "mse"], default="sq",
                    help="sq: ((y - t) ** 2).mean() (default); mse: F.mse_loss")
    args = ap.parse_args(argv)
    print(H.header("tp_mlp"))
    cfg = _settings(args.quick)
    print(f"MLP {D_IN}->{D_HID}->{D_IN}, batch {BATCH}, SGD, {args.nproc} gloo processes; ms per training step, "
          f"median of {cfg['repeats']} rounds of {cfg['inner']} steps (slowest rank)\n")
    t0 = time.time()
    res = H.spawn(_worker, args.nproc, args.quick, args.loss, 3)
    t = res["times"]
    names = [("hand", "hand-written torch.distributed"), ("dt", "DTensor parallelize_module"),
             ("gt", "globaltensor"), ("gt_b", "globaltensor + y.to_global(sbp=B)")]
    rows = [[label, H.fmt(t[k]), H.ratio(t[k], t["hand"]), f"{H.paired_ratio(t[k], t['hand']):.2f}x",
             H.fmt(t[k].min), H.ratio(t[k].min, t["hand"].min)] for k, label in names]
    print(H.table(["version", "ms / step", "vs hand-written", "paired", "min ms", "vs hand-written (min)"], rows,
                  "## Training step (median; median of the per-round ratios; fastest round)"))
    paired = H.paired_ratio(t["gt"], t["hand"])
    print(f"gt/DTensor: {H.ratio(t['gt'], t['dt'])} (paired {H.paired_ratio(t['gt'], t['dt']):.2f}x)")
    print(f"goal: gt <= 1.05x hand-written (paired ratio) -> {'MET' if paired <= 1.05 else 'MISSED'}\n")
    ls = res["losses"]
    print("losses of the first steps (must agree):")
    for k, name in (("hand", "hand-written"), ("dt", "DTensor"), ("gt", "globaltensor"), ("gt_b", "gt + to_global(B)")):
        print(f"  {name:18s} " + "  ".join(f"{v:.6f}" for v in ls[k]))
    c = res["counts"]
    print(f"\ncollectives in one step: globaltensor {len(c['gt'])} {c['gt']}; gt + to_global(B) {len(c['gt_b'])} "
          f"{c['gt_b']}; DTensor {c['dt']}; hand-written 2 all_reduce")
    if res["fallbacks"]:
        print(f"ops that fell back (no SBP rule) in the globaltensor step: {res['fallbacks']}")
    else:
        print("no op fell back (every op of the globaltensor step has an SBP rule)")
    print(f"\n(total {time.time() - t0:.0f} s; load average at the end {H.load_average()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
