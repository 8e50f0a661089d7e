"""Scaled dot-product attention (the CPU flash kernels): every candidate, F.sdpa on random
layouts with gradients, and the head split running with no communication."""
import math

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from harness import candidate_signatures, check_candidates, check_layouts

aten = torch.ops.aten
FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum



def _qkv(b, h, l, s, e, hk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    hk = hk or h
    return (torch.randn(b, h, l, e, generator=g), torch.randn(b, hk, s, e, generator=g),
            torch.randn(b, hk, s, e, generator=g))


# [B, H, L, S, E]: even; uneven with fewer heads (3) than ranks, so one rank holds no head
# and some no query row (the CPU kernel would die on such pieces)
SHAPES = [(4, 4, 8, 8, 4), (3, 3, 5, 7, 4)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_candidates(shape, causal):
    q, k, v = _qkv(*shape, seed=1)
    assert check_candidates(FWD, q, k, v, 0.0, causal, max_2d=8) >= 3
    out, lse = FWD(q, k, v, 0.0, causal)
    go = torch.randn_like(out)
    assert check_candidates(BWD, go, q, k, v, out, lse, 0.0, causal, max_2d=8) >= 4


def test_sdpa_masks_and_scale():
    q, k, v = _qkv(3, 2, 5, 6, 4, seed=2)
    for mask in (torch.randn(5, 6), torch.randn(3, 1, 5, 6), torch.randn(1, 2, 5, 1)):
        check_candidates(FWD, q, k, v, 0.0, False, attn_mask=mask, scale=0.3, max_2d=6)
        out, lse = FWD(q, k, v, 0.0, False, attn_mask=mask, scale=0.3)
        check_candidates(BWD, torch.randn_like(out), q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=0.3,
                         max_2d=6)


def test_sdpa_grouped_query_attention():
    """GQA (8 query heads, 4 kv heads): every candidate -- the head split, where a rank's query heads
    are its kv heads' groups, and q split on heads with k and v whole -- equals one device; random
    layouts (2 kv heads too) with gradients."""
    q, k, v = _qkv(3, 8, 5, 6, 4, hk=4, seed=3)
    sigs = candidate_signatures(FWD, q, k, v, 0.0, True)
    assert {(S(1), S(1), S(1)), (S(1), B, B)} <= {c.inputs for c in sigs}
    check_candidates(FWD, q, k, v, 0.0, True, max_2d=8)
    out, lse = FWD(q, k, v, 0.0, True)
    check_candidates(BWD, torch.randn_like(out), q, k, v, out, lse, 0.0, True, max_2d=8)
    for hk in (4, 2):
        q, k, v = _qkv(3, 8, 5, 6, 4, hk=hk, seed=3)
        check_layouts(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                      q, k, v, grad=True, trials=4)


@pytest.mark.parametrize("heads,kv_heads,lined_up", [(8, 4, True), (8, 2, False), (4, 2, False), (6, 3, False)])
def test_a_gqa_head_split_is_admitted_only_where_the_heads_line_up(p1, heads, kv_heads, lined_up):
    """On 4 ranks a head split of q and k lines up only where 4 divides the kv heads; else q keeps its
    head split and each rank takes the kv heads its query heads read from whole k and v: no
    collective in the forward, the kv gradients partial (each rank's share) in the backward."""
    from globaltensor.ops import decide as stages
    q, k, v = _qkv(2, heads, 8, 8, 4, hk=kv_heads, seed=5)
    q, k, v = (t.double() for t in (q, k, v))
    gq = gt.distribute(q, p1, S(1)).requires_grad_()
    gk, gv = (gt.distribute(t, p1, S(1)) for t in (k, v))
    r = stages.route(FWD, (gq, gk, gv, 0.0, True), {})
    problem = stages.candidates(r, FWD, (gq, gk, gv, 0.0, True), {}, True)
    assert any(c.inputs == ((S(1),),) * 3 for c in problem.candidates) == lined_up
    gk, gv = (gt.distribute(t, p1, S(1) if lined_up else B).requires_grad_() for t in (k, v))
    with gt.comm_stats() as st:
        out = F.scaled_dot_product_attention(gq, gk, gv, is_causal=True, enable_gqa=True)
    assert st.count == 0 and out.sbp == (S(1),)
    weights = torch.randn(out.shape, dtype=torch.float64)
    (out * gt.distribute(weights, p1, S(1))).sum().backward()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (want * weights).sum().backward()
    torch.testing.assert_close(out.full_tensor(), want, rtol=1e-12, atol=1e-13)
    for g, w in ((gq, q), (gk, k), (gv, v)):
        torch.testing.assert_close(g.grad.full_tensor(), w.grad, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_random_layouts(causal):
    q, k, v = _qkv(2, 5, 6, 6, 4, seed=4)
    check_layouts(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), q, k, v,
                  grad=True, trials=3)


@pytest.mark.parametrize("place,sbp", [([0, 1, 2, 3], (S(1),)), ([[0, 1], [2, 3]], (S(0), S(1))),
                                       ([0, 1, 2, 3], (S(2),))])
def test_sdpa_split_layouts_exact(place, sbp):
    """Heads split (or batch x heads on 2x2, or query rows with whole k, v): causal attention
    forward and backward match one device and the outputs and gradients keep the split;
    the head / batch splits move no bytes at all."""
    q, k, v = _qkv(3, 6, 7, 7, 4, seed=5)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=True)
    grad = torch.randn_like(want)
    want.backward(grad)
    query_split = sbp == (S(2),)
    with gt.simulate(4):
        p = gt.placement("cpu", place)
        kv_sbp = (B,) if query_split else sbp
        gq = gt.distribute(q, p, sbp).detach().requires_grad_(True)
        gk = gt.distribute(k, p, kv_sbp).detach().requires_grad_(True)
        gv = gt.distribute(v, p, kv_sbp).detach().requires_grad_(True)
        g = gt.distribute(grad, p, sbp)
        with gt.comm_stats() as st:
            got = F.scaled_dot_product_attention(gq, gk, gv, is_causal=True)
            assert got.sbp == sbp
            got.backward(g)
        if not query_split:
            assert st.bytes_sent == 0
        torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=1e-4, atol=1e-5)
        for t, leaf in zip((gq, gk, gv), leaves):
            assert t.grad.sbp == t.sbp
            torch.testing.assert_close(t.grad.full_tensor(), leaf.grad, rtol=1e-4, atol=1e-5)


