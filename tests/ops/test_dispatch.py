"""The dispatcher (ops/dispatch.py): placement checks, plain tensors and scalars mixing in, the
decision cache, least-boxing signature choice on 1-D and 2-D placements, written tensors
keeping their layout, and placements that cover only some of the world's ranks."""
import re

import pytest
import torch

import globaltensor as gt
from globaltensor.ops import dispatch
from globaltensor.ops.registry import RULES
from globaltensor.sbp import broadcast as B, partial_sum as P, split as S
from harness import lay

aten = torch.ops.aten
torch.manual_seed(0)

XM = torch.randn(8, 6)
WM = torch.randn(6, 4)




# -- placements ------------------------------------------------------------------------------

def test_inputs_on_different_placements_raise_naming_both():
    with gt.simulate(4):
        p4, p2 = gt.placement("cpu", [0, 1, 2, 3]), gt.placement("cpu", [0, 1])
        x, y = lay(XM, S(0), p4), lay(XM, S(0), p2)
        with pytest.raises(ValueError) as err:
            x + y
        msg = str(err.value)
        assert re.search(r"ranks=\[0, 1, 2, 3\]", msg) and re.search(r"ranks=\[0, 1\]\)", msg), msg
        with pytest.raises(ValueError, match="placement"):
            torch.cat([x, y])                          # tensors inside a list are checked too
        with pytest.raises(ValueError, match="placement"):
            x @ lay(WM, B, gt.placement("cpu", [[0, 1], [2, 3]]))   # same ranks, another hierarchy


def test_ranks_outside_the_placement_hold_nothing_and_run_nothing():
    """A tensor on ranks [0, 1] of a 4-rank world: ops run on ranks 0 and 1 only."""
    op = aten.hypot.default
    saved = RULES.get(op)
    ran = []

    def record(rank, ins, outs, *args, **kwargs):
        ran.append(rank)
        return args, kwargs

    try:
        gt.register_rule(op, lambda a, b: ["S(0), S(0) -> S(0)"], local=record)
        with gt.simulate(4):
            p01 = gt.placement("cpu", [0, 1])
            a, b = torch.randn(5, 3), torch.randn(5, 3)
            x, y = lay(a, S(0), p01), lay(b, S(0), p01)
            assert set(x.local_tensors()) == {0, 1}
            z = torch.hypot(x, y)
            assert sorted(ran) == [0, 1]
            assert set(z.local_tensors()) == {0, 1} and z.placement == p01
            torch.testing.assert_close(z.full_tensor(), torch.hypot(a, b))
            assert z.to_local(rank=2).numel() == 0 and z.to_local(rank=3).numel() == 0
            w = (x * 2).sum(0) + y[0]           # other ops, other rules: still only ranks 0 and 1
            assert set(w.local_tensors()) == {0, 1}
            torch.testing.assert_close(w.full_tensor(), (a * 2).sum(0) + b[0])
            # a disjoint placement in the same world runs on its own ranks
            p23 = gt.placement("cpu", [2, 3])
            v = lay(a, S(1), p23).exp()
            assert set(v.local_tensors()) == {2, 3}
            torch.testing.assert_close(v.full_tensor(), a.exp())
    finally:
        if saved is None:
            RULES.pop(op, None)
        else:
            RULES[op] = saved


# -- plain tensors and scalars -----------------------------------------------------------------

def test_plain_tensors_and_scalars_are_broadcast():
    with gt.simulate(4):
        x = lay(XM, S(0))
        with gt.comm_stats() as stats:
            y = (x * torch.arange(6.0) + 1.5) / 2 - torch.tensor(3.0)
        assert y.sbp == (S(0),) and stats.bytes_sent == 0
        torch.testing.assert_close(y.full_tensor(), (XM * torch.arange(6.0) + 1.5) / 2 - 3)
        # a plain operand is sliced (no communication) to meet a split
        with gt.comm_stats() as stats:
            z = lay(XM, S(1)) @ WM
        assert z.sbp == (P,) and stats.bytes_sent == 0
        torch.testing.assert_close(z.full_tensor(), XM @ WM)
        # the plain tensor first, a Python scalar in a list argument
        c = torch.cat([XM[:2], x], 0)
        torch.testing.assert_close(c.full_tensor(), torch.cat([XM[:2], XM]))
        assert torch.equal(torch.clamp(x, max=0.5).full_tensor(), XM.clamp(max=0.5))


# -- the decision cache ------------------------------------------------------------------------

