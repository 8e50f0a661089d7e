"""The dispatch cache's key (ops/call_key.py) and the cache itself (ops/decision_cache.py): a number that
only scales or fills enters the key by its type; dims, sizes, flags and a rule's ``keyed=`` arguments
by what they decide; one key function serves the look-up and the store; the cache is bounded, least
recently used out first, and counts its hits and misses."""

import pytest
import torch

import globaltensor as gt
from globaltensor.ops import dispatch
from globaltensor.ops.call_key import call_key
from globaltensor.ops.decide import candidates, route
from globaltensor.ops.decision_cache import MAXSIZE
from globaltensor.sbp import broadcast as B, partial_sum as P, split as S
from harness import lay

aten = torch.ops.aten




@pytest.fixture
def fresh_cache():
    """An empty cache with zero counts; the default size again afterwards."""
    gt.dispatch_cache_clear()
    yield dispatch.CACHE
    gt.set_dispatch_cache_size(MAXSIZE)


def _size_growth(step, n: int) -> int:
    step(0)
    before = gt.dispatch_cache_info()
    for i in range(1, n):
        step(i)
    after = gt.dispatch_cache_info()
    assert after.misses == before.misses, f"{after.misses - before.misses} new decisions"
    return after.size - before.size


@pytest.mark.parametrize("name,step", [
    ("add_ alpha", lambda x, y, i: x.add_(y, alpha=1e-3 * i)),
    ("mul_ by a number", lambda x, y, i: x.mul_(1.0 - 1e-4 * i)),
    ("addcdiv_ value", lambda x, y, i: x.addcdiv_(y, y.abs() + 1, value=-1e-3 * (i + 1))),
    ("lerp_ weight", lambda x, y, i: x.lerp_(y, 0.1 + 1e-4 * i)),
    ("a number operand", lambda x, y, i: x * (0.5 + i) + (i - 3.5)),
    ("clamp bounds", lambda x, y, i: x.clamp(min=-1.0 - i, max=1.0 + i)),
    ("masked_fill with a nonzero fill", lambda x, y, i: x.masked_fill(y > 0, float(i + 1))),
])
def test_a_changing_number_makes_one_cache_entry(fresh_cache, name, step):
    """1,000 calls whose number changes at every call (a step size, a bias correction, a fill) make one
    decision, with no miss after the first call (each step's ops once)."""
    with gt.simulate(4):
        x, y = lay(torch.randn(8, 6, dtype=torch.float64), S(0)), lay(torch.randn(8, 6, dtype=torch.float64), S(0))
        assert _size_growth(lambda i: step(x, y, i), 1000) == 0


def test_values_still_reach_the_pieces(fresh_cache):
    """The decision is shared; the numbers of each call are its own (float64: exact)."""
    with gt.simulate(4):
        xs = torch.randn(8, 6, dtype=torch.float64)
        x = lay(xs, S(0))
        for a in (0.5, -3.25, 7.0):
            assert torch.equal((x * a + a).full_tensor(), xs * a + a)
            assert torch.equal(x.masked_fill(x > 0, a).full_tensor(), xs.masked_fill(xs > 0, a))


def test_what_can_change_a_decision_stays_in_the_key(fresh_cache):
    with gt.simulate(4):
        x = lay(torch.randn(8, 6, dtype=torch.float64), S(0))
        n = len(dispatch.CACHE)
        x.sum(0)
        x.sum(1)                                            # a dim: a decision of its own
        x + 1.0
        x + 1                                               # an int promotes otherwise than a float
        x.to(torch.float32)
        x.to(torch.float16)                                 # a dtype
        x.reshape(48)
        x.reshape(6, 8)                                     # a size
        assert len(dispatch.CACHE) == n + 8


def test_a_keyed_number_keys_by_what_the_rule_reads(fresh_cache):
    """masked_fill keeps a partial sum only for a zero fill (pointwise.py: ``keyed={"value": is_zero}``):
    zero and nonzero fills offer other candidates and key apart; all the nonzero fills key alike."""
    with gt.simulate(4):
        xs = torch.randn(8, 6, dtype=torch.float64)
        x, mask = lay(xs, P), xs > 0
        fill = aten.masked_fill.Scalar

        def offers_partial(value) -> bool:
            problem = candidates(route(fill, (x, mask, value), {}), fill, (x, mask, value), {}, False)
            return any(c.outputs == ((P,),) for c in problem.candidates)
        assert offers_partial(0.0) and not offers_partial(1.0)
        keys = {v: call_key(fill, (x, mask, v), {}) for v in (0.0, 1.0, -2.5)}
        assert keys[0.0] != keys[1.0] == keys[-2.5]
        for v in (0.0, 1.0, -2.5):      # the partial pieces hold noise that cancels to float64 rounding
            torch.testing.assert_close(x.masked_fill(mask, v).full_tensor(), xs.masked_fill(mask, v))
        assert _size_growth(lambda i: x.masked_fill(mask, float(i + 2)), 50) == 0


