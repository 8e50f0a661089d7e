"""The peer's plan, run by the peer and by us: bytes and collectives of one training step of HF Llama
(transformers' own code, a tiny config) under DTensor's ``parallelize_module`` and under
``gt.nn.distribute_module`` given the same dict of DTensor parallel styles, on gloo processes.

    .venv/bin/python benchmarks/peer_plans.py [--nproc 2]

Plans (keyed by module name, as torchtitan writes them): ``tp`` -- q / k / v and gate / up
``ColwiseParallel``, o / down ``RowwiseParallel`` -- and ``tp-clip``, the same step with
``clip_grad_norm_(1.0)``. A step: the forward, the causal-LM loss, the backward, the clipping where
asked, SGD; DTensor's step runs under ``implicit_replication()`` (its clipping meets the plain
parameters no style names beside the DTensor ones). DTensor's bytes are every collective its step
issues, DTensor's own redistributions included (_peer_bytes.PeerBytes), by the same ring formulas as
``gt.comm_stats`` (all-reduce 2(n-1)/n of the tensor, all-gather and reduce-scatter (n-1)/n of the
whole, all-to-all what leaves the rank), the busiest rank's; each side's first step is a warm-up,
the second counted. The losses of both sides must agree.
"""
from __future__ import annotations

import argparse
import sys

import _harness as H
from _peer_bytes import PeerBytes, check_losses_agree, most

HIDDEN, HEADS, LAYERS, VOCAB, BATCH, SEQ = 64, 4, 2, 128, 8, 16


def _styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    layer = "model.layers.*"
    return {**{f"{layer}.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            f"{layer}.self_attn.o_proj": RowwiseParallel(),
            f"{layer}.mlp.gate_proj": ColwiseParallel(), f"{layer}.mlp.up_proj": ColwiseParallel(),
            f"{layer}.mlp.down_proj": RowwiseParallel()}


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=4 * SEQ,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _worker(rank: int, world: int):
    import warnings

    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import parallelize_module

    import globaltensor as gt
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    p = gt.placement("cpu", list(range(world)))
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for plan in ("tp", "tp-clip"):
        clip = plan.endswith("clip")
        dmodel = parallelize_module(_model(), mesh, _styles())
        gmodel = gt.nn.distribute_module(_model(), p, _styles())
        dopt, gopt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (dmodel, gmodel))

        def step(model, opt, x):
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss
        losses = {"dt": [], "gt": []}
        for k in range(2):
            with implicit_replication(), PeerBytes(world) as counted:
                loss = step(dmodel, dopt, ids)
            losses["dt"].append(float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()))
            gids = gt.distribute(ids, p, gt.sbp.broadcast)
            with gt.comm_stats() as st:
                loss = step(gmodel, gopt, gids)
            losses["gt"].append(float(loss.full_tensor().detach()))
        check_losses_agree(plan, "DTensor", losses)
        out[plan] = {"dt_bytes": most([counted.bytes])[0], "dt_ops": counted.ops, "gt_bytes": st.bytes_sent, "gt_ops": st.ops(),
                     "losses": losses}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args(argv)
    print(H.header("peer_plans"))
    print(f"HF Llama (hidden {HIDDEN}, {HEADS} heads, {LAYERS} layers, float32), batch {BATCH} x {SEQ}, SGD; "
          f"{args.nproc} gloo processes; one step, the busiest rank's bytes\n")
    res = H.spawn(_worker, args.nproc)
    rows = []
    for plan, r in res.items():
        rows.append([plan, f"{r['dt_bytes']:,}", str(len(r["dt_ops"])), f"{r['gt_bytes']:,}", str(len(r["gt_ops"])),
                     f"{r['gt_bytes'] / max(r['dt_bytes'], 1):.2f}x"])
    print(H.table(["plan", "DTensor bytes", "coll.", "globaltensor bytes", "coll.", "gt / DTensor"], rows,
                  "## The same parallel styles, DTensor's parallelize_module vs gt.nn.distribute_module"))
    for plan, r in res.items():
        print(f"{plan}: DTensor {sorted(set(r['dt_ops']))}, globaltensor {sorted(set(r['gt_ops']))}; "
              f"losses DTensor {r['losses']['dt']}, globaltensor {r['losses']['gt']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
