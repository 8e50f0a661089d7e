"""The program every rank runs in tests/multiprocess/test_process_world.py (one launch per world size).

It runs sections in order. A check that fails is recorded, not raised, so that every rank
keeps issuing the same collectives; an exception ends the job (the launcher stops the other
ranks), and the tests report the sections that never finished. Records are printed as
``GT {json}`` lines; the launcher prefixes them with ``[rank N] ``.

Expected values are computed here without globaltensor's own shape code: the logical
tensors come from ``torch.manual_seed`` (the same on every rank and in the test process),
the balanced split is re-derived below, and partial-sum pieces are summed with a raw
``torch.distributed.all_reduce``.
"""
import itertools
import json
import time
import traceback

import torch
import torch.distributed as dist

import globaltensor as gt
from launched_values import logical

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
SBPS = {"S0": S(0), "S1": S(1), "B": B, "P": P}
SHAPES = [(8, 6), (7, 5), (3, 1)]
RANDOM_SHAPES = [(7, 5), (3, 1)]
SEED = 1234


def emit(section, **fields):
    print("GT " + json.dumps({"section": section, **fields}), flush=True)


def balanced(n, k):
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def placements(n):
    """name -> placement; the full one in rank order and reversed (group order != rank order)."""
    return {"all": gt.placement("cpu", ranks=list(range(n))),
            "reversed": gt.placement("cpu", ranks=list(reversed(range(n))))}


class Checker:
    def __init__(self, section):
        self.section = section
        self.failures = []
        self.count = 0

    def equal(self, what, got, expected):
        self.count += 1
        if isinstance(got, torch.Tensor) or isinstance(expected, torch.Tensor):
            ok = (isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor)
                  and got.shape == expected.shape and got.dtype == expected.dtype and torch.equal(got, expected))
        else:
            ok = got == expected
        if not ok:
            self.failures.append(f"{what}: got {got!r}, expected {expected!r}")

    def true(self, what, cond):
        self.count += 1
        if not cond:
            self.failures.append(what)

    def raises(self, what, fn, error, text):
        """A check that ``fn()`` raises ``error`` with ``text`` in its message."""
        try:
            fn()
        except error as e:
            self.true(f"{what}: the error says so ({e})", text in str(e))
        else:
            self.true(f"{what}: expected a {error.__name__}", False)

    def done(self, **fields):
        emit(self.section, done=True, checks=self.count, failures=self.failures, **fields)


def check_piece(c, what, x, full, sbp, plc):
    """``x``'s piece on this rank against the slice of ``full`` its sbp gives this rank."""
    me = gt.rank()
    piece = x.to_local()
    inside = me in plc
    if not inside:
        c.equal(f"{what}: piece outside the placement", piece.numel(), 0)
    if sbp.is_partial:
        # every rank of the world calls this for the same tensors; outsiders add zeros
        total = piece.clone() if inside else torch.zeros_like(full)
        c.equal(f"{what}: partial piece shape", tuple(total.shape), tuple(full.shape))
        dist.all_reduce(total)
        if inside:
            c.equal(f"{what}: sum of partial pieces", total, full)
    elif not inside:
        return
    elif sbp.is_split:
        i = plc.rank_list().index(me)
        sizes = balanced(full.shape[sbp.dim], plc.size)
        c.equal(f"{what}: piece", piece, full.narrow(sbp.dim, sum(sizes[:i]), sizes[i]))
    else:
        c.equal(f"{what}: piece", piece, full)


def section_world():
    c = Checker("world")
    import os
    c.equal("world_size() vs WORLD_SIZE", gt.world_size(), int(os.environ["WORLD_SIZE"]))
    c.equal("rank() vs RANK", gt.rank(), int(os.environ["RANK"]))
    world = gt.get_world()
    c.equal("world is not simulated", world.simulated, False)
    c.equal("world.local_ranks", tuple(world.local_ranks), (gt.rank(),))
    c.done(rank=gt.rank(), world_size=gt.world_size())


