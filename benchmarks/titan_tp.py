"""torchtitan's Llama 3 with torchtitan's tensor parallelism: bytes and collectives of one training
step, torchtitan itself (its sharding configs and ``Module.parallelize`` on DTensor) beside
globaltensor (the same model, laid out by the SBP translation of that plan), on gloo processes.

    .venv/bin/python benchmarks/titan_tp.py [--nproc 2]

The model is torchtitan's own ``Llama3Model`` from its package (examples/titan_models.py: 64 wide,
4 heads, 2 layers, vocabulary 128, fused ``wqkv``, sdpa attention), float32. torchtitan's plan:
the embedding split over the vocabulary (its output reduced), ``wqkv`` / ``w1`` / ``w3`` column
parallel, ``wo`` / ``w2`` row parallel, ``lm_head`` column parallel with its logits left split over
the vocabulary for a vocabulary-parallel loss; with sequence parallelism (torchtitan's default)
the norms run on a sequence split, the row-parallel outputs reduce-scattered onto it and the
inputs of attention, the feed-forward and the head all-gathered. globaltensor's plan is the same
in SBP (``titan_plan``): ``gt.nn.llama_plan(model, tp, sequence_parallel=...)``, the embedding's and
the head's weights ``S(0)`` and, with sequence parallelism, the final norm's output entry ``B``.

A step: torchtitan's loss (``cross_entropy_loss``: the sum over tokens, here divided by their
count), the backward, torchtitan's ``clip_grad_norm_`` at 1.0 where asked, AdamW. Each side's first
step is a warm-up, the second counted. DTensor's bytes: the functional collectives its step issues
(a dispatch mode) and the ``torch.distributed`` calls torchtitan makes on plain tensors (its
vocabulary-parallel loss), by the same ring formulas as ``gt.comm_stats``; the busiest rank's. The
two sides' losses must agree.
"""
from __future__ import annotations

import argparse
import os
import sys

import _harness as H
from _peer_bytes import PeerBytes, check_losses_agree, most, wire_bytes

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
SIZES = dict(dim=64, heads=4, kv_heads=4, layers=2, vocab=128)
BATCH, SEQ = 8, 16
PLANS = ("tp", "tp-clip", "tp-sp", "tp-sp-clip")


def titan_plan(model, tp: int, sequence_parallel: bool) -> dict:
    """torchtitan's tensor-parallel plan of its Llama 3 in SBP: ``llama_plan``'s, the embedding and the
    head split over the vocabulary, and with sequence parallelism the final norm's output gathered
    (torchtitan's ``pre_lm_head_norm_config``), so that the head's backward keeps the gathered copy."""
    import globaltensor as gt
    from globaltensor.sbp import broadcast as B, split as S
    plan = {"tok_embeddings.weight": (S(0),), "lm_head.weight": (S(0),),
            **gt.nn.llama_plan(model, tp, sequence_parallel=sequence_parallel)}
    if sequence_parallel:
        plan["norm:output"] = (B,)
    return plan


def _worker(rank: int, world: int):
    import warnings

    import torch
    from torch.distributed.tensor import DTensor

    import globaltensor as gt
    sys.path.insert(0, EXAMPLES)
    from titan_models import llama3, sharded_llama3
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.utils import clip_grad_norm_
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    tokens = torch.randint(0, SIZES["vocab"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    p = gt.placement("cpu", list(range(world)))
    out = {}
    for plan in PLANS:
        clip, sp = plan.endswith("clip"), "-sp" in plan
        dmodel = sharded_llama3(world, sequence_parallel=sp, **SIZES)
        gmodel = llama3(**SIZES)
        gt.nn.distribute_module(gmodel, p, titan_plan(gmodel, world, sp))
        dopt, gopt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (dmodel, gmodel))

        def step(model, opt, x, y):
            loss = cross_entropy_loss(model(x), y) / y.numel()
            loss.backward()
            if clip:
                clip_grad_norm_(list(model.parameters()), 1.0)
            opt.step()
            opt.zero_grad()
            return loss
        losses = {"dt": [], "gt": []}
        for k in range(2):
            with PeerBytes(world) as counted:
                loss, dt_wire = wire_bytes(lambda: step(dmodel, dopt, inputs, labels))
            losses["dt"].append(float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()))
            gx, gy = (gt.distribute(t, p, gt.sbp.broadcast) for t in (inputs, labels))
            with gt.comm_stats() as st:
                loss, gt_wire = wire_bytes(lambda: step(gmodel, gopt, gx, gy))
            losses["gt"].append(float(loss.full_tensor().detach()))
        check_losses_agree(plan, "torchtitan", losses)
        dt_bytes, dt_wire, gt_wire = most([counted.bytes, dt_wire, gt_wire])
        out[plan] = {"dt_bytes": dt_bytes, "dt_ops": counted.ops, "gt_bytes": st.bytes_sent, "gt_ops": st.ops(),
                     "dt_wire": dt_wire, "gt_wire": gt_wire, "losses": losses}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args(argv)
    print(H.header("titan_tp"))
    print(f"torchtitan's Llama3Model ({SIZES}, float32), batch {BATCH} x {SEQ}, AdamW; {args.nproc} gloo "
          f"processes; the second step, the busiest rank's bytes\n")
    res = H.spawn(_worker, args.nproc)
    rows = [[plan, f"{r['dt_bytes']:,}", str(len(r["dt_ops"])), f"{r['gt_bytes']:,}", str(len(r["gt_ops"])),
             f"{r['gt_bytes'] / max(r['dt_bytes'], 1):.2f}x", f"{r['dt_wire']:,}", f"{r['gt_wire']:,}",
             f"{r['gt_wire'] / max(r['dt_wire'], 1):.2f}x"] for plan, r in res.items()]
    print(H.table(["plan", "torchtitan bytes", "coll.", "globaltensor bytes", "coll.", "gt / torchtitan",
                   "torchtitan on the wire", "globaltensor on the wire", "gt / torchtitan"], rows,
                  "## torchtitan's tensor parallelism of its Llama 3: torchtitan (DTensor) vs globaltensor"))
    for plan, r in res.items():
        print(f"{plan}: torchtitan {r['dt_ops']}\n    globaltensor {r['gt_ops']}\n    losses torchtitan "
              f"{r['losses']['dt']}, globaltensor {r['losses']['gt']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
