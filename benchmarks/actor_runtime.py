"""The traced mode (``gt.compile``, the actor runtime) side by side with its peers, in one run.

    .venv/bin/python benchmarks/actor_runtime.py [--quick] [--only ops,tp,dp,pp]

2 gloo processes, one thread each (the compiled graph adds its stream threads). Every part
checks that the compiled version computes what its peer computes before it is timed.

1. ops: a chain of 99 small ops (33 x [add, relu, mm] on 64x64 pieces, S(0) data, B weight),
   the time per op = a call's time / 99: local torch on the pieces, DTensor eager, gt eager,
   gt compiled (``timeline=True``; the default ``timeline=False``; and the weights captured as
   state instead of passed as arguments). Overhead = per op minus local torch's per op.
   Goal: the compiled overhead at most 1/4 of DTensor's eager overhead (paired per round).
2. tp: benchmarks/tp_mlp.py's tensor-parallel MLP training step (Linear(1024,4096) -> ReLU ->
   Linear(4096,1024), batch 64, SGD), compiled, vs the hand-written torch.distributed step
   (Megatron f/g, one all_reduce each way). Goal: compiled <= 1.0x hand-written (paired).
3. dp: a data-parallel training step of examples/gpt.py's GPT (n_embd 256, or ``--dp-embd``:
   make bench also runs 512, where compute dominates more; 4 layers, 4 heads, batch 16 x 64
   tokens, SGD), compiled (gradients all-reduced in buckets during the backward), vs torch
   DistributedDataParallel on the same model. Goal: <= 1.0x DDP (paired).
4. pp: a 2-stage pipeline, stage 1 (an MLP 512->2048->512) on rank 0, stage 2 (the same
   shape, plus the loss) on rank 1. (a) a training step with ``micro_batches=16`` (GPipe:
   all forwards, then all backwards, then SGD once); (b) forward only, ``g.pipeline`` of 16
   micro-batch calls. Efficiency = (sum over stages of that stage's work done sequentially in
   plain torch, for all micro-batches) / p / measured time; the bubble-limited ideal is
   m / (m + p - 1) = 16/17. Goal: efficiency >= 90% of the ideal. Beside it, where the forward
   pipeline's CPU goes: each thread kind's CPU per call (the compute thread, the graph's stream
   threads, gloo's event loop, the arrivals board, the store), next to the stage run alone.
5. memory: ``measure_memory=True`` compiles of the same functions (separate from the timed
   ones): the registers' measured peak bytes <= ``g.plan.memory_bound``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import _harness as H

PARTS = ("ops", "tp", "dp", "pp")

# 1. the op chain
K, CHAIN = 64, 33                        # 64x64 pieces; 33 x (add, relu, mm) = 99 ops
N_OPS = 3 * CHAIN
# 3. the GPT
GPT_EMBD, GPT_LAYERS, GPT_HEADS, GPT_BATCH, GPT_SEQ, GPT_VOCAB, GPT_LR = 256, 4, 4, 16, 64, 64, 0.1
# the larger width make bench also measures: 4x the matmul work per op, the same ops, so the
# per-op cost of any Python subclass is a quarter of the share it has at 256
GPT_EMBD_LARGE = 512
# 4. the pipeline
# 16 micro-batches of PP_MB rows; 128 rows (~3 ms of compute per stage and micro-batch) is where compute
# dominates a hand-off between threads (~0.1-2 ms on 2 busy cores); --pp-rows 16 shows the latency-bound case
PP_D, PP_HID, PP_M, PP_LR = 512, 2048, 16, 0.01
PP_MB = int(os.environ.get("GT_BENCH_PP_ROWS", "128"))


def _cfg(part: str, quick: bool) -> dict:
    full = dict(ops=dict(warmup=5, repeats=41, inner=20), tp=dict(warmup=2, repeats=41, inner=2),
                dp=dict(warmup=1, repeats=31, inner=1), pp=dict(warmup=1, repeats=31, inner=1))
    fast = dict(ops=dict(warmup=3, repeats=7, inner=5), tp=dict(warmup=1, repeats=5, inner=1),
                dp=dict(warmup=1, repeats=3, inner=1), pp=dict(warmup=1, repeats=3, inner=1))
    return (fast if quick else full)[part]


def _value(t) -> float:
    return float((t.full_tensor() if getattr(t, "is_global", False) else t).detach())


def _close(a: float, b: float, tol: float = 1e-4) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


def _memory(g, calls) -> dict:
    """Run a measure_memory=True compiled function a few times; its registers' peak and the plan's bound."""
    for c in calls:
        c()
    return dict(peak=g.peak_register_bytes, bound=g.plan.memory_bound, tasks=len(g.plan.tasks))


# ------------------------------------------------------------------------------------ 1. op chain
def _chain(x, w, n: int = CHAIN, b=None):
    import torch
    y = x
    for _ in range(n):
        y = y + (x if b is None else b)
        y = torch.relu(y)
        y = y @ w
    return y


def _worker_ops(rank: int, world: int, quick: bool):
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    import globaltensor as gt

    S, B = gt.sbp.split, gt.sbp.broadcast
    torch.manual_seed(0)
    X, W = torch.randn(K * world, K), torch.randn(K, K) / (2 * K ** 0.5)
    p = gt.placement("cpu", ranks=list(range(world)))
    mesh = init_device_mesh("cpu", (world,))
    lx = X[rank * K:(rank + 1) * K].clone()
    gx, gw = gt.distribute(X, p, S(0)), gt.distribute(W, p, B)
    sx, sw = gt.distribute(X, p, S(0)), gt.distribute(W, p, B)      # captured as state by `state`
    dx, dw = distribute_tensor(X, mesh, [Shard(0)]), distribute_tensor(W, mesh, [Replicate()])

    c_tl = gt.compile(_chain, timeline=True)
    c_nt = gt.compile(_chain, timeline=False)
    c_st = gt.compile(lambda x: _chain(x, sw, b=sx))               # the weights are state, not arguments
    want = _chain(lx, W)
    for name, f in (("DTensor", lambda: _chain(dx, dw)), ("gt eager", lambda: _chain(gx, gw)),
                    ("compiled", lambda: c_tl(gx, gw)), ("compiled timeline=False", lambda: c_nt(gx, gw)),
                    ("compiled state", lambda: c_st(gx))):
        for _ in range(3):                      # eager warm-up, capture, a run of the graph
            got = f().to_local()
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise AssertionError(f"op chain: {name} differs from local torch by {(got - want).abs().max():.3g}")
    captures = dict(tl=c_tl.captures, nt=c_nt.captures, st=c_st.captures)
    t = H.timed_many({"local": lambda: _chain(lx, W), "dt": lambda: _chain(dx, dw), "gte": lambda: _chain(gx, gw),
                      "c_tl": lambda: c_tl(gx, gw), "c_nt": lambda: c_nt(gx, gw), "c_st": lambda: c_st(gx)},
                     **_cfg("ops", quick))
    if any(g.captures != 1 for g in (c_tl, c_nt, c_st)):
        raise AssertionError(f"op chain: a compiled chain was captured again during the timing: {captures}")
    cm = gt.compile(_chain, measure_memory=True)
    mem = _memory(cm, [lambda: cm(gx, gw)] * 3)
    return dict(times=t, mem=mem, plan=repr(c_tl.plan).splitlines()[0])


# ------------------------------------------------------------------------------------ 2. TP MLP
def _worker_tp(rank: int, world: int, quick: bool, check_steps: int = 4):
    import globaltensor as gt
    from tp_mlp import hand_written_step, megatron_model, model_and_data

    B = gt.sbp.broadcast

    make_model, x, target = model_and_data()
    p = gt.placement("cpu", ranks=list(range(world)))
    gtarget = target.to_global(placement=p, sbp=B)

    def make_gt():
        return megatron_model(make_model, p)

    def make_step(model, opt):
        def step(xl, t):       # tp_mlp.py's gt_step, with the input and target as arguments
            xin = xl.detach().requires_grad_()
            loss = ((model(xin.to_global(placement=p, sbp=B)) - t) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
        return step

    gt_step = make_step(*make_gt())                 # eager, for reference
    compiled = gt.compile(make_step(*make_gt()))

    # hand-written: tp_mlp.py's Megatron f/g step on local shards
    hand_step = hand_written_step(make_model(), x, target, rank, world, lambda y, t: ((y - t) ** 2).mean())

    losses = {"hand": [], "compiled": [], "eager": []}
    for _ in range(check_steps):                    # compiled: eager warm-up, capture, graph, graph
        losses["hand"].append(_value(hand_step()))
        losses["compiled"].append(_value(compiled(x, gtarget)))
        losses["eager"].append(_value(gt_step(x, gtarget)))
    for k in ("compiled", "eager"):
        if not all(_close(a, b) for a, b in zip(losses[k], losses["hand"])):
            raise AssertionError(f"TP MLP: {k} losses differ from the hand-written ones: {losses}")
    t = H.timed_many({"hand": hand_step, "compiled": lambda: compiled(x, gtarget),
                      "eager": lambda: gt_step(x, gtarget)}, **_cfg("tp", quick))
    if compiled.captures != 1:
        raise AssertionError(f"TP MLP: captured {compiled.captures} times")
    cm = gt.compile(make_step(*make_gt()), measure_memory=True)
    mem = _memory(cm, [lambda: cm(x, gtarget)] * 3)
    return dict(times=t, losses=losses, mem=mem, plan=repr(compiled.plan).splitlines()[0])


# ------------------------------------------------------------------------------------ 3. DP GPT
def _worker_dp(rank: int, world: int, quick: bool, check_steps: int = 4, embd: int = GPT_EMBD):
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import globaltensor as gt
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from gpt import GPT, GPTConfig, make_batch

    S = gt.sbp.split
    cfg = GPTConfig(vocab_size=GPT_VOCAB, block_size=GPT_SEQ, n_layer=GPT_LAYERS, n_head=GPT_HEADS, n_embd=embd)
    torch.manual_seed(0)
    base = GPT(cfg)
    idx, tgt = make_batch(cfg, GPT_BATCH, GPT_SEQ, torch.Generator().manual_seed(1))
    p = gt.placement("cpu", ranks=list(range(world)))
    gidx, gtgt = gt.distribute(idx, p, S(0)), gt.distribute(tgt, p, S(0))

    def make_gt():
        m = GPT(cfg)
        m.load_state_dict(base.state_dict())
        gt.nn.distribute_module(m, p)              # every parameter broadcast: data parallel
        opt = torch.optim.SGD(m.parameters(), lr=GPT_LR)

        return lambda i, t: H.sgd_step(m, opt, i, t)

    compiled = gt.compile(make_gt())
    eager = make_gt()

    dm = GPT(cfg)
    dm.load_state_dict(base.state_dict())
    ddp = DDP(dm)
    dopt = torch.optim.SGD(ddp.parameters(), lr=GPT_LR)
    n = GPT_BATCH // world
    li, lt = idx[rank * n:(rank + 1) * n], tgt[rank * n:(rank + 1) * n]

    def ddp_step():
        return H.logits_step(ddp, dopt, li, lt)

    def ddp_loss():
        v = ddp_step().detach().clone()
        dist.all_reduce(v)
        return float(v) / world

    losses = {"ddp": [], "compiled": [], "eager": []}
    for _ in range(check_steps):
        losses["ddp"].append(ddp_loss())
        losses["compiled"].append(_value(compiled(gidx, gtgt)))
        losses["eager"].append(_value(eager(gidx, gtgt)))
    for k in ("compiled", "eager"):
        if not all(_close(a, b) for a, b in zip(losses[k], losses["ddp"])):
            raise AssertionError(f"GPT data parallel: {k} losses differ from DDP's: {losses}")
    t = H.timed_many({"ddp": ddp_step, "compiled": lambda: compiled(gidx, gtgt), "eager": lambda: eager(gidx, gtgt)},
                     **_cfg("dp", quick))
    if compiled.captures != 1:
        raise AssertionError(f"GPT data parallel: captured {compiled.captures} times")
    colls = [f"{s.node.target}({s.node.label}, {s.nbytes} B)" for s in compiled.plan.tasks
             if s.stream.endswith(":collective")]
    return dict(times=t, losses=losses, plan=repr(compiled.plan).splitlines()[0], collectives=colls,
                params=sum(q.numel() for q in base.parameters()), embd=embd)


# ------------------------------------------------------------------------------------ 4. pipeline
def _worker_pp(rank: int, world: int, quick: bool, check_steps: int = 4):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import globaltensor as gt

    B = gt.sbp.broadcast
    assert world == 2, "the pipeline part runs on 2 processes"
    batch = PP_MB * PP_M

    def mlp():
        return nn.Sequential(nn.Linear(PP_D, PP_HID), nn.ReLU(), nn.Linear(PP_HID, PP_D))

    torch.manual_seed(0)
    base1, base2 = mlp(), mlp()
    g = torch.Generator().manual_seed(1)
    x, tgt = torch.randn(batch, PP_D, generator=g), torch.randn(batch, PP_D, generator=g)
    p0, p1 = gt.placement("cpu", ranks=[0]), gt.placement("cpu", ranks=[1])
    gx, gtgt = gt.distribute(x, p0, B), gt.distribute(tgt, p1, B)

    def copy(m):
        c = mlp()
        c.load_state_dict(m.state_dict())
        return c

    def make_stages():
        s1, s2 = copy(base1), copy(base2)
        gt.nn.distribute_module(s1, p0)            # stage 1 on rank 0
        gt.nn.distribute_module(s2, p1)            # stage 2 on rank 1
        return s1, s2

    def make_train(s1, s2):
        opt = torch.optim.SGD(list(s1.parameters()) + list(s2.parameters()), lr=PP_LR)

        def step(xb, tb):
            h = s1(xb).to_global(placement=p1, sbp=B)
            loss = ((s2(h) - tb) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
        return step

    train = gt.compile(make_train(*make_stages()), micro_batches=PP_M)
    f1, f2 = make_stages()

    def forward(xb):
        return f2(f1(xb).to_global(placement=p1, sbp=B))
    fwd = gt.compile(forward)
    xs = [gt.distribute(x[j * PP_MB:(j + 1) * PP_MB], p0, B) for j in range(PP_M)]

    # the reference: the whole model in plain torch on every rank (the same init and data)
    r1, r2 = copy(base1), copy(base2)
    ropt = torch.optim.SGD(list(r1.parameters()) + list(r2.parameters()), lr=PP_LR)
    with torch.no_grad():
        want_fwd = [r2(r1(x[j * PP_MB:(j + 1) * PP_MB])) for j in range(PP_M)]
    losses = {"ref": [], "compiled": []}
    for _ in range(check_steps):
        loss = ((r2(r1(x)) - tgt) ** 2).mean()
        ropt.zero_grad()
        loss.backward()
        ropt.step()
        losses["ref"].append(loss.item())
        losses["compiled"].append(_value(train(gx, gtgt)))
    if not all(_close(a, b) for a, b in zip(losses["compiled"], losses["ref"])):
        raise AssertionError(f"pipeline: the micro-batched losses differ from one device's: {losses}")
    with torch.no_grad():
        for _ in range(3):
            got = fwd.pipeline(xs)
    if rank == 1:
        for j, (a, b) in enumerate(zip(got, want_fwd)):
            if not torch.allclose(a.to_local(), b, rtol=1e-4, atol=1e-5):
                raise AssertionError(f"pipeline: forward micro-batch {j} differs from one device's")

    # each rank's stage, sequentially, in plain torch: all micro-batches' forward+backward and the update,
    # or all forwards; the boundary tensors (activation in, its gradient back) are fixed tensors
    stage = copy(base1 if rank == 0 else base2)
    sopt = torch.optim.SGD(stage.parameters(), lr=PP_LR)
    g2 = torch.Generator().manual_seed(2 + rank)
    ins = [torch.randn(PP_MB, PP_D, generator=g2) if rank else x[j * PP_MB:(j + 1) * PP_MB] for j in range(PP_M)]
    grads = [torch.randn(PP_MB, PP_D, generator=g2) for _ in range(PP_M)]
    tgts = [tgt[j * PP_MB:(j + 1) * PP_MB] for j in range(PP_M)]

    def stage_train():
        sopt.zero_grad()
        for j in range(PP_M):
            if rank == 0:
                stage(ins[j]).backward(grads[j] / PP_M)
            else:
                h = ins[j].detach().requires_grad_()
                (((stage(h) - tgts[j]) ** 2).mean() / PP_M).backward()
        sopt.step()

    def stage_fwd():
        with torch.no_grad():
            for j in range(PP_M):
                stage(ins[j])

    def fwd_run():
        with torch.no_grad():
            fwd.pipeline(xs)

    cfg = _cfg("pp", quick)
    for f in (lambda: train(gx, gtgt), stage_train, fwd_run, stage_fwd):
        for _ in range(cfg["warmup"]):
            f()
    rounds = []                                    # per round: compiled train, my stage, pipeline fwd, my stage fwd
    cpu = {"fwd": [], "stage": []}                 # per round: this process's CPU seconds by thread kind
    for _ in range(cfg["repeats"]):
        row = []
        for f in (lambda: train(gx, gtgt), stage_train, fwd_run, stage_fwd):
            dist.barrier()
            before = _thread_cpu() if f in (fwd_run, stage_fwd) else None
            t0 = time.perf_counter()
            f()
            row.append(time.perf_counter() - t0)
            if before is not None:
                after = _thread_cpu()
                cpu["fwd" if f is fwd_run else "stage"].append(
                    {k: after[k] - before.get(k, 0.0) for k in after if after[k] > before.get(k, 0.0)})
        rounds.append(row)
    cpu_every = [None] * world
    dist.all_gather_object(cpu_every, cpu)
    mine = torch.tensor(rounds, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    every = torch.stack(every)                     # [rank, round, what]
    if train.captures != 1 or fwd.captures != 1:
        raise AssertionError(f"pipeline: captured again (train {train.captures}, forward {fwd.captures})")

    mem = {}
    mt = gt.compile(make_train(*make_stages()), micro_batches=PP_M, measure_memory=True)
    mem["train"] = _memory(mt, [lambda: mt(gx, gtgt)] * 3)
    mf = gt.compile(forward, measure_memory=True)
    with torch.no_grad():
        mem["fwd"] = _memory(mf, [lambda: mf.pipeline(xs)] * 3)
    return dict(rounds=every.tolist(), losses=losses, mem=mem, plan=repr(train.plan).splitlines()[0],
                fwd_plan=repr(fwd.plan).splitlines()[0], cpu=cpu_every)


def _thread_cpu() -> dict:
    """This process's CPU seconds so far by thread kind (Linux: /proc/self/task/*/schedstat; {}
    elsewhere): "compute" (this, the calling thread: the caller runs the compute stream), the
    graphs' stream threads, gloo's event loop, the arrivals board's publisher, the store's server."""
    import threading
    if not os.path.isdir("/proc/self/task"):
        return {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    me = threading.get_native_id()
    out: dict = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:                            # the thread ended meanwhile
            continue
        name = names.get(int(tid), comm)
        kind = ("compute" if int(tid) == me else "stream threads" if name.startswith("gt-actor") else
                "gloo" if comm.startswith("gloo") else "arrivals board" if name == "gt-arrivals" else
                "store" if "tcpstore" in comm else "other")
        out[kind] = out.get(kind, 0.0) + ns / 1e9
    return out


# ------------------------------------------------------------------------------------ report
def _overhead_ratio(x, local, peer) -> float:
    """Median over rounds of (x - local) / (peer - local), the rounds taken in turn."""
    return statistics.median((a - c) / (b - c) for a, b, c in zip(x.rounds, peer.rounds, local.rounds))


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.2f} MiB"


def _report_ops(res, summary):
    t = res["times"]
    us = lambda v: v * 1e6 / N_OPS                 # noqa: E731 -- microseconds per op
    loc, dt = t["local"], t["dt"]
    rows = []
    for key, label in (("local", "local torch"), ("dt", "DTensor eager"), ("gte", "gt eager"),
                       ("c_tl", "gt compiled (timeline=True)"), ("c_nt", "gt compiled, timeline=False"),
                       ("c_st", "gt compiled, weights as state")):
        v = t[key]
        over = (f"{us(v - loc):.2f}", f"{_overhead_ratio(v, loc, dt):.3f}x", f"{us(v.min - loc.min):.2f}") \
            if key != "local" else ("-", "-", "-")
        rows.append([label, f"{us(v):.2f}", over[0], over[1], f"{us(v.min):.2f}", over[2]])
    rows[1][3] = "1.000x (by definition)"
    print(H.table(["version", "us / op", "overhead us", "overhead / DTensor's (paired)", "min us / op",
                   "min overhead us"], rows,
                  f"## 1. A chain of {N_OPS} small ops (33 x add S0+S0, relu, mm S0@B; 64x64 pieces), 2 processes"))
    print(f"compiled graph: {res['plan']}\n")
    od = us(dt - loc)
    for key, label, goal in (("c_tl", "1. compiled per-op overhead (timeline=True)", True),
                             ("c_nt", "1. compiled per-op overhead (timeline=False)", True),
                             ("gte", "1. gt eager per-op overhead (reference)", False)):
        r = _overhead_ratio(t[key], loc, dt)
        summary.append([label, f"{us(t[key] - loc):.2f} us", f"DTensor {od:.2f} us", f"{r:.3f}x",
                        "<= 0.25x" if goal else "-", ("met" if r <= 0.25 else "short") if goal else "-"])
    summary.append(["5. registers' peak, op chain", _mib(res["mem"]["peak"]), f"bound {_mib(res['mem']['bound'])}",
                    f"{res['mem']['peak'] / res['mem']['bound']:.3f}x", "<= 1.0x",
                    "met" if res["mem"]["peak"] <= res["mem"]["bound"] else "short"])


def _report_step(res, peer: str, peer_label: str, title: str, measure: str, summary, note: str = ""):
    t = res["times"]
    rows = []
    for key, label in ((peer, peer_label), ("compiled", "gt compiled"), ("eager", "gt eager")):
        v = t[key]
        rows.append([label, H.fmt(v), H.ratio(v, t[peer]), f"{H.paired_ratio(v, t[peer]):.2f}x", H.fmt(v.min),
                     H.ratio(v.min, t[peer].min)])
    print(H.table(["version", "ms / step", f"vs {peer_label}", "paired", "min ms", "vs (min)"], rows, title))
    ls = res["losses"]
    print("losses of the first steps (must agree): " + "; ".join(
        f"{k} " + " ".join(f"{v:.5f}" for v in ls[k]) for k in ls))
    print(f"compiled graph: {res['plan']}")
    if note:
        print(note)
    print()
    r = H.paired_ratio(t["compiled"], t[peer])
    summary.append([measure, f"{H.fmt(t['compiled'])} ms", f"{peer_label} {H.fmt(t[peer])} ms", f"{r:.3f}x",
                    "<= 1.0x", "met" if r <= 1.0 else "short"])
    if "mem" in res:
        m = res["mem"]
        summary.append([f"5. registers' peak, {measure.split('. ', 1)[1].split(' step')[0]}", _mib(m["peak"]),
                        f"bound {_mib(m['bound'])}", f"{m['peak'] / m['bound']:.3f}x", "<= 1.0x",
                        "met" if m["peak"] <= m["bound"] else "short"])


def _report_pp(res, summary):
    every = res["rounds"]                          # [rank][round][train, stage_train, fwd, stage_fwd]
    p, m = len(every), PP_M
    ideal = m / (m + p - 1)
    rows = []
    for label, run, ref in (("training step, micro_batches=16", 0, 1), ("forward only, g.pipeline of 16", 2, 3)):
        measured = [max(every[r][i][run] for r in range(p)) for i in range(len(every[0]))]
        stages = [[every[r][i][ref] for i in range(len(every[0]))] for r in range(p)]
        eff = [sum(s[i] for s in stages) / p / measured[i] for i in range(len(measured))]
        e = statistics.median(eff)
        e_min = sum(min(s) for s in stages) / p / min(measured)     # from each side's fastest round
        rows.append([label, H.fmt(statistics.median(measured)),
                     " / ".join(H.fmt(statistics.median(s)) for s in stages),
                     f"{e:.3f}", f"{ideal:.3f}", f"{e / ideal:.2f}", f"{e_min:.3f} ({e_min / ideal:.2f})"])
        summary.append([f"4. pipeline efficiency, {label}", f"{e:.3f}", f"ideal {m}/{m + p - 1} = {ideal:.3f}",
                        f"{e / ideal:.3f}x", ">= 0.90x", "met" if e / ideal >= 0.90 else "short"])
    print(H.table(["pipeline (2 stages, 16 micro-batches)", "ms measured", "ms stage 1 / stage 2 sequential",
                   "efficiency", "ideal", "of ideal", "from fastest rounds (of ideal)"], rows,
                  f"## 4. Stage 1 MLP {PP_D}->{PP_HID}->{PP_D} on rank 0, stage 2 (same + loss) on rank 1, "
                  f"micro-batches of {PP_MB} rows"))
    ls = res["losses"]
    print("losses of the first steps (must agree): " + "; ".join(
        f"{k} " + " ".join(f"{v:.6f}" for v in ls[k]) for k in ls))
    print(f"compiled training graph: {res['plan']}\ncompiled forward graph: {res['fwd_plan']}\n")
    _report_pp_cpu(res.get("cpu"), summary)
    for k, label in (("train", "pipeline training"), ("fwd", "pipeline forward")):
        mm = res["mem"][k]
        summary.append([f"5. registers' peak, {label}", _mib(mm["peak"]), f"bound {_mib(mm['bound'])}",
                        f"{mm['peak'] / mm['bound']:.3f}x", "<= 1.0x", "met" if mm["peak"] <= mm["bound"] else "short"])


def _report_pp_cpu(cpu, summary):
    """Where the forward pipeline's CPU goes, per rank: medians over rounds of each thread kind's
    CPU per call, beside the same rank's stage run alone. On 2 cores the compute threads fill the
    machine, so what the other threads take comes out of the compute (the ideal counts none);
    the summary row is their CPU per call on the rank where it is larger, over the stage's."""
    if not cpu or not any(c["fwd"] for c in cpu):
        return
    kinds = ["compute", "stream threads", "gloo", "arrivals board", "store", "other"]
    rows, extra = [], []
    for rank, c in enumerate(cpu):
        med = {k: statistics.median(r.get(k, 0.0) for r in c["fwd"]) for k in kinds}
        alone = statistics.median(sum(r.values()) for r in c["stage"])
        total = statistics.median(sum(r.values()) for r in c["fwd"])
        extra.append((statistics.median(sum(v for k, v in r.items() if k != "compute") for r in c["fwd"]), alone))
        rows.append([f"rank {rank}"] + [H.fmt(med[k]) for k in kinds] + [H.fmt(total), H.fmt(alone)])
    print(H.table(["forward pipeline, CPU ms per call"] + kinds + ["all threads", "stage alone"], rows,
                  "## 4. Forward pipeline: CPU per call by thread (medians over rounds)"))
    print()
    more, alone = max(extra)
    summary.append(["4. forward pipeline: CPU of the threads beside the compute (more loaded rank)",
                    f"{H.fmt(more)} ms", f"stage alone {H.fmt(alone)} ms", f"{more / alone:.3f}x", "-", "-"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts to run, of {','.join(PARTS)}")
    ap.add_argument("--pp-rows", type=int, default=PP_MB, help="rows per pipeline micro-batch (default %(default)s)")
    ap.add_argument("--dp-embd", type=int, default=GPT_EMBD, help="the dp part's GPT width (default %(default)s)")
    args = ap.parse_args(argv)
    os.environ["GT_BENCH_PP_ROWS"] = str(args.pp_rows)     # the spawned workers read it
    globals()["PP_MB"] = args.pp_rows
    parts = [s for s in args.only.split(",") if s]
    if any(s not in PARTS for s in parts):
        ap.error(f"--only: expected parts of {PARTS}, got {args.only!r}")
    print(H.header("actor_runtime"))
    print("2 gloo processes, 1 thread each (plus the compiled graphs' stream threads); medians of interleaved "
          "rounds (slowest rank); ratios are paired per round\n")
    t0 = time.time()
    summary: list = []
    workers = dict(ops=_worker_ops, tp=_worker_tp, dp=_worker_dp, pp=_worker_pp)
    for part in PARTS:
        if part not in parts:
            continue
        try:
            res = H.spawn(workers[part], 2, args.quick, *((4, args.dp_embd) if part == "dp" else ()))
        except Exception as e:  # noqa: BLE001 -- a failing part is reported in its rows, the others still run
            reason = str(e).strip().splitlines()[-1][:120]
            print(f"## part {part} failed:\n{e}\n")
            summary.append([f"{PARTS.index(part) + 1}. {part}", f"n/a ({reason})", "-", "-", "-", "short"])
            continue
        if part == "ops":
            _report_ops(res, summary)
        elif part == "tp":
            _report_step(res, "hand", "hand-written", "## 2. Tensor-parallel MLP training step (tp_mlp.py's), "
                         "2 processes", "2. TP MLP step", summary)
        elif part == "dp":
            _report_step(res, "ddp", "DDP", f"## 3. Data-parallel GPT training step (n_embd {res['embd']}, {GPT_LAYERS} "
                         f"layers, batch {GPT_BATCH}x{GPT_SEQ}, {res['params'] / 1e6:.2f} M parameters), 2 processes",
                         f"3. DP GPT step (n_embd {res['embd']})", summary,
                         note="compiled collectives: " + ", ".join(res["collectives"]))
        else:
            _report_pp(res, summary)
    order = {"1": 0, "2": 1, "3": 2, "4": 3, "5": 4}
    summary.sort(key=lambda r: order.get(r[0][:1], 9))
    print(H.table(["measure", "ours", "peer", "ratio", "goal", "met/short"], summary,
                  "## Summary (ratio: ours / peer, paired per round where timed)"))
    print(f"\n(total {time.time() - t0:.0f} s; load average at the end {H.load_average()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
