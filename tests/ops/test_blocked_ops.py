"""Ops on blocked splits, against one device (float64, exact up to the reduction order of the
same sums: 1e-12 relative): a view merging a split dim that does not lead its group gives a
blocked split, kept by index-preserving ops (pointwise, matrix products, dim permutations) and
by the view that unmerges it; ``cat`` of equal split tensors is blocked, ``split`` into the
blocks is plain. Ops that are not index-preserving box a blocked input first."""
import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import broadcast as B, split as S
from harness import check_candidates

TOL = dict(rtol=1e-12, atol=1e-12)


def _pair(p, sbp, *shape):
    x = torch.randn(*shape, dtype=torch.float64)
    return x.clone().requires_grad_(), gt.distribute(x, p, sbp).requires_grad_()


@pytest.mark.parametrize("kind", ["1d", "2x2"])
def test_four_d_matmul_keeps_the_heads_split_forward_and_backward(world4, kind):
    """Eager attention's ``q @ k.transpose(2, 3)`` and ``attn @ v`` on heads split: matmul merges
    (batch, heads) into bmm's batch dim -- a blocked split -- and views the result back."""
    p = gt.placement("cpu", [0, 1, 2, 3] if kind == "1d" else [[0, 1], [2, 3]])
    heads = S(1) if kind == "1d" else (S(0), S(1))
    (q, gq), (k, gk), (v, gv) = (_pair(p, heads, 4, 4, 6, 3) for _ in range(3))
    with gt.comm_stats() as stats:
        out = torch.matmul(torch.matmul(gq, gk.transpose(2, 3)).softmax(-1), gv)
        out.backward(gt.distribute(torch.ones(4, 4, 6, 3, dtype=torch.float64), p, heads))
    assert stats.count == 0 and out.sbp == (heads if kind == "2x2" else (heads,))
    ref = torch.matmul(torch.matmul(q, k.transpose(2, 3)).softmax(-1), v)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(out.full_tensor(), ref, **TOL)
    for g, t in ((gq, q), (gk, k), (gv, v)):
        assert g.grad.sbp == g.sbp
        torch.testing.assert_close(g.grad.full_tensor(), t.grad, **TOL)


def test_fused_qkv_column_parallel_hands_out_q_k_v_split_with_no_communication(p1):
    """GPT-2's ``c_attn``: ``addmm`` with weight S(1, blocks=3) and bias S(0, blocks=3) gives
    ``[q | k | v]`` blocked, and ``split`` into the three is plain S(1) each."""
    x = torch.randn(6, 4, dtype=torch.float64)
    (w, gw), (b, gb) = _pair(p1, S(1, blocks=3), 4, 12), _pair(p1, S(0, blocks=3), 12)
    gx = gt.distribute(x, p1, B)
    with gt.comm_stats() as stats:
        q, k, v = torch.addmm(gb, gx, gw).split(4, dim=1)
        assert (q.sbp, k.sbp, v.sbp) == ((S(1),),) * 3
        (q * k + v.sin()).sum(dim=1).backward(gt.distribute(torch.ones(6, dtype=torch.float64), p1, B))
    assert stats.count == 0
    rq, rk, rv = torch.addmm(b, x, w).split(4, dim=1)
    (rq * rk + rv.sin()).sum(dim=1).backward(torch.ones(6, dtype=torch.float64))
    assert gw.grad.sbp == (S(1, blocks=3),) and gb.grad.sbp == (S(0, blocks=3),)
    torch.testing.assert_close(gw.grad.full_tensor(), w.grad, **TOL)
    torch.testing.assert_close(gb.grad.full_tensor(), b.grad, **TOL)


def test_cat_of_equal_splits_is_blocked_and_views_merge_and_unmerge(p1):
    parts = [torch.randn(3, 8, dtype=torch.float64) for _ in range(3)]
    fused = torch.cat([gt.distribute(t, p1, S(1)) for t in parts], dim=1)
    assert fused.sbp == (S(1, blocks=3),)
    torch.testing.assert_close(fused.full_tensor(), torch.cat(parts, dim=1), **TOL)
    x = torch.randn(2, 4, 5, dtype=torch.float64)
    g = gt.distribute(x, p1, S(1))
    merged = g.reshape(8, 5)
    assert merged.sbp == (S(0, blocks=2),)
    back = (merged * 2 + 1).view(2, 4, 5)
    assert back.sbp == (S(1),)
    torch.testing.assert_close(back.full_tensor(), x * 2 + 1, **TOL)


def test_ops_that_move_indices_box_a_blocked_input_first(p1):
    """cumsum along the blocked dim and a slice across blocks: the blocks are boxed to a plain
    layout, and the values are one device's."""
    x = torch.randn(4, 12, dtype=torch.float64)
    g = gt.distribute(x, p1, S(1, blocks=3))
    torch.testing.assert_close(g.cumsum(1).full_tensor(), x.cumsum(1), **TOL)
    torch.testing.assert_close(g[:, 2:9].full_tensor(), x[:, 2:9], **TOL)
    torch.testing.assert_close(g.flip(1).full_tensor(), x.flip(1), **TOL)
    torch.testing.assert_close((g @ gt.distribute(x.T.contiguous(), p1, B)).full_tensor(), x @ x.T, **TOL)


def test_an_optimizer_updates_blocked_parameters_in_place(p1):
    w = torch.randn(4, 12, dtype=torch.float64)
    ref = torch.nn.Parameter(w.clone())
    gw = torch.nn.Parameter(gt.distribute(w, p1, S(1, blocks=3)))
    for param in (ref, gw):
        opt = torch.optim.AdamW([param], lr=0.1)
        (param.sin() * param).sum().backward()
        opt.step()
    assert gw.sbp == (S(1, blocks=3),)
    torch.testing.assert_close(gw.full_tensor(), ref.detach(), **TOL)


