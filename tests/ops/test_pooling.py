"""Pooling and resampling (ops/rules/pooling.py): every candidate of the forward and backward ops
against one device -- batch and channel splits, fewer channels than ranks (empty pieces),
unbatched inputs --, the functional API on random layouts with gradients, and no fallback."""
import random

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.sbp import split as S
from harness import PLACEMENTS, check_all, check_layouts, make_global, no_fallback, sigs

aten = torch.ops.aten
torch.manual_seed(0)

# batched with an uneven batch, fewer channels than the 4 ranks, unbatched (3-D)
INPUTS_2D = [torch.randn(5, 4, 6, 6), torch.randn(2, 3, 7, 5), torch.randn(3, 6, 7)]
INPUTS_3D = [torch.randn(3, 2, 4, 5, 4), torch.randn(5, 4, 6, 4)]


def _id(t):
    return "x".join(map(str, t.shape))


def _grad_like(t):
    return torch.randn(t.shape)


# -- max pools ---------------------------------------------------------------------------------

@pytest.mark.parametrize("x", INPUTS_2D, ids=_id)
@pytest.mark.parametrize("pool", [([2, 2], [2, 2], [0, 0], [1, 1], False), ([3, 2], [2, 1], [1, 0], [1, 2], True)],
                         ids=["2x2", "padded-dilated-ceil"])
def test_max_pool2d_with_indices(x, pool):
    assert check_all(aten.max_pool2d_with_indices.default, x, *pool) >= x.dim() - 2
    out, idx = aten.max_pool2d_with_indices.default(x, *pool)
    assert check_all(aten.max_pool2d_with_indices_backward.default, _grad_like(out), x, *pool, idx) >= x.dim() - 1


@pytest.mark.parametrize("x", INPUTS_3D, ids=_id)
def test_max_pool3d_with_indices(x):
    pool = ([2, 2, 2], [2, 1, 2], [1, 0, 0], [1, 1, 1], False)
    assert check_all(aten.max_pool3d_with_indices.default, x, *pool) >= x.dim() - 3
    out, idx = aten.max_pool3d_with_indices.default(x, *pool)
    assert check_all(aten.max_pool3d_with_indices_backward.default, _grad_like(out), x, *pool, idx) >= x.dim() - 2


@pytest.mark.parametrize("x", INPUTS_2D, ids=_id)
def test_adaptive_max_pool2d(x):
    assert check_all(aten.adaptive_max_pool2d.default, x, [3, 2]) >= x.dim() - 2
    out, idx = aten.adaptive_max_pool2d.default(x, [3, 2])
    assert check_all(aten.adaptive_max_pool2d_backward.default, _grad_like(out), x, idx) >= x.dim() - 1


@pytest.mark.parametrize("x", INPUTS_3D, ids=_id)
def test_adaptive_max_pool3d(x):
    assert check_all(aten.adaptive_max_pool3d.default, x, [2, 3, 2]) >= x.dim() - 3
    out, idx = aten.adaptive_max_pool3d.default(x, [2, 3, 2])
    assert check_all(aten.adaptive_max_pool3d_backward.default, _grad_like(out), x, idx) >= x.dim() - 2


# -- average pools -----------------------------------------------------------------------------

@pytest.mark.parametrize("x", INPUTS_2D, ids=_id)
@pytest.mark.parametrize("pool", [([2, 2], [2, 2], [0, 0], False, True, None), ([3, 3], [2, 1], [1, 1], True, False, None),
                                  ([2, 3], [1, 2], [1, 0], False, True, 5)],
                         ids=["2x2", "padded-ceil-no-pad-count", "divisor"])
def test_avg_pool2d(x, pool):
    assert check_all(aten.avg_pool2d.default, x, *pool) >= x.dim() - 1
    out = aten.avg_pool2d.default(x, *pool)
    assert check_all(aten.avg_pool2d_backward.default, _grad_like(out), x, *pool) >= x.dim() - 1


@pytest.mark.parametrize("x", INPUTS_3D, ids=_id)
def test_avg_pool3d(x):
    pool = ([2, 2, 2], [2, 1, 2], [1, 0, 1], False, True, None)
    assert check_all(aten.avg_pool3d.default, x, *pool) >= x.dim() - 2
    out = aten.avg_pool3d.default(x, *pool)
    assert check_all(aten.avg_pool3d_backward.default, _grad_like(out), x, *pool) >= x.dim() - 2


