"""The logical values the launched programs distribute and the tests that check them recompute."""
from __future__ import annotations

from typing import Sequence, Union

import torch


def logical(shape: Sequence[int], salt: Union[int, str] = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A random tensor: the same for the same shape, salt and dtype on every rank, in every program
    and in the test process (its own generator; the global one is left alone). A str salt (a
    tensor's name) counts by its characters."""
    seed = salt if isinstance(salt, int) else sum(map(ord, salt))
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(1000 + seed), dtype=dtype)
