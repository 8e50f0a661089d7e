"""The program every rank runs in tests/multiprocess/test_compiled.py: gt.compile in a process world.

``python -m globaltensor.launch --nproc-per-node 4 _compiled_program.py MODE``, MODE one of:

- ``equal``: every rank runs, side by side, the eager and the compiled version of the same
  functions -- forwards with boxing on a 1-D and a 2x2 placement, training steps (SGD with
  momentum, AdamW, gt.nn.ZeroOptimizer) of a Megatron-planned MLP on a 2x2 (data x tensor)
  placement, dropout, ``g.pipeline``, 2-stage pipeline parallelism with ``micro_batches=4`` --
  and compares its own pieces (layout, shape, values in float64). Call 1 of a compiled function
  is its eager warm-up, call 2 captures and runs the graph, calls 3+ run the graph.
- ``fail-all``: a custom op raises inside the graph on every rank (a flag set after the capture):
  every rank gets ``gt.GraphError`` naming the op and its rank; cleared, the function captures
  again and computes the right values; set again, the error is left uncaught (exit code 1).
- ``fail-rank0``: the op raises on rank 0 only, before an all-gather: rank 0 gets the GraphError
  naming the op, reports it and dies of it; the other ranks, blocked in the all-gather, get a
  GraphError naming the collective once rank 0's process is gone, report it and die of it.
  (They ignore the launcher's SIGTERM meanwhile, so that their own way out shows.)
- ``fail-rank0-alive``: as ``fail-rank0``, but rank 0 stays alive after its error: the others'
  all-gather fails after GT_COLLECTIVE_TIMEOUT.

A check that fails is recorded, not raised, so that every rank keeps issuing the same
collectives; an exception ends the job. Records are ``GT {json}`` lines (the launcher prefixes
them with ``[rank N] ``), one per section and rank, written and run as in _rank_program.py.
The model trained is tests/nn's ``Net`` (with dropout), stepped by its ``training_step``.
"""
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import globaltensor as gt
import globaltensor.nn as gnn
from _rank_program import Checker as RecordingChecker, balanced, emit, run_sections
from globaltensor.tensor import GlobalTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from nn_models import MEGATRON_2D, Net, training_step  # noqa: E402

torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
REL = 1e-12          # compiled vs eager, relative to the eager piece's largest magnitude (float64)
STEPS = 4            # a compiled function's calls: warm-up, capture + first run, then graph runs
OP = "gt_mp_compiled.maybe_fail"
RANK0_SLEEP_S = 90   # fail-rank0-alive: rank 0 stays alive this long after its error (the job must end first)


# -- a custom op that raises inside the graph when told to -----------------------------------------
FAIL = {"on": False}


class InjectedFailure(RuntimeError):
    pass


@torch.library.custom_op("gt_mp_compiled::maybe_fail", mutates_args=())
def maybe_fail_op(x: torch.Tensor) -> torch.Tensor:
    if FAIL["on"]:
        raise InjectedFailure(f"injected failure on a piece of shape {tuple(x.shape)}")
    return x * 2.0


@maybe_fail_op.register_fake
def _maybe_fail_fake(x):
    return torch.empty_like(x)


maybe_fail_op.register_autograd(lambda ctx, grad: grad * 2.0)
gt.register_rule(torch.ops.gt_mp_compiled.maybe_fail.default, ["S(0) -> S(0)", "S(1) -> S(1)", "B -> B"])
maybe_fail = torch.ops.gt_mp_compiled.maybe_fail


