"""Writes into views whose pieces are not views of their base's pieces.

A view op (its result aliases an input: slice, select, view, transpose, ...) runs on the
pieces of its input, so the result's pieces are views of the input's -- unless the input was
boxed first (a slice along a split dim, say) or the op ran through the fallback: then they are
views of a boxed copy, and a write into the result (``x[2:5] = 0``: a slice, then ``copy_``)
would be lost. Such a result remembers its base and how it was made; after an in-place or
out= op writes it, the written value is put back into the base: the base is gathered, the
view op runs on each replica and the value is copied into that view, and the result is boxed
back into the base's layout and copied into its pieces -- then on up a chain of views.

A metadata in-place op on such a result (``v = x[1:3]; v.t_()``) adds its out-of-place
form to the recipe (:func:`rebase`), so later writes into ``v`` still find their place.

Not covered: a write into the *base* after such a view was taken does not reach the view
(it holds a copy).
"""
from __future__ import annotations

from torch.utils._pytree import tree_map

from ...comm import get_world
from ...sbp import broadcast
from ...tensor import GlobalTensor, box, write_into
from ..schema.args import get
from ..schema.op_record import record


def remember(out, base, func, args, kwargs) -> None:
    """Mark ``out`` (a tensor or a list of them) as a copy-view of ``base`` made by ``func``."""
    if isinstance(out, GlobalTensor):
        if out is not base:
            out._view_of = (base, func, args, kwargs, None)
    elif isinstance(out, (list, tuple)):
        for j, o in enumerate(out):
            if isinstance(o, GlobalTensor) and o is not base:
                o._view_of = (base, func, args, kwargs, j)


class _Then:
    """A copy-view's recipe followed by the out-of-place form of a metadata in-place op."""

    def __init__(self, info, op, rest, kwargs):
        self.info, self.op, self.rest, self.kwargs = info, op, rest, kwargs

    def __call__(self, piece):
        base, func, args, kwargs, j = self.info
        a, kw = tree_map(lambda v: piece if v is base else v, (args, kwargs))
        view = func(*a, **kw)
        return self.op(view if j is None else view[j], *self.rest, **self.kwargs)


def rebase(view: GlobalTensor, op, rest, kwargs) -> None:
    """``view`` is about to be changed by ``op(view, *rest, **kwargs)`` in place (``t_`` as
    ``t``): if it is a copy-view, its recipe now ends with that op."""
    info = getattr(view, "_view_of", None)
    if info is not None:
        view._view_of = (info[0], _Then(info, op, rest, kwargs), (info[0],), {}, None)


def propagate(view: GlobalTensor) -> None:
    """Put ``view``'s value back into the base it was made from (and that one's base, ...)."""
    while True:
        info = getattr(view, "_view_of", None)
        if info is None:
            return
        base, func, args, kwargs, j = info
        b = (broadcast,) * base.placement.ndim
        whole = box(base, base._layout.with_sbp(b))
        value = box(view, view._layout.with_sbp(b))
        world = get_world()
        pieces = {}
        for r in base.placement.rank_list():
            if not world.holds(r):
                continue
            piece = whole._pieces[r]
            if piece is base._pieces.get(r):
                piece = piece.clone()
            a, kw = tree_map(lambda v: piece if v is base else v, (args, kwargs))
            target = func(*a, **kw)
            (target if j is None else target[j]).copy_(value._pieces[r])
            pieces[r] = piece
        write_into(base, GlobalTensor(whole._layout, pieces))
        view = base


class ViewRun:
    """Runs a view op; marks the result when its pieces are not views of the base's pieces."""

    def __init__(self, run, func, pos, target):
        self.run, self.func, self.pos, self.target = run, func, pos, target
        self.index = pos[1] if pos[0] == 0 and pos[2] is None else None     # a plain positional argument

    def __call__(self, args, kwargs):
        out = self.run(args, kwargs)
        base = args[self.index] if self.index is not None else get(args, kwargs, self.pos)
        if type(base) is GlobalTensor and ((base._layout is not self.target and base._layout != self.target) or
                                           getattr(base, "_view_of", None) is not None):
            remember(out, base, self.func, args, kwargs)
        return out


class WriteRun:
    """Runs an in-place / out= op, then puts what it wrote into copy-views back into their bases."""

    def __init__(self, run, positions):
        self.run, self.positions = run, positions

    def __call__(self, args, kwargs):
        out = self.run(args, kwargs)
        done = set()
        for pos in self.positions:
            t = get(args, kwargs, pos)
            if getattr(t, "_view_of", None) is not None and id(t) not in done:
                done.add(id(t))
                propagate(t)
        return out


def fallback_view(func, args, kwargs, out) -> None:
    """The fallback ran a view op on gathered copies: mark its result as a copy-view."""
    i = record(func).view_of
    if i is None:
        return
    base = record(func).at(args, kwargs, i)
    if isinstance(base, GlobalTensor) and (not all(v.is_broadcast for v in base.sbp) or
                                           getattr(base, "_view_of", None) is not None):
        remember(out, base, func, args, kwargs)
