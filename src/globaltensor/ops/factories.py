"""Global factories: ``gt.randn(8, 5, placement=p, sbp=S(0))`` and friends.

Each rank builds only its own piece. Random factories draw from the sharding-invariant
generator (rng.py); partial_sum axes keep the value on the first rank of the axis and zeros
elsewhere, so the logical tensor is the same for every layout.
"""
from __future__ import annotations

import torch

from ..boxing import Layout, execute, plan_boxing
from ..comm import get_world
from ..placement import Placement
from ..sbp import as_nd_sbp, broadcast, check_blocks, numel
from ..tensor import GlobalTensor
from . import rng


def _shape(size) -> tuple:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(s, int) and s >= 0 for s in size):
        raise ValueError(f"size: expected non-negative ints, got {size!r}")
    return tuple(size)


def _layout(shape, dtype, placement, sbp, name: str) -> Layout:
    if not isinstance(placement, Placement):
        raise TypeError(f"{name}(placement=): expected a globaltensor placement, got {placement!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name}(dtype=): expected a torch.dtype such as torch.float32, got {dtype!r}")
    if sbp is None:
        raise ValueError(f"{name}: sbp= is required")
    nd = as_nd_sbp(sbp, placement.ndim, len(shape), f"{name}(sbp)")
    check_blocks(shape, placement.hierarchy, nd, f"{name}(sbp)")
    return Layout(tuple(shape), dtype or torch.get_default_dtype(), placement, nd)


def _build(layout: Layout, make_piece, requires_grad: bool) -> GlobalTensor:
    """Make each held rank's piece of the partial-free, unblocked layout, then zero partial axes
    and take the blocks' parts locally (the values follow the logical index, as on one device)."""
    world = get_world()
    plain = layout.with_sbp(tuple(broadcast if v.is_partial or v.is_split and (v.blocks > 1 or v.head_tail) else v
                                  for v in layout.nd_sbp))
    pieces = {r: make_piece(plain.box(r), world.device(layout.placement.type, r))
              for r in layout.placement.rank_list() if world.holds(r)}
    if plain != layout:
        pieces = execute(plan_boxing(plain, layout), pieces, world)
    out = GlobalTensor(layout, pieces)
    return out.requires_grad_(True) if requires_grad else out


def _box_shape(box) -> tuple:
    return tuple(l for _, l in box)


def _filled(name, fill):
    def factory(*size, placement=None, sbp=None, dtype=None, requires_grad=False):
        layout = _layout(_shape(size), dtype, placement, sbp, name)
        return _build(layout, lambda box, dev: torch.full(_box_shape(box), fill, dtype=layout.dtype, device=dev),
                      requires_grad)
    factory.__name__ = name
    factory.__doc__ = f"A global tensor of {fill}s with the given placement and sbp."
    return factory


zeros = _filled("zeros", 0)
ones = _filled("ones", 1)


def empty(*size, placement=None, sbp=None, dtype=None, requires_grad=False):
    """A global tensor of uninitialised values with the given placement and sbp."""
    layout = _layout(_shape(size), dtype, placement, sbp, "empty")
    return _build(layout, lambda box, dev: torch.empty(_box_shape(box), dtype=layout.dtype, device=dev),
                  requires_grad)


def full(size, fill_value, *, placement=None, sbp=None, dtype=None, requires_grad=False):
    """A global tensor of ``fill_value`` (bool and int values give bool and int64, as torch.full)."""
    if dtype is None and isinstance(fill_value, bool):
        dtype = torch.bool
    elif dtype is None and isinstance(fill_value, int):
        dtype = torch.int64
    layout = _layout(_shape((size,) if isinstance(size, int) else tuple(size)), dtype, placement, sbp, "full")
    return _build(layout, lambda box, dev: torch.full(_box_shape(box), fill_value, dtype=layout.dtype, device=dev),
                  requires_grad)


def arange(start, end=None, step=1, *, placement=None, sbp=None, dtype=None, requires_grad=False):
    """``torch.arange(start, end, step)`` as a 1-D global tensor; each rank makes only its part."""
    if end is None:
        start, end = 0, start
    if step == 0 or (end - start) * step < 0:
        raise ValueError(f"arange: the step {step} does not lead from {start} to {end}")
    n = max(0, -(-(end - start) // step)) if all(isinstance(v, int) for v in (start, end, step)) else \
        len(torch.arange(start, end, step))
    if dtype is None:
        dtype = torch.int64 if all(isinstance(v, int) for v in (start, end, step)) else torch.get_default_dtype()
    layout = _layout((n,), dtype, placement, sbp, "arange")

    def piece(box, dev):
        (s, l), = box
        return torch.arange(start + s * step, start + (s + l) * step, step, dtype=dtype, device=dev)[:l]
    return _build(layout, piece, requires_grad)


def _random(name, draw):
    def factory(*size, placement=None, sbp=None, dtype=None, requires_grad=False):
        layout = _layout(_shape(size), dtype, placement, sbp, name)
        if not layout.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating dtype, got {layout.dtype}")
        offset = rng.next_offset(max(1, numel(layout.shape)))
        return _build(layout, lambda box, dev: draw(rng.positions(layout.shape, box, dev), offset, layout.dtype),
                      requires_grad)
    factory.__name__ = name
    return factory


randn = _random("randn", rng.normal)
randn.__doc__ = "Standard normal values, the same logical tensor for every layout (sharding-invariant)."
rand = _random("rand", rng.uniform)
rand.__doc__ = "Uniform [0, 1) values, the same logical tensor for every layout (sharding-invariant)."
manual_seed = rng.manual_seed