def section_conversions():
    """Every 1-D conversion pair on every shape and placement: pieces, numpy(), bytes counted."""
    c = Checker("conversions")
    n = gt.world_size()
    stats = {}
    for pname, plc in placements(n).items():
        for salt, shape in enumerate(SHAPES):
            full = logical(shape, salt)
            for aname, a in SBPS.items():
                for bname, b in SBPS.items():
                    what = f"{pname} {shape} {aname}->{bname}"
                    x = gt.distribute(full, plc, a)
                    check_piece(c, what + " (source)", x, full, a, plc)
                    with gt.comm_stats() as st:
                        y = x.to_global(sbp=b)
                    stats[what] = {"bytes": st.bytes_sent, "ops": st.ops(),
                                   "per_rank": {str(r): v for r, v in sorted(st.per_rank.items())}}
                    c.equal(what + ": shape", tuple(y.shape), shape)
                    c.equal(what + ": sbp", y.sbp, (b,))
                    check_piece(c, what, y, full, b, plc)
                    c.equal(what + ": numpy()", torch.from_numpy(y.numpy()), full)
    c.done(stats=stats)


def section_random():
    """Random factories: the logical tensor, per seed, whatever the sbp and number of ranks."""
    c = Checker("random")
    n = gt.world_size()
    plc = placements(n)["all"]
    values = {}
    for fname, factory in (("randn", gt.randn), ("rand", gt.rand)):
        for shape in RANDOM_SHAPES:
            for sname, sbp in SBPS.items():
                what = f"{fname} {shape} {sname}"
                gt.manual_seed(SEED)
                x = factory(*shape, placement=plc, sbp=sbp)
                whole = torch.from_numpy(x.numpy())
                values[what] = whole.double().tolist()
                c.equal(what + ": shape", tuple(x.shape), shape)
                check_piece(c, what, x, whole, sbp, plc)
    c.done(values=values)


def section_from_local():
    """``to_global`` from each rank's own local tensor: uneven split pieces give the global shape."""
    c = Checker("from_local")
    n = gt.world_size()
    me = gt.rank()
    plc = placements(n)["all"]
    full = torch.arange((2 * n + 1) * (n + 1), dtype=torch.float32).reshape(2 * n + 1, n + 1)
    for d in (0, 1):
        sizes = balanced(full.shape[d], n)
        mine = full.narrow(d, sum(sizes[:me]), sizes[me]).clone()
        x = mine.to_global(placement=plc, sbp=S(d))
        c.equal(f"S({d}) from uneven pieces: shape", tuple(x.shape), tuple(full.shape))
        c.equal(f"S({d}) from uneven pieces: own piece kept", x.to_local(), mine)
        c.equal(f"S({d}) from uneven pieces: numpy()", torch.from_numpy(x.numpy()), full)
    x = gt.to_global(full.clone(), placement=plc, sbp=B)
    c.equal("B from local: shape", tuple(x.shape), tuple(full.shape))
    c.equal("B from local: numpy()", torch.from_numpy(x.numpy()), full)
    x = (full * (me + 1)).to_global(placement=plc, sbp=P)
    c.equal("P from local: numpy() is the sum", torch.from_numpy(x.numpy()), full * sum(range(1, n + 1)))
    # pieces that do not follow the balanced split: every rank sees every shape, so all raise
    wrong = full[: (n + 1 if me == 0 else 1)]
    c.raises("unbalanced pieces", lambda: wrong.to_global(placement=plc, sbp=S(0)), ValueError, "balanced")
    c.done()


INSIDER_SLEEP_S = 3.0     # section_subset: the insiders' sleep, which the outsiders must not wait out


def section_subset():
    """A placement on a subset of ranks: the others hold empty pieces, skip its ops, never wait."""
    c = Checker("subset")
    n = gt.world_size()
    me = gt.rank()
    ranks = [1] if n == 2 else [1, 2]
    sub = gt.placement("cpu", ranks=ranks)
    inside = me in ranks
    full = logical((7, 5), 50)
    if inside:
        time.sleep(INSIDER_SLEEP_S)  # outsiders that waited for insiders would take this long too
    start = time.monotonic()
    converted = []
    for aname, a in SBPS.items():
        for bname, b in SBPS.items():
            x = gt.distribute(full, sub, a)
            converted.append((f"subset {ranks} {aname}->{bname}", x.to_global(sbp=b), b))
    elapsed = time.monotonic() - start
    if not inside:
        c.true(f"rank {me} outside the placement spent {elapsed:.2f} s on its ops, not less than the insiders' "
               f"sleep ({INSIDER_SLEEP_S} s): it waited for them", elapsed < INSIDER_SLEEP_S)
    for what, y, b in converted:
        check_piece(c, what, y, full, b, sub)
        c.equal(what + ": shape", tuple(y.shape), (7, 5))
        c.equal(what + ": sbp", y.sbp, (b,))
        if not inside:
            c.equal(what + ": local_tensors() outside", y.local_tensors(), {})
        # numpy() gives the whole value on every rank, outsiders included (a world-wide collective)
        c.equal(what + ": numpy()", torch.from_numpy(y.numpy()), full)
    # moving to the whole world involves everyone again
    everyone = placements(n)["all"]
    for bname, b in SBPS.items():
        if b.is_partial:
            continue
        x = gt.distribute(full, sub, S(0))
        y = x.to_global(placement=everyone, sbp=b)
        check_piece(c, f"subset S0 -> all {bname}", y, full, b, everyone)
        c.equal(f"subset S0 -> all {bname}: numpy()", torch.from_numpy(y.numpy()), full)
    c.done()


