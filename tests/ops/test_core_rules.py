"""The pointwise, view and matmul rules, candidate by candidate and on random layouts."""
import pytest
import torch

from harness import check_candidates, check_layouts

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