def test_repeated_op_reuses_its_decision(monkeypatch):
    calls = []
    decide = dispatch.decide

    def counting(func, args, kwargs, **options):
        calls.append(func)
        return decide(func, args, kwargs, **options)

    monkeypatch.setattr(dispatch, "decide", counting)
    with gt.simulate(4):
        x, w = lay(torch.randn(12, 5), S(0)), lay(torch.randn(5, 7), B)
        y1 = torch.mm(x, w)
        n = len(dispatch.CACHE)
        decided = list(calls)
        for _ in range(3):
            y = torch.mm(x, w)
        assert calls == decided and len(dispatch.CACHE) == n          # hits, no new decisions
        torch.testing.assert_close(y.full_tensor(), y1.full_tensor())
        x2 = lay(torch.randn(12, 5), S(0), seed=1)                     # other values, same layout: a hit
        torch.mm(x2, w)
        assert calls == decided
        torch.mm(lay(torch.randn(12, 5), S(1)), w)                      # another layout: a new decision
        assert calls == decided + [aten.mm.default] and len(dispatch.CACHE) == n + 1
        x.add(1.0)
        x.add(2.0)                                         # a scalar operand enters the key by its type
        assert calls.count(aten.add.Tensor) == 1
        x.add(2)                                           # an int promotes otherwise: a key of its own
        assert calls.count(aten.add.Tensor) == 2


# -- least boxing ------------------------------------------------------------------------------

@pytest.mark.parametrize("xs,ws,out,moved", [
    (S(0), B, S(0), 0), (B, S(1), S(1), 0), (S(1), S(0), P, 0), (P, B, P, 0),
    # the partial sum is reduced either way: the smaller operand now ([6, 4]) beats the output later ([8, 4])
    (B, P, B, 144),
    (S(0), S(0), S(0), 80),        # the weight gathered; x keeps its split (a partial output would be owed)
    (S(1), B, P, 0),               # row parallel: w sliced for free
    (P, P, P, 144),                # one operand reduced, the product of the other partial
    (B, B, B, 0),
])
def test_mm_chooses_the_least_boxing(xs, ws, out, moved):
    """Boxing now plus what the outputs owe later (ops/decide/cost.py) is least."""
    with gt.simulate(4):
        x, w = lay(XM, xs, seed=1), lay(WM, ws, seed=2)
        with gt.comm_stats() as stats:
            y = x @ w
        assert stats.bytes_sent == moved and y.sbp == (out,)
        torch.testing.assert_close(y.full_tensor(), XM @ WM)


@pytest.mark.parametrize("xs,ws,out", [
    ((S(0), S(1)), (B, S(0)), (S(0), P)),          # data parallel x row-split contraction
    ((S(0), B), (B, S(1)), (S(0), S(1))),
    ((B, S(1)), (B, S(0)), (B, P)),                 # tensor parallel on the second axis only
    ((S(1), S(0)), (S(0), B), (P, S(0))),
])
def test_2d_placement_uses_product_signatures(xs, ws, out):
    with gt.simulate(4):
        x, w = lay(XM, xs, "2x2"), lay(WM, ws, "2x2")
        with gt.comm_stats() as stats:
            y = x @ w
        assert y.sbp == out and stats.bytes_sent == 0
        torch.testing.assert_close(y.full_tensor(), XM @ WM)


def test_recorded_inputs_are_charged_their_gradients_way_back():
    """``mm(x S(1), w B)``: unrecorded, w is sliced (free) and the product is row parallel. With
    w recorded, boxing x to S(0) (an all-to-all, the fewest bytes now) would leave w's gradient
    a partial sum from a batch-split product, reduced to w's broadcast every step (32 x 32); the
    cost counts that way back, and gathering x (8 x 32) wins: the product and w's gradient come
    out broadcast, with no communication in the backward."""
    with gt.simulate(4):
        x, w = lay(torch.randn(8, 32), S(1), seed=3), lay(torch.randn(32, 32), B)
        with gt.comm_stats() as stats:
            y = x @ w
        assert y.sbp == (P,) and stats.ops() == []
        w.requires_grad_()
        with gt.comm_stats() as stats:
            y = x @ w
        assert y.sbp == (B,) and stats.ops() == ["all_gather"]
        with gt.comm_stats() as stats:
            y.sum().backward()
        assert w.grad.sbp == (B,) and stats.ops() == []
        torch.testing.assert_close(w.grad.full_tensor(), x.full_tensor().sum(0)[:, None].expand(32, 32))


def test_a_split_made_from_unsplit_inputs_is_charged_its_way_back():
    """``sub(P, B)``: reduce-scattering the partial input is half an all-reduce, but the split it
    makes out of unsplit inputs is gathered back later (the program around it is unsplit):
    one all-reduce, the result broadcast."""
    t = torch.randn(8, 6)
    with gt.simulate(4):
        y, target = lay(XM, P, seed=3), lay(t, B)
        with torch.no_grad(), gt.comm_stats() as stats:
            d = y - target
        assert d.sbp == (B,) and stats.ops() == ["all_reduce"]
        torch.testing.assert_close(d.full_tensor(), XM - t)


