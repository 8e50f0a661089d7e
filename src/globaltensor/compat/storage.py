"""Whether a tensor is the only one on its storage, read alike on every supported torch.

Buffers handed out again (actor_rt/recycle.py, nn/grad_buckets.py) must have no other tensor on
their storage: a view, a gradient made from them. torch counts a storage's users in C++; the
Python storage object that ``untyped_storage()`` makes counts as one user from torch 2.11 on and
not before, so the count of a tensor alone on its storage is measured once here, not assumed.
"""
from __future__ import annotations

import torch

_uses = torch._C._storage_Use_Count


def _alone() -> int:
    t = torch.empty(1)
    return _uses(t.untyped_storage()._cdata)


ALONE = _alone()


def alone_on_storage(t: torch.Tensor) -> bool:
    """No tensor but ``t`` (and the storage object this call makes) uses ``t``'s storage."""
    return _uses(t.untyped_storage()._cdata) == ALONE
