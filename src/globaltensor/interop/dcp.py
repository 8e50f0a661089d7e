"""What ``torch.distributed.checkpoint`` (DCP) asks of a tensor, for GlobalTensor.

DCP's planners call three methods on any tensor that has them (DTensor does the same):

- ``__create_write_items__(fqn, t)`` when saving: one write item per distinct piece this
  process holds, each naming the piece's offsets in the logical tensor. Broadcast axes give
  pieces with equal offsets on several ranks; DCP's own de-duplication of save plans (by
  ``(fqn, offsets)``) then writes one copy. A tensor with partial-sum axes is first boxed to a
  savable layout (each partial axis reduce-scattered to a split, see :func:`savable_layout`);
  the boxed pieces are kept on the tensor until its pieces are read for writing.
- ``__create_chunk_list__()`` when loading: the offsets and sizes of the pieces to fill.
  DCP reads the overlapping parts of the saved chunks into them, whatever layout saved
  them: that is the resharding. On a partial-sum axis the first rank of the axis takes the
  value and the others are zeroed (the sum is the value).
- ``__get_tensor_shard__(index)``: the plain local piece at ``index.offset`` (a view: DCP
  loads into it in place).

A simulated world holds every rank in this process: its pieces are all listed, so DCP
without a process group saves and loads the whole logical tensor from one process.
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..boxing import Layout
from ..sbp import broadcast, split
from ..sbp.shape import numel

_SAVABLE = "_dcp_savable"   # the attribute holding the boxed copy of a partial tensor between plan and write


def savable_layout(layout: Layout) -> Layout:
    """``layout`` with each partial-sum axis made a split (a reduce-scatter; broadcast for a 0-dim
    tensor): the cheapest layout whose pieces can be written as they are."""
    if not layout.has_partial:
        return layout
    if not layout.shape:
        return layout.with_sbp(tuple(broadcast if v.is_partial else v for v in layout.nd_sbp))
    free = [d for d in range(len(layout.shape)) if all(not (v.is_split and v.dim == d) for v in layout.nd_sbp)]
    dim = max(free or range(len(layout.shape)), key=lambda d: (layout.shape[d], -d))
    return layout.with_sbp(tuple(split(dim) if v.is_partial else v for v in layout.nd_sbp))


def _chunks(layout: Layout, rank: int, piece: torch.Tensor) -> list:
    """``(offsets, view of piece)`` of the boxes ``rank``'s piece covers: the piece itself, or for a
    blocked split its part of each block (a view of the factored piece; DCP fills views in place)."""
    boxes = layout.block_boxes(rank)
    if not layout.blocked:
        return [(torch.Size(start for start, _ in boxes[0][1]), piece)]
    fpiece = piece.view(layout.factored().piece_shape(rank))
    out = []
    for picks, box in boxes:
        view = fpiece
        for dim, index in picks:
            view = view.select(dim, index)
        out.append((torch.Size(start for start, _ in box), view))
    return out


def _distinct_pieces(layout: Layout, pieces: dict) -> list:
    """``(offsets, piece)`` of the pieces to write, one per offset, empty ones left out (unless the
    whole tensor is empty: then one stands for it so that its entry and shape are saved)."""
    out, seen = [], set()
    keep_empty = numel(layout.shape) == 0
    for rank in sorted(pieces):
        for offsets, piece in _chunks(layout, rank, pieces[rank]):
            if offsets in seen or (piece.numel() == 0 and not keep_empty):
                continue
            seen.add(offsets)
            out.append((offsets, piece))
    return out


def create_write_items(t, fqn: str, box) -> list:
    """The write items of ``t``'s pieces in this process; ``box(t, layout)`` boxes a partial ``t``."""
    source = t
    if t._layout.has_partial:
        source = box(t, savable_layout(t._layout))
        setattr(t, _SAVABLE, source)
    size = torch.Size(t._layout.shape)
    items = []
    for offsets, piece in _distinct_pieces(source._layout, source._pieces):
        items.append(WriteItem(
            index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=piece.shape),
                                        properties=TensorProperties.create_from_tensor(piece), size=size)))
    return items


def _load_targets(t) -> list:
    """``(offsets, piece)`` of the pieces a load fills, in a fixed order: every held piece (replicas
    included: each is filled), on partial axes only the first rank's. Empty pieces are left out
    (unless the whole tensor is empty): an empty piece can start where a rank's full piece starts
    (2 rows split twice: rank 1's empty piece and rank 2's row both start at row 1), and DCP finds
    pieces by their offsets."""
    layout = t._layout
    partial_axes = [a for a, v in enumerate(layout.nd_sbp) if v.is_partial]
    keep_empty = numel(layout.shape) == 0
    out = []
    for rank in sorted(t._pieces):
        coord = layout.placement.coord(rank)
        if t._pieces[rank].numel() == 0 and not keep_empty:
            continue
        if all(coord[a] == 0 for a in partial_axes):
            out.extend(_chunks(layout, rank, t._pieces[rank]))
    return out


def create_chunk_list(t) -> list:
    """The chunks a load fills; the pieces of a partial tensor that take no value are zeroed here."""
    if hasattr(t, _SAVABLE):
        delattr(t, _SAVABLE)
    targets = _load_targets(t)
    if t._layout.has_partial:
        filled = {id(piece) for _, piece in targets}
        with torch.no_grad():
            for piece in t._pieces.values():
                if id(piece) not in filled:
                    piece.zero_()
    return [ChunkStorageMetadata(offsets=offsets, sizes=piece.shape) for offsets, piece in targets]


def get_tensor_shard(t, index: MetadataIndex) -> torch.Tensor:
    """The piece at ``index``: while saving a partial tensor, from its boxed copy; loading, the
    chunk ``index.index`` of :func:`create_chunk_list` when its offsets match (replicas share
    offsets), else the first piece at ``index.offset``."""
    source = getattr(t, _SAVABLE, None)
    if source is not None:
        candidates = _distinct_pieces(source._layout, source._pieces)
    else:
        candidates = _load_targets(t)
    if index.index is not None and index.index < len(candidates) and candidates[index.index][0] == index.offset:
        return candidates[index.index][1]
    for offsets, piece in candidates:
        if offsets == index.offset:
            return piece
    raise ValueError(f"checkpoint: {index.fqn}: this process holds no piece of the global tensor at offsets "
                     f"{tuple(index.offset or ())} (its pieces start at {[tuple(o) for o, _ in candidates]})")
