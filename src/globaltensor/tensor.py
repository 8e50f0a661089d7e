"""GlobalTensor: a torch.Tensor wrapper subclass holding a logical tensor's global meta and pieces.

The wrapper's own shape, dtype and device are the logical tensor's; ``_pieces`` maps each
rank of the placement that lives in this process to its local piece. Ops on it go through
``__torch_dispatch__``, which the ops layer installs with :func:`set_dispatcher`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .boxing import Layout, execute, plan_boxing
from .compat.aot_cache import stable_cache_hash
from .compat.dynamo import constant, trace_through
from .boxing.executor import ready
from .boxing.interned import intern
from .comm import collective_call, get_world
from .comm import current as _current
from .observe.context import run_labelled
from .placement import Placement
from .sbp import Broadcast, PartialSum, Split, as_nd_sbp, broadcast, check_blocks

_PIECE = "_piece_"          # the inner tensors' names of __tensor_flatten__: _piece_<rank>

def set_dispatcher(fn: Callable) -> None:
    """Install ``fn(cls, func, types, args, kwargs)`` as ``__torch_dispatch__`` (the ops layer's)."""
    GlobalTensor.__torch_dispatch__ = classmethod(fn)


def _strides_like(piece: torch.Tensor, shape: tuple):
    """Strides of ``shape`` laid out in the dim order of ``piece``, a non-contiguous piece.

    The wrapper reports the memory order its pieces have, as a plain tensor would: a transposed
    gradient then reads as non-contiguous, so autograd and ``.contiguous()`` treat it as torch
    does instead of running later ops on strided pieces unawares.
    """
    stride = piece.stride()
    if len(stride) != len(shape):
        return None
    order = sorted(range(len(stride)), key=stride.__getitem__, reverse=True)     # stable: ties by dim
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def _device(placement: Placement) -> torch.device:
    world = get_world()
    return world.device(placement.type, world.local_ranks[0])


_grad_slot = torch._C.TensorBase.grad
_on_create: Optional[Callable] = None


def observe_creation(observer: Optional[Callable]) -> Optional[Callable]:
    """Call ``observer(t)`` with every GlobalTensor made from now on (None: stop); returns the
    previous observer. The traced mode learns through it which wrappers a captured call creates."""
    global _on_create
    previous, _on_create = _on_create, observer
    return previous


_make_wrapper = torch.Tensor._make_wrapper_subclass


def _make_inference_view(cls, shape, **kwargs):
    """The wrapper of inference pieces made outside ``torch.inference_mode`` -- ``to_global`` of
    an inference tensor, a view op on an inference global -- an inference tensor too, as torch
    makes a view of one. Torch checks the bit on the wrapper, above the dispatcher (in-place
    updates outside inference mode, saving for backward); inside ``__torch_dispatch__`` it never
    checks the pieces'. (Made under inference mode, the wrapper is an inference tensor anyway.)"""
    with torch.inference_mode():
        return _make_wrapper(cls, shape, **kwargs)


def _wrapper_maker(piece):
    return _make_inference_view if piece.is_inference() and not torch.is_inference_mode_enabled() \
        else _make_wrapper


def wrap_result(layout, pieces: dict, device, piece) -> "GlobalTensor":
    """``GlobalTensor(layout, pieces, device=device)`` for an op's fresh result, ``piece`` one of
    its pieces: the same wrapper, built without the constructor's look-ups (the ops' hot path)."""
    # _wrapper_maker, inlined: the hot path
    make = _make_inference_view if piece.is_inference() and not torch.is_inference_mode_enabled() else _make_wrapper
    t = make(GlobalTensor, layout.shape, dtype=layout.dtype, device=device,
             strides=None if piece.is_contiguous() else _strides_like(piece, layout.shape))
    t._layout = layout
    t._pieces = pieces
    if piece.is_conj() or piece.is_neg():
        _mirror_bits(t, piece)
    if _on_create is not None:
        _on_create(t)
    return t


def wrap_fresh(layout, pieces: dict, device, piece) -> "GlobalTensor":
    """:func:`wrap_result` for a result that aliases no input (its op's schema says so): such a
    piece is made by the kernel under the caller's inference mode and carries no conjugate or
    negative bit, so only its memory order is read."""
    t = _make_wrapper(GlobalTensor, layout.shape, dtype=layout.dtype, device=device,
                      strides=None if piece.is_contiguous() else _strides_like(piece, layout.shape))
    t._layout = layout
    t._pieces = pieces
    if _on_create is not None:
        _on_create(t)
    return t


def _mirror_bits(t: torch.Tensor, piece: torch.Tensor) -> None:
    """The wrapper carries its pieces' conjugate and negative bits (``x.conj()`` is a lazy view).

    Kernels run on pieces inside ``__torch_dispatch__``, where torch excludes the Conjugate and
    Negative keys: only the wrapper's bits make torch resolve them (before dispatching to the
    subclass) for ops that do not read the bits themselves. A bit only the pieces had would be
    silently dropped by the next op."""
    if piece.is_conj():
        torch._C._set_conj(t, True)
    if piece.is_neg():
        torch._C._set_neg(t, True)


class GlobalTensor(torch.Tensor):
    """A logical tensor laid out over the ranks of a placement: its meta is global (``shape``,
    ``dtype``, ``placement``, ``sbp``), its data the pieces of the ranks this process holds.

    Made by ``x.to_global``, ``gt.to_global``, ``gt.distribute`` and the global factories; every
    torch op on it runs through ``__torch_dispatch__`` (an SBP signature, boxing, the local op on
    each piece) and autograd works through it.
    """
    _layout: Layout
    _pieces: dict
    _boxed = None   # the ops layer's kept boxed copy (ops/kept_boxed_copy.py); a class default reads fast
    _view_of = None     # a copy-view's recipe (ops/writes/copy_views.py), likewise
    __torch_function__ = torch._C._disabled_torch_function_impl
    # by identity, as torch.Tensor's, but in C: a tensor's is a Python function, and an optimizer looks
    # up every parameter's state by the parameter at every step
    __hash__ = object.__hash__

    @staticmethod
    def __new__(cls, layout: Layout, pieces: dict, requires_grad: bool = False, device=None):
        piece = next(iter(pieces.values()), None)
        t = (_make_wrapper if piece is None else _wrapper_maker(piece))(
            cls, layout.shape, dtype=layout.dtype, device=device or _device(layout.placement),
            requires_grad=requires_grad,
            strides=None if piece is None or piece.is_contiguous() else _strides_like(piece, layout.shape))
        t._layout = layout
        t._pieces = pieces
        if piece is not None:
            _mirror_bits(t, piece)
        if _on_create is not None:
            _on_create(t)
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"globaltensor: no op dispatcher is installed to run {func}")

    # -- meta -----------------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        """The ranks that hold pieces of this tensor (1-D or N-D)."""
        return self._layout.placement

    @property
    def sbp(self) -> tuple:
        """The nd-SBP: a tuple with one SBP value per placement axis."""
        return self._layout.nd_sbp

    @property
    def is_global(self) -> bool:
        """True (plain tensors answer False once globaltensor is imported)."""
        return True

    @property
    def layout_meta(self) -> Layout:
        """The layout (global shape, dtype, placement, nd-SBP): every rank's piece, without data."""
        return self._layout

    def __repr__(self, *, tensor_contents=None) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (f"GlobalTensor(shape={tuple(self.shape)}, dtype={self.dtype}, placement={self.placement}, "
                f"sbp={self.sbp}{grad})")

    @property
    def grad(self):
        """The gradient in this tensor's layout (partial axes as broadcast): an accumulated
        partial gradient is reduced here, once, when it is read. A gradient already in it takes
        the tensor's interned layout object (and so does the tensor), so that the next read -- an
        optimizer's step reads each gradient several times -- is an identity check.

        A parameter a ``ZeroOptimizer`` shards (``_sharded_grad``: its shard's nd-SBP) reads its
        gradient in the shard's layout instead: the reduce-scatter ZeRO makes anyway, never gathered
        back -- clipping measures and scales the shards, as the optimizer steps them."""
        g = _grad_slot.__get__(self)
        if g.__class__ is GlobalTensor and g._layout is not self._layout:     # the same object: nothing to do
            sharded = self.__dict__.get("_sharded_grad")
            want = gradient_layout(self._layout) if sharded is None else self._layout.with_sbp(sharded)
            if g._layout != want:
                g = run_labelled("grad read", box, g, want)
                _grad_slot.__set__(self, g)
            elif want is self._layout:
                g._layout = self._layout = intern(want)
        return g

    @grad.setter
    def grad(self, value):
        _grad_slot.__set__(self, value)

    @grad.deleter
    def grad(self):
        _grad_slot.__set__(self, None)

    # -- local views ----------------------------------------------------------------------
    def local_tensors(self) -> dict:
        """``{rank: piece}`` for every rank of the placement that lives in this process."""
        return dict(self._pieces)

    def to_local(self, rank: Optional[int] = None) -> torch.Tensor:
        """This rank's piece (``rank=`` picks one in a simulated world); empty outside the placement."""
        return _ToLocal.apply(self, _pick_rank(rank))

    def full_tensor(self) -> torch.Tensor:
        """The whole logical value as a plain tensor, on every rank (differentiable). A collective:
        every rank calls it."""
        with collective_call("full_tensor()", self.placement):
            return self._full_tensor()

    def _full_tensor(self) -> torch.Tensor:
        whole = self.to_global(sbp=(broadcast,) * self.placement.ndim)
        world = get_world()
        if len(self.placement.rank_list()) != world.size:  # the same answer on every rank
            everywhere = Placement(self.placement.type, list(range(world.size)))
            whole = whole.to_global(placement=everywhere, sbp=broadcast)
        return whole.to_local()

    def numpy(self, *, force: bool = False):
        """The whole logical value as a numpy array, on every rank (a collective)."""
        with collective_call("numpy()", self.placement):
            return self._full_tensor().detach().cpu().numpy()

    def tolist(self):
        """The whole logical value as nested lists, on every rank (a collective)."""
        with collective_call("tolist()", self.placement):
            return self._full_tensor().tolist()

    def item(self):
        """The value of a one-element tensor, on every rank (a collective)."""
        with collective_call("item()", self.placement):
            return self._full_tensor().item()

    # -- tracing by torch.compile ---------------------------------------------------------
    def __tensor_flatten__(self):
        """The traceable wrapper subclass protocol: the pieces of the ranks this process holds as
        the inner tensors (``_piece_<rank>``; one in a process world, one per simulated rank in a
        simulated one), the layout and those ranks as the (hashable) context."""
        ranks = tuple(sorted(self._pieces))
        names = [f"{_PIECE}{r}" for r in ranks]
        for r, name in zip(ranks, names):
            if not hasattr(GlobalTensor, name):
                setattr(GlobalTensor, name, property(lambda t, r=r: t._pieces[r], doc=f"rank {r}'s piece"))
        return names, (self._layout, ranks)

    _stable_hash_for_caching = stable_cache_hash

    @staticmethod
    def __tensor_unflatten__(inner: dict, context: tuple, outer_size, outer_stride) -> "GlobalTensor":
        layout, ranks = context
        return GlobalTensor(layout, {r: inner[f"{_PIECE}{r}"] for r in ranks})

    def __coerce_same_metadata_as_tangent__(self, context: tuple, expected_type=None):
        """A gradient arriving in another layout than the one the traced backward expects (a
        partial loss's gradient comes broadcast): boxed to it."""
        if expected_type is not None:
            return None
        layout = context[0]
        return self if self._layout == layout else box(self, layout)

    # -- conversion -----------------------------------------------------------------------
    def to_global(self, placement: Optional[Placement] = None, sbp=None, *, grad_sbp=None) -> "GlobalTensor":
        """Box to ``placement`` / ``sbp`` (either may be left out to keep it); differentiable.

        The gradient comes back in this tensor's layout (partial axes as broadcast) unless
        ``grad_sbp`` names another.
        """
        if grad_sbp is None and not (self.requires_grad and torch.is_grad_enabled()):
            direct = _direct_of(self, placement, sbp)
            if direct is None:
                self._layout = intern(self._layout)      # a fresh equal layout (each batch's) finds its entry
                direct = _direct_of(self, placement, sbp) or _Direct.make(self, placement, sbp)
            return direct.run(self)
        target = self._target(placement, sbp)
        grad_layout = None
        if grad_sbp is not None:
            grad_layout = self._layout.with_sbp(as_nd_sbp(grad_sbp, self.placement.ndim, self.dim(), "grad_sbp"))
        return _Box.apply(self, target, grad_layout)

    def _target(self, placement, sbp) -> Layout:
        """The layout ``to_global(placement, sbp)`` boxes to, checked."""
        placement = self.placement if placement is None else check_placement(placement)
        if sbp is None:
            if placement.ndim != self.placement.ndim:
                raise ValueError(f"to_global: sbp is required when the placement changes from "
                                 f"{self.placement.ndim} to {placement.ndim} dims")
            sbp = self.sbp
        nd = as_nd_sbp(sbp, placement.ndim, self.dim(), "to_global(sbp)")
        check_blocks(self.shape, placement.hierarchy, nd, "to_global(sbp)")
        return Layout(tuple(self.shape), self.dtype, placement, nd)