# -- checks -------------------------------------------------------------------------------------------
class Checker(RecordingChecker):
    """_rank_program's checker (failed checks recorded, not raised), timed, with ``same``: a
    compiled result against the eager one."""

    def __init__(self, section):
        super().__init__(section)
        self.start = time.perf_counter()

    def same(self, what, got, ref, rel=REL, exact=False):
        """``got`` (compiled) equals ``ref`` (eager): placement, sbp, shape, and this rank's piece."""
        self.count += 1
        if not isinstance(got, GlobalTensor) or not isinstance(ref, GlobalTensor):
            self.failures.append(f"{what}: expected global tensors, got {type(got).__name__} and "
                                 f"{type(ref).__name__}")
            return
        if got.placement != ref.placement or got.sbp != ref.sbp or tuple(got.shape) != tuple(ref.shape):
            self.failures.append(f"{what}: compiled {got.placement} {got.sbp} {tuple(got.shape)} != eager "
                                 f"{ref.placement} {ref.sbp} {tuple(ref.shape)}")
            return
        a, b = got.detach().to_local(), ref.detach().to_local()
        if a.shape != b.shape or a.dtype != b.dtype:
            self.failures.append(f"{what}: piece {tuple(a.shape)} {a.dtype} != eager {tuple(b.shape)} {b.dtype}")
            return
        if exact:
            if not torch.equal(a, b):
                self.failures.append(f"{what}: piece differs from eager (max diff "
                                     f"{(a - b).abs().max().item():.3e}); data movement must be exact")
            return
        if not b.numel():
            return
        err = (a - b).abs().max().item()
        scale = max(b.abs().max().item(), 1e-30)
        if not err <= rel * scale:
            self.failures.append(f"{what}: max |compiled - eager| = {err:.3e}, {err / scale:.2e} of its scale")

    def done(self, **fields):
        super().done(seconds=round(time.perf_counter() - self.start, 3), **fields)


def check_plan(c, what, g, micro_batches=1):
    """A process runs its own rank's tasks only, on its own streams, collectives on their own stream."""
    me, plan = gt.rank(), g.plan
    others = sorted({t.rank for t in plan.tasks if t.rank != me} | {t.stream for t in plan.tasks
                                                                     if not t.stream.startswith(f"r{me}:")})
    c.true(f"{what}: the plan holds tasks of other ranks or streams: {others}", bool(plan.tasks) and not others)
    c.true(f"{what}: no collective stream with tasks in {sorted(plan.streams)}",
           len(plan.streams.get(f"r{me}:collective", [])) > 0)
    c.true(f"{what}: plan.micro_batches {plan.micro_batches} != {micro_batches}", plan.micro_batches == micro_batches)


def data(seed, *shape):
    """A logical tensor, the same on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def partial(full, placement, nd, weights):
    """``full`` as a tensor partial on axis 0 of ``nd``: each rank's piece (of the layout ``nd`` with
    that axis broadcast) scaled by its weight along that axis; the weights sum to 1."""
    bcast = (B,) + tuple(nd[1:])
    piece = gt.distribute(full, placement, bcast).to_local()
    coord = [tuple(c) for c in zip(*(placement.ranks == gt.rank()).nonzero())]
    w = weights[coord[0][0]] if coord else 0.0
    return gt.to_global(piece * w, placement=placement, sbp=nd, shape=tuple(full.shape))


def one(x):
    """This rank's piece of a global tensor (for reports)."""
    return x.detach().to_local()


# -- sections ----------------------------------------------------------------------------------------
def section_forward_1d():
    """S->B, P->B (an argument and a partial made inside), S(0)->S(1), on uneven sizes, 4 ranks."""
    c = Checker("forward_1d")
    p = gt.placement("cpu", ranks=[0, 1, 2, 3])
    w = gt.distribute(data(1, 5, 3), p, S(0))      # 5 rows over 4 ranks: 2, 1, 1, 1

    def fn(x, q):
        a = x.to_global(sbp=B)                      # all-gather of 7 rows: 2, 2, 2, 1
        b = (x * 2.0).to_global(sbp=S(1))           # all-to-all, 5 columns: 2, 1, 1, 1
        cq = q.to_global(sbp=B)                     # P -> B: all-reduce
        h = x.to_global(sbp=S(1)) @ w               # S(1) @ S(0): partial sum
        d = h.to_global(sbp=B)                      # P -> B
        e = (torch.tanh(a) @ cq[:5, :4]).to_global(sbp=S(0))
        return a, b, cq, d, e, (x.sum(dim=0) + 1.0)
    names = ["S->B", "S(0)->S(1)", "P->B (argument)", "P->B (made inside)", "B->S(0)", "sum over S(0)"]
    exact = [True, True, False, False, False, False]
    g = gt.compile(fn)
    for s in range(STEPS):
        x = gt.distribute(data(10 + s, 7, 5), p, S(0))
        q = partial(data(20 + s, 9, 6), p, (P,), [0.1, 0.2, 0.3, 0.4])
        ref = fn(x, q)
        with gt.comm_stats() as st_c:
            out = g(x, q)
        with gt.comm_stats() as st_e:
            fn(x, q)
        for name, o, r, ex in zip(names, out, ref, exact):
            c.same(f"call {s}: {name}", o, r, exact=ex)
        if s >= 1:
            c.true(f"call {s}: compiled collectives {sorted(st_c.ops())} / {st_c.bytes_sent} B != eager "
                   f"{sorted(st_e.ops())} / {st_e.bytes_sent} B",
                   sorted(st_c.ops()) == sorted(st_e.ops()) and st_c.bytes_sent == st_e.bytes_sent)
    c.true(f"one capture, got {g.captures}", g.captures == 1)
    c.true("the argument's uneven piece on this rank",
           tuple(one(x).shape) == (balanced(7, 4)[gt.rank()], 5))
    c.done()