def test_tensor_parallel_mlp_step_communicates_as_megatron():
    """Column- then row-parallel linear layers, a loss on a broadcast target: one all-reduce
    in the forward, one in the backward (the input's gradient), as the hand-written code."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
    x, t = torch.randn(8, 6), torch.randn(8, 6)
    xr = x.clone().requires_grad_()
    ((model(xr) - t) ** 2).mean().backward()
    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        layouts = {"0.weight": S(0), "0.bias": S(0), "2.weight": S(1), "2.bias": B}
        params = {n: torch.nn.Parameter(gt.distribute(v.detach(), p, layouts[n])) for n, v in model.named_parameters()}
        xg = x.clone().requires_grad_()
        with gt.comm_stats() as stats:
            y = torch.func.functional_call(model, params, (xg.to_global(placement=p, sbp=B),))
            loss = ((y - t.to_global(placement=p, sbp=B)) ** 2).mean()
            loss.backward()
        assert stats.ops() == ["all_reduce", "all_reduce"]
        torch.testing.assert_close(xg.grad, xr.grad)
        for n, v in model.named_parameters():
            assert params[n].grad.sbp == params[n].sbp
            torch.testing.assert_close(params[n].grad.full_tensor(), v.grad)


F = torch.nn.functional
SAVES_ITS_INPUT = {
    "layer_norm": lambda y: F.layer_norm(y, (WM.shape[1],)).pow(2).sum(),
    "gelu": lambda y: F.gelu(y).sum(),
    "mse_loss": lambda y: F.mse_loss(y, torch.ones(XM.shape[0], WM.shape[1])),   # a decomposition
    "silu": lambda y: F.silu(y).sum(),
}


@pytest.mark.parametrize("name", sorted(SAVES_ITS_INPUT))
def test_a_saved_partial_input_is_reduced_once(name):
    """``f(x @ W)`` with the contraction split: the partial product is all-reduced for ``f`` in
    the forward; ``f``'s backward, which needs the same input, uses that copy instead of reducing
    it again (before: a reduce-scatter and three all-to-alls more)."""
    f = SAVES_ITS_INPUT[name]
    xr, wr = XM.clone().requires_grad_(), WM.clone().requires_grad_()
    f(xr @ wr).backward()
    with gt.simulate(4):
        x, w = lay(XM, S(1)).requires_grad_(), lay(WM, S(0)).requires_grad_()
        with gt.comm_stats() as stats:
            y = x @ w
            f(y).backward()
        assert y.sbp == (P,) and stats.ops() == ["all_reduce"], stats.ops()
        torch.testing.assert_close(x.grad.full_tensor(), xr.grad)
        torch.testing.assert_close(w.grad.full_tensor(), wr.grad)


def test_a_kept_copy_is_dropped_when_its_tensor_changes():
    with gt.simulate(4):
        x, w = lay(XM, S(1)).requires_grad_(), lay(WM, S(0))
        y = x @ w
        F.gelu(y)                                             # y all-reduced, the copy kept on y
        assert y._boxed is not None
        with torch.no_grad():
            y.mul_(2)
            torch.testing.assert_close(F.gelu(y).full_tensor(), F.gelu(2 * XM @ WM))
            y.to_local(rank=1).add_(1)                        # a piece written directly counts too
            torch.testing.assert_close(F.gelu(y).full_tensor(), F.gelu(2 * XM @ WM + 1))


def test_leaves_keep_no_kept_boxed_copy():
    """A parameter gathered for an op is gathered again next time: a kept copy of a sharded
    parameter would live as long as the parameter."""
    with gt.simulate(4):
        w = lay(WM, S(1)).requires_grad_()
        x = lay(XM, S(1)).requires_grad_()
        counts = []
        for _ in range(2):
            with gt.comm_stats() as stats:
                x @ w
            counts.append(stats.count)
        assert counts[0] == counts[1] > 0
        assert w._boxed is None


def test_ties_prefer_no_boxing_then_split_outputs():
    with gt.simulate(4):
        x = lay(XM, B)
        y = x.exp()                 # B -> B costs nothing; slicing to a split is a step more
        assert y.sbp == (B,)
        x = lay(XM, S(1))
        y = x.exp()
        assert y.sbp == (S(1),)


# -- written tensors ---------------------------------------------------------------------------

def test_written_tensor_keeps_layout_as_input_and_output():
    """An in-place or out= op may only use candidates whose *output* is the written tensor's layout:
    ``x(B).mul_(y(S(1)))`` must not take ``B, P -> P`` (y boxed to zero-padded partial pieces)."""
    with gt.simulate(4):
        x = lay(XM, B).clone()
        x.mul_(lay(XM, S(1)))
        assert x.sbp == (B,)
        torch.testing.assert_close(x.full_tensor(), XM * XM)
        for r, piece in x.local_tensors().items():     # every replica holds the value
            torch.testing.assert_close(piece, XM * XM)
        c = lay(torch.zeros(8, 6), P).clone()
        torch.mul(lay(XM, S(0)), 3.0, out=c)          # not "B, P -> P" with the out tensor as the P
        assert c.sbp == (P,)
        torch.testing.assert_close(c.full_tensor(), XM * 3)
        c = lay(torch.zeros(8, 6), B).clone()
        torch.add(lay(XM, P, seed=3), lay(XM, P, seed=4), out=c)
        for r, piece in c.local_tensors().items():
            torch.testing.assert_close(piece, 2 * XM)


def test_writing_into_a_plain_tensor_is_an_error():
    with gt.simulate(4):
        x = lay(XM, S(0))
        plain = torch.zeros(8, 6)
        with pytest.raises(TypeError, match="plain"):
            plain.add_(x)
