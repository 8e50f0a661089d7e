"""Bridges to other PyTorch distributed libraries (above the tensor layer): DTensor both ways.

    d = x.to_dtensor()            # placement -> DeviceMesh, S/B/P -> Shard/Replicate/Partial
    y = gt.from_dtensor(d)

``torch.distributed.tensor`` takes a second or more to import, so dtensor.py is imported on
first use, not with globaltensor.
"""
from ..tensor import GlobalTensor


def to_dtensor(x, mesh=None):
    """``x`` as a DTensor on its placement's DeviceMesh (or ``mesh``, which must hold the same ranks):
    split(d) / broadcast / partial_sum become Shard(d) / Replicate() / Partial("sum"). Each rank's
    piece is shared where both libraries cut the tensor alike; where an uneven split differs
    (balanced here, torch.chunk-style in DTensor) only the rows that change rank move. Collective
    (every rank calls it) and differentiable; needs a process world."""
    from .dtensor import to_dtensor as convert
    return convert(x, mesh)


def from_dtensor(d):
    """DTensor ``d`` as a global tensor on its mesh's ranks (Shard(d) / Replicate() / Partial("sum")
    become split(d) / broadcast / partial_sum), sharing each rank's piece where both libraries cut
    the tensor alike and moving only the rows that differ elsewhere. Collective and differentiable;
    other DTensor placements raise a ValueError."""
    from .dtensor import from_dtensor as convert
    return convert(d)


def install_to_dtensor() -> None:
    """``GlobalTensor.to_dtensor(mesh=None)``: the method form of :func:`to_dtensor`."""
    def method(self, mesh=None):
        return to_dtensor(self, mesh)
    method.__doc__ = to_dtensor.__doc__
    method.__name__ = "to_dtensor"
    GlobalTensor.to_dtensor = method


__all__ = ["to_dtensor", "from_dtensor", "install_to_dtensor"]
