"""Ops without a rule: decomposed where PyTorch can, else gathered to broadcast (ops/fallback.py),
with a one-time warning naming the op; a rule registered by the user replaces the fallback."""
import warnings

import pytest
import torch

import globaltensor as gt
from globaltensor.ops import fallback
from globaltensor.ops.registry import RULES, find_rule
from globaltensor.sbp import broadcast as B, partial_sum as P, split as S
from harness import check_layouts, lay, no_fallback

aten = torch.ops.aten
torch.manual_seed(0)

T = torch.randn(9, 6)
SORTED = torch.sort(torch.randn(6, 5), dim=1).values

# name -> (function of the input, the aten op that falls back or None where a decomposition applies)
OPS = {
    "histc": (lambda x: torch.histc(x, bins=5), aten.histc.default),
    "bincount": (lambda x: torch.bincount((x.abs() * 3).long().flatten()), aten.bincount.default),
    "tril": (lambda x: torch.tril(x, 1), None),
    "median": (lambda x: torch.median(x), aten.median.default),
    "put": (lambda x: x.put(torch.tensor([0, 7]), torch.tensor([1.5, -2.0])), aten.put.default),
    "mask": (lambda x: x[x > 0], aten.index.Tensor),
    "unique": (lambda x: torch.unique((x * 2).round(), return_counts=True), aten._unique2.default),
    "nonzero": (lambda x: torch.nonzero(x > 0.5), aten.nonzero.default),
    "flip": (lambda x: torch.flip(x, [0]), None),
    "roll": (lambda x: torch.roll(x, 2, 0), None),
}




def _full(v):
    return v.full_tensor() if getattr(v, "is_global", False) else v


def _same(got, want, what):
    got = list(got) if isinstance(got, tuple) else [got]
    want = list(want) if isinstance(want, tuple) else [want]
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        g = _full(g)
        assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, w.shape)
        if w.is_floating_point() or w.is_complex():
            torch.testing.assert_close(g, w, msg=lambda m: f"{what}: {m}")
        else:
            assert torch.equal(g, w), what


@pytest.mark.filterwarnings("ignore:globaltensor")
@pytest.mark.parametrize("name", list(OPS))
def test_op_without_rule_matches_one_device(name):
    fn, _ = OPS[name]
    want = fn(T)
    with gt.simulate(4):
        for placement, sbp in (("1d", S(0)), ("1d", S(1)), ("1d", P), ("2x2", (S(1), S(0)))):
            _same(fn(lay(T, sbp, placement)), want, f"{name} on {sbp}")


@pytest.mark.parametrize("name", [n for n, (_, op) in OPS.items() if op is not None])
def test_fallback_warns_once_naming_the_op(name):
    fn, op = OPS[name]
    fallback._warned.discard(op)
    with gt.simulate(4):
        x = lay(T, S(0))
        with pytest.warns(UserWarning, match=rf"{op}.*gathered to broadcast") as record:
            fn(x)
        message = "".join(str(w.message) for w in record if str(op) in str(w.message))
        # x[x > 0] has a rule (index.Tensor) that cannot plan a data-dependent shape: said so
        assert ("has no SBP rule" in message) == (find_rule(op) is None), message
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fn(x)                       # the second call is silent
            fn(lay(T, S(1)))            # and so is another layout of the same op


@pytest.mark.parametrize("name", [n for n, (_, op) in OPS.items() if op is None])
def test_decomposed_ops_keep_sharding_without_warning(name):
    """roll / tril decompose into ops with rules (flip has a rule of its own): a split of another dim needs no gather."""
    fn, _ = OPS[name]
    with gt.simulate(4):
        x = lay(T, S(1))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with gt.comm_stats() as stats:
                y = fn(x)
        assert stats.bytes_sent == 0 and y.sbp == (S(1),)
        _same(y, fn(T), name)


@pytest.mark.filterwarnings("ignore:globaltensor")
def test_fallback_result_is_broadcast_and_mixes_plain_tensors():
    with gt.simulate(4):
        x = lay(T, S(0))
        q, r = torch.linalg.qr(x)
        assert q.sbp == (B,) and r.sbp == (B,)
        assert set(q.local_tensors()) == {0, 1, 2, 3}
        q = lay(T[:6, :3].contiguous(), S(1))
        got = torch.searchsorted(SORTED, q)     # a plain sorted sequence with a global query
        assert torch.equal(got.full_tensor(), torch.searchsorted(SORTED, T[:6, :3].contiguous()))


