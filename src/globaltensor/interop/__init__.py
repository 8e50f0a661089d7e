"""Bridges to other PyTorch distributed libraries (above the tensor layer): DTensor both ways, and
``torch.distributed.checkpoint``'s protocol on global tensors (dcp.py).

    d = x.to_dtensor()            # placement -> DeviceMesh, S/B/P -> Shard/Replicate/Partial
    y = gt.from_dtensor(d)

``torch.distributed.tensor`` takes a second or more to import, so dtensor.py (and dcp.py) is
imported on first use, not with globaltensor.
"""
from ..tensor import GlobalTensor, box


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


def install_dcp_protocol() -> None:
    """The methods ``torch.distributed.checkpoint`` calls on a tensor subclass: each rank writes its
    pieces with their offsets, and loading reads the chunks of its own pieces (dcp.py)."""
    def create_write_items(self, fqn: str, object) -> list:
        from .dcp import create_write_items as create
        return create(self, fqn, box)

    def create_chunk_list(self) -> list:
        from .dcp import create_chunk_list as create
        return create(self)

    def get_tensor_shard(self, index):
        from .dcp import get_tensor_shard as get
        return get(self, index)

    GlobalTensor.__create_write_items__ = create_write_items
    GlobalTensor.__create_chunk_list__ = create_chunk_list
    GlobalTensor.__get_tensor_shard__ = get_tensor_shard


__all__ = ["to_dtensor", "from_dtensor", "install_to_dtensor", "install_dcp_protocol"]
