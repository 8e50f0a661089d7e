"""``torch.compile`` on global tensors beside ``torch.compile`` on plain torch, in one run.

    .venv/bin/python benchmarks/torch_compile.py [--quick] [--only dp,tp]

2 gloo processes, examples/gpt.py at actor_runtime.py's sizes (n_embd 256, 4 layers, 4 heads,
batch 16 x 64 tokens), SGD. Each side compiles its loss function (forward and loss) with the
default backend (Inductor) and runs ``zero_grad``, the compiled loss, ``backward`` and
``opt.step()``; the optimizer stays eager on both sides (torch.optim breaks the graph around its
step by design).

1. dp: the global model data parallel (``distribute_module``: every parameter broadcast, the batch
   split; the gradients bucketed as they are produced) vs the plain model in
   ``DistributedDataParallel``, compiled around it (``torch.compile`` of DDP: Dynamo's DDP
   optimizer cuts the graph at the buckets). Goal: global <= 1.05x plain.
2. tp: the global model Megatron tensor parallel (``megatron_plan``, the batch broadcast) vs each
   rank's hand-written Megatron shards (hybrid_gpt.py's ``megatron_shards``) whose f / g are
   torch's functional collectives (``_c10d_functional`` ops in the graph). Goal: <= 1.05x.

Beside them, each side's step not compiled (the global eager step, plain DDP or the shards with
torch's in-place f / g being the usual eager peers). Each part checks first that the two compiled
sides' losses agree, counts the global program's graphs and
breaks (``torch._dynamo.explain``: goal 1 graph, 0 breaks), and times the first step (trace and
compile: Dynamo, AOTAutograd, Inductor, with Inductor's and AOTAutograd's caches off so that
neither side reuses the other's kernels) of each side: goal global <= 2x plain.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import _harness as H
from actor_runtime import GPT_BATCH, GPT_EMBD, GPT_HEADS, GPT_LAYERS, GPT_LR, GPT_SEQ, GPT_VOCAB
from hybrid_gpt import megatron_shards

PARTS = ("dp", "tp")
STEP_GOAL, COMPILE_GOAL = 1.05, 2.0


def _settings(quick: bool) -> dict:
    return dict(warmup=1, repeats=3, inner=1) if quick else dict(warmup=2, repeats=15, inner=1)


def _no_compile_caches() -> None:
    import torch._functorch.config
    import torch._inductor.config
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def _step(loss_of, opt, *batch):
    opt.zero_grad()
    loss = loss_of(*batch)
    loss.backward()
    opt.step()
    return loss.detach()


def _first_step(step) -> float:
    """Seconds of the first call (trace and compile, then one run), the slowest rank's."""
    t0 = time.perf_counter()
    step()
    return H.slowest(time.perf_counter() - t0)


def _explain(fn, *args) -> tuple:
    import torch._dynamo
    e = torch._dynamo.explain(fn)(*args)
    torch._dynamo.reset()
    return e.graph_count, e.graph_break_count, [str(r.reason).splitlines()[0] for r in e.break_reasons]


def _run(global_step, plain_step, global_loss, plain_loss, explained, eager: dict, quick: bool,
         check_steps: int = 3) -> dict:
    """Compile times, matching losses, paired step times (the uncompiled steps ``eager`` beside);
    ``global_loss()`` / ``plain_loss()`` give each side's mean loss of the last step as a float."""
    first = {"global": _first_step(global_step), "plain": _first_step(plain_step)}
    for step in range(check_steps):
        global_step()
        plain_step()
        g, p = global_loss(), plain_loss()
        if abs(g - p) > 1e-4 * max(1.0, abs(p)):
            raise AssertionError(f"step {step}: the global loss {g} differs from the plain {p}")
    t = H.timed_many({"plain": plain_step, "global": global_step, **eager}, **_settings(quick))
    return dict(times=t, first=first, explained=explained)


