"""What a peer's step sends: the collectives torch.distributed runs for DTensor or torchtitan, counted
by the ring formulas ``gt.comm_stats`` uses, and the bytes its gloo sockets wrote.

``PeerBytes`` counts every functional collective (``torch.ops._c10d_functional``: what DTensor's
redistributions and its autograd issue, however deep inside DTensor's own dispatch -- a dispatch
mode does not see those, it is switched off while DTensor handles an op) and every plain
``torch.distributed`` collective (torchtitan's vocabulary-parallel loss calls ``dist.all_reduce``).
``wire_bytes(fn)`` reads the bytes the process wrote through system calls while ``fn`` ran: in a
step that writes no file, what its gloo sockets sent, headers included, whichever API issued it.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Tuple

#: the functional ops counted, and the kind of collective each is
FUNCTIONAL = {"all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
              "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
              "all_to_all_single": "all_to_all", "broadcast": "broadcast"}
#: the plain torch.distributed calls counted (the tensor whose size the formula takes is the first
#: argument, but for reduce_scatter_tensor the whole input, its second)
PLAIN = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "all_to_all_single": "all_to_all", "broadcast": "broadcast"}


class PeerBytes:
    """``with PeerBytes(world) as counted:`` -- ``counted.bytes`` this rank sent and ``counted.ops``."""

    def __init__(self, world: int):
        self.world, self.bytes, self.ops = world, 0, []
        self._stack = contextlib.ExitStack()

    def count(self, kind: str, tensors) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors)
        n = self.world
        sent = {"all_reduce": 2 * (n - 1) * size // n, "all_gather": (n - 1) * size,
                "reduce_scatter": (n - 1) * size // n, "broadcast": size}.get(kind, size - size // n)
        self.bytes += sent
        self.ops.append(kind)

    def _patch(self, owner, name: str, kind: str, whole: Callable) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.count(kind, whole(args))
            return original(*args, **kwargs)
        setattr(owner, name, counted)
        self._stack.callback(setattr, owner, name, original)

    def __enter__(self) -> "PeerBytes":
        import torch
        import torch.distributed as dist
        ops = torch.ops._c10d_functional
        for name, kind in FUNCTIONAL.items():
            self._patch(ops, name, kind, lambda a: list(a[0]) if isinstance(a[0], (list, tuple)) else [a[0]])
        for name, kind in PLAIN.items():
            self._patch(dist, name, kind, lambda a, name=name: [a[1] if name == "reduce_scatter_tensor" else a[0]])
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


def _written() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar"))


def wire_bytes(fn: Callable) -> Tuple[object, int]:
    """``fn()``'s result and the bytes this process wrote while it ran, less an empty interval's (the
    barriers that bound it on every rank)."""
    import torch.distributed as dist

    def interval(body):
        dist.barrier()
        start = _written()
        out = body()
        dist.barrier()
        return out, _written() - start
    _, empty = interval(lambda: None)
    out, sent = interval(fn)
    return out, sent - empty


def most(values: List[int]) -> List[int]:
    """Each value's maximum over the ranks (a collective: every rank calls it)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t]


def check_losses_agree(plan: str, peer: str, losses: dict) -> None:
    """The peer's losses (``losses["dt"]``) and ours (``losses["gt"]``) agree to float32's rounding."""
    for a, b in zip(losses["dt"], losses["gt"]):
        if abs(a - b) > 1e-4 * max(1.0, abs(b)):
            raise AssertionError(f"{plan}: the losses differ, {peer} {losses['dt']} vs globaltensor {losses['gt']}")
