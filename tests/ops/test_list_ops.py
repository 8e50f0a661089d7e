"""List ops on global tensors (ops/decide/lists.py, ops/executor/lists.py): ``_foreach_*`` as one local call per group of elements,
each element laid out by its per-tensor op's signature, written elements kept in their layouts.

Values are float64 and exact: a foreach op is elementwise, so each piece's result is the whole
tensor's at the same positions (the kernel's arithmetic per element does not depend on where a
piece starts)."""
from __future__ import annotations

import torch

import globaltensor as gt
from globaltensor.tensor import GlobalTensor
from local_calls import LocalCalls

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
EXACT = dict(rtol=0, atol=0)


def _tensors(seed: int, shapes, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, dtype=dtype, generator=g) for s in shapes]


SHAPES = [(10, 6), (7,), (4, 3, 5), (6, 10), ()]


def _lay_out(values, placement, sbps):
    return [gt.distribute(v, placement, sbp) for v, sbp in zip(values, sbps)]


def test_foreach_is_one_local_call_per_group(p1):
    xs, ys = _tensors(0, SHAPES), _tensors(1, SHAPES)
    sbps = [S(0), S(0), S(1), B, B]
    gx, gy = _lay_out(xs, p1, sbps), _lay_out(ys, p1, sbps)
    with LocalCalls() as seen:
        torch._foreach_add_(gx, gy, alpha=0.5)
    assert seen.count("_foreach_add_") == 1          # one placement, one device, one dtype: one call
    torch._foreach_add_(xs, ys, alpha=0.5)
    for g, x, sbp in zip(gx, xs, sbps):
        assert g.sbp == (sbp,)
        torch.testing.assert_close(g.full_tensor(), x, **EXACT)


def test_groups_follow_placement_and_dtype(world4):
    p1 = gt.placement("cpu", [0, 1, 2, 3])
    pair = gt.placement("cpu", [0, 1])
    values = _tensors(2, [(8, 3), (5,), (4, 4), (6,)])
    gx = [gt.distribute(values[0], p1, S(0)), gt.distribute(values[1].float(), p1, S(0)),
          gt.distribute(values[2], pair, S(1)), gt.distribute(values[3], p1, B)]
    want = [v.float() if i == 1 else v for i, v in enumerate(values)]
    with LocalCalls() as seen:
        out = torch._foreach_mul(gx, 3.0)
    assert seen.count("_foreach_mul") == 3           # (p1, float64), (p1, float32), (pair, float64)
    for o, g, w in zip(out, gx, want):
        assert isinstance(o, GlobalTensor) and o.sbp == g.sbp and o.placement == g.placement
        torch.testing.assert_close(o.full_tensor(), w * 3.0, **EXACT)


def test_scalar_lists_follow_their_elements(p1):
    xs = _tensors(3, SHAPES)
    gx = _lay_out(xs, p1, [S(0), B, S(2), S(1), B])
    scalars = [0.5, -2.0, 3.0, 0.25, 7.0]
    torch._foreach_mul_(gx, scalars)
    torch._foreach_mul_(xs, scalars)
    for g, x in zip(gx, xs):
        torch.testing.assert_close(g.full_tensor(), x, **EXACT)


def test_an_element_in_another_layout_is_boxed_first(p1):
    """``add_(S(0), B)`` reads the broadcast element's slice; a partial ``self`` keeps its layout."""
    xs, ys = _tensors(4, [(8, 4), (8, 4)]), _tensors(5, [(8, 4), (8, 4)])
    gx = [gt.distribute(xs[0], p1, S(0)), gt.distribute(xs[1], p1, B).to_global(sbp=P) * 1.0]
    gy = [gt.distribute(ys[0], p1, B), gt.distribute(ys[1], p1, S(1))]
    torch._foreach_add_(gx, gy)
    assert [g.sbp for g in gx] == [(S(0),), (P,)]
    for g, x, y in zip(gx, xs, ys):
        torch.testing.assert_close(g.full_tensor(), x + y, **EXACT)