def section_forward_2x2():
    """nd boxing on a 2x2 placement: (S(0), S(1)) -> (B, B), (P, S(0)) -> (B, B), swaps of split dims."""
    c = Checker("forward_2x2")
    p2 = gt.placement("cpu", ranks=[[0, 1], [2, 3]])
    w = gt.distribute(data(2, 5, 4), p2, (B, S(0)))

    def fn(x, q):
        a = x.to_global(sbp=(B, B))                          # 7 x 5 over 2 x 2: uneven both ways
        b = x.to_global(sbp=(S(1), S(0)))
        cq = q.to_global(sbp=(B, B))                         # partial on axis 0
        h = x @ w                                            # (S(0), S(1)) @ (B, S(0)) -> (S(0), P)
        return a, b, cq, h.to_global(sbp=(B, B)), h.to_global(sbp=(S(1), S(0))), (a * cq[:7, :5]).sum()
    names = ["(S0,S1)->(B,B)", "(S0,S1)->(S1,S0)", "(P,S0)->(B,B)", "(S0,P)->(B,B)", "(S0,P)->(S1,S0)", "sum"]
    exact = [True, True, False, False, False, False]
    g = gt.compile(fn)
    for s in range(STEPS):
        x = gt.distribute(data(30 + s, 7, 5), p2, (S(0), S(1)))
        q = partial(data(40 + s, 9, 6), p2, (P, S(0)), [0.25, 0.75])
        ref = fn(x, q)
        out = g(x, q)
        for name, o, r, ex in zip(names, out, ref, exact):
            c.same(f"call {s}: {name}", o, r, exact=ex)
    c.true(f"one capture, got {g.captures}", g.captures == 1)
    c.done()


