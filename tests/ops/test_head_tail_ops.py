"""Ops on head-tail splits (``S(d, order="head_tail")``: rank ``r`` of ``W`` holds chunks ``r`` and
``2W - 1 - r``), against one device (float64; 1e-12 relative: the same sums in another order).

Every candidate that holds in any order of its split dims' indices (sbp/split_kinds.py: a rule on
plain pieces, or one declaring ``any_order``) holds in head-tail order, blocked or not; each is
forced on its own on 1-D and 2x2 placements. Then the pieces
a GPT needs, end to end: embedding, position embeddings, norms, linears, causal attention (ring),
and the loss, with only the ring's blocks and the loss's scalar moving."""
import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.sbp import broadcast as B, split as S
from harness import check_candidates
from test_blocked_ops import ANY_ORDER_RULE_CASES

TOL = dict(rtol=1e-12, atol=1e-12)
aten = torch.ops.aten


def HT(d: int, f: int = 1):
    return S(d, blocks=f, order="head_tail")


def _t(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("op,args,kwargs", ANY_ORDER_RULE_CASES, ids=[str(c[0]) for c in ANY_ORDER_RULE_CASES])
def test_every_any_order_rule_holds_in_head_tail_order(op, args, kwargs):
    """Each candidate that holds in any order (a rule on plain pieces, or one declaring ``any_order``),
    in head-tail order and also blocked 2 ways, forced on its own, gives one device's values in its
    layouts."""
    ran = sum(check_candidates(op, *args, blocks=f, head_tail=True, rtol=1e-12, atol=1e-12, **kwargs) for f in (1, 2))
    assert ran > 0


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_sequence_candidates_hold_in_head_tail_order_and_blocked(causal):
    """Ring attention and the query split, with q (and k, v) split head-tail, and blocked 2 ways,
    forward and backward.
    Every output of the op is compared, the log-sum-exp too, which the CPU flash kernel of torch
    2.9 keeps in float32 even for float64 inputs: merging the ring's partial ones then differs from
    one device by float32 rounding (~1e-7 of values near log(keys) + max score, a few units), hence
    1e-6; the values and gradients F.sdpa returns are checked at 1e-12 in test_attention.py."""
    fwd, bwd = aten._scaled_dot_product_flash_attention_for_cpu.default, \
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    q, k, v = _t(2, 2, 16, 4), _t(2, 2, 16, 4), _t(2, 2, 16, 4)
    lse_tol = dict(rtol=1e-6, atol=1e-6)
    out, lse = fwd(q, k, v, 0.0, causal)
    for kind in (dict(head_tail=True), dict(blocks=2)):         # a blocked sequence: the ring reads its segments
        assert check_candidates(fwd, q, k, v, 0.0, causal, **kind, **lse_tol) > 0
        assert check_candidates(bwd, torch.randn_like(out), q, k, v, out, lse, 0.0, causal, **kind, **lse_tol) > 0


def test_a_flattened_head_tail_split_is_blocked_head_tail_and_unflattens(world4):
    """``[b, t] -> [b*t]`` keeps each sequence's chunks as blocks; ``[t, h] -> [t*h]`` would not (its
    chunks are of other sizes), so that view boxes first -- and both equal one device."""
    p = gt.placement("cpu", [0, 1, 2, 3])
    x = _t(2, 16, 6)
    g = gt.distribute(x, p, HT(1))
    merged = g.reshape(32, 6)
    assert merged.sbp == (HT(0, 2),)
    back = (merged * 2).view(2, 16, 6)
    assert back.sbp == (HT(1),)
    torch.testing.assert_close(back.full_tensor(), x * 2, **TOL)
    heads = gt.distribute(x.transpose(0, 1).contiguous(), p, HT(0)).reshape(32, 6)
    assert heads.sbp != (HT(0),)
    torch.testing.assert_close(heads.full_tensor(), x.transpose(0, 1).reshape(32, 6), **TOL)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_on_head_tail_logits_stays_local(world4, reduction, smoothing):
    """Sequence-split logits flattened to rows, ``ignore_index`` among the targets: the loss and the
    logits' gradient equal one device; only scalars are all-reduced (the mean's count, label
    smoothing's sums: a float64 scalar's ring all-reduce sends at most 16 bytes), no logits move."""
    p = gt.placement("cpu", [0, 1, 2, 3])
    logits, targets = _t(2, 16, 10), torch.randint(0, 10, (2, 16))
    targets[0, 3] = targets[1, 15] = -100
    leaf = logits.clone().requires_grad_()
    want = F.cross_entropy(leaf.view(-1, 10), targets.view(-1), reduction=reduction, label_smoothing=smoothing)
    want.sum().backward()
    g = gt.distribute(logits, p, HT(1)).requires_grad_()
    with gt.comm_stats() as stats:
        got = F.cross_entropy(g.view(-1, 10), gt.distribute(targets, p, HT(1)).view(-1), reduction=reduction,
                              label_smoothing=smoothing)
        got.sum().backward()
    assert set(stats.ops()) <= {"all_reduce"} and stats.bytes_sent <= 16 * stats.count, (stats.ops(), stats.bytes_sent)
    torch.testing.assert_close(got.full_tensor(), want.detach(), **TOL)
    assert g.grad.sbp == (HT(1),)
    torch.testing.assert_close(g.grad.full_tensor(), leaf.grad, **TOL)


@pytest.mark.parametrize("sbp,length", [(HT(1), 13), (S(1, blocks=3), 12)], ids=["head_tail", "blocked"])
@pytest.mark.parametrize("draw", ["dropout", "rand_like", "randn_like", "bernoulli"])
def test_random_ops_draw_by_position_on_head_tail_and_blocked_pieces(world4, draw, sbp, length):
    """A random op on a head-tail (or blocked) tensor keeps the split and draws, element by element,
    what it draws on the whole tensor after the same seed (each rank hashes its segments' positions)."""
    p = gt.placement("cpu", [0, 1, 2, 3])
    fns = {"dropout": lambda x: F.dropout(x, 0.5), "rand_like": torch.rand_like, "randn_like": torch.randn_like,
           "bernoulli": lambda x: torch.bernoulli(x * 0.5)}
    x = torch.ones(2, length, 3, dtype=torch.float64)
    gt.manual_seed(7)
    got = fns[draw](gt.distribute(x, p, sbp))
    gt.manual_seed(7)
    want = fns[draw](gt.distribute(x, p, B))
    assert got.sbp == (sbp,)
    assert torch.equal(got.full_tensor(), want.full_tensor())


def test_rotary_embeddings_through_complex_views_keep_the_head_tail_split(world4):
    """torchtitan's RoPE: ``view_as_complex`` of the reshaped q, times the frequencies, ``view_as_real``:
    element by element, so a head-tail sequence split stays as it is, and nothing moves."""
    p = gt.placement("cpu", [0, 1, 2, 3])
    x = _t(2, 16, 4, 8)
    freqs = torch.polar(torch.ones(16, 1, 4, dtype=torch.float64), _t(16, 1, 4))

    def rope(q, f):
        return torch.view_as_real(torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2)) * f).flatten(3)
    g = gt.distribute(x, p, HT(1))
    with gt.comm_stats() as st:
        y = rope(g, gt.distribute(freqs, p, HT(0)))
    assert y.sbp == (HT(1),) and st.count == 0, (y.sbp, st.ops())
    torch.testing.assert_close(y.full_tensor(), rope(x, freqs), rtol=0, atol=0)    # elementwise: exact