@pytest.mark.parametrize("x", INPUTS_2D, ids=_id)
def test_adaptive_avg_pool2d(x):
    assert check_all(aten._adaptive_avg_pool2d.default, x, [4, 3]) >= x.dim() - 1
    out = aten._adaptive_avg_pool2d.default(x, [4, 3])
    assert check_all(aten._adaptive_avg_pool2d_backward.default, _grad_like(out), x) >= x.dim() - 1


@pytest.mark.parametrize("x", INPUTS_3D, ids=_id)
def test_adaptive_avg_pool3d(x):
    assert check_all(aten._adaptive_avg_pool3d.default, x, [2, 3, 2]) >= x.dim() - 2
    out = aten._adaptive_avg_pool3d.default(x, [2, 3, 2])
    assert check_all(aten._adaptive_avg_pool3d_backward.default, _grad_like(out), x) >= x.dim() - 2


def test_pool_candidate_sets():
    x = torch.empty(5, 4, 6, 6)
    assert sigs(aten.max_pool2d_with_indices.default, x, [2, 2]) == {"S(0) -> S(0), S(0)", "S(1) -> S(1), S(1)"}
    assert sigs(aten.avg_pool2d.default, x[0], [2, 2]) == {"S(0) -> S(0)", "P -> P"}
    out, idx = aten.max_pool2d_with_indices.default(torch.randn(5, 4, 6, 6), [2, 2])
    assert sigs(aten.max_pool2d_with_indices_backward.default, out, x, [2, 2], [2, 2], [0, 0], [1, 1], False,
                idx) == {"S(0), S(0), S(0) -> S(0)", "S(1), S(1), S(1) -> S(1)", "P, B, B -> P"}
    assert sigs(aten.max_pool3d_with_indices.default, x, [2, 2, 2]) == {"S(0) -> S(0), S(0)"}
    assert sigs(aten._adaptive_avg_pool2d_backward.default, out, x) == {
        "S(0), S(0) -> S(0)", "S(1), S(1) -> S(1)", "P, B -> P"}


# -- upsampling ----------------------------------------------------------------------------------

UPSAMPLE = [
    (aten.upsample_nearest1d.default, lambda x: ([x.shape[-1] * 2 + 1],), 1),
    (aten.upsample_nearest2d.default, lambda x: ([9, 13],), 2),
    (aten._upsample_nearest_exact2d.default, lambda x: ([9, 13],), 2),
    (aten.upsample_nearest3d.default, lambda x: ([5, 4, 7],), 3),
    (aten.upsample_linear1d.default, lambda x: ([x.shape[-1] * 2 + 1], True), 1),
    (aten.upsample_bilinear2d.default, lambda x: ([9, 13], False), 2),
    (aten.upsample_bilinear2d.default, lambda x: ([4, 3], True, 0.5, 0.5), 2),
    (aten.upsample_bicubic2d.default, lambda x: ([9, 13], False), 2),
    (aten._upsample_bilinear2d_aa.default, lambda x: ([4, 3], False), 2),
    (aten.upsample_trilinear3d.default, lambda x: ([5, 4, 7], True), 3),
]
UPSAMPLE_INPUTS = {1: [torch.randn(5, 3, 6)], 2: [torch.randn(5, 4, 6, 6), torch.randn(2, 3, 7, 5)],
                   3: [torch.randn(3, 2, 4, 5, 4)]}


@pytest.mark.parametrize("op,extra,spatial", UPSAMPLE, ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(UPSAMPLE)])
def test_upsample_and_backward(op, extra, spatial):
    backward = getattr(aten, str(op).split(".")[1] + "_backward").default
    for x in UPSAMPLE_INPUTS[spatial]:
        args = extra(x)
        assert check_all(op, x, *args, max_2d=6) >= x.dim() - spatial + 1
        out = op(x, *args)
        back = (_grad_like(out), args[0], list(x.shape)) + tuple(args[1:])
        assert check_all(backward, *back, max_2d=6) >= x.dim() - spatial + 1


def test_upsample_backward_candidates():
    g = torch.empty(5, 4, 12, 12)
    assert sigs(aten.upsample_nearest2d_backward.default, g, [12, 12], [5, 4, 6, 6]) == {
        "S(0) -> S(0)", "S(1) -> S(1)", "P -> P"}