# -- training ------------------------------------------------------------------------------------------
class DropoutNet(Net):
    """tests/nn's Net with dropout after every block."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        for blk in self.blocks:
            x = self.drop(blk(x))
        return self.head(x)


def make_model(p2, optimizer, dropout=0.0):
    """The Megatron-planned net on 2x2 (data x tensor), its optimizer and training step."""
    torch.manual_seed(0)
    m = gnn.distribute_module(DropoutNet(dropout), p2, MEGATRON_2D)
    opt = optimizer(m)
    return m, opt, training_step(lambda x, y: ((m(x) - y) ** 2).mean(), opt)


OPTIMIZERS = {
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
    "zero-adamw": lambda m: gnn.ZeroOptimizer(m.parameters(), torch.optim.AdamW, axis=0, lr=0.01,
                                              weight_decay=0.1),
}


def batch(p2, seed, rows=8):
    return (gt.distribute(data(seed, rows, 6), p2, (S(0), B)), gt.distribute(data(seed + 1, rows, 3), p2, (S(0), B)))


def check_state(c, what, opt_c, opt_e, params_c, params_e):
    for i, (pc, pe) in enumerate(zip(params_c, params_e)):
        sc, se = opt_c.state.get(pc, {}), opt_e.state.get(pe, {})
        c.true(f"{what}, param {i}: state keys {sorted(sc)} != eager {sorted(se)}", set(sc) == set(se))
        for k, ve in se.items():
            if isinstance(ve, GlobalTensor) and ve.dim() > 0 and k in sc:
                c.same(f"{what}, param {i}, state {k!r}", sc[k], ve)


def section_training():
    """A Megatron-planned MLP on 2x2 (data x tensor), stepped eagerly and compiled side by side."""
    c = Checker("training")
    p2 = gt.placement("cpu", ranks=[[0, 1], [2, 3]])
    captures = {}
    for name, optimizer in OPTIMIZERS.items():
        m_e, opt_e, step_e = make_model(p2, optimizer)
        m_c, opt_c, step_c = make_model(p2, optimizer)
        names = [n for n, _ in m_e.named_parameters()]
        g = gt.compile(step_c)
        for s in range(STEPS + 1):
            x, y = batch(p2, 100 + 2 * s)
            loss_e, loss_c = step_e(x, y), g(x, y)
            c.same(f"{name} step {s}: loss", loss_c, loss_e)
            for n, pc, pe in zip(names, m_c.parameters(), m_e.parameters()):
                c.same(f"{name} step {s}: parameter {n}", pc, pe)
            check_state(c, f"{name} step {s}", opt_c, opt_e, list(m_c.parameters()), list(m_e.parameters()))
        moved = [n for n, p in zip(names, m_c.parameters()) if p.detach().to_local().numel()]
        c.true(f"{name}: this rank holds parameter pieces", len(moved) == len(names))
        c.true(f"{name}: the parameters were sharded on the tensor axis",
               m_c.blocks[0].up.weight.sbp == (B, S(0)) and m_c.blocks[0].down.weight.sbp == (B, S(1)))
        check_plan(c, name, g)
        captures[name] = g.captures
    c.true(f"one capture per optimizer, got {captures}", set(captures.values()) == {1})
    c.done(captures=captures)


def section_hand_placed():
    """Hand-placed parameters (column- then row-parallel on the tensor axis) and AdamW on 2x2."""
    c = Checker("hand_placed")
    p2 = gt.placement("cpu", ranks=[[0, 1], [2, 3]])

    def make():
        w1 = gt.distribute(data(7, 6, 10), p2, (B, S(1))).requires_grad_()
        b1 = gt.distribute(data(8, 10), p2, (B, S(0))).requires_grad_()
        w2 = gt.distribute(data(9, 10, 3), p2, (B, S(0))).requires_grad_()
        params = [w1, b1, w2]
        opt = torch.optim.AdamW(params, lr=0.02)
        return params, opt, training_step(lambda x, y: ((torch.relu(x @ w1 + b1) @ w2 - y) ** 2).mean(), opt)
    params_e, opt_e, step_e = make()
    params_c, opt_c, step_c = make()
    g = gt.compile(step_c)
    for s in range(STEPS + 1):
        x, y = batch(p2, 200 + 2 * s, rows=10)          # 10 rows over the data axis: 5, 5
        c.same(f"step {s}: loss", g(x, y), step_e(x, y))
        for i, (pc, pe) in enumerate(zip(params_c, params_e)):
            c.same(f"step {s}: parameter {i}", pc, pe)
        check_state(c, f"step {s}", opt_c, opt_e, params_c, params_e)
    c.true(f"one capture, got {g.captures}", g.captures == 1)
    c.done()


def section_dropout():
    """Dropout inside the compiled step draws the eager step's masks (gt.manual_seed equal on both sides)."""
    c = Checker("dropout")
    p2 = gt.placement("cpu", ranks=[[0, 1], [2, 3]])
    sgd = OPTIMIZERS["sgd-momentum"]
    m_e, _, step_e = make_model(p2, sgd, dropout=0.3)
    m_c, _, step_c = make_model(p2, sgd, dropout=0.3)
    names = [n for n, _ in m_e.named_parameters()]
    g = gt.compile(step_c)
    for s in range(STEPS + 1):
        x, y = batch(p2, 300 + 2 * s)
        gt.manual_seed(1000 + s)
        loss_e = step_e(x, y)
        gt.manual_seed(1000 + s)
        loss_c = g(x, y)
        c.same(f"step {s}: loss", loss_c, loss_e)
        for n, pc, pe in zip(names, m_c.parameters(), m_e.parameters()):
            c.same(f"step {s}: parameter {n}", pc, pe)
    # another seed, another mask: the mask is not frozen into the graph
    x, y = batch(p2, 390)
    gt.manual_seed(7)
    loss_e = step_e(x, y)
    gt.manual_seed(8)
    loss_c = g(x, y)
    c.true("another seed gives another mask (the compiled step's loss differs from eager's)",
           not torch.allclose(one(loss_c), one(loss_e), rtol=1e-9, atol=0))
    c.true(f"one capture, got {g.captures}", g.captures == 1)
    c.done()


