"""Sharding-invariant random numbers: a counter-based generator keyed by seed and element position.

Element ``i`` (row-major position in the logical tensor) of the ``n``-th random call takes its
bits from ``hash(seed, offset + i)``, where ``offset`` advances by the call's numel; so the
logical tensor is the same whatever the placement, SBP or number of ranks, and each rank
computes only its own piece's elements. The hash is a 32-bit integer mixer (lowbias32)
applied in int64 torch ops, identical on CPU and CUDA.
"""
from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF


class _State:
    seed = 0
    offset = 0


def manual_seed(seed: int) -> None:
    """Seed the global random factories (and dropout masks); resets the call counter."""
    if not isinstance(seed, int):
        raise TypeError(f"manual_seed: expected an int seed, got {seed!r}")
    _State.seed = seed & ((1 << 64) - 1)
    _State.offset = 0


def current_offset() -> int:
    return _State.offset


def set_offset(offset: int) -> None:
    _State.offset = offset


def next_offset(numel: int) -> int:
    """Reserve ``numel`` counters for one random call; every rank reserves the same."""
    off = _State.offset
    _State.offset += numel
    return off


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def _mix_int(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def positions(shape: tuple, box: tuple, device) -> torch.Tensor:
    """Row-major logical positions (int64) of the elements of the block ``box`` of ``shape``."""
    return _grid_positions(shape, [((start, length),) for start, length in box], device)


def piece_positions(layout, rank: int, device) -> torch.Tensor:
    """Row-major logical positions (int64) of the elements of ``rank``'s piece of ``layout``, in the
    piece's order: its box, or for a blocked or head-tail split the grid of its ranges."""
    if not (layout.head_tail or layout.blocked):
        return positions(layout.shape, layout.box(rank), device)
    return _grid_positions(layout.shape, [tuple((s, l) for s, _, l in layout.segments(rank, d))
                                          for d in range(len(layout.shape))], device)


def _grid_positions(shape: tuple, ranges: list, device) -> torch.Tensor:
    """Positions of the grid whose dim ``d`` holds the ranges ``ranges[d]`` (``(start, length)`` each)."""
    pos = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(shape))):
        idx = torch.cat([torch.arange(start, start + length, dtype=torch.int64, device=device)
                         for start, length in ranges[d]] or [torch.zeros(0, dtype=torch.int64, device=device)])
        pos = pos.unsqueeze(0) + (idx * stride).view((idx.numel(),) + (1,) * (len(shape) - 1 - d))
        stride *= shape[d]
    return pos


def key_values(offset: int, stream: int) -> list:
    """``[offset, k0, k1]``: a random call's counter base and its two keys from the seed."""
    seed = _State.seed
    k0 = _mix_int((seed & MASK32) ^ _mix_int(stream + 0x9E3779B9))
    k1 = _mix_int((seed >> 32) ^ k0)
    return [offset, k0, k1]


def _make_keys(offset: int, stream: int, device) -> torch.Tensor:
    return torch.tensor(key_values(offset, stream), dtype=torch.int64, device=device)


_keys_maker = _make_keys


def make_keys_with(maker) -> object:
    """Build each call's key tensor with ``maker(offset, stream, device)`` (None: the default);
    returns the previous maker. The traced mode marks these tensors as inputs of each call, so a
    replayed random op draws the numbers the same eager call would."""
    global _keys_maker
    previous, _keys_maker = _keys_maker, maker or _make_keys
    return None if previous is _make_keys else previous


def random_bits(pos: torch.Tensor, offset: int, stream: int) -> torch.Tensor:
    """32 random bits (in int64) per position, for one of several independent streams.

    The call's counter base and keys come in as one small int64 tensor rather than as Python
    ints, so that they are data a captured graph can feed anew on every call."""
    keys = _keys_maker(offset, stream, pos.device)
    c = pos + keys[0]
    return _mix(_mix((c & MASK32) ^ keys[1]) ^ ((c >> 32) & MASK32) ^ keys[2])


def uniform(pos: torch.Tensor, offset: int, dtype: torch.dtype, stream: int = 0) -> torch.Tensor:
    """U[0, 1) with 24 bits (53 for float64) per element."""
    if dtype == torch.float64:
        hi = random_bits(pos, offset, stream) >> 6
        lo = random_bits(pos, offset, stream + 1) >> 5
        return ((hi * 134217728 + lo).to(torch.float64) * (1.0 / 9007199254740992.0))
    return ((random_bits(pos, offset, stream) >> 8).to(torch.float32) * (1.0 / 16777216.0)).to(dtype)


def normal(pos: torch.Tensor, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """N(0, 1) by Box-Muller from two independent uniform streams."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    u1 = uniform(pos, offset, work, stream=0)
    u2 = uniform(pos, offset, work, stream=2)
    r = torch.sqrt(-2.0 * torch.log1p(-u1))
    return (r * torch.cos((2.0 * math.pi) * u2)).to(dtype)