def test_written_element_boxed_for_the_op_is_written_back(p1):
    """``_foreach_sqrt_`` on a partial element: the square root of the sum, not of the pieces; the
    element is reduced for the op and its result boxed back into its partial layout."""
    x = torch.rand(6, 3, dtype=torch.float64) + 0.5
    g = gt.distribute(x, p1, B).to_global(sbp=P) * 1.0
    torch._foreach_sqrt_([g])
    assert g.sbp == (P,)
    torch.testing.assert_close(g.full_tensor(), x.sqrt(), **EXACT)


def test_written_copy_view_reaches_its_base(p1):
    """A slice along the split dim is a boxed copy (copy_views.py); a foreach write into it lands in its base."""
    x = torch.randn(8, 4, dtype=torch.float64)
    g = gt.distribute(x.clone(), p1, S(0))
    view = g[1:6]
    torch._foreach_mul_([view], 10.0)
    x[1:6] *= 10.0
    torch.testing.assert_close(g.full_tensor(), x, **EXACT)


def test_an_element_without_a_plain_signature_runs_on_its_own(p1):
    """``_foreach_norm``: each norm of a split tensor needs its reduction's kernel, so those elements
    run one by one through the dispatcher; the result still equals one device."""
    xs = _tensors(6, [(8, 3), (5,)])
    gx = _lay_out(xs, p1, [S(0), B])
    out = torch._foreach_norm(gx)
    want = torch._foreach_norm(xs)
    for o, w in zip(out, want):
        torch.testing.assert_close(o.full_tensor(), w, rtol=1e-15, atol=0)


def test_a_foreach_op_without_a_per_tensor_op_takes_the_fallback(p1):
    """``_foreach_maximum_`` (Adam's amsgrad and Adamax under ``foreach=True``): there is no ``maximum_``
    to run each element through, so the call takes the gather fallback -- equal to one device, every
    written element in its own layout."""
    xs, ys = _tensors(9, SHAPES), _tensors(10, SHAPES)
    sbps = [S(0), S(0), S(1), B, B]
    gx, gy = _lay_out(xs, p1, sbps), _lay_out(ys, p1, sbps)
    torch._foreach_maximum_(gx, gy)
    torch._foreach_maximum_(xs, ys)
    for g, x, sbp in zip(gx, xs, sbps):
        assert g.sbp == (sbp,)
        torch.testing.assert_close(g.full_tensor(), x, **EXACT)


def test_repeated_calls_with_new_numbers_reuse_one_decision(p1):
    from globaltensor.ops import dispatch
    gx = _lay_out(_tensors(7, SHAPES), p1, [S(0)] * 4 + [B])
    torch._foreach_mul_(gx, [1.0] * 5)
    before = len(dispatch.CACHE)
    for step in range(5):
        torch._foreach_mul_(gx, [1.0 + step / 8] * 5)      # bias corrections change every step
        torch._foreach_add_(gx, 0.125 * step)
    assert len(dispatch.CACHE) == before + 1            # the add's decision; the mul's was there


def test_torch_optim_defaults_for_global_parameters_as_for_plain_ones(p1):
    """torch picks foreach by default only for tensor types it lists and devices with foreach
    kernels (CUDA; on CPU its default is the for-loop, for plain tensors too)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.utils._foreach_utils import _has_foreach_support
    plain = torch.randn(8, 4)
    w = gt.distribute(plain, p1, S(0))
    for fused in (False, True):
        assert _default_to_fused_or_foreach([w], False, fused) == _default_to_fused_or_foreach([plain], False, fused)
    assert _has_foreach_support([w], plain.device) == _has_foreach_support([plain], plain.device)
    from torch.optim.optimizer import _foreach_supported_types
    assert GlobalTensor in _foreach_supported_types


def test_an_optimizer_step_is_one_call_per_foreach_op(p1):
    params = [gt.distribute(t, p1, sbp).requires_grad_() for t, sbp in zip(_tensors(8, SHAPES), [S(0), S(0), S(2), S(1), B])]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=0.1, foreach=True)
    with LocalCalls() as seen:
        opt.step()
    assert seen.count("_foreach_lerp_") == 1 and seen.count("_foreach_addcdiv_") == 1