def section_pipeline():
    """g.pipeline of forwards and of training steps: each item equals the eager call, in order."""
    c = Checker("pipeline")
    p = gt.placement("cpu", ranks=[0, 1, 2, 3])
    p2 = gt.placement("cpu", ranks=[[0, 1], [2, 3]])
    w = gt.distribute(data(3, 7, 5), p, S(1))

    def fn(x):
        y = torch.tanh(x @ w)                        # S(0) @ S(1): boxing inside
        return y.to_global(sbp=B), y.sum(dim=0)
    xs = [gt.distribute(data(400 + i, 10, 7), p, S(0)) for i in range(6)]
    for registers in (1, 2):
        g = gt.compile(fn, registers=registers)
        outs = g.pipeline(xs)
        c.true(f"registers={registers}: {len(outs)} outputs for {len(xs)} items", len(outs) == len(xs))
        for i, (x, (y, sm)) in enumerate(zip(xs, outs)):
            ry, rs = fn(x)
            c.same(f"registers={registers}, item {i}: y", y, ry)
            c.same(f"registers={registers}, item {i}: sum", sm, rs)
        again = g.pipeline(xs[::-1])                 # the captured graph again, other order
        for i, (x, (y, _)) in enumerate(zip(xs[::-1], again)):
            c.same(f"registers={registers}, second pipeline, item {i}", y, fn(x)[0])
        c.true(f"registers={registers}: one capture, got {g.captures}", g.captures == 1)

    # overlapped training steps: item i sees the parameters after step i - 1
    m_e, _, step_e = make_model(p2, OPTIMIZERS["adamw"])
    m_c, _, step_c = make_model(p2, OPTIMIZERS["adamw"])
    batches = [batch(p2, 500 + 2 * i) for i in range(6)]
    g = gt.compile(step_c)
    losses = g.pipeline(batches)
    for i, (loss, (x, y)) in enumerate(zip(losses, batches)):
        c.same(f"pipelined training, step {i}: loss", loss, step_e(x, y))
    for (n, pc), pe in zip(m_c.named_parameters(), m_e.parameters()):
        c.same(f"pipelined training, after the pipeline: {n}", pc, pe)
    c.done()


def two_stage(pa, pb, optimizer):
    """Stage 1 on ranks [0, 1], stage 2 on [2, 3], data parallel inside each stage."""
    w1 = gt.distribute(data(11, 6, 8), pa, B).requires_grad_()
    b1 = gt.distribute(data(12, 8), pa, B).requires_grad_()
    w2 = gt.distribute(data(13, 8, 3), pb, B).requires_grad_()
    params = [w1, b1, w2]
    opt = optimizer(params)

    def forward(x):
        h = torch.tanh(x @ w1 + b1)
        return h.to_global(placement=pb, sbp=S(0)) @ w2
    return params, forward, training_step(lambda x, y: ((forward(x) - y) ** 2).mean(), opt)