# -- ring attention (rules/ring_attention.py) ----------------------------------------------------------------------

@pytest.mark.parametrize("order", ["plain", "head_tail"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, kv_heads, length", [(2, 2, 13), (2, 1, 16), (8, 8, 16)], ids=["uneven", "gqa", "8heads"])
def test_ring_attention_equals_one_device_and_moves_only_key_value_blocks(causal, heads, kv_heads, length, order,
                                                                          float64):
    """q, k and v split on the sequence (plain, or head-tail: two chunks a rank), taken as they are
    (gt.explicit: the ring is the one signature that does): forward and backward equal one device;
    every byte is a key/value block passed on or a gradient share sent home -- no gather, no
    all-to-all."""
    torch.manual_seed(heads * 100 + length)
    q, k, v = torch.randn(2, heads, length, 8), torch.randn(2, kv_heads, length, 8), torch.randn(2, kv_heads, length, 8)
    kw = {"enable_gqa": True} if heads != kv_heads else {}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=causal, **kw)
    probe = torch.randn_like(want)
    (want * probe).sum().backward()
    seq = S(2, order=order)
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        split = [gt.distribute(t, p, seq).requires_grad_() for t in (q, k, v)]
        with gt.explicit(), gt.comm_stats() as stats:
            got = F.scaled_dot_product_attention(*split, is_causal=causal, **kw)
            (got * gt.distribute(probe, p, seq)).sum().backward()
        assert got.sbp == (seq,) and set(stats.ops()) == {"send_recv"}, stats.ops()
        torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=0, atol=1e-12)
        for a, b in zip(split, leaves):
            assert a.grad.sbp == (seq,)
            torch.testing.assert_close(a.grad.full_tensor(), b.grad, rtol=0, atol=1e-12)


def _key_padding(length):
    """Keys past a cut hidden from every query (sequence 1 pads its last 6 keys)."""
    keep = torch.ones(2, 1, 1, length, dtype=torch.bool)
    keep[1, ..., length - 6:] = False
    return keep


