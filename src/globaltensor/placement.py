"""Placement: a device type and the ranks that hold a tensor, arranged as an nd-array.

The array's shape is the placement's *hierarchy*; each of its axes carries one SBP of a
tensor's nd-SBP. The placement is the bottom layer: it knows nothing of worlds, so the
world layer tells it how many ranks exist through :func:`set_world_size_source`.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

DEVICE_TYPES = ("cpu", "cuda")

_world_size_source: Optional[Callable[[], int]] = None


def set_world_size_source(fn: Callable[[], int]) -> None:
    """Install the function that tells how many ranks the current world has."""
    global _world_size_source
    _world_size_source = fn


def _ranks_array(ranks) -> np.ndarray:
    if isinstance(ranks, np.ndarray):
        arr = ranks
    else:
        if isinstance(ranks, int):
            raise TypeError(f"placement ranks: expected a list or nested list of ints, got the int {ranks}")
        try:
            arr = np.array(ranks, dtype=object)
        except ValueError as e:
            raise ValueError(f"placement ranks: ragged nesting in {ranks!r}; every row must be as long") from e
    if arr.dtype == object:
        flat = arr.reshape(-1)
        if any(isinstance(v, (list, tuple, np.ndarray)) for v in flat):
            raise ValueError(f"placement ranks: ragged nesting in {ranks!r}; every row must be as long")
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in flat):
            raise TypeError(f"placement ranks: expected ints, got {ranks!r}")
        arr = arr.astype(np.int64)
    elif not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"placement ranks: expected ints, got {ranks!r}")
    arr = arr.astype(np.int64)
    if arr.ndim == 0 or arr.size == 0:
        raise ValueError(f"placement ranks: expected at least one rank, got {ranks!r}")
    return arr


class Placement:
    """Where a global tensor lives: ``Placement("cpu", [[0, 1], [2, 3]])``.

    ``type`` is the device type, ``ranks`` an integer numpy array whose shape is the
    ``hierarchy``. Two placements are equal when type and ranks are.
    """

    __slots__ = ("_type", "_ranks", "_key", "_hash", "_rank_coords")

    def __init__(self, type: str = "cpu", ranks: Sequence = None):
        if not isinstance(type, str):
            raise TypeError(f"placement type: expected a str such as 'cpu' or 'cuda', got {type!r}")
        if type not in DEVICE_TYPES:
            raise ValueError(f"placement type: expected one of {DEVICE_TYPES}, got {type!r}")
        if ranks is None:
            raise TypeError("placement ranks: expected a list or nested list of ints, got None")
        arr = _ranks_array(ranks)
        flat = arr.reshape(-1).tolist()
        if len(set(flat)) != len(flat):
            dups = sorted({r for r in flat if flat.count(r) > 1})
            raise ValueError(f"placement ranks: rank(s) {dups} appear more than once in {arr.tolist()}")
        if min(flat) < 0:
            raise ValueError(f"placement ranks: negative rank(s) {[r for r in flat if r < 0]} in {arr.tolist()}")
        if _world_size_source is not None:
            n = _world_size_source()
            outside = [r for r in flat if r >= n]
            if outside:
                raise ValueError(
                    f"placement ranks: rank(s) {outside} are outside the world of {n} ranks (valid: 0..{n - 1})")
        arr.setflags(write=False)
        self._type = type
        self._ranks = arr
        self._key = (type, arr.shape, tuple(flat))
        self._hash = hash(self._key)        # hashed on every bucket hook and layout interning
        self._rank_coords = {r: tuple(int(i) for i in idx) for idx, r in np.ndenumerate(arr)}

    @classmethod
    def all(cls, type: str = "cpu") -> "Placement":
        """A 1-D placement over every rank of the current world."""
        if _world_size_source is None:
            raise RuntimeError("placement.all: no world is set up")
        return cls(type, list(range(_world_size_source())))

    @property
    def type(self) -> str:
        """The device type: ``"cpu"`` or ``"cuda"``."""
        return self._type

    @property
    def device_type(self) -> str:
        """The same as ``type`` (OneFlow's name)."""
        return self._type

    @property
    def ranks(self) -> np.ndarray:
        """The ranks as an integer numpy array whose shape is the hierarchy."""
        return self._ranks

    @property
    def hierarchy(self) -> tuple:
        """The shape of the ranks array, e.g. ``(2, 2)``."""
        return tuple(self._ranks.shape)

    @property
    def ndim(self) -> int:
        """The number of placement axes (the length of every nd-SBP on it)."""
        return self._ranks.ndim

    @property
    def size(self) -> int:
        """The number of ranks."""
        return self._ranks.size

    def rank_list(self) -> tuple:
        """The ranks in row-major order of the hierarchy."""
        return self._key[2]

    def __contains__(self, rank: int) -> bool:
        return rank in self._rank_coords

    def coord(self, rank: int) -> tuple:
        """The position of ``rank`` in the hierarchy."""
        try:
            return self._rank_coords[rank]
        except (KeyError, TypeError):
            raise ValueError(f"placement.coord: rank {rank!r} is not in {self!r}") from None

    def __eq__(self, other) -> bool:
        return isinstance(other, Placement) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"placement(type={self._type!r}, ranks={self._ranks.tolist()})"


placement = Placement