def micro(t, m, j):
    """Micro-batch j of m of ``t`` (S(0)): each rank's piece split along dim 0, as gt.compile splits it."""
    piece = t.to_local()
    n = piece.shape[0] // m
    return gt.to_global(piece.narrow(0, j * n, n), placement=t.placement, sbp=S(0),
                        shape=(t.shape[0] // m,) + tuple(t.shape[1:]))


def section_pipeline_parallel():
    """micro_batches=4 over 2 stages ([0, 1] then [2, 3]) equals the eager full-batch step."""
    c = Checker("pipeline_parallel")
    pa, pb = gt.placement("cpu", ranks=[0, 1]), gt.placement("cpu", ranks=[2, 3])
    inside = {"stage 1": gt.rank() in (0, 1), "stage 2": gt.rank() in (2, 3)}
    optimizers = {"sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                  "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)}
    for oname, optimizer in optimizers.items():
        params_e, forward_e, step_e = two_stage(pa, pb, optimizer)
        params_c, _, step_c = two_stage(pa, pb, optimizer)
        g = gt.compile(step_c, micro_batches=4)
        for s in range(STEPS):
            x = gt.distribute(data(600 + 2 * s, 16, 6), pa, S(0))
            y = gt.distribute(data(601 + 2 * s, 16, 3), pb, S(0))
            with torch.no_grad():            # the micro-batches' own losses, eagerly, before the step
                mb = [((forward_e(micro(x, 4, j)) - micro(y, 4, j)) ** 2).mean() for j in range(4)]
                mean_mb = torch.stack([t.to_global(sbp=B) for t in mb]).mean()
            loss_e = step_e(x, y)            # the full-batch step
            loss_c = g(x, y)
            c.same(f"{oname} step {s}: loss", loss_c, loss_e)
            c.same(f"{oname} step {s}: loss is the mean of the micro-batches' losses",
                   loss_c.to_global(sbp=B), mean_mb)        # the loss is partial over the stage: boxed
            for i, (pc, pe) in enumerate(zip(params_c, params_e)):
                c.same(f"{oname} step {s}: parameter {i}", pc, pe)
        c.true(f"{oname}: one capture, got {g.captures}", g.captures == 1)
        c.true(f"{oname}: this rank holds a piece of its stage's parameters only",
               (one(params_c[0]).numel() > 0) == inside["stage 1"] and
               (one(params_c[2]).numel() > 0) == inside["stage 2"])
        check_plan(c, oname, g, micro_batches=4)
    c.done()


SECTIONS = [section_forward_1d, section_forward_2x2, section_training, section_hand_placed, section_dropout,
            section_pipeline, section_pipeline_parallel]


# -- failures ------------------------------------------------------------------------------------------
def failing_function():
    p = gt.placement("cpu", ranks=[0, 1, 2, 3])
    w = gt.distribute(data(50, 4, 4), p, B)

    def fn(x):
        h = maybe_fail(torch.tanh(x @ w))       # raises on every rank holding a piece, when told to
        return h.to_global(sbp=B) * 2.0          # an all-gather after it
    x = gt.distribute(data(51, 7, 4), p, S(0))
    return fn, x


def compiled_and_checked(fn, x, c):
    """The compiled fn after its warm-up and capture, both equal to eager (the flag off)."""
    g = gt.compile(fn)
    ref = fn(x)
    for s in range(2):
        c.same(f"call {s} (flag off)", g(x), ref)
    c.true(f"one capture, got {g.captures}", g.captures == 1)
    return g, ref


def timed_graph_error(call):
    """(GraphError or None, seconds, other exception text or None)."""
    start = time.perf_counter()
    try:
        call()
    except gt.GraphError as e:
        return e, time.perf_counter() - start, None
    except Exception as e:  # noqa: BLE001 -- reported
        return None, time.perf_counter() - start, f"{type(e).__name__}: {e}"
    return None, time.perf_counter() - start, "no error"


def run_fail_all():
    c = Checker("fail_all")
    fn, x = failing_function()
    g, ref = compiled_and_checked(fn, x, c)
    FAIL["on"] = True
    err, seconds, other = timed_graph_error(lambda: g(x))
    FAIL["on"] = False
    cause = type(err.__cause__).__name__ if err is not None else None
    emit("fail_all_error", graph_error=str(err) if err is not None else None, other=other,
         seconds=round(seconds, 3), cause=cause)
    # cleared: the function captures again and computes the right values
    out = g(x)
    c.same("after the failure: the recaptured graph's result", out, ref)
    c.same("after the failure: a second graph call", g(x), ref)
    c.true(f"after the failure: captured again (captures {g.captures})", g.captures == 2)
    c.done()
    dist.barrier()                                 # every rank has reported
    FAIL["on"] = True
    g(x)                                           # uncaught GraphError: exit code 1, the op named
    emit("not_reached", after="the second failing call")


def run_fail_rank0(stay_alive):
    c = Checker("fail_rank0")
    fn, x = failing_function()
    g, _ = compiled_and_checked(fn, x, c)
    c.done()
    dist.barrier()
    FAIL["on"] = gt.rank() == 0
    if gt.rank() != 0:
        # The launcher ends the job when the first rank fails (SIGTERM, SIGKILL after --grace); this
        # rank ignores SIGTERM, so that what it does on its own -- leave the blocked all-gather with
        # an error -- shows, bounded by the grace period.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    err, seconds, other = timed_graph_error(lambda: g(x))
    emit("fail_rank0_error", graph_error=str(err) if err is not None else None, other=other,
         seconds=round(seconds, 3), cause=type(err.__cause__).__name__ if err is not None else None)
    if gt.rank() == 0 and stay_alive:
        emit("rank0_sleeps", at=time.time(), seconds=RANK0_SLEEP_S)
        time.sleep(RANK0_SLEEP_S)   # the others' all-gather times out; the launcher ends this process after them
    if err is not None:
        raise err            # uncaught: exit code 1, the op (rank 0) or the collective (others) named
    sys.exit(3)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "equal":
        run_sections(SECTIONS)
    elif mode == "fail-all":
        run_fail_all()
    elif mode in ("fail-rank0", "fail-rank0-alive"):
        run_fail_rank0(stay_alive=mode.endswith("alive"))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