def test_the_stored_key_is_the_looked_up_key(fresh_cache):
    """One key function for the look-up and the store: after a call, its key is in the cache, and the
    next call with other numbers is a hit."""
    with gt.simulate(4):
        x, y = lay(torch.randn(8, 6), S(0)), lay(torch.randn(8, 6), B)
        calls = [(aten.add.Tensor, (x, y), {"alpha": 0.5}), (aten.mul.Tensor, (x, 3.0), {}),
                 (aten.sum.dim_IntList, (x, [1]), {}), (aten.masked_fill.Scalar, (x, y > 0, 2.0), {}),
                 (aten._foreach_mul_.Scalar, ([x, y], 0.9), {}), (aten.addcdiv_.default, (x, y, y), {"value": -0.1})]
        for func, args, kwargs in calls:
            func(*args, **kwargs)
            assert call_key(func, args, kwargs) in dispatch.CACHE.recent, func
        before = gt.dispatch_cache_info()
        aten.add.Tensor(x, y, alpha=0.25)
        aten.mul.Tensor(x, -7.0)
        aten._foreach_mul_.Scalar([x, y], 0.8)
        after = gt.dispatch_cache_info()
        assert (after.hits - before.hits, after.misses - before.misses) == (3, 0)


def test_the_cache_is_bounded_least_recently_used_out_first(fresh_cache):
    gt.set_dispatch_cache_size(8)
    with gt.simulate(4):
        kept = lay(torch.randn(4, 3), S(0))
        for n in range(5, 30):
            kept + 1.0                                      # used throughout: never dropped
            lay(torch.randn(n, 3), S(0)) + 1.0               # a new shape: a new decision each
            assert len(dispatch.CACHE) <= 8
        misses = gt.dispatch_cache_info().misses
        kept + 1.0
        assert gt.dispatch_cache_info().misses == misses
        lay(torch.randn(5, 3), S(0)) + 1.0                   # unused for 24 new decisions: dropped
        assert gt.dispatch_cache_info().misses == misses + 1


def test_cache_info_counts_and_clear():
    gt.dispatch_cache_clear()
    assert gt.dispatch_cache_info() == (0, 0, 0, dispatch.CACHE.maxsize)
    with gt.simulate(4):
        x = lay(torch.randn(8, 6), S(0))
        for _ in range(3):
            x.relu()
    info = gt.dispatch_cache_info()
    assert info.misses >= 1 and info.hits >= 2 and info.size >= 1
    gt.dispatch_cache_clear()
    assert gt.dispatch_cache_info() == (0, 0, 0, dispatch.CACHE.maxsize)


def test_bad_cache_size_and_bad_keyed_raise():
    with pytest.raises(ValueError, match="set_dispatch_cache_size.*got 0"):
        gt.set_dispatch_cache_size(0)
    with pytest.raises(TypeError, match="keyed= must map argument names"):
        gt.register_rule(aten.hardshrink.default, ["S(0) -> S(0)"], keyed=["lambd"])


def test_keyed_naming_no_argument_raises_at_registration_naming_the_op():
    from globaltensor.ops.registry import RULES
    before = RULES.get(aten.softshrink.default)
    with pytest.raises(ValueError, match=r"softshrink.default: no argument named \['lamda'\].*'lambd'"):
        gt.register_rule(aten.softshrink, ["S(0) -> S(0)"], keyed={"lamda": None})
    assert RULES.get(aten.softshrink.default) is before          # nothing registered


@pytest.mark.parametrize("declared", [True, False])
def test_attention_keys_dropout_apart(monkeypatch, declared):
    """sdpa's CPU kernel offers no sharded signature with dropout (attention_cost.DROPOUT): the sweep of
    tests/conformance never reaches that op, so the key check runs on it here -- and fails without the
    rule's ``keyed=``."""
    from globaltensor.ops.registry import RULES
    from key_check import value_free_keys_checked
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    if not declared:
        monkeypatch.setitem(RULES, op, RULES[op].__class__(**{**vars(RULES[op]), "keyed": None}))
        monkeypatch.setattr("globaltensor.ops.call_key._SPECS", {})
    with gt.simulate(4):
        q, k, v = (lay(torch.randn(2, 4, 8, 16), S(1), seed=i) for i in range(3))
        with value_free_keys_checked() as findings:
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert bool(findings) != declared, findings