# -- im2col / col2im -----------------------------------------------------------------------------

def test_im2col_col2im():
    x = torch.randn(5, 3, 6, 5)
    conv = ([2, 3], [1, 1], [1, 0], [2, 1])
    assert sigs(aten.im2col.default, x, *conv) == {"S(0) -> S(0)", "P -> P"}
    assert sigs(aten.im2col.default, x[0], *conv) == {"P -> P"}
    assert check_all(aten.im2col.default, x, *conv) >= 2
    cols = aten.im2col.default(x, *conv)
    assert sigs(aten.col2im.default, cols, [6, 5], *conv) == {"S(0) -> S(0)", "P -> P"}
    assert check_all(aten.col2im.default, cols, [6, 5], *conv) >= 2
    assert check_all(aten.col2im.default, cols[0], [6, 5], *conv) >= 1


# -- the functional API --------------------------------------------------------------------------

FUNCTIONS = {
    "max_pool2d": lambda x: F.max_pool2d(x, 2, ceil_mode=True),
    "max_pool1d": lambda x: F.max_pool1d(x.flatten(2), 3, stride=2, padding=1),
    "max_pool3d": lambda x: F.max_pool3d(x.unsqueeze(2), (1, 2, 2)),
    "avg_pool2d": lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False),
    "avg_pool1d": lambda x: F.avg_pool1d(x.flatten(2), 4),
    "adaptive_avg": lambda x: F.adaptive_avg_pool2d(x, (2, 3)),
    "adaptive_avg_1": lambda x: F.adaptive_avg_pool2d(x, 1),
    "adaptive_max": lambda x: F.adaptive_max_pool2d(x, 3),
    "nearest": lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
    "bilinear": lambda x: F.interpolate(x, size=(9, 4), mode="bilinear", align_corners=False),
    "bicubic": lambda x: F.interpolate(x, scale_factor=1.5, mode="bicubic", align_corners=True),
    "unfold_fold": lambda x: F.fold(F.unfold(x, 2, padding=1), (6, 5), 2, padding=1),
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_functional_random_layouts_with_grad(name):
    check_layouts(FUNCTIONS[name], torch.randn(5, 3, 6, 5), grad=True, trials=4)


def test_pooling_net_with_split_batch_or_channels_moves_nothing_and_falls_back_nowhere():
    x0 = torch.randn(6, 3, 8, 8)

    def net(x):
        y = F.max_pool2d(F.relu(x * 2.0 - 0.5), 2)
        y = F.interpolate(F.avg_pool2d(y, 2), scale_factor=2, mode="bilinear")
        return F.adaptive_avg_pool2d(y, (1, 2))

    want_x = x0.clone().requires_grad_(True)
    want = net(want_x)
    want.sum().backward()
    with gt.simulate(4):
        for nd, name in (((S(0),), "1d"), ((S(1),), "1d"), ((S(0), S(1)), "2x2")):
            x = make_global(x0, PLACEMENTS[name](), nd, random.Random(0), requires_grad=True)
            with no_fallback(), gt.comm_stats() as st:
                out = net(x)
                out.sum().backward()
            assert out.sbp == nd and x.grad.sbp == nd
            assert "all_gather" not in " ".join(st.ops()), st.ops()
            torch.testing.assert_close(out.full_tensor(), want)
            torch.testing.assert_close(x.grad.full_tensor(), want_x.grad)


def test_fewer_channels_than_ranks_makes_empty_pieces():
    """3 channels over 4 ranks: the last rank's pieces are empty, which the CPU kernels refuse."""
    x0 = torch.randn(2, 3, 6, 6)
    with gt.simulate(4):
        x = make_global(x0, PLACEMENTS["1d"](), (S(1),), random.Random(0))
        assert x.to_local(rank=3).shape == (2, 0, 6, 6)
        with no_fallback(), gt.comm_stats() as st:
            out = F.max_pool2d(x, 2)
            up = F.interpolate(x, scale_factor=2)
        assert st.bytes_sent == 0 and out.sbp == up.sbp == (S(1),)
        torch.testing.assert_close(out.full_tensor(), F.max_pool2d(x0, 2))
        torch.testing.assert_close(up.full_tensor(), F.interpolate(x0, scale_factor=2))