def section_local_map():
    """``gt.local_map`` on each rank's own piece: values and gradients against the whole computation,
    the logical shape of uneven results exchanged, and a rank outside the placement refused."""
    c = Checker("local_map")
    n, me = gt.world_size(), gt.rank()
    torch.manual_seed(7)
    full, weight = torch.randn(2 * n + 1, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    want = torch.tanh(full @ weight)
    for pname, plc in placements(n).items():
        x = gt.distribute(full, plc, S(0))
        w = gt.distribute(weight, plc, B).requires_grad_()

        def local(a, b):
            c.equal(f"{pname}: rank() inside", gt.local_map.rank(), me)
            return torch.tanh(a @ b)

        y = gt.local_map(local, (S(0), B), S(0))(x, w)
        c.equal(f"{pname}: result shape", tuple(y.shape), tuple(want.shape))
        c.true(f"{pname}: result", torch.allclose(torch.from_numpy(y.numpy()), want, rtol=0, atol=1e-12))
        (y * y).sum().backward()
        w_ref = weight.clone().requires_grad_()
        (torch.tanh(full @ w_ref) ** 2).sum().backward()
        c.true(f"{pname}: weight gradient", torch.allclose(w.grad.full_tensor(), w_ref.grad, rtol=0, atol=1e-12))
        # a result whose pieces' sizes only the ranks know: the logical shape is exchanged
        z = gt.local_map(lambda a: a[: 1 + (gt.local_map.rank() == plc.rank_list()[0])], (S(0),), S(0))(x)
        c.equal(f"{pname}: exchanged shape", tuple(z.shape), (n + 1, 4))
    # compiled: each rank's call one task of the graph, the weight's gradient summed by the graph
    plc = placements(n)["reversed"]
    w = gt.distribute(weight, plc, B).requires_grad_()
    mapped = gt.local_map(lambda a, b: torch.tanh(a @ b), (S(0), B), S(0))

    def step(x):
        w.grad = None
        loss = mapped(x, w).square().sum()
        loss.backward()
        return loss, w.grad
    compiled = gt.compile(step)
    for i in range(3):                                  # eager, capture, a replay
        data = full * (i + 1)
        w_ref = weight.clone().requires_grad_()
        want_loss = torch.tanh(data @ w_ref).square().sum()
        want_loss.backward()
        loss, grad = compiled(gt.distribute(data, plc, S(0)))
        c.true(f"compiled call {i}: loss", torch.allclose(loss.full_tensor(), want_loss, rtol=0, atol=1e-12))
        c.true(f"compiled call {i}: weight gradient", torch.allclose(grad.full_tensor(), w_ref.grad, rtol=0, atol=1e-12))
    c.equal("compiled: one task per call", sorted(t.name.split(":", 1)[1] for t in compiled.plan.tasks
                                                  if "local_map" in t.name),
            [f"local_map(<lambda>) (backward)@r{me}", f"local_map(<lambda>)@r{me}"])
    sub = gt.placement("cpu", ranks=list(range(n - 1)))
    x = gt.distribute(full, sub, S(0)) if me in sub else None
    if me in sub:
        y = gt.local_map(lambda a: a * 2, (S(0),), S(0))(x)
        c.equal("subset: shape exchanged among its ranks", tuple(y.shape), tuple(full.shape))
    else:
        c.raises("outside the placement", gt.local_map(lambda: torch.zeros(1), (), S(0), placement=sub), ValueError,
                 "holds no rank of the placement")
    c.done()


def section_expert_parallel():
    """Expert parallelism's all-to-all with uneven, data-decided sizes between processes: 5 experts
    over the ranks, 13 tokens, one step against the same experts module computed whole here; stacked
    experts (laid out by a plan) and a plain nn.ModuleList of experts (moved by expert_parallel)."""
    import copy
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from moe_models import Experts, ListedExperts

    c = Checker("expert_parallel")
    n = gt.world_size()
    plc = placements(n)["reversed"]                     # group order != rank order
    for kind, make, plan in [("stacked", Experts, {"*_proj": S(0)}), ("listed", ListedExperts, None)]:
        torch.manual_seed(11)
        one = make(num_experts=5).double()
        experts = copy.deepcopy(one)
        x = torch.randn(13, 6, dtype=torch.float64)
        scores = torch.rand(13, 5, dtype=torch.float64)
        scores[:4] = 0.0                                # ties: the first tokens all pick experts 0 and 1
        weights, index = torch.topk(scores.softmax(-1), 2, dim=-1)
        gt.nn.distribute_module(experts, plc, plan)
        gt.nn.expert_parallel(experts, plc)
        gx = gt.distribute(x, plc, S(0)).requires_grad_()
        with gt.comm_stats() as stats:
            y = experts(gx, gt.distribute(index, plc, S(0)), gt.distribute(weights, plc, S(0)))
            (y * y).sum().backward()
        xr = x.clone().requires_grad_()
        want = one(xr, index, weights)
        (want * want).sum().backward()
        c.true(f"{kind}: forward equals the whole computation", torch.allclose(y.full_tensor(), want, rtol=0, atol=1e-12))
        c.true(f"{kind}: input gradient", torch.allclose(gx.grad.full_tensor(), xr.grad, rtol=0, atol=1e-12))
        for (name, a), (_, b) in zip(experts.named_parameters(), one.named_parameters()):
            c.true(f"{kind}: {name} gradient", torch.allclose(a.grad.full_tensor(), b.grad, rtol=0, atol=1e-12))
        c.equal(f"{kind}: collectives", [op for op in stats.ops() if op != "all_reduce"],
                ["all_gather", "all_to_all", "all_to_all", "all_to_all", "all_to_all"])
    c.done()


def section_ring_attention():
    """Ring attention between processes: q, k, v split on an uneven sequence (plain and head-tail),
    key/value blocks passed on by point-to-point transfers (reversed group order too), forward and
    backward against the whole computation here, causal and not."""
    import torch.nn.functional as F
    c = Checker("ring_attention")
    n = gt.world_size()
    torch.manual_seed(13)
    tensors = [torch.randn(2, 2, 4 * n + 1, 8, dtype=torch.float64) for _ in range(3)]
    for (pname, plc), order in itertools.product(placements(n).items(), ("plain", "head_tail")):
        for causal in (False, True):
            split = [gt.distribute(t, plc, S(2, order=order)).requires_grad_() for t in tensors]
            with gt.explicit(), gt.comm_stats() as stats:
                out = F.scaled_dot_product_attention(*split, is_causal=causal)
                out.sum().backward()
            leaves = [t.clone().requires_grad_() for t in tensors]
            want = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            want.sum().backward()
            what = f"{pname} {order} causal={causal}"
            c.equal(f"{what}: only point-to-point transfers", sorted(set(stats.ops())), ["send_recv"])
            c.true(f"{what}: output", torch.allclose(out.full_tensor(), want, rtol=0, atol=1e-12))
            for name, a, b in zip("qkv", split, leaves):
                c.true(f"{what}: grad {name}", torch.allclose(a.grad.full_tensor(), b.grad, rtol=0, atol=1e-12))
    c.done()


SECTIONS = [section_world, section_conversions, section_random, section_from_local, section_subset,
            section_local_map, section_expert_parallel, section_ring_attention]


def run_sections(sections):
    """Run the ``section_*`` functions in order; one that raises is reported, then ends the rank."""
    for section in sections:
        name = section.__name__[len("section_"):]
        try:
            section()
        except Exception:
            emit(name, error=traceback.format_exc())
            raise  # uncaught: the rank exits at once, and the launcher ends the job


if __name__ == "__main__":
    run_sections(SECTIONS)
