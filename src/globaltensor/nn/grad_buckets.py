"""Gradient buckets: data-parallel gradients reduced in flat buckets as the backward produces them.

A parameter whose gradient arrives partial over the data axis (a broadcast parameter used on a
batch split over that axis) needs a reduction before an optimizer can use it. Reducing each
gradient when it is read costs one collective per parameter, all after the backward. Here each
gradient joins a bucket when autograd has accumulated it (``register_post_accumulate_grad_hook``),
in backward order; a bucket reaching ``bucket_bytes`` (the first one of a backward at 1 MB, as
DDP does, so that communication starts early; the rest at the end of the backward) is reduced
as one flat collective over the partial axes: an all-reduce where the gradient is wanted
broadcast there, a reduce-scatter where it is wanted split (a ``ZeroOptimizer``'s parameters,
marked ``_sharded_grad`` with their shard's nd-SBP). The parameters' gradients become the
reduced ones -- the value and layout reading ``.grad`` would give (a split one is gathered when
read, as before). As in DDP, a gradient that would take an all-reduce bucket past the limit
starts the next one, and each gradient is copied into its bucket's flat buffer when it arrives,
so the copies spread over the backward instead of delaying the collective. A buffer holds the
limit, or what the watched parameters' gradients still to come in this backward can fill where
that is less (a model's last bucket, or a small model's only one, is not a whole limit's worth).

Two modes. *Eager* (``overlap=True``, what :func:`bucket_gradients` and ``distribute_module``
install): a full bucket's collective is started and runs while the backward goes on (gloo /
NCCL async work in a process world, a communication thread for simulated ranks); the end of
the backward starts the last buckets and waits for all of them, so ``backward()`` returns with
every gradient reduced, as with ``DistributedDataParallel``. Inside :meth:`GradBuckets.no_sync`
nothing is reduced: gradients accumulate partial over several backwards, and the first backward
outside reduces the sum. A backward outside ``no_sync`` onto gradients already reduced turns them
partial again first (no communication), so its sum is bucketed too. *Traced* (``gt.compile``'s
capture): each bucket's all-reduce runs at once and is recorded; in the compiled graph it runs on the collective stream while the backward
of earlier layers still computes. An eager bucketer stands aside while a call is captured
(collectives observed): the capture buckets by its own ``bucket_bytes``.

Every process makes the same bucketing decisions (they follow from layouts, never from values),
so the collectives line up across processes.
"""
from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional, Union

import torch
from torch import nn

from ..boxing.layout import axis_groups
from ..comm import get_world
from ..observe.context import labelled
from ..comm.stats import ring_bytes
from ..comm.world import all_reduce_bytes, done, observed
from ..sbp.shape import numel as numel_of
from ..compat.storage import alone_on_storage
from ..tensor import GlobalTensor, box, gradient_layout

_raw_grad = torch._C.TensorBase.grad
FIRST_BUCKET_BYTES = 2 ** 20
DEFAULT_BUCKET_BYTES = 25 * 2 ** 20