def _t(*shape):
    return torch.randn(*shape, dtype=torch.float64)


aten = torch.ops.aten
BLOCKED_RULE_CASES = [
    (aten.add.Tensor, (_t(4, 12), _t(4, 12)), {}),
    (aten.mul.Tensor, (_t(4, 12), _t(12)), {}),
    (aten.relu.default, (_t(4, 12),), {}),
    (aten.mm.default, (_t(12, 6), _t(6, 12)), {}),
    (aten.addmm.default, (_t(12), _t(4, 6), _t(6, 12)), {}),
    (aten.bmm.default, (_t(12, 3, 4), _t(12, 4, 12)), {}),
    (aten.baddbmm.default, (_t(12, 3, 12), _t(12, 3, 4), _t(12, 4, 12)), {}),
    (aten.sum.dim_IntList, (_t(12, 12), [1]), {}),
    (aten.mean.dim, (_t(12, 12), [0]), {}),
    (aten.amax.default, (_t(12, 12), [1]), {}),
    (aten.transpose.int, (_t(4, 12), 0, 1), {}),
    (aten.permute.default, (_t(12, 4, 12), [2, 0, 1]), {}),
    (aten.unsqueeze.default, (_t(4, 12), 1), {}),
    (aten.select.int, (_t(4, 12, 3), 2, 1), {}),
    (aten.expand.default, (_t(1, 12), [4, 12]), {}),
    (aten.squeeze.dim, (_t(12, 1, 12), 1), {}),
    (aten.split.Tensor, (_t(4, 12), 2, 0), {}),
    (aten.cat.default, ([_t(4, 12), _t(4, 12)], 0), {}),
    (aten.stack.default, ([_t(4, 12), _t(4, 12)], 1), {}),
    (aten._to_copy.default, (_t(4, 12),), {"dtype": torch.float32}),
    (aten.native_layer_norm.default, (_t(12, 4, 6), [6], _t(6), _t(6), 1e-5), {}),
    (aten.view.default, (_t(12, 4, 6), [12, 24]), {}),
    (aten.view_as_complex.default, (_t(12, 4, 2),), {}),
    (aten._conj.default, (torch.randn(12, 4, dtype=torch.complex128),), {}),
]
_ids = torch.randint(0, 10, (2, 12))
_sorted_rows = torch.randn(24, 8, dtype=torch.float64).sort(1).values
# Rules whose kernels read positions only through the layout's segments (``any_order=``)
KERNEL_RULE_CASES = [
    (aten.embedding.default, (_t(10, 4), _ids), {}),
    (aten.embedding_dense_backward.default, (_t(2, 12, 4), _ids, 10, -1, False), {}),
    (aten._log_softmax.default, (_t(24, 10), 1, False), {}),
    (aten.nll_loss_forward.default, (_t(24, 10).log_softmax(1), torch.randint(0, 10, (24,)), None, 1, -100), {}),
]
# Rules that run the op on each rank's pieces, with no kernel and no local rewrite, and say nothing of
# split kinds: every kind passes through them (``Rule.takes_kinds``)
PLAIN_PIECE_RULE_CASES = [
    (aten.gelu.default, (_t(4, 24),), {}),
    (aten.sort.default, (_t(24, 24), 1), {}),
    (aten.topk.default, (_t(24, 24), 3, 1), {}),
    (aten.cumsum.default, (_t(24, 24), 1), {}),
    (aten.gather.default, (_t(24, 24), 1, torch.randint(0, 24, (24, 5))), {}),
    (aten.index_select.default, (_t(24, 24), 1, torch.tensor([3, 1, 4])), {}),
    (aten.scatter_add.default, (_t(24, 24), 1, torch.randint(0, 24, (24, 5)), _t(24, 5)), {}),
    (aten.roll.default, (_t(24, 24), [2], [1]), {}),
    (aten.flip.default, (_t(24, 24), [1]), {}),
    (aten.constant_pad_nd.default, (_t(24, 24), [1, 2]), {}),
    (aten.diagonal.default, (_t(24, 5, 5), 0, 1, 2), {}),
    (aten.unfold.default, (_t(24, 24), 1, 3, 2), {}),
    (aten._cdist_forward.default, (_t(24, 4), _t(24, 4), 2.0, None), {}),
    (aten.searchsorted.Tensor, (_sorted_rows, _t(24, 3)), {}),
    (aten.linalg_inv_ex.default, (_t(24, 3, 3) + 3 * torch.eye(3, dtype=torch.float64),), {}),
    (aten.fill.Scalar, (_t(24, 24), 2.0), {}),
]
ANY_ORDER_RULE_CASES = BLOCKED_RULE_CASES + KERNEL_RULE_CASES + PLAIN_PIECE_RULE_CASES


@pytest.mark.parametrize("op,args,kwargs", ANY_ORDER_RULE_CASES, ids=[str(c[0]) for c in ANY_ORDER_RULE_CASES])
def test_every_any_order_rule_holds_with_its_splits_blocked(op, args, kwargs):
    """Each candidate that holds in any order (a rule on plain pieces, or one declaring ``any_order``),
    with every split blocked 2 and 3 ways, forced on its own on 1-D and 2x2 placements, gives one
    device's values in its layouts."""
    ran = sum(check_candidates(op, *args, blocks=f, rtol=1e-12, atol=1e-12, **kwargs) for f in (2, 3))
    assert ran > 0