trace_through(GlobalTensor.full_tensor)
constant(Placement, lambda p: (Placement, (p.type, p.ranks.tolist())))
for _cls in (Split, Broadcast, PartialSum):
    constant(_cls, _cls.__reduce__)


class _Direct:
    """``to_global`` from one layout to one target in one world, for a tensor with no graph to
    record: the target, the plan made ready in the world and the result's device, worked out on
    the first call, so that later calls pay only their data movement.

    It runs the boxing as ``_Box``'s forward does, grad mode off, but without the autograd
    Function, which would only add its cost. (Grad mode off matters: a piece may itself require
    grad -- the local tensor given to ``to_global`` under no_grad.)
    """
    __slots__ = ("source", "target", "ready", "world", "device")

    @staticmethod
    def make(t: GlobalTensor, placement, sbp) -> "_Direct":
        d = _Direct()
        d.source = t._layout            # interned, and kept: its id is part of the key
        d.target = t._target(placement, sbp)
        d.world = get_world()
        d.ready = None if d.source == d.target else ready(plan_boxing(d.source, d.target), d.world)
        d.device = d.world.device(d.target.placement.type, d.world.local_ranks[0])
        if not isinstance(sbp, list):
            if len(_directs) >= _DIRECTS_MAX:
                _directs.clear()
            _directs[id(d.source), placement, sbp] = d
        return d

    def run(self, t: GlobalTensor) -> GlobalTensor:
        if self.ready is None:
            return GlobalTensor(self.target, dict(t._pieces))
        pieces = t._pieces
        if t.is_conj() or t.is_neg():   # collectives and slicing copies read the raw data: resolve the bits first
            pieces = {r: p.resolve_conj().resolve_neg() for r, p in pieces.items()}
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            out = self.ready.run(pieces)
        finally:
            torch._C._set_grad_enabled(enabled)
        piece = next(iter(out.values()), None)
        if piece is None:               # this process holds no rank of the target placement
            return GlobalTensor(self.target, out)
        return wrap_result(self.target, out, self.device, piece)