def _blocked_diagonal(length):
    """A float mask: each query sees the keys of its own quarter of the sequence and key 0 -- so whole
    key blocks are hidden from some rows."""
    quarter = torch.arange(length) * 4 // length
    seen = (quarter[:, None] == quarter[None, :]) | (torch.arange(length)[None, :] == 0)
    return torch.zeros(length, length).masked_fill(~seen, -math.inf)


@pytest.mark.parametrize("order", ["plain", "head_tail"])
@pytest.mark.parametrize("make_mask", [_key_padding, _blocked_diagonal], ids=["key_padding_bool", "block_float"])
def test_ring_attention_with_an_explicit_mask_equals_one_device(make_mask, order, float64):
    """The mask's query dim split like q (or broadcast there), its key columns taken per block; a row a
    mask hides wholly from a block takes nothing from it. Forward and backward equal one device, and
    only key/value blocks move."""
    torch.manual_seed(5)
    length = 16
    q, k, v = (torch.randn(2, 2, length, 8) for _ in range(3))
    mask = make_mask(length)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    probe = torch.randn_like(want)
    (want * probe).sum().backward()
    seq = S(2, order=order)
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        split = [gt.distribute(t, p, seq).requires_grad_() for t in (q, k, v)]
        gmask = gt.distribute(mask, p, S(mask.dim() - 2, order=order) if mask.shape[-2] != 1 else B)
        with gt.explicit(), gt.comm_stats() as stats:
            got = F.scaled_dot_product_attention(*split, attn_mask=gmask)
            (got * gt.distribute(probe, p, seq)).sum().backward()
        assert got.sbp == (seq,) and set(stats.ops()) == {"send_recv"}, stats.ops()
        torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=0, atol=1e-12)
        for a, b in zip(split, leaves):
            torch.testing.assert_close(a.grad.full_tensor(), b.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("lengths", [(12, 16), (16, 12), (13, 7), (5, 21)], ids=lambda n: str(n))
def test_causal_ring_attention_with_query_and_key_lengths_apart(lengths, float64):
    """Top-left causal attention with more or fewer keys than queries: each rank's rows meet blocks
    of another size, cut into the keys wholly before them, a square on the diagonal (the kernel's
    ``is_causal``) and the rows after it -- and rows before a block's first key take nothing."""
    length, keys = lengths
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(2, 2, length, 8, generator=g), torch.randn(2, 2, keys, 8, generator=g), \
        torch.randn(2, 2, keys, 8, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=True)
    want.sum().backward()
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        split = [gt.distribute(t, p, S(2)).requires_grad_() for t in (q, k, v)]
        with gt.explicit(), gt.comm_stats() as stats:
            got = F.scaled_dot_product_attention(*split, is_causal=True)
            got.sum().backward()
        assert set(stats.ops()) == {"send_recv"}, stats.ops()
        torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=0, atol=1e-12)
        for a, b in zip(split, leaves):
            torch.testing.assert_close(a.grad.full_tensor(), b.grad, rtol=0, atol=1e-12)


def test_ring_attention_bytes_and_the_causal_blocks_skipped(float64):
    """Forward: each rank passes on 3 of the 4 key/value blocks. Backward: the blocks again, and the
    gradient shares of the blocks it saw -- under the causal mask only those before its rows."""
    from globaltensor.ops.rules.ring_attention import ring_bytes
    block = 2 * (2 * 2 * 4 * 8 * 8)                  # a k and a v block: [2, 2, 4, 8] float64
    sent = {}
    for causal in (False, True):
        with gt.simulate(4):
            p = gt.placement("cpu", [0, 1, 2, 3])
            q, k, v = (gt.distribute(torch.randn(2, 2, 16, 8), p, S(2)).requires_grad_() for _ in range(3))
            with gt.explicit():
                with gt.comm_stats() as forward:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                with gt.comm_stats() as backward:
                    out.sum().backward()
            sent[causal] = backward.bytes_sent, sum(backward.per_rank.values())
            assert forward.bytes_sent == 3 * block == ring_bytes(k.layout_meta, v.layout_meta, backward=False)
    assert sent[False][0] == 6 * block == ring_bytes(k.layout_meta, v.layout_meta, backward=True)
    # causal: rank i saw only blocks 0..i, so it sends i shares, not 3 (the busiest, rank 3, still 3)
    assert sent[True][1] == sent[False][1] - 6 * block and sent[True][0] == sent[False][0]