def _worker(rank: int, world: int, part: str, quick: bool, embd: int = GPT_EMBD):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import globaltensor as gt
    import globaltensor.nn as gnn
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from gpt import TENSOR_PARALLEL, GPT, GPTConfig, make_batch

    _no_compile_caches()
    S, B = gt.sbp.split, gt.sbp.broadcast
    cfg = GPTConfig(vocab_size=GPT_VOCAB, block_size=GPT_SEQ, n_layer=GPT_LAYERS, n_head=GPT_HEADS, n_embd=embd)
    torch.manual_seed(0)
    base = GPT(cfg)
    idx, tgt = make_batch(cfg, GPT_BATCH, GPT_SEQ, torch.Generator().manual_seed(1))
    p = gt.placement("cpu", ranks=list(range(world)))

    def global_model():
        m = GPT(cfg)
        m.load_state_dict(base.state_dict())
        gnn.distribute_module(m, p, None if part == "dp" else gnn.megatron_plan(**TENSOR_PARALLEL))
        return m, torch.optim.SGD(m.parameters(), lr=GPT_LR)

    batch_sbp = S(0) if part == "dp" else B
    gi, gtg = gt.distribute(idx, p, batch_sbp), gt.distribute(tgt, p, batch_sbp)
    gm, gopt = global_model()
    explained = _explain(gm.loss, gi, gtg)
    gloss = torch.compile(gm.loss)
    em, eopt = global_model()
    last = {}

    def global_step():
        last["global"] = _step(gloss, gopt, gi, gtg)

    def plain_model():
        if part == "tp":
            m = megatron_shards(base, rank, world, *funcol_f_g())
        else:
            m = GPT(cfg)
            m.load_state_dict(base.state_dict())
            m = DDP(m)
        return m, torch.optim.SGD(m.parameters(), lr=GPT_LR)

    def loss_of(m):
        def loss(i, t):
            logits = m(i)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1))
        return loss

    n = GPT_BATCH // world
    li, lt = (idx[rank * n:(rank + 1) * n], tgt[rank * n:(rank + 1) * n]) if part == "dp" else (idx, tgt)
    pm, popt = plain_model()
    ploss = torch.compile(loss_of(pm))
    epm, epopt = plain_model()

    def plain_step():
        last["plain"] = _step(ploss, popt, li, lt)

    def plain_mean() -> float:
        """The mean of the ranks' losses: DDP's are their batch slices', the shards' all the same."""
        v = last["plain"].clone()
        dist.all_reduce(v)
        return float(v) / world

    eager = {"global eager": lambda: _step(em.loss, eopt, gi, gtg), "plain eager": lambda: _step(loss_of(epm), epopt, li, lt)}
    res = _run(global_step, plain_step, lambda: float(last["global"].full_tensor()), plain_mean, explained, eager, quick)
    res.update(params=sum(q.numel() for q in base.parameters()), embd=embd)
    return res


def funcol_f_g():
    """Megatron's f and g over the world with torch's functional collectives, which torch.compile
    traces into ``_c10d_functional`` ops: f is the identity forward and an all-reduce backward,
    g an all-reduce forward and the identity backward."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return funcol.all_reduce(grad.contiguous(), "sum", group)

    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return funcol.all_reduce(t.contiguous(), "sum", group)

        @staticmethod
        def backward(ctx, grad):
            return grad

    return F.apply, G.apply


def report(part: str, res: dict, summary: list) -> None:
    t, first = res["times"], res["first"]
    graphs, breaks, reasons = res["explained"]
    peer = "DDP" if part == "dp" else "hand-written Megatron (funcol)"
    print(H.table(["side", "step median ms", "fastest ms", "first step s"],
                  [["global", H.fmt(t["global"]), H.fmt(t["global"].min), f"{first['global']:.1f}"],
                   [peer, H.fmt(t["plain"]), H.fmt(t["plain"].min), f"{first['plain']:.1f}"],
                   ["global, not compiled", H.fmt(t["global eager"]), H.fmt(t["global eager"].min), "-"],
                   [f"{peer}, not compiled", H.fmt(t["plain eager"]), H.fmt(t["plain eager"].min), "-"]],
                  f"## {part}: GPT n_embd {res['embd']}, {res['params'] / 1e6:.2f} M parameters, 2 processes, "
                  f"torch.compile (Inductor)"))
    print(f"graphs {graphs}, breaks {breaks}" + (f": {reasons}" if reasons else "") + "\n")
    step = H.paired_ratio(t["global"], t["plain"])
    comp = first["global"] / first["plain"]
    summary.append([f"{part}: compiled step", H.fmt(t["global"]), H.fmt(t["plain"]), f"{step:.2f}x",
                    f"<= {STEP_GOAL}x", "met" if step <= STEP_GOAL else "short"])
    summary.append([f"{part}: trace + compile (first step)", f"{first['global']:.1f} s", f"{first['plain']:.1f} s",
                    f"{comp:.2f}x", f"<= {COMPILE_GOAL}x", "met" if comp <= COMPILE_GOAL else "short"])
    summary.append([f"{part}: graphs / breaks", f"{graphs} / {breaks}", "-", "-", "1 / 0",
                    "met" if (graphs, breaks) == (1, 0) else "short"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=",".join(PARTS))
    args = ap.parse_args(argv)
    print(H.header("torch.compile on global tensors"))
    summary = []
    for part in args.only.split(","):
        report(part, H.spawn(_worker, 2, part, args.quick, timeout=1800), summary)
    print(H.table(["measure", "global", "plain", "ratio", "goal", "met/short"], summary,
                  "## Summary (ratio: global / plain, paired per round where timed)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