_directs: dict = {}     # (id(interned source layout), placement, sbp) as given to to_global -> _Direct
_DIRECTS_MAX = 4096


def _direct_of(t: GlobalTensor, placement, sbp) -> Optional[_Direct]:
    """The entry for ``t``'s layout object (None: none, or one made in another world)."""
    try:
        direct = _directs.get((id(t._layout), placement, sbp))
    except TypeError:                   # an sbp given as a list
        return None
    return direct if direct is not None and direct.world is _current._world else None


def _pick_rank(rank: Optional[int]) -> int:
    world = get_world()
    if rank is None:
        return world.local_ranks[0]
    if not world.holds(rank):
        raise ValueError(f"to_local(rank={rank}): rank {rank} does not live in this process "
                         f"(it holds ranks {list(world.local_ranks)})")
    return rank


def check_placement(placement) -> Placement:
    if not isinstance(placement, Placement):
        raise TypeError(f"placement: expected a globaltensor placement, got {placement!r}")
    return placement


def box(t: GlobalTensor, target: Layout) -> GlobalTensor:
    """Run the boxing from ``t``'s layout to ``target`` (no autograd)."""
    if t._layout == target:
        return GlobalTensor(target, dict(t._pieces))
    pieces = t._pieces
    if t.is_conj() or t.is_neg():   # collectives and slicing copies read the raw data: resolve the bits first
        pieces = {r: p.resolve_conj().resolve_neg() for r, p in pieces.items()}
    pieces = execute(plan_boxing(t._layout, target), pieces, get_world())
    return GlobalTensor(target, pieces)


