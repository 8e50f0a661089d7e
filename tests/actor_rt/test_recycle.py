"""A compiled graph's empty-like tasks hand their CPU buffers out again once nothing holds them
(actor_rt/recycle.py): never while a tensor, a view or a Python reference still holds one, never
one an in-place op reshaped, and the results stay those of eager runs."""
from __future__ import annotations

import weakref

import torch

import globaltensor as gt
from compile_helpers import module_maker
from globaltensor.actor_rt.recycle import Recycler, recycled

S = gt.sbp.split
aten = torch.ops.aten


def make_empty(keep: int = 2) -> Recycler:
    r = recycled(aten.empty.memory_format, keep)
    assert isinstance(r, Recycler)
    return r


def test_only_empty_like_ops_are_recycled():
    for op in (aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
               aten.new_empty_strided.default):
        assert isinstance(recycled(op, 2), Recycler), op
    for op in (aten.zeros.default, aten.add.Tensor, aten.clone.default):
        assert recycled(op, 2) is None, op


def test_a_tensor_nothing_holds_is_handed_out_again():
    r = make_empty()
    t = r([4, 4])
    seen = weakref.ref(t)
    del t
    again = r([4, 4])
    assert again is seen()


def test_a_tensor_still_referenced_is_not_handed_out():
    r = make_empty()
    t = r([4, 4])
    u = r([4, 4])
    assert u is not t and u.data_ptr() != t.data_ptr()


def test_a_tensor_whose_storage_a_view_holds_is_not_handed_out_until_the_view_goes():
    r = make_empty()
    t = r([4, 4])
    seen = weakref.ref(t)
    view = t[1:]
    del t
    other = r([4, 4])
    assert other is not seen() and seen() is not None
    del view
    assert r([4, 4]) is seen()


def test_a_tensor_an_in_place_op_reshaped_is_not_handed_out():
    r = make_empty(keep=1)
    t = r([2, 3])
    seen = weakref.ref(t)
    t.t_()
    del t
    fresh = r([2, 3])
    assert fresh is not seen() and fresh.shape == (2, 3)


def test_it_keeps_at_most_keep_tensors():
    r = make_empty(keep=2)
    held = [r([4]) for _ in range(4)]
    assert [t for t, _ in r.pool] == held[2:]


def test_tensors_off_the_cpu_are_not_kept():
    r = make_empty()
    t = r([4], device="meta")
    assert t.device.type == "meta" and len(r.pool) == 0


def test_a_compiled_graph_reuses_an_empty_buffer_its_caller_dropped(p1):
    """The buffer a call returned comes back as the next call's once the caller dropped it, and not
    while the caller keeps it; the values are eager's every time."""
    x = gt.distribute(torch.arange(16.).reshape(4, 4), p1, S(0))

    def fn(x):
        y = x.new_empty(x.shape)
        y.copy_(x * 2)
        return y
    g = gt.compile(fn, warmup=0)
    first = g(x)
    seen = {r: weakref.ref(t) for r, t in first.local_tensors().items()}
    del first
    second = g(x)
    assert all(t is seen[r]() for r, t in second.local_tensors().items())
    third = g(x)
    assert all(t is not seen[r]() for r, t in third.local_tensors().items())
    want = fn(x).full_tensor()
    for out in (second, third):
        assert torch.equal(out.full_tensor(), want)


def test_a_compiled_data_parallel_step_fills_the_same_bucket_buffers_every_call(p1):
    """The gradients a compiled data-parallel step leaves lie in its bucket's flat buffer; after the
    first calls, every call's buffer is one an earlier call filled (no fresh memory to fault in each
    step, as DDP keeps its buckets). A storage's Python object lives as long as the storage."""
    m, _, step = module_maker(p1, {}, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), zero_grad_first=True)()
    g = gt.compile(step)
    gen = torch.Generator().manual_seed(1)
    buffers = []
    for _ in range(6):
        g(gt.distribute(torch.randn(8, 6, generator=gen), p1, S(0)))
        storages = {id(s): s for q in m.parameters() for s in
                    (t.untyped_storage() for t in q.grad.local_tensors().values())}
        assert len(storages) == len(p1.rank_list())         # one bucket per rank
        buffers.append([weakref.ref(s) for s in storages.values()])
        del storages
    for call in (3, 4, 5):
        earlier = [b() for refs in buffers[1:call] for b in refs]
        assert all(any(b() is e for e in earlier) for b in buffers[call]), f"call {call} filled a new bucket buffer"
