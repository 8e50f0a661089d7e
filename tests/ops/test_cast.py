"""Casts (ops/rules/cast.py) and scalar reads (ops/scalar_read.py): ``x.to(device=, dtype=)`` and
``softmax(dtype=)`` under a rule, partial sums through widening casts only, and ``bool / int /
float(x)`` as collective reads -- none of them through the fallback."""

import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import broadcast as B, partial_sum as P, split as S
from harness import lay, no_fallback, sigs

X = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))




@pytest.mark.parametrize("kwargs", [dict(device="cpu"), dict(dtype=torch.float32, device=torch.device("cpu")),
                                    dict(dtype=torch.float16, memory_format=torch.contiguous_format), dict(dtype=torch.int64)])
def test_to_with_device_and_dtype_keeps_the_split(world4, kwargs):
    with no_fallback():
        for placement, sbp in (("1d", S(0)), ("2x2", (S(1), S(0)))):
            y = lay(X * 4, sbp, placement).to(**kwargs)
            assert y.sbp == (sbp if isinstance(sbp, tuple) else (sbp,))
            want = (X * 4).to(**kwargs)
            assert y.dtype == want.dtype
            assert torch.equal(y.full_tensor(), want)


def test_to_copy_with_layout(world4):
    with no_fallback():
        y = torch.ops.aten._to_copy(lay(X, S(1)), dtype=torch.float32, layout=torch.strided, device="cpu")
    assert y.sbp == (S(1),) and torch.equal(y.full_tensor(), X.float())


def test_softmax_and_log_softmax_with_dtype(world4):
    with no_fallback():
        x = lay(X.float(), S(0))
        for fn in (torch.softmax, torch.log_softmax):
            y = fn(x, -1, dtype=torch.float64)
            assert y.sbp == (S(0),) and y.dtype == torch.float64
            assert torch.equal(y.full_tensor(), fn(X.float(), -1, dtype=torch.float64))


def test_to_another_device_type_names_the_placement(world4):
    x = lay(X, S(0))
    with pytest.raises(ValueError, match="device"):
        x.to(device="meta")


def test_a_widening_cast_keeps_the_partial_sum_without_communication(world4):
    x = lay(X.float(), P, seed=3)
    with gt.comm_stats() as st:
        y = x.to(torch.float64)
    assert y.sbp == (P,) and st.count == 0
    torch.testing.assert_close(y.full_tensor(), X.float().double(), rtol=1e-6, atol=1e-6)  # float32 pieces' sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_a_narrowing_cast_sums_the_partial_pieces_first(world4, dtype):
    """(S(0), P) float64 -> float32: the pieces (value + large noise, minus the noise) would each
    round to float32 before the sum and lose the value's low digits; summed first, the result is
    exactly one device's cast of the sum."""
    big = X * 1e6
    with no_fallback():
        x = lay(big, (S(0), P), "2x2", seed=5)
        y = x.to(dtype)
    assert not any(v.is_partial for v in y.sbp)
    assert torch.equal(y.full_tensor(), x.full_tensor().to(dtype))
    assert torch.equal(x.full_tensor(), big)          # the pieces sum to the value exactly (float64)


def test_a_narrowing_copy_sums_the_partial_pieces_first(world4):
    x = lay(X * 1e6, P, seed=6)
    with no_fallback():
        y = torch.ops.aten.copy(lay(torch.zeros(8, 6), B), x)
    assert not any(v.is_partial for v in y.sbp)
    assert torch.equal(y.full_tensor(), (X * 1e6).float())
    assert "P, P -> P" not in sigs(torch.ops.aten.copy.default, torch.zeros(8, 6), X)
    assert "P, P -> P" in sigs(torch.ops.aten.copy.default, torch.zeros(8, 6, dtype=torch.float64), X.float())


@pytest.mark.parametrize("sbp", [P, S(0), B])
def test_bool_int_float_read_the_logical_value(world4, sbp):
    with no_fallback():
        one = lay(torch.tensor([2.75], dtype=torch.float64), sbp if sbp != S(0) else B)
        assert float(one) == 2.75 and int(one) == 2 and bool(one) is True
        x = lay(X, sbp)
        assert bool((x > 10).any()) is False
        assert float(x.sum()) == pytest.approx(float(X.sum()), rel=1e-12)
        assert int((x > 0).sum()) == int((X > 0).sum())


def test_a_scalar_read_is_one_collective_on_every_rank(world4):
    x = lay(X, S(0)).sum()          # partial
    with gt.comm_stats() as st:
        v = float(x)
    assert st.ops() == ["all_reduce"]
    assert v == pytest.approx(float(X.sum()), rel=1e-12)