@pytest.mark.parametrize("heads, recorded, chosen", [(8, True, "all_to_all"), (2, False, "send_recv"),
                                                    (2, True, "send_recv")],
                         ids=["ulysses_with_heads", "ring_without_grad", "ring_with_grad"])
def test_the_cost_model_chooses_between_ring_and_ulysses_by_bytes(heads, recorded, chosen, float64):
    """Heads to spare and a backward to pay for: the all-to-all to a head split (Ulysses) sends the
    least. Fewer heads than ranks (and a batch of 2 on 4 ranks): ring attention. Without autograd its
    one rotation ties with gathering k and v, and the ring, listed first, keeps the key/value blocks
    where they are; with autograd ring sends a third more (the backward's rotation) but gathering
    would hold k and v whole until the backward, and those bytes count (attention.py)."""
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        q, k, v = (gt.distribute(torch.randn(2, heads, 64, 16), p, S(2)).requires_grad_(recorded) for _ in range(3))
        with gt.comm_stats() as stats:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if recorded:
                out.sum().backward()
        assert chosen in stats.ops() and "all_gather" not in stats.ops(), stats.ops()


@pytest.mark.parametrize("order", ["plain", "head_tail"])
def test_ring_attention_compiles_with_gt_compile(order, float64):
    """Its blocks' transfers are collectives the capture records, its masks follow from the ranges:
    a compiled causal forward and backward equals one device on new data."""
    def step(q, k, v):
        with gt.explicit():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        return out

    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        compiled = gt.compile(step)
        for _ in range(3):                              # eager, capture, a graph run
            tensors = [torch.randn(2, 2, 13, 8) for _ in range(3)]
            split = [gt.distribute(t, p, S(2, order=order)).requires_grad_() for t in tensors]
            got = compiled(*split)
            leaves = [t.clone().requires_grad_() for t in tensors]
            want = F.scaled_dot_product_attention(*leaves, is_causal=True)
            want.sum().backward()
            torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=0, atol=1e-12)
            for a, b in zip(split, leaves):
                torch.testing.assert_close(a.grad.full_tensor(), b.grad, rtol=0, atol=1e-12)


def _attention_work(order: str, length: int = 64, width: int = 4) -> tuple:
    """Per rank, the query-key scores per (batch, head) its causal ring attention computes (forward),
    counted from the kernel calls themselves (a block run with ``is_causal`` scores its lower
    triangle, any other all of its rows x keys), and as ``attention_work`` models them."""
    from globaltensor.ops.rules.ring_attention import attention_work
    from globaltensor.ops.rules import attention
    work = dict.fromkeys(range(width), 0)
    ring_forward = attention.ring_forward

    def counting(attend, pieces, ins, causal, scale):
        owner = {n["query"].untyped_storage().data_ptr(): r for r, n in pieces.items()}
        assert len(owner) == len(pieces)

        def counted(q, k, v, is_causal, mask, scale):
            n, m = q.shape[2], k.shape[2]
            work[owner[q.untyped_storage().data_ptr()]] += n * (n + 1) // 2 if is_causal else n * m
            return attend(q, k, v, is_causal, mask, scale)
        return ring_forward(counted, pieces, ins, causal, scale)

    with pytest.MonkeyPatch.context() as patched, gt.simulate(width):
        patched.setattr(attention, "ring_forward", counting)
        p = gt.placement("cpu", list(range(width)))
        q, k, v = (gt.distribute(torch.randn(1, 2, length, 8), p, S(2, order=order)) for _ in range(3))
        with gt.explicit():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        modelled = attention_work(q._layout, k._layout, causal=True)
    return work, modelled


def test_the_head_tail_split_balances_causal_ring_attention():
    """Under the causal mask a plain sequence split leaves rank 0 one triangle and rank 3 three blocks
    and a triangle; the head-tail split gives every rank the same work: both count the whole causal
    triangle, and per rank the head-tail work is equal (the issue asks within 5%)."""
    (plain, plain_modelled), (balanced, balanced_modelled) = _attention_work("plain"), _attention_work("head_tail")
    assert plain == plain_modelled and balanced == balanced_modelled
    triangle = 64 * 65 // 2                                         # per (batch, head), as both count
    assert sum(plain.values()) == sum(balanced.values()) == triangle
    assert max(balanced.values()) == min(balanced.values()) == triangle // 4
    assert max(plain.values()) / (triangle / 4) > 1.7          # 904 of a mean 520