class GradBuckets:
    """Buckets the gradients of the parameters it watches; see the module docstring."""

    def __init__(self, bucket_bytes: int, overlap: bool = False):
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 0:
            raise ValueError(f"bucket_bytes: expected a non-negative int, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self.pending: dict = {}        # bucket key -> [(param, partial gradient, target layout)]
        self.sizes: dict = {}
        self.filling: dict = {}        # all-reduce bucket key -> its flat buffers, filled as gradients arrive
        self.started: list = []        # (started collectives, entries) of this backward
        self.handles: list = []
        self.watched: set = set()
        self.watched_numel: dict = {}  # (dtype, rank) -> elements of the watched parameters' pieces
        self.arrived_numel: dict = {}  # (dtype, rank) -> of those whose gradient this backward bucketed
        self.backward_id = None        # autograd's id of the backward running (a new one: a new end callback)
        self.flushed_once = False      # the first bucket of each backward is small (FIRST_BUCKET_BYTES)
        self.syncing = True
        self.made: list = []           # the flat buffers this backward fills
        self.spare: dict = {}          # (numel, dtype, device) -> the last backward's, to fill again when free
        self.on_new_buffer: Optional[Callable[[int, torch.Tensor], None]] = None   # told (rank, buffer) of each
        self.on_bucketed: Optional[Callable[[GlobalTensor], None]] = None   # told of each gradient a bucket takes

    def watch(self, p) -> None:
        """Bucket ``p``'s gradient from now on, if it is a global leaf that gets one."""
        if (type(p) is not GlobalTensor or not p.requires_grad or p.grad_fn is not None or id(p) in self.watched
                or (not self.overlap and getattr(p, "_sharded_grad", False))):
            return
        self.watched.add(id(p))
        _count_pieces(self.watched_numel, p)
        self.handles.append(p.register_post_accumulate_grad_hook(self._ready))
        if self.overlap:
            self.handles.append(p.register_hook(functools.partial(self._arriving, weakref.ref(p))))

    def close(self) -> None:
        """Stop bucketing (the hooks are removed)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.watched.clear()
        self.watched_numel.clear()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within, backwards reduce nothing: gradients accumulate partial; the first backward after
        reduces their sum (gradient accumulation, as ``DistributedDataParallel.no_sync``)."""
        previous, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = previous

    # -- the hooks --------------------------------------------------------------------------
    def _arriving(self, param, grad):
        """Before a gradient is accumulated into one a bucket reduced (a second backward outside
        ``no_sync``): the stored gradient becomes partial again, which costs no communication (one
        rank keeps it, the others hold zeros; a split one is padded), so that autograd's sum is
        partial and joins a bucket, instead of each gradient being reduced to be added in place."""
        p = param()
        g = None if p is None else _raw_grad.__get__(p)
        if (not self.syncing or observed() or type(g) is not GlobalTensor or type(grad) is not GlobalTensor
                or g._layout.has_partial or not grad._layout.has_partial or g.shape != grad.shape):
            return None
        nd = tuple(v if v.is_partial else u for u, v in zip(g.sbp, grad.sbp))
        with torch.no_grad():
            _raw_grad.__set__(p, box(g, g._layout.with_sbp(nd)))
        return None

    def _ready(self, p) -> None:
        if not self.syncing or (self.overlap and observed()):
            return
        g = _raw_grad.__get__(p)
        if type(g) is not GlobalTensor or not g._layout.has_partial:
            return
        planned = _plan(p, g, self.overlap)
        if planned is None:
            return
        kind, want, axes = planned
        key = (g.placement, g.dtype, axes, kind)
        nbytes = g.numel() * g.element_size()
        task = torch._C._current_graph_task_id()
        if task != self.backward_id:           # the first gradient of this backward
            self.backward_id, self.flushed_once, self.arrived_numel = task, False, {}
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if kind == "all_reduce":
            if key in self.pending and (self.sizes[key] + nbytes > self._limit() or not self._fits(key, g)):
                self.flushed_once = True       # it would overflow the bucket: that goes first
                self._flush(key)
            self._fill(key, g)
        _count_pieces(self.arrived_numel, p)
        self.pending.setdefault(key, []).append((p, g, want))
        if self.on_bucketed is not None:
            self.on_bucketed(g)
        self.sizes[key] = self.sizes.get(key, 0) + nbytes
        if self.sizes[key] >= self._limit():
            self.flushed_once = True
            self._flush(key)

    def _limit(self) -> int:
        return self.bucket_bytes if self.flushed_once else min(self.bucket_bytes, FIRST_BUCKET_BYTES)

    def _fits(self, key, g: GlobalTensor) -> bool:
        """Whether ``g``'s pieces fit in what its bucket's buffers have left (made for the limit when
        the bucket began: the first bucket of a backward is smaller)."""
        filling = self.filling.get(key)
        return filling is None or all(filling[1][r] + t.numel() <= filling[0][r].numel() for r, t in g._pieces.items())

    def _fill(self, key, g: GlobalTensor) -> None:
        """Copy ``g``'s pieces into its all-reduce bucket's flat buffers, as DDP does, so that the
        copies spread over the backward instead of one ``cat`` of the whole bucket delaying its
        collective. A bucket over axes of one rank needs no reduction, hence no buffer."""
        filling = self.filling.get(key)
        if filling is None:
            placement, dtype, axes, _ = key
            if not _groups(placement, axes, get_world()):
                return
            # no more than the limit, nor than the gradients still to come can fill: the last bucket of
            # a backward is as large as what is left of it, not a whole limit's worth of unused memory
            limit = self._limit() // g.element_size()
            filling = self.filling[key] = (
                {r: self._buffer(r, max(min(limit, self._still_to_come(dtype, r)), t.numel()), dtype, t.device)
                 for r, t in g._pieces.items()},
                dict.fromkeys(g._pieces, 0))
        flats, used = filling
        for r, t in g._pieces.items():
            n = t.numel()
            flats[r][used[r]:used[r] + n].view(t.shape).copy_(t)
            used[r] += n

    def _still_to_come(self, dtype, rank: int) -> int:
        """Elements of rank ``rank``'s pieces of the watched parameters of ``dtype`` whose gradient
        this backward has not bucketed yet: a bound on what a bucket begun now can be filled with (a
        gradient's piece is its parameter's, partial over the data axes)."""
        return self.watched_numel.get((dtype, rank), 0) - self.arrived_numel.get((dtype, rank), 0)

    def _buffer(self, rank: int, numel: int, dtype, device) -> torch.Tensor:
        """A flat buffer for a new bucket of ``rank``: one the last backward filled, of this size, once
        nothing holds it any more (its gradients were cleared or replaced), else a new one. DDP keeps
        its buckets for the same reason: memory the allocator hands out afresh costs a page fault per
        page when first written, and the copies into a bucket would pay them every step. A new one
        is told to ``on_new_buffer`` (auto_plan's memory counts them as held from step to step)."""
        spare = self.spare.get((numel, dtype, device), [])
        free = next((i for i, b in enumerate(spare) if alone_on_storage(b)), None)
        if free is not None:
            buf = spare.pop(free)
        else:
            buf = torch.empty(numel, dtype=dtype, device=device)
            if self.on_new_buffer is not None:
                self.on_new_buffer(rank, buf)
        self.made.append(buf)
        return buf

    def _end_of_backward(self) -> None:
        self.backward_id = None
        self.spare = {}
        for buf in self.made:
            self.spare.setdefault((buf.numel(), buf.dtype, buf.device), []).append(buf)
        self.made = []
        for key in list(self.pending):
            self._flush(key)
        started, self.started = self.started, []
        for finish in started:
            finish()

    @labelled("gradient bucket")
    def _flush(self, key) -> None:
        entries = self.pending.pop(key, [])
        self.sizes.pop(key, None)
        if not entries:
            return
        filling = self.filling.pop(key, None)
        if key[3] == "all_reduce":
            flat = None if filling is None else {r: buf[:filling[1][r]] for r, buf in filling[0].items()}
            finish = _start_all_reduce(key, entries, self.overlap, flat)
        else:
            finish = _start_reduce_scatter(key, entries, self.overlap)
        if self.overlap:
            self.started.append(finish)
        else:
            finish()


def _plan(p, g: GlobalTensor, overlap: bool) -> Optional[tuple]:
    """("all_reduce" | "reduce_scatter", target layout, partial axes) for ``p``'s partial gradient
    ``g``, or None to leave it to be reduced when read."""
    sharded = getattr(p, "_sharded_grad", None)
    if isinstance(sharded, tuple):
        if not overlap:
            return None
        want = g._layout.with_sbp(sharded)
    else:
        want = gradient_layout(p._layout)
    if want.shape != g._layout.shape:
        return None
    axes = tuple(a for a, v in enumerate(g.sbp) if v.is_partial)
    if all(u == v or (u.is_partial and v.is_broadcast) for u, v in zip(g.sbp, want.nd_sbp)):
        return "all_reduce", want, axes
    if (len(axes) == 1 and want.nd_sbp[axes[0]].is_split and not want.blocked and not g._layout.blocked
            and all(u == v for a, (u, v) in enumerate(zip(g.sbp, want.nd_sbp)) if a != axes[0])
            and _chunks_line_up(g._layout, want, axes)):
        return "reduce_scatter", want, axes
    return None


def _chunks_line_up(source, target, axes) -> bool:
    """Whether each member's piece of ``target`` is a slice of the partial piece (the same on every
    member of a group) along the split dim, the others whole."""
    d = target.nd_sbp[axes[0]].dim
    for group in axis_groups(source.placement, axes):
        box = source.box(group[0])
        for r in group:
            want = target.box(r)
            if any(w != b for k, (w, b) in enumerate(zip(want, box)) if k != d):
                return False
            if not (box[d][0] <= want[d][0] and want[d][0] + want[d][1] <= box[d][0] + box[d][1]):
                return False
    return True


def _groups(placement, axes, world) -> list:
    groups = [g for g in axis_groups(placement, axes) if len(g) > 1]
    world.prepare_groups(groups)
    return groups


def _start_all_reduce(key, entries, overlap: bool, flat: Optional[dict]):
    """Start one flat all-reduce per group over the bucket, whose gradients ``flat`` holds one after
    the other (None: a bucket over axes of one rank); returns what finishes it."""
    placement, dtype, axes, _ = key
    world = get_world()
    held = [r for r in placement.rank_list() if world.holds(r)]
    if flat is None:                        # partial over axes of one rank: each piece is the sum
        return functools.partial(_regrad, entries)
    groups = _groups(placement, axes, world)
    started = []
    for group in groups:
        mine = [r for r in group if world.holds(r)]
        if not mine:                        # counted on every process, as the boxing executor does
            numel = sum(numel_of(g._layout.piece_shape(group[0])) for _, g, _ in entries)
            world.count("all_reduce", group, all_reduce_bytes(group, numel, dtype.itemsize))
        elif overlap:
            started.append(world.all_reduce_async(group, {r: flat[r] for r in mine}))
        else:
            started.append(done(world.all_reduce_in_place(group, {r: flat[r] for r in mine})))

    def finish():
        reduced = dict(flat)
        for s in started:
            reduced.update(s.wait())
        offset = dict.fromkeys(held, 0)
        for p, g, want in entries:
            pieces = {}
            for r in held:
                n = g._pieces[r].numel()
                pieces[r] = reduced[r][offset[r]:offset[r] + n].view(g._pieces[r].shape)
                offset[r] += n
            with torch.no_grad():
                p.grad = GlobalTensor(want, pieces)
    return finish


def _regrad(entries) -> None:
    """Each gradient in its wanted layout, the pieces as they are (no rank to sum with)."""
    with torch.no_grad():
        for p, g, want in entries:
            p.grad = GlobalTensor(want, g._pieces)


def _start_reduce_scatter(key, entries, overlap: bool):
    """Start one flat reduce-scatter per group: each rank's buffer holds, member by member, the
    slices of every gradient that member keeps."""
    placement, dtype, axes, _ = key
    dims = [want.nd_sbp[axes[0]].dim for _, _, want in entries]
    world = get_world()
    started, shapes = [], {}
    for group in _groups(placement, axes, world):
        sizes = [sum(numel_of(want.piece_shape(r)) for _, _, want in entries) for r in group]
        mine = [r for r in group if world.holds(r)]
        if not mine:
            world.count("reduce_scatter", group, ring_bytes(group, [s * dtype.itemsize for s in sizes]))
            continue
        send = {}
        for r in mine:
            buf = torch.empty(sum(sizes), dtype=dtype, device=world.device(placement.type, r))
            offset = 0
            for member in group:
                for (_, g, want), d in zip(entries, dims):
                    start, length = want.box(member)[d]
                    chunk = g._pieces[r].narrow(d, start - g._layout.box(member)[d][0], length)
                    n = chunk.numel()
                    buf[offset:offset + n].view(chunk.shape).copy_(chunk)
                    offset += n
            send[r] = buf
        started.append(world.reduce_scatter_async(group, send, sizes) if overlap else
                       done(world.reduce_scatter(group, send, 0, sizes)))
        for r in mine:
            shapes[r] = [want.piece_shape(r) for _, _, want in entries]

    def finish():
        reduced = {}
        for s in started:
            reduced.update(s.wait())
        for j, (p, g, want) in enumerate(entries):
            pieces = {}
            for r, flat in reduced.items():
                offset = sum(numel_of(s) for s in shapes[r][:j])
                pieces[r] = flat[offset:offset + numel_of(shapes[r][j])].view(shapes[r][j])
            with torch.no_grad():
                p.grad = GlobalTensor(want, pieces)
    return finish


# -- the user's side ----------------------------------------------------------------------
def bucket_gradients(params: Union[nn.Module, Iterable], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> GradBuckets:
    """Reduce the data-parallel gradients of ``params`` (a module's parameters, or an iterable of
    global parameters) in buckets of about ``bucket_bytes``, overlapped with the backward.

    ``gt.nn.distribute_module`` does this for the module it distributes (its ``bucket_bytes=``;
    0 turns it off). Returns the :class:`GradBuckets`; ``close()`` removes its hooks and
    ``no_sync()`` (or ``gt.nn.no_sync(module)``) accumulates gradients without reducing.
    """
    if isinstance(params, torch.Tensor) or not isinstance(params, (nn.Module, Iterable)):
        raise TypeError(f"bucket_gradients(params): expected an nn.Module or an iterable of parameters, "
                        f"got {type(params).__name__}")
    buckets = GradBuckets(bucket_bytes, overlap=True)
    module = params if isinstance(params, nn.Module) else None
    for p in (params.parameters() if module is not None else params):
        buckets.watch(p)
    if module is not None:
        previous = getattr(module, "_gt_grad_buckets", None)
        if previous is not None:
            previous.close()
        module._gt_grad_buckets = buckets
    return buckets


@contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Accumulate gradients over the backwards run inside without reducing them (as
    ``DistributedDataParallel.no_sync``); the first backward after reduces their sum. A module
    whose gradients are not bucketed reduces them when read anyway: then this does nothing."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"no_sync(module): expected an nn.Module, got {type(module).__name__}")
    buckets = getattr(module, "_gt_grad_buckets", None)
    if buckets is None:
        yield
        return
    with buckets.no_sync():
        yield


def _count_pieces(counts: dict, p: GlobalTensor) -> None:
    """Add the elements of each of ``p``'s pieces to ``counts[(dtype, rank)]``."""
    for r, t in p._pieces.items():
        counts[p.dtype, r] = counts.get((p.dtype, r), 0) + t.numel()
