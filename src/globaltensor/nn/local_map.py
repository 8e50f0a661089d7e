"""``gt.local_map``: a function of plain tensors run on each rank's pieces, its arguments and results global.

The escape hatch for per-rank code -- a custom kernel, an op the library has no rule for, code that
knows it holds one shard. Each global argument is first boxed to the layout declared for it; the
function then runs once per rank of the placement this process holds (each simulated rank in turn,
or the one rank of a process world) on that rank's pieces; its tensor results become global tensors
of the declared layouts, their logical shapes read off the pieces. Autograd flows through: the
function's own ops are recorded on the pieces, so its backward runs per rank as well. Under
``gt.compile`` each rank's call is one task of the graph, its backward another (mapped_call.py).

Inside the function, ``gt.local_map.rank()``, ``coord()`` and ``group(axis)`` say whose pieces it
holds. It may not run a collective (a global tensor's op or boxing): in a simulated world one
process runs the function for every rank in turn, so a collective would have no peers to meet.
Communication goes between two mapped calls, as a global op or ``to_global``.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch

from ..boxing import Layout
from ..comm import get_world
from ..comm.world import forbid_collectives
from ..from_local import exchange_shapes, logical_shape, meta_read
from ..placement import Placement
from ..sbp import SbpValue, as_nd_sbp, broadcast, partial_sum
from ..tensor import GlobalTensor, box_like, check_placement, wrap_result
from .mapped_call import call_on_rank, note_read, running_placement, running_rank


def dual_layout(layout: Layout) -> Layout:
    """The layout of a gradient of pieces: split stays split; broadcast becomes partial (each rank's
    copy gets the gradient of its own use, the copies' sum is the gradient) and partial broadcast
    (each piece adds to the sum with weight one, so each gets the whole gradient)."""
    flipped = tuple(partial_sum if v.is_broadcast else broadcast if v.is_partial else v for v in layout.nd_sbp)
    return layout.with_sbp(flipped)


class _Pieces(torch.autograd.Function):
    """A global tensor -> the pieces of the given ranks, differentiably (the pieces' gradients make a
    global tensor of the dual layout, a rank whose piece got none a zero piece)."""

    @staticmethod
    def forward(ctx, x, ranks):
        ctx.layout, ctx.ranks = x._layout, ranks
        return tuple(x._pieces[r].view_as(x._pieces[r]) for r in ranks)

    @staticmethod
    def backward(ctx, *grads):
        layout, world = ctx.layout, get_world()
        pieces = {r: g if g is not None else torch.zeros(layout.piece_shape(r), dtype=layout.dtype,
                                                         device=world.device(layout.placement.type, r))
                  for r, g in zip(ctx.ranks, grads)}
        return GlobalTensor(dual_layout(layout), pieces), None


class _Assemble(torch.autograd.Function):
    """Pieces -> the global tensor of ``layout``; the gradient is boxed to its dual layout and handed
    back piece by piece."""

    @staticmethod
    def forward(ctx, layout, ranks, *pieces):
        ctx.layout, ctx.ranks = layout, ranks
        return GlobalTensor(layout, dict(zip(ranks, pieces)))

    @staticmethod
    def backward(ctx, grad):
        g = box_like(grad, dual_layout(ctx.layout))
        return (None, None) + tuple(g._pieces[r] for r in ctx.ranks)


def pieces_of(x: GlobalTensor, ranks: tuple) -> list:
    """The pieces of ``ranks``, differentiably where a gradient is being recorded (the pieces'
    gradients make a global tensor of the dual layout)."""
    note_read(x)
    if torch.is_grad_enabled() and x.requires_grad:
        return list(_Pieces.apply(x, ranks))
    return [x._pieces[r] for r in ranks]


def assemble(layout: Layout, ranks: tuple, pieces: list, device=None) -> GlobalTensor:
    """The global tensor of ``layout`` made of these ranks' pieces (at least one), differentiably where
    they carry a gradient (boxed to the dual layout and handed back piece by piece); ``device``: the
    wrapper's, where the caller knows it already."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in pieces):
        return _Assemble.apply(layout, ranks, *pieces)
    device = device or get_world().device(layout.placement.type, ranks[0])
    return wrap_result(layout, dict(zip(ranks, pieces)), device, pieces[0])


def local_map(fn: Callable, in_sbp: Sequence, out_sbp, *, placement: Optional[Placement] = None) -> Callable:
    """``fn`` of plain tensors, made a function of global tensors: run on each rank's pieces.

    ``in_sbp`` has one entry per positional argument: the SBP (one value, or one per placement axis)
    its global tensor is boxed to before ``fn`` sees its piece, or None for an argument passed to
    every rank as it is (a number, a plain tensor taken as every rank's own). ``out_sbp`` gives the
    layout of ``fn``'s result (one SBP entry for one tensor; a sequence of entries, None for a
    non-tensor, for a tuple). ``placement`` is needed only when no argument is global. Keyword
    arguments pass to every rank as they are. Differentiable.
    """
    if not callable(fn):
        raise TypeError(f"local_map: fn must be callable, got {type(fn).__name__}")
    if isinstance(in_sbp, SbpValue) or not isinstance(in_sbp, (tuple, list)):
        raise TypeError(f"local_map: in_sbp must be a sequence with one entry per positional argument "
                        f"(an SBP, a tuple of them, or None), got {in_sbp!r}")
    return functools.update_wrapper(_Mapped(fn, tuple(in_sbp), out_sbp, placement), fn)


class _Mapped:
    """A mapped function. It keeps, per call signature (the arguments' layouts and plain values, the
    same on every rank), the layouts its results took: a later call checks its pieces against them
    instead of working the logical shapes out again -- which, in a process world, is a collective."""

    def __init__(self, fn, in_sbp: tuple, out_sbp, placement):
        self.fn, self.in_sbp, self.out_sbp = fn, in_sbp, out_sbp
        self.placement = None if placement is None else check_placement(placement)
        self.name = getattr(fn, "__name__", type(fn).__name__)
        self.nd_sbp: dict = {}          # (argument index, its dims, placement dims) -> nd-SBP
        self.known: dict = {}           # call signature -> _Known: the results' layouts
        self.held = (None, None, ())    # (placement, world, the placement's ranks the world holds here)
        self.reason = (f"globaltensor: collective {{op}} called inside gt.local_map({self.name})'s function: it "
                       f"runs once per rank in turn, so no collective can meet its peers there; communicate "
                       f"between two mapped calls, with a global op or to_global")

    def __call__(self, *args, **kwargs):
        name = self.name
        self._check_arguments(args, kwargs)
        placement = _placement_of(name, args, self.placement)
        world = get_world()
        if self.held[0] is not placement or self.held[1] is not world:
            self.held = (placement, world, tuple(r for r in placement.rank_list() if world.holds(r)))
        ranks = self.held[2]
        if not ranks:
            raise ValueError(f"local_map({name}): this process (rank {world.rank}) holds no rank of the placement "
                             f"{placement}; call it on the placement's ranks only")
        per_rank = [list(args) for _ in ranks]
        signature = [tuple(sorted((k, _plain_key(v)) for k, v in kwargs.items()))] if kwargs else [()]
        for i, arg in enumerate(args):
            if self.in_sbp[i] is None:
                signature.append(_plain_key(arg))
                continue
            boxed = self._boxed(i, arg, placement)
            signature.append(boxed._layout)
            for k, piece in enumerate(pieces_of(boxed, ranks)):
                per_rank[k][i] = piece
        with forbid_collectives(self.reason):
            results = [call_on_rank(self.fn, name, per_rank[k], kwargs, r, placement) for k, r in enumerate(ranks)]
        signature = tuple(signature)
        known = self.known.get(signature)
        if known is None or not _fits(known, results, ranks, name, world):
            known = _Known(_result_layouts(name, results, self.out_sbp, placement, ranks), ranks,
                           world.device(placement.type, ranks[0]))
            if len(self.known) >= _KNOWN_MAX:
                self.known.clear()
            self.known[signature] = known
        return _wrap_results(results, known, ranks)

    def _check_arguments(self, args: tuple, kwargs: dict) -> None:
        name, in_sbp = self.name, self.in_sbp
        if len(args) != len(in_sbp):
            raise ValueError(f"local_map({name}): in_sbp has {len(in_sbp)} entries, the call gave "
                             f"{len(args)} positional arguments")
        for key, v in kwargs.items():
            if isinstance(v, GlobalTensor):
                raise TypeError(f"local_map({name}): keyword argument {key!r} is a global tensor; pass it "
                                f"positionally with its entry in in_sbp")
        for i, (arg, spec) in enumerate(zip(args, in_sbp)):
            if spec is None and isinstance(arg, GlobalTensor):
                raise TypeError(f"local_map({name}): argument {i} is a global tensor but in_sbp[{i}] is None; "
                                f"give the SBP its pieces should have")
            if spec is not None and not isinstance(arg, GlobalTensor):
                raise TypeError(f"local_map({name}): in_sbp[{i}] is {spec!r}, so argument {i} must be a global "
                                f"tensor, got {type(arg).__name__}")

    def _boxed(self, i: int, arg: GlobalTensor, placement: Placement) -> GlobalTensor:
        key = (i, arg.dim(), placement.ndim)
        nd = self.nd_sbp.get(key)
        if nd is None:
            nd = self.nd_sbp[key] = as_nd_sbp(self.in_sbp[i], placement.ndim, arg.dim(),
                                              f"local_map({self.name}) in_sbp[{i}]")
        return arg if arg._layout.nd_sbp == nd else arg.to_global(sbp=nd)


_KNOWN_MAX = 256


def _plain_key(v):
    """What a call signature keeps of a plain argument: a tensor's meta, a hashable value itself."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype)
    try:
        hash(v)
    except TypeError:
        return ("unhashable", type(v).__name__)
    return v


def _placement_of(name: str, args: tuple, given: Optional[Placement]) -> Placement:
    found = [(i, a.placement) for i, a in enumerate(args) if isinstance(a, GlobalTensor)]
    for i, p in found:
        if given is not None and p != given:
            raise ValueError(f"local_map({name}): argument {i} lives on {p}, not on the placement {given}")
        if p != found[0][1]:
            raise ValueError(f"local_map({name}): arguments {found[0][0]} and {i} live on different placements "
                             f"({found[0][1]} and {p}); bring them to one with to_global first")
    if given is not None:
        return given
    if not found:
        raise ValueError(f"local_map({name}): no argument is a global tensor; give placement=")
    return found[0][1]


class _Known:
    """The results' layouts of one call signature, with each tensor result's pieces' shapes on the
    ranks held here, and the device its wrapper reports."""
    __slots__ = ("single", "layouts", "shapes", "device")

    def __init__(self, found: tuple, ranks: tuple, device):
        self.single, self.layouts = found
        self.shapes = tuple(None if layout is None else tuple(layout.piece_shape(r) for r in ranks)
                            for layout in self.layouts)
        self.device = device


def _fits(known: _Known, results: list, ranks: tuple, name: str, world) -> bool:
    """Whether the pieces are those of the layouts the same call signature gave before. In a process
    world the other ranks trust the layouts without asking, so pieces that do not fit are an error."""
    single = known.single
    for j, shapes in enumerate(known.shapes):
        if shapes is None:
            continue
        dtype = known.layouts[j].dtype
        for k, res in enumerate(results):
            piece = res if single else res[j]
            if isinstance(piece, torch.Tensor) and piece.shape == shapes[k] and piece.dtype == dtype:
                continue
            if world.simulated:
                return False
            layout = known.layouts[j]
            got = tuple(piece.shape) if isinstance(piece, torch.Tensor) else piece
            raise ValueError(f"local_map({name}): rank {ranks[k]}'s piece of {_what(single, j)} is {got!r}, but an "
                             f"earlier call with the same argument layouts made it {shapes[k]} ({layout.nd_sbp} of "
                             f"{tuple(layout.shape)}); a result's logical shape must follow from the arguments' "
                             f"layouts and plain values")
    return True


def _what(single: bool, j: int) -> str:
    return "the result" if single else f"result {j}"


def _result_layouts(name: str, results: list, out_sbp, placement: Placement, ranks: tuple) -> tuple:
    """``(single, layouts)``: whether ``fn`` returned one tensor, and each result's layout (None for a
    non-tensor, checked equal on every rank), its logical shape read off the pieces."""
    first = results[0]
    if isinstance(first, torch.Tensor):
        return True, (_layout_of(name, _what(True, 0), results, out_sbp, placement, ranks),)
    if not isinstance(first, (tuple, list)):
        _check_plain(name, _what(True, 0), results, out_sbp)
        return True, (None,)
    if isinstance(out_sbp, SbpValue) or not isinstance(out_sbp, (tuple, list)) or len(out_sbp) != len(first):
        raise ValueError(f"local_map({name}): fn returned {len(first)} values, so out_sbp must be a sequence of "
                         f"{len(first)} entries, got {out_sbp!r}")
    layouts = []
    for j, spec in enumerate(out_sbp):
        values = [res[j] for res in results]
        if isinstance(values[0], torch.Tensor):
            layouts.append(_layout_of(name, _what(False, j), values, spec, placement, ranks))
        else:
            _check_plain(name, _what(False, j), values, spec)
            layouts.append(None)
    return False, tuple(layouts)


def _check_plain(name: str, what: str, values: list, spec) -> None:
    """A non-tensor result: the same on every rank this process holds, returned once."""
    if spec is not None:
        raise TypeError(f"local_map({name}): {what} is a {type(values[0]).__name__}, not a tensor; its out_sbp "
                        f"entry must be None, got {spec!r}")
    if any(v != values[0] for v in values[1:]):
        raise ValueError(f"local_map({name}): {what} differs between ranks ({values}); return a tensor to keep "
                         f"a value per rank")


def _layout_of(name: str, what: str, pieces: list, spec, placement: Placement, ranks: tuple) -> Layout:
    if spec is None:
        raise TypeError(f"local_map({name}): {what} is a tensor but its out_sbp entry is None; give its SBP")
    if not all(isinstance(p, torch.Tensor) and not isinstance(p, GlobalTensor) for p in pieces):
        raise TypeError(f"local_map({name}): {what} must be a plain tensor on every rank, got "
                        f"{[type(p).__name__ for p in pieces]}")
    dtypes = {p.dtype for p in pieces}
    if len(dtypes) > 1:
        raise ValueError(f"local_map({name}): {what} has different dtypes on different ranks: "
                         f"{sorted(map(str, dtypes))}")
    nd = as_nd_sbp(spec, placement.ndim, pieces[0].dim(), f"local_map({name}) out_sbp for {what}")
    return Layout(_logical_shape(name, what, pieces, placement, nd, ranks), pieces[0].dtype, placement, nd)


def _logical_shape(name: str, what: str, pieces: list, placement: Placement, nd: tuple, ranks: tuple) -> tuple:
    label = f"local_map({name}) {what}"
    if len(ranks) == len(placement.rank_list()):
        return logical_shape({r: tuple(p.shape) for r, p in zip(ranks, pieces)}, placement, nd, label)
    if not any(v.is_split for v in nd):
        return tuple(pieces[0].shape)
    group = tuple(placement.rank_list())
    with meta_read():
        shapes = exchange_shapes(pieces[0], group)
    return logical_shape(shapes, placement, nd, label)


def _wrap_results(results: list, known: _Known, ranks: tuple):
    layouts, device = known.layouts, known.device
    if known.single:
        return results[0] if layouts[0] is None else assemble(layouts[0], ranks, results, device)
    first = results[0]
    return type(first)(first[j] if layout is None else assemble(layout, ranks, [res[j] for res in results], device)
                       for j, layout in enumerate(layouts))


def _coord() -> tuple:
    return running_placement().coord(_current("coord"))


def _current(what: str) -> int:
    rank = running_rank()
    if rank is None:
        raise RuntimeError(f"gt.local_map.{what}() is only defined inside a function gt.local_map runs")
    return rank


def _group(axis: int = 0) -> tuple:
    """The ranks along placement ``axis`` that share the running rank's other coordinates, in order."""
    coord = _coord()
    p = running_placement()
    if not 0 <= axis < p.ndim:
        raise ValueError(f"gt.local_map.group(axis): axis must be in 0..{p.ndim - 1}, got {axis}")
    index = list(coord)
    index[axis] = slice(None)
    return tuple(int(r) for r in p.ranks[tuple(index)])


local_map.rank = lambda: _current("rank")
local_map.rank.__doc__ = "The rank whose pieces the running mapped function holds."
local_map.coord = _coord
local_map.coord.__doc__ = "The running rank's position in the placement's hierarchy."
local_map.group = _group
