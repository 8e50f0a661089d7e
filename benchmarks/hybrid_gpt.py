"""A 2x2 hybrid (data x tensor parallel) GPT training step: globaltensor eager vs hand-written DDP + Megatron.

    .venv/bin/python benchmarks/hybrid_gpt.py [--quick]

4 gloo processes on a [[0, 1], [2, 3]] placement (axis 0: data, axis 1: tensor), examples/gpt.py
at actor_runtime.py's data-parallel sizes (n_embd 256, 4 layers, 4 heads, batch 16 x 64; ``--embd``
another width), SGD.

- gt: ``gt.nn.distribute_module(model, placement, megatron_plan(...))`` (qkv and fc1 column
  parallel, proj and fc2 row parallel on the tensor axis, everything broadcast on the data axis),
  the batch split over the data axis; the data-parallel gradients bucketed during the backward.
- hand-written: each rank builds its shards of the same model: qkv / fc1 split by output features
  (whole heads), proj / fc2 by input features, Megatron's f (identity forward, all_reduce backward)
  before them and g (all_reduce forward) after, on the tensor-axis process group; the module
  wrapped in ``DistributedDataParallel`` over the data-axis process group (25 MB buckets).

Both start from one initialisation and see the same batches; the losses of the first steps must
agree before anything is timed. Goal: gt at most 1.1x the hand-written step (paired ratio).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import _harness as H
from actor_runtime import GPT_BATCH, GPT_EMBD, GPT_HEADS, GPT_LAYERS, GPT_LR, GPT_SEQ, GPT_VOCAB

GOAL = 1.1


def _settings(quick: bool) -> dict:
    return dict(warmup=1, repeats=3, inner=1) if quick else dict(warmup=2, repeats=11, inner=1)


def megatron_shards(base, tp_rank: int, tp: int, copy_to_tp, reduce_from_tp):
    """A copy of ``base`` holding tensor rank ``tp_rank``'s Megatron shards (of ``tp``): qkv / fc1 split by
    output features (whole heads), proj / fc2 by input features, ``copy_to_tp`` (Megatron's f) before
    the column-parallel layers and ``reduce_from_tp`` (g) after the row-parallel ones."""
    import copy

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def column(lin: nn.Linear) -> nn.Linear:
        n = lin.out_features // tp
        out = nn.Linear(lin.in_features, n)
        with torch.no_grad():
            out.weight.copy_(lin.weight[tp_rank * n:(tp_rank + 1) * n])
            out.bias.copy_(lin.bias[tp_rank * n:(tp_rank + 1) * n])
        return out

    def row(lin: nn.Linear) -> tuple:
        n = lin.in_features // tp
        out = nn.Linear(n, lin.out_features, bias=False)
        with torch.no_grad():
            out.weight.copy_(lin.weight[:, tp_rank * n:(tp_rank + 1) * n])
        return out, nn.Parameter(lin.bias.detach().clone())

    class Attention(nn.Module):
        def __init__(self, a):
            super().__init__()
            self.heads, self.head_dim = a.n_head // tp, a.head_dim
            self.qkv = column(a.qkv)
            self.proj, self.proj_bias = row(a.proj)

        def forward(self, x):
            b, t, _ = x.shape
            qkv = self.qkv(copy_to_tp(x)).view(b, t, self.heads, 3, self.head_dim)
            q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return reduce_from_tp(self.proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))) + \
                self.proj_bias

    class MLP(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.fc1 = column(m.fc1)
            self.fc2, self.fc2_bias = row(m.fc2)

        def forward(self, x):
            return reduce_from_tp(self.fc2(F.gelu(self.fc1(copy_to_tp(x))))) + self.fc2_bias

    model = copy.deepcopy(base)
    for block in model.blocks:
        block.attn = Attention(block.attn)
        block.mlp = MLP(block.mlp)
    return model


def _hand_written(base, dp_group, tp_group, tp_rank: int, tp: int):
    """This rank's shard of ``base`` with Megatron's f / g on ``tp_group``, wrapped in DDP over ``dp_group``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(megatron_shards(base, tp_rank, tp, *H.megatron_f_g(tp_group)), process_group=dp_group)


def _worker(rank: int, world: int, quick: bool, embd: int = GPT_EMBD, check_steps: int = 3):
    import torch
    import torch.distributed as dist

    import globaltensor as gt
    import globaltensor.nn as gnn
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from gpt import TENSOR_PARALLEL, GPT, GPTConfig, make_batch

    S, B = gt.sbp.split, gt.sbp.broadcast
    cfg = GPTConfig(vocab_size=GPT_VOCAB, block_size=GPT_SEQ, n_layer=GPT_LAYERS, n_head=GPT_HEADS, n_embd=embd)
    torch.manual_seed(0)
    base = GPT(cfg)
    idx, tgt = make_batch(cfg, GPT_BATCH, GPT_SEQ, torch.Generator().manual_seed(1))

    p = gt.placement("cpu", ranks=[[0, 1], [2, 3]])
    data, tensor = p.coord(rank)
    gm = GPT(cfg)
    gm.load_state_dict(base.state_dict())
    gnn.distribute_module(gm, p, gnn.megatron_plan(**TENSOR_PARALLEL, axis=1, ndim=2))
    gopt = torch.optim.SGD(gm.parameters(), lr=GPT_LR)
    gidx, gtgt = gt.distribute(idx, p, (S(0), B)), gt.distribute(tgt, p, (S(0), B))

    def gt_step():
        return H.sgd_step(gm, gopt, gidx, gtgt)

    # every rank creates every group, in one order
    dp_groups = {d: dist.new_group([d, d + 2]) for d in (0, 1)}
    tp_groups = {t: dist.new_group([2 * t, 2 * t + 1]) for t in (0, 1)}
    hand = _hand_written(base, dp_groups[tensor], tp_groups[data], tensor, 2)
    hopt = torch.optim.SGD(hand.parameters(), lr=GPT_LR)
    n = GPT_BATCH // 2
    li, lt = idx[data * n:(data + 1) * n], tgt[data * n:(data + 1) * n]

    def hand_step():
        return H.logits_step(hand, hopt, li, lt)

    for step in range(check_steps):
        g = float(gt_step().detach().full_tensor())
        h = hand_step().detach().clone()
        dist.all_reduce(h)
        h = float(h) / world
        if abs(g - h) > 1e-4 * max(1.0, abs(h)):
            raise AssertionError(f"hybrid GPT step {step}: gt loss {g} differs from the hand-written {h}")
    t = H.timed_many({"hand": hand_step, "gt": gt_step}, **_settings(quick))
    with gt.comm_stats() as st:
        gt_step()
    return dict(times=t, ops=st.ops(), params=sum(q.numel() for q in base.parameters()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--embd", type=int, default=GPT_EMBD, help="the GPT's width (default %(default)s)")
    args = ap.parse_args(argv)
    print(H.header("hybrid_gpt"))
    print(f"n_embd {args.embd}")
    t0 = time.time()
    res = H.spawn(_worker, 4, args.quick, args.embd)
    t = res["times"]
    r = H.paired_ratio(t["gt"], t["hand"])
    print(H.table(["version", "ms per step", "min ms", "gt / hand (paired)"],
                  [["hand-written DDP + Megatron", H.fmt(t["hand"]), H.fmt(t["hand"].min), "-"],
                   ["gt eager", H.fmt(t["gt"]), H.fmt(t["gt"].min), f"{r:.2f}x"]],
                  f"## 2x2 hybrid GPT step ({res['params'] / 1e6:.2f} M parameters), 4 processes"))
    print("gt collectives per step: " + ", ".join(f"{op} x{res['ops'].count(op)}" for op in sorted(set(res["ops"]))))
    print(f"goal: gt <= {GOAL}x hand-written -> {'MET' if r <= GOAL else 'SHORT'}")
    print(f"\n(total {time.time() - t0:.0f} s; load average at the end {H.load_average()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