class _Rebinds:
    count = 0


def rebind_piece(t: GlobalTensor, rank: int, piece: torch.Tensor) -> None:
    """Give the existing tensor ``t`` a new piece at ``rank``, in place (a compiled call's results bound to
    the wrappers that outlive it). Every other piece a tensor holds was given when it was made, so what
    keeps a tensor's pieces beyond one call (nn/kept_pieces.py) compares :func:`piece_rebinds`."""
    t._pieces[rank] = piece
    _Rebinds.count += 1


def piece_rebinds() -> int:
    """How many pieces :func:`rebind_piece` has replaced in this process."""
    return _Rebinds.count


def write_into(target: GlobalTensor, value: torch.Tensor) -> None:
    """Write ``value`` (a global tensor, or a plain one taken as broadcast) into ``target``'s own pieces:
    boxed into ``target``'s layout, copied into each piece that is not already the one boxed."""
    if not isinstance(value, GlobalTensor):
        value = replicate(value, target.placement)
    back = box(value, target._layout)
    with torch.no_grad():
        for r, piece in target._pieces.items():
            if back._pieces[r] is not piece:
                piece.copy_(back._pieces[r])


def gradient_layout(layout: Layout) -> Layout:
    """The layout a gradient takes by default: the tensor's own, partial axes as broadcast."""
    if not layout.has_partial:
        return layout
    return layout.with_sbp(tuple(broadcast if v.is_partial else v for v in layout.nd_sbp))


