"""The pointwise, view, matmul and cdist rules, candidate by candidate and on random layouts."""
import random

import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import split as S
from harness import PLACEMENTS, check_all, check_candidates, check_layouts, make_global, no_fallback, sigs

aten = torch.ops.aten
torch.manual_seed(0)


@pytest.mark.parametrize("shape_a,shape_b", [((8, 6), (8, 6)), ((7, 5), (5,)), ((3, 1, 5), (4, 5)), ((6,), ())])
def test_add_mul_broadcasting(shape_a, shape_b):
    a, b = torch.randn(shape_a), torch.randn(shape_b)
    assert check_candidates(aten.add.Tensor, a, b) > 0
    assert check_candidates(aten.mul.Tensor, a, b) > 0


@pytest.mark.parametrize("m,k,n", [(8, 6, 4), (7, 5, 3), (3, 2, 5)])
def test_mm(m, k, n):
    assert check_candidates(aten.mm.default, torch.randn(m, k), torch.randn(k, n)) >= 6


def test_view_merge_and_split_dims():
    check_candidates(aten.view.default, torch.randn(4, 6, 5), [24, 5])
    check_candidates(aten.view.default, torch.randn(3, 6, 5), [3, 2, 3, 5])


def test_mlp_forward_backward_random_layouts():
    def mlp(x, w1, w2):
        return torch.relu(x @ w1) @ w2
    check_layouts(mlp, torch.randn(8, 6), torch.randn(6, 10), torch.randn(10, 3), grad=True)


# -- pairwise distances ---------------------------------------------------------------------------

CDIST_CASES = [((7, 3), (5, 3), 2.0), ((2, 6, 4), (2, 30, 4), 2.0), ((3, 5, 2), (3, 4, 2), 1.0),
               ((2, 1, 5, 3), (1, 3, 6, 3), 2.0), ((6, 3), (3, 3), float("inf"))]


@pytest.mark.parametrize("s1,s2,p", CDIST_CASES)
def test_cdist_forward_and_backward(s1, s2, p):
    x1, x2 = torch.randn(s1), torch.randn(s2)
    got = sigs(aten._cdist_forward.default, x1, x2, p, None)
    n = len(torch.broadcast_shapes(s1[:-2], s2[:-2])) + 2
    batch = {f"S({d}), S({d}) -> S({d})" for d in range(len(s1) - 2)} if s1[:-2] == s2[:-2] else set()
    assert got == batch | {f"S({len(s1) - 2}), B -> S({n - 2})", f"B, S({len(s2) - 2}) -> S({n - 1})"}
    assert check_all(aten._cdist_forward.default, x1, x2, p, None, max_2d=6) >= len(got)
    dist = aten._cdist_forward.default(x1, x2, p, None)
    if s1[:-2] == s2[:-2]:
        assert check_all(aten._cdist_backward.default, torch.randn(dist.shape), x1, x2, p, dist, max_2d=6) >= len(got) + 1
    if max(s1[-2], s2[-2]) <= 25:   # more rows: torch.cdist takes _euclidean_dist (test_euclidean_dist)
        check_layouts(lambda a, b: torch.cdist(a, b, p), x1, x2, grad=True, trials=3)


def test_euclidean_dist():
    """torch.cdist's path for p = 2 with more than 25 rows."""
    x1, x2 = torch.randn(6, 4), torch.randn(30, 4)
    assert sigs(aten._euclidean_dist.default, x1, x2) == {"S(0), B -> S(0)", "B, S(0) -> S(1)"}
    assert check_all(aten._euclidean_dist.default, x1, x2, max_2d=6, rtol=1e-3, atol=1e-4) >= 2
    assert check_all(aten._euclidean_dist.default, torch.randn(3, 5, 2), torch.randn(3, 27, 2), max_2d=6,
                     rtol=1e-3, atol=1e-4) >= 3
    with gt.simulate(4):
        b = make_global(x2, PLACEMENTS["1d"](), (S(0),), random.Random(0))
        with no_fallback(), gt.comm_stats() as st:
            got = torch.cdist(x1, b)
        assert got.sbp == (S(1),) and st.bytes_sent == 0
        torch.testing.assert_close(got.full_tensor(), torch.cdist(x1, x2), rtol=1e-3, atol=1e-4)
