"""Gradient buckets: data-parallel gradients reduced in flat buckets as the backward produces them.

A parameter whose gradient arrives partial over the data axis (a broadcast parameter used on a
batch split over that axis) needs an all-reduce before an optimizer can use it. Reducing each
gradient when it is read costs one collective per parameter, all after the backward. Here each
gradient joins a bucket when autograd has accumulated it (``register_post_accumulate_grad_hook``),
in backward order; a bucket reaching ``bucket_bytes`` (the first one of a backward at 1 MB, as
DDP does, so that communication starts early; the rest at the end of the backward)
is reduced as one flat all-reduce over the partial axes, and the parameters' gradients become
the reduced, broadcast ones -- the value and layout reading ``.grad`` would give. In a compiled
graph these collectives run on the collective stream while the backward of earlier layers still
computes.

Parameters that want a split gradient (``ZeroOptimizer``'s, marked ``_sharded_grad``) are left
to their optimizer's reduce-scatter.
"""
from __future__ import annotations

import torch

from ..boxing.layout import axis_groups
from ..comm import get_world
from ..comm.profile_context import labelled
from ..comm.world import all_reduce_bytes
from ..sbp.shape import numel as numel_of
from ..tensor import GlobalTensor, gradient_layout

_raw_grad = torch._C.TensorBase.grad
FIRST_BUCKET_BYTES = 2 ** 20


class GradBuckets:
    def __init__(self, bucket_bytes: int):
        if not isinstance(bucket_bytes, int) or bucket_bytes < 0:
            raise ValueError(f"bucket_bytes: expected a non-negative int, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self.pending: dict = {}        # (placement, dtype, partial axes) -> [(param, grad, layout)]
        self.sizes: dict = {}
        self.handles: list = []
        self.watched: set = set()
        self.flush_queued = False
        self.flushed_once = False      # the first bucket of each backward is small (FIRST_BUCKET_BYTES)

    def watch(self, p) -> None:
        """Bucket ``p``'s gradient from now on, if it is a global leaf that gets one."""
        if (type(p) is not GlobalTensor or not p.requires_grad or p.grad_fn is not None or id(p) in self.watched
                or getattr(p, "_sharded_grad", False)):
            return
        self.watched.add(id(p))
        self.handles.append(p.register_post_accumulate_grad_hook(self._ready))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.watched.clear()

    def _ready(self, p) -> None:
        g = _raw_grad.__get__(p)
        if type(g) is not GlobalTensor or not g._layout.has_partial:
            return
        want = getattr(p, "_grad_layout", None) or gradient_layout(p._layout)
        if want.shape != g._layout.shape or not all(u == v or (u.is_partial and v.is_broadcast)
                                                    for u, v in zip(g.sbp, want.nd_sbp)):
            return
        axes = tuple(a for a, v in enumerate(g.sbp) if v.is_partial)
        key = (g.placement, g.dtype, axes)
        self.pending.setdefault(key, []).append((p, g, want))
        self.sizes[key] = self.sizes.get(key, 0) + g.numel() * g.element_size()
        if not self.flush_queued:
            self.flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush_all)
        limit = self.bucket_bytes if self.flushed_once else min(self.bucket_bytes, FIRST_BUCKET_BYTES)
        if self.sizes[key] >= limit:
            self.flushed_once = True
            self._flush(key)

    def _flush_all(self) -> None:
        self.flush_queued = self.flushed_once = False
        for key in list(self.pending):
            self._flush(key)

    @labelled("gradient bucket")
    def _flush(self, key) -> None:
        entries = self.pending.pop(key, [])
        self.sizes.pop(key, None)
        if not entries:
            return
        placement, dtype, axes = key
        world = get_world()
        held = [r for r in placement.rank_list() if world.holds(r)]
        flat = {r: torch.cat([g._pieces[r].reshape(-1) for _, g, _ in entries]) for r in held}
        groups = [g for g in axis_groups(placement, axes) if len(g) > 1]
        world.prepare_groups(groups)
        reduced = dict(flat)
        for group in groups:
            mine = [r for r in group if world.holds(r)]
            if mine:
                reduced.update(world.all_reduce(group, {r: flat[r] for r in mine}))
            else:                               # counted on every process, as the boxing executor does
                numel = sum(numel_of(g._layout.piece_shape(group[0])) for _, g, _ in entries)
                world.count("all_reduce", group, all_reduce_bytes(group, numel, dtype.itemsize))
        offset = dict.fromkeys(held, 0)
        for p, g, want in entries:
            pieces = {}
            for r in held:
                n = g._pieces[r].numel()
                pieces[r] = reduced[r][offset[r]:offset[r] + n].view(g._pieces[r].shape)
                offset[r] += n
            with torch.no_grad():
                p.grad = GlobalTensor(want, pieces)