class _Box(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, grad_layout):
        ctx.grad_layout = grad_layout or gradient_layout(x._layout)
        return box(x, target)

    @staticmethod
    def backward(ctx, grad):
        return box_like(grad, ctx.grad_layout), None, None


def box_like(grad, layout: Layout) -> GlobalTensor:
    """Bring a gradient (global, or plain and so broadcast) to ``layout``."""
    if not isinstance(grad, GlobalTensor):
        grad = replicate(grad, layout.placement)
    return box(grad, layout)


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rank):
        ctx.layout = x._layout
        ctx.rank = rank
        piece = x._pieces.get(rank)
        if piece is None:
            return torch.empty(0, dtype=x.dtype, device=_device(x.placement))
        return piece.view_as(piece)

    @staticmethod
    def backward(ctx, grad):
        layout = ctx.layout
        pieces = {r: grad if r == ctx.rank else torch.zeros(layout.piece_shape(r), dtype=grad.dtype,
                                                             device=grad.device)
                  for r in layout.placement.rank_list() if get_world().holds(r)}
        return GlobalTensor(layout, pieces), None


def replicate(t: torch.Tensor, placement: Placement) -> GlobalTensor:
    """A plain tensor, equal on every rank, as a broadcast global tensor on ``placement``.

    The first held rank's piece is ``t`` itself (moved to its device); every other held rank
    gets its own copy, so an in-place op on the result runs once on each rank's piece.
    """
    world = get_world()
    layout = Layout(tuple(t.shape), t.dtype, placement, (broadcast,) * placement.ndim)
    held = [r for r in placement.rank_list() if world.holds(r)]
    pieces = {r: t.to(world.device(placement.type, r), copy=i > 0) for i, r in enumerate(held)}
    return GlobalTensor(layout, pieces)
