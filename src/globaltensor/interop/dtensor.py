"""Global tensors to DTensor and back: ``x.to_dtensor()`` and ``gt.from_dtensor(d)``.

A placement is a DeviceMesh (same device type, same ranks in the same array), an nd-SBP is
DTensor placements axis for axis: ``split(d)`` is ``Shard(d)``, ``broadcast`` is ``Replicate()``,
``partial_sum`` is ``Partial("sum")``. Each rank's local piece is handed over as it is (the
same storage) when both libraries cut the tensor the same way; where an uneven split differs
(balanced here, ``torch.chunk``-style in DTensor, see chunk_layout.py) the rows that change
owner move point to point. Both conversions are differentiable and collective (every rank of
the world calls them, as DeviceMesh creation and the moves need).

DTensor holds one rank's piece per process, so both need a process world (torch.distributed
initialised, e.g. under ``globaltensor.launch`` or torchrun); a simulated world raises.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..comm import get_world
from ..placement import Placement
from ..sbp import broadcast, contiguous_strides, partial_sum, split
from ..from_local import to_global
from ..tensor import GlobalTensor
from .repartition import Repartition

_meshes: dict = {}        # placement -> the DeviceMesh used for it (made here or met in from_dtensor)


def _require_process_world(what: str) -> None:
    if get_world().simulated:
        raise RuntimeError(f"{what}: DTensor keeps one rank's piece per process and needs a process world "
                           f"(torch.distributed initialised: launch with `python -m globaltensor.launch` or "
                           f"torchrun); this process simulates {get_world().size} ranks")


def placement_of_mesh(mesh: DeviceMesh) -> Placement:
    """The placement with ``mesh``'s device type and rank array."""
    return Placement(mesh.device_type, mesh.mesh.tolist())


def _check_ascending(placement: Placement, what: str) -> None:
    """DTensor's collectives order the ranks of a mesh dim by rank number (torch's ``new_group`` sorts
    them), its offsets (DCP, ``compute_local_shape_and_global_offset``) by mesh coordinate: the two
    disagree unless the ranks ascend along every mesh dim, so other meshes are refused."""
    ranks = placement.ranks
    for axis in range(ranks.ndim):
        if ranks.shape[axis] > 1 and not (np.diff(ranks, axis=axis) > 0).all():
            raise ValueError(f"{what}: the ranks {ranks.tolist()} do not ascend along mesh dim {axis}; DTensor "
                             f"orders a mesh dim's ranks by number in its collectives and by position in its "
                             f"offsets, so only ascending meshes convert (move the tensor to such a placement "
                             f"first with to_global(placement=...))")


def mesh_of_placement(placement: Placement) -> DeviceMesh:
    """The DeviceMesh of ``placement``: the one met for it before, else a new one (made on every rank:
    it creates process groups)."""
    mesh = _meshes.get(placement)
    if mesh is None:
        mesh = _meshes[placement] = DeviceMesh(placement.type, torch.tensor(placement.ranks.tolist()))
    return mesh


def dtensor_placements(nd_sbp: tuple) -> tuple:
    """DTensor placements for an nd-SBP, axis for axis."""
    return tuple(Shard(v.dim) if v.is_split else Replicate() if v.is_broadcast else Partial("sum") for v in nd_sbp)


def sbp_of_placements(placements, name: str = "from_dtensor") -> tuple:
    """The nd-SBP of DTensor ``placements``; a ValueError for one globaltensor has no equal of."""
    out = []
    for p in placements:
        if isinstance(p, Shard) and not isinstance(p, _StridedShard):
            out.append(split(p.dim))
        elif isinstance(p, Replicate):
            out.append(broadcast)
        elif type(p) is Partial and p.reduce_op == "sum":
            out.append(partial_sum)
        else:
            raise ValueError(f"{name}: DTensor placement {p!r} has no SBP equal; expected Shard(d), Replicate() "
                             f"or Partial('sum')")
    return tuple(out)


def _check_default_shard_order(d: DTensor) -> None:
    spec = d._spec
    order = getattr(spec, "shard_order", None)
    if order is not None and order != spec.compute_default_shard_order(spec.placements):
        raise ValueError(f"from_dtensor: the DTensor shards a dim over several mesh dims in the order {order}; "
                         f"globaltensor cuts in mesh-dim order, {spec.compute_default_shard_order(spec.placements)}")


def to_dtensor(x: GlobalTensor, mesh: Optional[DeviceMesh] = None) -> DTensor:
    """``x`` as a DTensor on its placement's DeviceMesh (or ``mesh``, which must have the same ranks),
    sharing each rank's piece where the two libraries cut it alike; collective, differentiable."""
    if not isinstance(x, GlobalTensor):
        raise TypeError(f"to_dtensor: expected a global tensor, got {type(x).__name__}")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"to_dtensor(mesh=): expected a torch.distributed DeviceMesh or None, "
                        f"got {type(mesh).__name__}")
    if x._layout.blocked or x._layout.head_tail:
        kind = "a blocked" if x._layout.blocked else "a head-tail"
        raise ValueError(f"to_dtensor: the tensor's sbp {x.sbp} has {kind} split, which no DTensor placement "
                         f"describes; convert it first: x.to_global(sbp=...) with plain splits")
    _require_process_world("to_dtensor")
    placement = x.placement
    _check_ascending(placement, "to_dtensor")
    if mesh is not None:
        if placement_of_mesh(mesh) != placement:
            raise ValueError(f"to_dtensor(mesh=): the mesh is {placement_of_mesh(mesh)}, the tensor's placement is "
                             f"{placement}; they must be the same ranks in the same array")
        _meshes.setdefault(placement, mesh)
    mesh = mesh or mesh_of_placement(placement)
    shape = tuple(x.shape)
    local = Repartition.apply(x.to_local(), shape, placement, x.sbp, "balanced", "chunk")
    return DTensor.from_local(local, mesh, dtensor_placements(x.sbp), run_check=False, shape=torch.Size(shape),
                              stride=contiguous_strides(shape))


def from_dtensor(d: DTensor) -> GlobalTensor:
    """DTensor ``d`` as a global tensor on its mesh's ranks, sharing each rank's piece where the two
    libraries cut it alike; collective, differentiable."""
    if not isinstance(d, DTensor):
        raise TypeError(f"from_dtensor: expected a torch.distributed.tensor.DTensor, got {type(d).__name__}")
    _require_process_world("from_dtensor")
    nd = sbp_of_placements(d.placements)
    _check_default_shard_order(d)
    placement = placement_of_mesh(d.device_mesh)
    _check_ascending(placement, "from_dtensor")
    _meshes.setdefault(placement, d.device_mesh)
    shape = tuple(d.shape)
    if get_world().rank not in placement.rank_list():     # outside the mesh: an empty piece of the right rank
        return to_global(d.to_local().new_empty((0,) * len(shape)), placement, nd, shape=shape)
    local = Repartition.apply(d.to_local(), shape, placement, nd, "chunk", "balanced")
    return to_global(local, placement, nd, shape=shape)
