"""Gradient sinks (ops/gradient_sinks.py): a forward op that makes an input's gradient partial marks
where that gradient is summed; in the backward, a contribution flowing there may stay partial, and
one reduction serves the sum. First the marks and the sinks on plain autograd graphs, then on global
tensors against one device (float64: the same sums in another order, 1e-12)."""
import random

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import globaltensor as gt
from globaltensor.ops.gradient_sinks import current_sinks, mark, merge_node, sunk_outputs
from globaltensor.sbp import broadcast as B, partial_sum as P, split as S
from harness import make_global

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


class _SinksDuring(TorchDispatchMode):
    """Records ``current_sinks()`` at each ``mm`` the backward runs."""
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.seen.append(current_sinks())
        return func(*args, **(kwargs or {}))


def test_a_mark_lands_past_the_views_where_the_contributions_meet():
    leaf = torch.randn(2, 3, 4, requires_grad=True)
    x = leaf * 2
    x2d = x.view(6, 4).t().t()
    assert merge_node(x2d.grad_fn) is x.grad_fn
    mark(x2d, "placement", (0,))
    assert x.grad_fn.metadata["globaltensor.partial_gradient"] == {"placement": frozenset({0})}


def test_the_backward_node_of_a_contribution_sees_its_marked_edge_and_its_gradient_shape():
    leaf = torch.randn(2, 3, 4, requires_grad=True)
    x = leaf * 2
    w = torch.randn(5, 4, requires_grad=True)
    y = torch.nn.functional.linear(x, w)          # x viewed to [6, 4], mm with w.t()
    mark(x.view(6, 4), "placement", (1,))         # another projection's view of x, as the forward marks it
    with _SinksDuring() as mode:
        y.sum().backward()
    assert ((6, 4), "placement", (1,)) in [s for sinks in mode.seen if sinks for s in sinks]
    assert sunk_outputs(next(s for s in mode.seen if s), [((6, 4), F64), ((4, 5), F64)], "placement") == {(0, 1)}


def test_an_edge_whose_shape_an_unmarked_edge_shares_is_no_sink():
    """``x @ w`` with both ``[4, 4]``: an output of that shape may be either gradient."""
    x = torch.randn(4, 4, requires_grad=True) * 1
    w = torch.randn(4, 4, requires_grad=True)
    y = x @ w
    mark(x, "placement", (0,))
    with _SinksDuring() as mode:
        y.sum().backward()
    assert not any(mode.seen)


class _SinksAtMul(_SinksDuring):
    """Records ``current_sinks()`` at each ``mul`` the backward runs."""
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mul.Tensor:
            self.seen.append(current_sinks())
        return func(*args, **(kwargs or {}))


def _rotated_projection(rows: int, width: int):
    """RoPE's shape of graph: ``x`` (marked) through a projection ``w`` (a leaf), its output's halves
    swapped and one negated (``cat``, slices, ``neg``), times a constant; the sinks the ``mul``'s
    backward sees."""
    x = torch.randn(rows, 4, requires_grad=True) * 1
    w = torch.randn(4, width, requires_grad=True)
    mark(x, "placement", (0,))
    y = x @ w
    half = width // 2
    z = torch.cat([-y[:, half:], y[:, :half]], 1) * torch.randn(rows, width)
    with _SinksAtMul() as mode:
        z.sum().backward()
    return [s for sinks in mode.seen if sinks for s in sinks]


def test_a_sink_reaches_through_moved_elements_and_a_product_whose_weight_is_no_larger():
    """The gradient entering the ``cat`` reaches ``x`` (marked) through the product; the product's
    weight gradient (4 x 2 = 8 elements against the 16 x 2 coming in) is reduced at its size."""
    assert ((16, 2), "placement", (0,)) in _rotated_projection(rows=16, width=2)


def test_no_sink_through_a_product_whose_weight_is_larger_than_the_gradient():
    """2 rows through a 4 x 8 weight: its gradient (32 elements) would cost more than the 16 coming in."""
    assert _rotated_projection(rows=2, width=8) == []


def _projections(p, with_column_parallel: bool):
    """A layer input ``x`` (broadcast) through a broadcast projection ``wk`` whose output's gradient
    comes partial (as sdpa's gives GQA's k), and with a column-parallel one ``wq`` beside it."""
    torch.manual_seed(0)
    x0, wq, wk = torch.randn(16, 8, dtype=F64), torch.randn(8, 8, dtype=F64), torch.randn(8, 4, dtype=F64)
    gq_out, gk_out = torch.randn(16, 8, dtype=F64), torch.randn(16, 4, dtype=F64)
    leaf, gleaf = x0.clone().requires_grad_(), gt.distribute(x0, p, B).requires_grad_()
    outs, grads = [(leaf * 1) @ wk], [gk_out]
    x = gleaf * 1
    gouts, ggrads = [x @ gt.distribute(wk, p, B)], [make_global(gk_out, p, (P,), random.Random(1))]
    if with_column_parallel:
        outs.append((leaf * 1) @ wq)
        grads.append(gq_out)
        gouts.append(x @ gt.distribute(wq, p, S(1)))
        ggrads.append(gt.distribute(gq_out, p, S(1)))
    torch.autograd.backward(outs, grads)
    return leaf, gleaf, gouts, ggrads


def test_a_broadcast_projections_input_gradient_joins_the_column_parallel_ones_partial_sum(p1):
    leaf, gleaf, outs, grads = _projections(p1, with_column_parallel=True)
    with gt.comm_stats() as st:
        torch.autograd.backward(outs, grads)
    assert st.count == 0, st.ops()               # both contributions partial, summed, reduced when read
    torch.testing.assert_close(gleaf.grad.full_tensor(), leaf.grad, **TOL)


def test_without_a_partial_partner_the_contribution_is_reduced_where_it_is_smallest(p1):
    """The same projection alone: no sink, so its ``[16, 4]`` gradient is reduced before the
    ``[16, 8]`` product (2 (W - 1) / W of 512 bytes), not after."""
    leaf, gleaf, outs, grads = _projections(p1, with_column_parallel=False)
    with gt.comm_stats() as st:
        torch.autograd.backward(outs, grads)
    assert [(r.op, r.bytes) for r in st.records] == [("all_reduce", 768)]
    torch.testing.assert_close(gleaf.grad.full_tensor(), leaf.grad, **TOL)
