"""Rules found missing by the OpInfo conformance suite: FFTs (ops/rules/fft.py), batched linear
algebra (linalg.py), roll, searchsorted, index_reduce, replication padding's backward -- each
candidate forced in turn against one device -- and the ops that raised: resize_as_,
index_select of a 0-dim input."""
import random

import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import broadcast as B, split as S
from harness import PLACEMENTS, check_all, check_layouts, make_global, no_fallback

aten = torch.ops.aten
torch.manual_seed(0)

X = torch.randn(5, 6, 4, dtype=torch.float64)
Z = torch.randn(5, 6, 4, dtype=torch.complex128)


@pytest.mark.parametrize("op, x, args", [
    (aten._fft_c2c.default, Z, ([1, 2], 0, True)),
    (aten._fft_r2c.default, X, ([2], 0, True)),
    (aten._fft_c2r.default, Z, ([0, 2], 2, 6)),
])
def test_fft_keeps_splits_off_the_transformed_dims_and_partial_sums(op, x, args):
    with no_fallback():
        assert check_all(op, x, *args) >= x.dim() - len(args[0]) + 1


def _spd(*batch, n=3):
    a = torch.randn(*batch, n, n, dtype=torch.float64)
    return a @ a.transpose(-1, -2) + n * torch.eye(n, dtype=torch.float64)


@pytest.mark.parametrize("fn", [
    lambda a: torch.linalg.inv(a), lambda a: torch.linalg.cholesky(a), lambda a: torch.linalg.slogdet(a),
    lambda a: torch.linalg.eigvalsh(a), lambda a: torch.linalg.qr(a), lambda a: torch.linalg.svdvals(a),
    lambda a: torch.linalg.lu_factor(a), lambda a: torch.linalg.det(a), lambda a: torch.cholesky_inverse(a),
    lambda a: torch.linalg.solve_triangular(torch.linalg.cholesky(a), a, upper=False),
    lambda a: torch.linalg.solve(a, a[..., 0]), lambda a: torch.linalg.solve(a, a.transpose(-1, -2)),
])
def test_batched_linear_algebra_keeps_batch_splits(fn):
    a = _spd(5, 2)
    with no_fallback():
        check_layouts(fn, a, trials=3, partial=False)
    with gt.simulate(4):
        got = fn(make_global(a, PLACEMENTS["1d"](), (S(0),), random.Random(0)))
        outs = [o for o in (got if isinstance(got, tuple) else (got,)) if o.dim() > 0]
        assert all(o.sbp == (S(0),) for o in outs), [o.sbp for o in outs]


def test_linalg_gradient_through_a_batch_split():
    check_layouts(lambda a: torch.linalg.inv(a), _spd(4), trials=2, grad=True, partial=False)


def test_roll_searchsorted_index_reduce():
    seq = torch.sort(torch.randn(6, dtype=torch.float64)).values
    idx = torch.tensor([0, 2, 0, 4])
    src = torch.randn(5, 4, 3, dtype=torch.float64)
    with no_fallback():
        assert check_all(aten.roll.default, X, [2, -1], [0, 2]) >= 2
        assert check_all(aten.searchsorted.Tensor, seq, X) >= 3
        assert check_all(aten.searchsorted.Tensor, torch.sort(X, -1).values, X[..., :2].contiguous()) >= 2
        assert check_all(aten.index_reduce.default, torch.randn(5, 6, 3, dtype=torch.float64), 1, idx, src, "amax") >= 2


def test_resize_as_keeps_the_elements_of_a_global_tensor(world4):
    x = torch.randn(4, 6)
    p = gt.placement("cpu", [0, 1, 2, 3])
    g = gt.distribute(x, p, S(1))
    same = gt.distribute(torch.randn(4, 6), p, S(0))
    assert g.resize_as_(same) is g and torch.equal(g.full_tensor(), x)
    g.resize_as_(gt.distribute(torch.randn(6, 4), p, B))
    assert g.shape == (6, 4) and torch.equal(g.full_tensor(), x.reshape(6, 4))
    with pytest.raises(NotImplementedError, match=r"resize_.*cannot be resized to \(30,\)"):
        g.resize_(30)


def test_index_select_of_a_0_dim_input_with_a_split_index(world4):
    x, idx = torch.tensor(3.5), torch.tensor([0])
    p = gt.placement("cpu", [0, 1, 2, 3])
    got = torch.index_select(gt.distribute(x, p, B), 0, gt.distribute(idx, p, S(0)))
    assert torch.equal(got.full_tensor(), torch.index_select(x, 0, idx))


def test_replication_pad_backward_keeps_leading_splits():
    x = torch.randn(4, 3, 5, 6, dtype=torch.float64)
    with no_fallback():
        check_layouts(lambda t: torch.nn.functional.pad(t, (1, 2, 2, 1), mode="replicate"), x, trials=3, grad=True)