@pytest.mark.filterwarnings("ignore:globaltensor")
def test_in_place_op_without_rule_keeps_the_layout():
    idx = torch.tensor([0, 7, 30, 53])
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0])
    want = T.clone().put_(idx, vals)
    with gt.simulate(4):
        for sbp in (S(0), S(1), P):
            x = lay(T, sbp).clone()
            out = x.put_(idx, vals)
            assert out is x and x.sbp == (sbp,)
            torch.testing.assert_close(x.full_tensor(), want)


def test_user_rule_replaces_the_fallback():
    """``gt.register_rule`` for sort along a dim: a split of another dim stays, nothing is gathered."""
    op = aten.sort.default
    saved = RULES.get(op)
    shape = (5, 12)                  # a shape no other test sorts: no decision is cached for it yet

    def sort_rule(x, dim=-1, descending=False):
        dim %= x.dim()
        return [f"S({d}) -> S({d}), S({d})" for d in range(x.dim()) if d != dim]

    t = torch.randn(shape)
    try:
        gt.register_rule(op, sort_rule)
        with gt.simulate(4):
            x = lay(t, S(0))
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with gt.comm_stats() as stats:
                    values, indices = torch.sort(x, dim=1)
            assert stats.bytes_sent == 0 and stats.count == 0
            assert values.sbp == (S(0),) and indices.sbp == (S(0),)
            want = torch.sort(t, dim=1)
            torch.testing.assert_close(values.full_tensor(), want.values)
            assert torch.equal(indices.full_tensor(), want.indices)
            # sorting along the split dim itself has no candidate: boxed to broadcast, still exact
            v0 = torch.sort(x, dim=0).values
            torch.testing.assert_close(v0.full_tensor(), torch.sort(t, dim=0).values)
    finally:
        if saved is None:
            RULES.pop(op, None)
        else:
            RULES[op] = saved


def test_register_rule_as_decorator_with_string_signatures():
    op = aten.hypot.default
    saved = RULES.get(op)
    try:
        @gt.register_rule(op)
        def hypot_rule(a, b):
            return ["S(0), S(0) -> S(0)"]      # only the split of rows (and the automatic B, B -> B)

        a, b = torch.randn(11, 3), torch.randn(11, 3)
        with gt.simulate(4):
            y = torch.hypot(lay(a, S(0)), lay(b, S(0)))
            assert y.sbp == (S(0),)
            z = torch.hypot(lay(a, S(1)), lay(b, S(1)))      # no S(1) candidate: boxed
            assert z.sbp != (S(1),)
            torch.testing.assert_close(z.full_tensor(), torch.hypot(a, b))
    finally:
        if saved is None:
            RULES.pop(op, None)
        else:
            RULES[op] = saved


F = torch.nn.functional
COMPOSITE_INSIDE_DECOMPOSITIONS = {
    # op reached only from inside a Python decomposition: (function, inputs)
    "log_sigmoid (BCE with logits)": (lambda x, t: F.binary_cross_entropy_with_logits(x, t),
                                      (torch.randn(8, 6), torch.rand(8, 6))),
    "__or__ (hardtanh backward)": (lambda x: F.hardtanh(x * 2), (torch.randn(8, 6),)),
    "__and__ (relu6 backward)": (lambda x: F.relu6(x * 4), (torch.randn(8, 6),)),
    "narrow (glu)": (lambda x: F.glu(x, dim=1), (torch.randn(8, 6),)),
    "hardsigmoid backward": (lambda x: F.hardsigmoid(x * 4), (torch.randn(8, 6),)),
}


@pytest.mark.parametrize("name", sorted(COMPOSITE_INSIDE_DECOMPOSITIONS))
def test_composite_ops_inside_decompositions_are_taken_apart(name):
    """A CompositeImplicitAutograd op met inside a decomposition (below autograd) runs as the ops
    it is made of, which have rules: equal values and gradients, and nothing falls back."""
    fn, args = COMPOSITE_INSIDE_DECOMPOSITIONS[name]
    with no_fallback():
        check_layouts(fn, *args, grad=True, trials=3)


def test_fallback_calls_lists_the_ops_that_fell_back(p1):
    """The public count: an op gathered to run shows up with its calls; one with a rule does not."""
    gt.fallback_calls_clear()
    x = gt.distribute(T, p1, S(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.histc(x, bins=5)
        torch.histc(x, bins=4)
    (x + 1).sum()
    assert gt.fallback_calls() == {str(aten.histc.default): 2}
    gt.fallback_calls_clear()
    assert gt.fallback_calls() == {}
