"""Train a small GPT on 4 ranks with 2-D (data x tensor) parallelism, beside a single-device run.

    python examples/demo.py                                          # 4 CPU-simulated ranks, one process
    python -m globaltensor.launch --nproc-per-node 4 examples/demo.py  # 4 processes (gloo)

The model (examples/gpt.py) is plain PyTorch. ``gt.nn.distribute_module`` lays its
parameters out on a 2x2 placement -- axis 0 is the data axis, axis 1 the tensor axis -- with
a Megatron-style plan: attention's qkv and the MLP's fc1 column parallel, attention's proj
and the MLP's fc2 row parallel on the tensor axis, everything replicated on the data axis.
The batch is split over the data axis. Every step prints the loss beside the loss of the
same model trained on one device from the same initialisation and data, and the bytes the
step communicated (the most any one rank sent).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import globaltensor as gt  # noqa: E402
import globaltensor.nn as gnn  # noqa: E402
from gpt import TENSOR_PARALLEL, GPT, GPTConfig, make_batch  # noqa: E402

S, B = gt.sbp.split, gt.sbp.broadcast
RANKS = 4
DATA_AXIS, TENSOR_AXIS = 0, 1
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def log(*args, **kwargs) -> None:
    """Print on rank 0 only (every rank runs the whole program)."""
    if gt.rank() == 0:
        print(*args, **kwargs, flush=True)


def setup_world() -> str:
    """4 simulated ranks in this process, unless a launcher started this process as one rank of a world."""
    if "WORLD_SIZE" not in os.environ:
        gt.simulate(RANKS)
        kind = f"{RANKS} CPU-simulated ranks in one process"
    else:
        kind = f"{gt.world_size()} processes (this is rank {gt.rank()})"
    if gt.world_size() != RANKS:
        raise SystemExit(f"demo: needs a world of {RANKS} ranks, got {gt.world_size()}")
    return kind


def describe_sharding(name: str, w) -> None:
    layout = w.layout_meta
    log(f"{name}: logical shape {tuple(w.shape)}, sbp {w.sbp} on placement {w.placement.ranks.tolist()}")
    for r in w.placement.rank_list():
        log(f"  rank {r} (data {w.placement.coord(r)[DATA_AXIS]}, tensor {w.placement.coord(r)[TENSOR_AXIS]}) "
            f"holds rows/cols {[(s, s + n) for s, n in layout.box(r)]} -> piece {layout.piece_shape(r)}")
    if hasattr(gt, "visualize") and gt.rank() == 0:
        gt.visualize(w)


def train(steps: int = 5, batch: int = 8, seq: int = 16, lr: float = 1e-2, cfg: GPTConfig = GPTConfig()) -> dict:
    """Train the distributed model and the single-device reference side by side; returns what was measured."""
    placement = gt.placement("cpu", ranks=[[0, 1], [2, 3]])          # axis 0: data, axis 1: tensor
    torch.manual_seed(0)                                             # the same init on every rank
    model = GPT(cfg)
    reference = GPT(cfg)
    reference.load_state_dict(model.state_dict())

    plan = gnn.megatron_plan(**TENSOR_PARALLEL, axis=TENSOR_AXIS, ndim=2)
    gnn.distribute_module(model, placement, plan)
    batch_sbp = (S(0), B)                                            # batch split over the data axis

    log("plan:")
    for pattern, sbp in plan.items():
        log(f"  {pattern:24s} {sbp}")
    describe_sharding("blocks.0.attn.qkv.weight", model.blocks[0].attn.qkv.weight)

    # eps=1e-6 rather than 1e-8: some gradients are zero in exact arithmetic (the key bias: softmax
    # ignores a constant added to every score), and Adam would blow their float noise up to
    # +-lr steps on either run alike, making two exact-in-theory runs differ visibly.
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, eps=1e-6)
    data = torch.Generator().manual_seed(1234)                       # the same batches on every rank
    losses, ref_losses, comm = [], [], []
    log(f"\n{'step':>4} {'loss (4 ranks)':>15} {'loss (1 device)':>16} {'|diff|':>8} {'bytes sent':>11} "
        f"{'collectives':>11} {'time':>7}")
    for step in range(steps):
        idx, targets = make_batch(cfg, batch, seq, data)
        start = time.perf_counter()
        with gt.comm_stats() as stats:
            loss = model.loss(gt.distribute(idx, placement, batch_sbp), gt.distribute(targets, placement, batch_sbp))
            loss.backward()
            opt.step()
            opt.zero_grad()
        elapsed = time.perf_counter() - start
        ref_loss = reference.loss(idx, targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        value = loss.item()                                          # a collective: every rank calls it
        losses.append(value)
        ref_losses.append(ref_loss.item())
        comm.append((stats.bytes_sent, Counter(stats.ops())))
        log(f"{step:>4} {value:>15.6f} {ref_losses[-1]:>16.6f} {abs(value - ref_losses[-1]):>8.1e} "
            f"{stats.bytes_sent:>11,} {stats.count:>11} {elapsed:>6.2f}s")
    log("collectives per step: " + ", ".join(f"{op} x{n}" for op, n in sorted(comm[-1][1].items())))

    with torch.no_grad():
        errs = [((p.full_tensor() - q).abs().max().item(), bool(torch.allclose(p.full_tensor(), q, **TOLERANCE)))
                for p, q in zip(model.parameters(), reference.parameters())]
    max_err = max(e for e, _ in errs)
    log(f"max |parameter - single-device parameter| after {steps} steps: {max_err:.2e}")
    return {"losses": losses, "reference": ref_losses, "bytes_sent": [b for b, _ in comm], "max_err": max_err,
            "params_close": all(ok for _, ok in errs)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    kind = setup_world()
    log(f"globaltensor demo: a {GPTConfig().n_layer}-layer GPT on {kind}, placement 2x2 (data x tensor)\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(steps=args.steps)
    missing = sorted({str(w.message).split(" has no SBP rule")[0].removeprefix("globaltensor: ")
                      for w in caught if "has no SBP rule" in str(w.message)})
    if missing:
        log(f"ops that ran through the gather-to-broadcast fallback (no SBP rule yet): {', '.join(missing)}")
    for w in caught:
        if "has no SBP rule" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    ok = result["params_close"] and all(abs(a - b) <= TOLERANCE["atol"] + TOLERANCE["rtol"] * abs(b)
                                        for a, b in zip(result["losses"], result["reference"]))
    log(f"{'OK' if ok else 'MISMATCH'}: the 4-rank run {'matches' if ok else 'does not match'} the single-device "
        f"run; total {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
