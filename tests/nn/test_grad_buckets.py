"""Eager gradient buckets (nn/grad_buckets.py): the same gradients, SBPs and updates as reducing each
gradient when it is read, with the collectives of a data-parallel step being the buckets, started
during the backward, and nothing reduced inside ``no_sync``.

Both sides run in float64 and the simulated world sums a group's pieces in the same order whether
they are flat or not, so the bucketed gradients equal the unbucketed ones exactly.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import globaltensor as gt
import globaltensor.nn as gnn
from globaltensor.tensor import GlobalTensor
from nn_models import MEGATRON_2D, net

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
_raw_grad = torch._C.TensorBase.grad


def _train(placement, plan, bucket_bytes, zero, backwards=2, steps=2, no_sync=True):
    """``steps`` SGD steps of the test net, each accumulating ``backwards`` backwards (all but the last
    inside no_sync, unless ``no_sync`` is False); returns the model, each step's gradients (sbp, value) and the collectives of the
    last step's backwards and gradient reads."""
    m = gnn.distribute_module(net().double(), placement, plan, bucket_bytes=bucket_bytes)
    opt = (gnn.ZeroOptimizer(m.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9) if zero else
           torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    batch = (S(0),) + (B,) * (placement.ndim - 1)
    gt.manual_seed(1)
    grads = []
    for _ in range(steps):
        with gt.comm_stats() as stats:
            for i in range(backwards):
                x = gt.randn(8, 6, placement=placement, sbp=batch, dtype=torch.float64)
                if i < backwards - 1 and no_sync:
                    with gnn.no_sync(m):
                        m(x).square().mean().backward()
                else:
                    m(x).square().mean().backward()
            reduced = [p.grad for p in m.parameters()]          # unbucketed: reduced here
        grads.append([(g.sbp, g.full_tensor()) for g in reduced])
        opt.step()
        opt.zero_grad()
    return m, grads, stats


@pytest.mark.parametrize("layout", ["dp", "hybrid"])
@pytest.mark.parametrize("zero", [False, True], ids=["sgd", "zero"])
def test_bucketed_equals_unbucketed_with_accumulation(world4, layout, zero):
    placement = gt.placement("cpu", [0, 1, 2, 3] if layout == "dp" else [[0, 1], [2, 3]])
    plan = {} if layout == "dp" else MEGATRON_2D
    m0, plain, _ = _train(placement, plan, 0, zero)
    m1, bucketed, stats = _train(placement, plan, 25 * 2 ** 20, zero)
    for step, (g0, g1) in enumerate(zip(plain, bucketed)):
        for (sbp0, v0), (sbp1, v1), (name, _) in zip(g0, g1, m0.named_parameters()):
            assert sbp0 == sbp1, (step, name)
            assert torch.equal(v0, v1), (step, name)
    for (name, p0), p1 in zip(m0.named_parameters(), m1.parameters()):
        assert p0.sbp == p1.sbp and torch.equal(p0.full_tensor(), p1.full_tensor()), name
    if zero:           # the data-parallel gradients were reduce-scattered in the backward, no all-reduce
        assert "reduce_scatter" in stats.ops()
        if layout == "dp":
            assert "all_reduce" not in stats.ops(), stats.ops()


@pytest.mark.parametrize("zero", [False, True], ids=["sgd", "zero"])
def test_accumulating_without_no_sync_buckets_each_backward(p2, zero):
    """Each backward reduces (as DDP without no_sync): the stored, reduced gradients turn partial again
    before the next one adds to them, so every backward's collectives are the buckets alone."""
    m0, plain, _ = _train(p2, MEGATRON_2D, 0, zero, steps=1)
    _, _, accumulated = _train(p2, MEGATRON_2D, 25 * 2 ** 20, zero, steps=1)             # with no_sync
    m1, twice, each = _train(p2, MEGATRON_2D, 25 * 2 ** 20, zero, steps=1, no_sync=False)
    for (sbp0, v0), (sbp1, v1), (name, _) in zip(plain[0], twice[0], m0.named_parameters()):
        assert sbp0 == sbp1, name
        torch.testing.assert_close(v1, v0, rtol=0, atol=1e-15, msg=name)   # sums in another order
    # the first backward's reduction is one bucket per group and layout (at most 3 here: the two
    # data-axis groups and the whole world); one all-reduce per gradient would be 2 per parameter
    extra = Counter(each.ops()) - Counter(accumulated.ops())
    assert 0 < sum(extra.values()) <= 3, extra


def test_dp_step_collectives_are_the_buckets(p1):
    n_params = len(list(net().parameters()))
    _, _, one = _train(p1, {}, 25 * 2 ** 20, zero=False, backwards=1, steps=1)
    assert one.ops() == ["all_reduce"], "every gradient fits one bucket"
    _, _, small = _train(p1, {}, 200, zero=False, backwards=1, steps=1)
    assert set(small.ops()) == {"all_reduce"} and 1 < small.count < n_params, small.ops()
    _, _, plain = _train(p1, {}, 0, zero=False, backwards=1, steps=1)
    assert plain.ops() == ["all_reduce"] * n_params         # reduced one by one, when read
    assert one.bytes_sent <= plain.bytes_sent


def test_buckets_start_during_the_backward_and_backward_returns_reduced(p1):
    m = gnn.distribute_module(net().double(), p1, {}, bucket_bytes=200)
    first = m.blocks[0].up.weight                    # among the last gradients the backward produces
    started_before = []
    first.register_post_accumulate_grad_hook(lambda p: started_before.append(stats.count))
    x = gt.randn(8, 6, placement=p1, sbp=S(0), dtype=torch.float64)
    with gt.comm_stats() as stats:
        m(x).square().mean().backward()
        after_backward = stats.count
        grads = [_raw_grad.__get__(p) for p in m.parameters()]
        _ = [p.grad for p in m.parameters()]
    assert started_before and started_before[0] > 0, "a bucket started before the backward reached the first layer"
    assert all(type(g) is GlobalTensor and g.sbp == (B,) for g in grads), "backward returns reduced gradients"
    assert stats.count == after_backward, "reading .grad after the backward reduces nothing more"


def test_no_sync_reduces_nothing_and_accumulates_partial(p1):
    m = gnn.distribute_module(net().double(), p1, {})
    x = gt.randn(8, 6, placement=p1, sbp=S(0), dtype=torch.float64)
    with gt.comm_stats() as stats, gnn.no_sync(m):
        m(x).square().mean().backward()
        m(x).square().mean().backward()
    assert stats.count == 0
    assert all(_raw_grad.__get__(p).sbp == (P,) for p in m.parameters())


def test_bucket_bytes_is_checked(p1):
    with pytest.raises(ValueError, match="bucket_bytes"):
        gnn.distribute_module(net(), p1, {}, bucket_bytes=-1)
    with pytest.raises(ValueError, match="bucket_bytes"):
        gnn.bucket_gradients(net().parameters(), bucket_bytes=1.5)


class _Embedded(torch.nn.Module):
    """Token and position embeddings as in the demo GPT: the position table is looked up with a
    broadcast index buffer and added to the batch-split token embeddings."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = torch.nn.Embedding(10, 6), torch.nn.Embedding(5, 6)
        self.head = torch.nn.Linear(6, 3)
        self.register_buffer("positions", torch.arange(5))

    def forward(self, idx):
        return self.head(self.tok(idx) + self.pos(self.positions))


def test_embedding_gradients_join_the_buckets(p1):
    """The position table's gradient is ``embedding_dense_backward`` of a partial gradient with a
    broadcast integer index: it stays partial and joins the bucket (ops/decide/cost.py), rather
    than being all-reduced on its own inside the backward; the values are those reduced one by one."""
    idx = gt.distribute(torch.randint(0, 10, (8, 5), generator=torch.Generator().manual_seed(1)), p1, S(0))
    grads = {}
    for bucket_bytes in (0, 25 * 2 ** 20):
        m = gnn.distribute_module(_Embedded().double(), p1, {}, bucket_bytes=bucket_bytes)
        with gt.comm_stats() as stats:
            m(idx).square().mean().backward()
            grads[bucket_bytes] = [(p.grad.sbp, p.grad.full_tensor()) for p in m.parameters()]
        if bucket_bytes:
            assert stats.ops() == ["all_reduce"], stats.ops()
    for (sbp0, v0), (sbp1, v1) in zip(grads[0], grads[25 * 2 ** 20]):
        assert sbp0 == sbp1 == (B,)
        assert torch.equal(v0, v1)


def test_a_data_axis_of_one_rank_keeps_the_gradients_as_they_are(world4):
    """Partial over one rank is already the sum: the backward leaves each gradient where autograd put
    it, in the parameter's layout, with no collective and no flat bucket (a copy of every gradient)."""
    one = gt.placement("cpu", [0])
    _, plain, _ = _train(one, {}, 0, zero=False, backwards=1, steps=1)
    m, bucketed, stats = _train(one, {}, 25 * 2 ** 20, zero=False, backwards=1, steps=1)
    assert stats.count == 0
    for (sbp0, v0), (sbp1, v1) in zip(plain[0], bucketed[0]):
        assert sbp0 == sbp1 == (B,) and torch.equal(v0, v1)
    x = gt.randn(8, 6, placement=one, sbp=S(0), dtype=torch.float64)
    m(x).square().mean().backward()
    grads = [_raw_grad.__get__(p) for p in m.parameters()]
    assert all(g.sbp == (B,) and g._pieces[0]._base is None for g in grads), "a gradient is a view of a bucket"


def test_a_bucket_holds_at_most_bucket_bytes_unless_one_gradient_does(p1):
    """A gradient that would take its bucket past ``bucket_bytes`` starts the next one (the bucket
    before it is reduced first), as DDP's buckets: only a gradient larger than the limit makes a
    larger bucket, on its own. (The gradients are copied into their bucket as they arrive.)"""
    limit = 200                                              # 25 float64 elements
    sizes = sorted(p.numel() for p in net().parameters())
    _, _, stats = _train(p1, {}, limit, zero=False, backwards=1, steps=1)
    # a ring all-reduce of n elements over 4 ranks sends 2 * 3 * n * 8 bytes in all
    payloads = [sum(r.bytes_per_rank.values()) // 48 for r in stats.records if r.op == "all_reduce"]
    assert sum(payloads) == sum(sizes)
    assert all(n * 8 <= limit or n in sizes for n in payloads), payloads
    assert any(1 < n and n * 8 <= limit for n in payloads), "small gradients share a bucket"


def _storages(m) -> dict:
    """Each parameter's gradient's pieces' storage addresses (ints: no reference is kept)."""
    return {name: {r: t.untyped_storage().data_ptr() for r, t in p.grad._pieces.items()}
            for name, p in m.named_parameters()}


def test_bucket_memory_is_filled_again_once_its_gradients_are_cleared(p1):
    """The gradients are views of their bucket's flat buffer (reduced in place, as in a process
    world). Once ``zero_grad`` has dropped them, the next backward fills the same buffers, as DDP
    keeps its buckets: fresh memory every step would cost a page fault per page it copies into."""
    m = gnn.distribute_module(net().double(), p1, {})
    x = gt.randn(8, 6, placement=p1, sbp=S(0), dtype=torch.float64)
    m(x).square().mean().backward()
    first = _storages(m)
    assert len({a for per_rank in first.values() for a in per_rank.values()}) == 4, "one bucket, one buffer per rank"
    m.zero_grad()
    m(x).square().mean().backward()
    assert _storages(m) == first


@pytest.mark.parametrize("layout", ["dp", "hybrid"])
def test_a_bucket_is_no_larger_than_the_gradients_still_to_come(world4, layout):
    """A buffer holds the limit or what the gradients still to come in the backward can fill,
    whichever is less: under the default 25 MB limit a small model's buffers on a rank add up to
    the elements of its gradients' pieces there exactly (Megatron's split weights: their pieces),
    not to a whole limit's worth of memory no gradient fills."""
    placement = gt.placement("cpu", [0, 1, 2, 3] if layout == "dp" else [[0, 1], [2, 3]])
    m = gnn.distribute_module(net().double(), placement, {} if layout == "dp" else MEGATRON_2D)
    x = gt.randn(8, 6, placement=placement, sbp=(S(0),) + (B,) * (placement.ndim - 1), dtype=torch.float64)
    m(x).square().mean().backward()
    buffers = {}
    for p in m.parameters():
        piece = p.grad.to_local(rank=0)
        buffers[piece.untyped_storage().data_ptr()] = piece.untyped_storage().nbytes()
    assert sum(buffers.values()) == 8 * sum(p.to_local(rank=0).numel() for p in m.parameters())


def test_a_gradient_still_held_keeps_its_value_when_the_next_backward_buckets(p1):
    """A bucket's buffer is filled again only when nothing holds any of its gradients: one kept by
    the program (a copy of ``.grad`` for logging, say) is left as it was, and the next backward
    takes new memory."""
    m = gnn.distribute_module(net().double(), p1, {})
    x = gt.randn(8, 6, placement=p1, sbp=S(0), dtype=torch.float64)
    m(x).square().mean().backward()
    kept = m.blocks[0].up.weight.grad
    value = kept.full_tensor().clone()
    before = _storages(m)
    m.zero_grad()
    (2 * m(x)).square().mean().backward()
    assert torch.equal(kept.full_tensor(), value)
    assert _storages(m) != before
    torch.testing.assert_close(m.blocks[0].up.weight.grad.full_tensor(), 4 * value, rtol=0, atol=0)


def test_one_rank_piece_still_held_leaves_the_other_ranks_buffers_free_to_fill(p1):
    """Buffers are told apart by identity: with rank 0's piece of a gradient kept, the next backward
    fills the three free buffers again and takes new memory for the fourth."""
    m = gnn.distribute_module(net().double(), p1, {})
    x = gt.randn(8, 6, placement=p1, sbp=S(0), dtype=torch.float64)
    m(x).square().mean().backward()
    kept = m.blocks[0].up.weight.grad.to_local(rank=0)
    value = kept.clone()
    before = _storages(m)
    m.zero_grad()
    (2 * m(x)).square().mean().backward()
    assert torch.equal(kept, value)
    old, new = ({a for per_rank in s.values() for a in per_rank.values()} for s in (before, _storages(m)))
    assert kept.untyped_storage().data_ptr() in old - new
    assert len(old & new) == 3, "the three free buffers are filled again"
