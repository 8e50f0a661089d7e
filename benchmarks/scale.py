"""Simulated worlds at scale: the GPT training step, eager and ``gt.compile``d, on 4, 16 and 64
CPU-simulated ranks in this one process (a notebook rehearsing a cluster's layout).

    .venv/bin/python benchmarks/scale.py [--quick] [--ranks 4,16,64] [--only dp,hybrid]

- dp: every parameter broadcast, the batch (64 x 16) split over a 1-D placement of N ranks;
- hybrid: an sqrt(N) x sqrt(N) placement, data parallel on axis 0 and the Megatron plan on axis 1,
  batch 16 x 16 (2x2, 4x4, 8x8).

examples/gpt.py with vocab 64, 2 layers, 8 heads, n_embd 64; AdamW (foreach, torch's default).
Eager and compiled steps run side by side (their rounds interleaved, _harness.timed_many) on
models with the same start; the ratio is compiled / eager, paired per round.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import _harness as H

VOCAB, LAYERS, HEADS, EMBD, SEQ = 64, 2, 8, 64, 16
BATCH = {"dp": 64, "hybrid": 16}
RANKS = (4, 16, 64)
FOREACH = True


def _settings(quick: bool, ranks: int) -> dict:
    """Warm-up calls: the compiled step's first runs eagerly, its second captures."""
    if quick:
        return dict(warmup=2, repeats=2, inner=1, sync=False)
    return dict(warmup=3, repeats=5 if ranks <= 16 else 3, inner=1, sync=False)


def build(kind: str, ranks: int, dtype=None):
    """``(eager step, compiled step)`` of ``kind`` on ``ranks`` simulated ranks (the world must be
    simulated already), two models from the same start, each with its own AdamW."""
    import torch

    import globaltensor as gt
    import globaltensor.nn as gnn
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from gpt import TENSOR_PARALLEL, GPT, GPTConfig, make_batch

    S, B = gt.sbp.split, gt.sbp.broadcast
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD)
    torch.manual_seed(0)
    base = GPT(cfg).to(dtype or torch.float32)
    idx, tgt = make_batch(cfg, BATCH[kind], SEQ, torch.Generator().manual_seed(1))
    if kind == "dp":
        p, plan, batch_sbp = gt.placement("cpu", list(range(ranks))), None, S(0)
    else:
        side = math.isqrt(ranks)
        p = gt.placement("cpu", [[i * side + j for j in range(side)] for i in range(side)])
        plan, batch_sbp = gnn.megatron_plan(**TENSOR_PARALLEL, axis=1, ndim=2), (S(0), B)
    steps = []
    for _ in range(2):
        m = GPT(cfg).to(base.wte.weight.dtype)
        m.load_state_dict(base.state_dict())
        gnn.distribute_module(m, p, plan) if plan is not None else gnn.distribute_module(m, p)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=FOREACH)
        batch = (gt.distribute(idx, p, batch_sbp), gt.distribute(tgt, p, batch_sbp))
        steps.append((m, opt, batch))

    def eager():
        m, opt, batch = steps[0]
        return H.sgd_step(m, opt, *batch)

    m1, opt1, batch1 = steps[1]
    compiled_step = gt.compile(lambda i, t: H.sgd_step(m1, opt1, i, t))

    def compiled():
        return compiled_step(*batch1)
    return eager, compiled, compiled_step


def _worker(rank: int, world: int, quick: bool, ranks=RANKS, kinds=("dp", "hybrid")):
    import torch

    import globaltensor as gt
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = {}
    for kind in kinds:
        for n in ranks:
            with gt.simulate(n):
                eager, compiled, step = build(kind, n)
                t = H.timed_many({"eager": eager, "compiled": compiled}, **_settings(quick, n))
                out[kind, n] = dict(times=t, ratio=H.paired_ratio(t["compiled"], t["eager"]),
                                    streams=len(step.plan.streams))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)))
    ap.add_argument("--only", default="dp,hybrid")
    a = ap.parse_args(argv)
    ranks = tuple(int(r) for r in a.ranks.split(","))
    res = H.spawn(_worker, 0, a.quick, ranks, tuple(a.only.split(",")), timeout=3600)
    print(f"load average {os.getloadavg()[0]:.1f}; GPT vocab {VOCAB}, {LAYERS} layers, {HEADS} heads, n_embd {EMBD}")
    print(f"{'step':<8}{'ranks':>6}{'eager ms':>12}{'compiled ms':>14}{'compiled/eager':>16}{'streams':>9}")
    for (kind, n), r in res.items():
        t = r["times"]
        print(f"{kind:<8}{n:>6}{t['eager'] * 1e3:>12.1f}{t['compiled'] * 1e3:>14.1f}{r['ratio']:>15.2f}x"
              f"{r['streams']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
