"""The World: one collective interface over ``{rank: tensor}`` pieces.

A world holds some ranks in this process (all of them when simulated, one when launched as
processes). Every collective takes a *group* (a tuple of global ranks, in a fixed order)
and the pieces of the group's ranks that live here, and returns the results for those
ranks. Callers give the global meta (shapes, dtype) so that every process can count the
bytes of every rank the same way; the base class does the counting and the subclasses
move the data.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

from ..sbp.shape import balanced_sizes, numel
from . import stats
from .errors import CollectiveError

Pieces = Dict[int, torch.Tensor]

_observer = None


def observe_collectives(observer) -> object:
    """Route every collective through ``observer(name, world, args, run)`` (None: stop); returns
    the previous observer. ``run()`` moves the data; ``getattr(world, name)(*args)`` would run the
    same collective again, stats included. The traced mode records collectives through this."""
    global _observer
    previous, _observer = _observer, observer
    return previous


def observed() -> bool:
    """Whether collectives are being observed (a traced call is being captured)."""
    return _observer is not None


class forbid_collectives:
    """While inside, a collective raises CollectiveError with ``reason`` (``{op}``: the collective's
    name): code that runs once per rank in turn, in one process, where no collective can meet."""
    reason = None

    def __init__(self, reason: str):
        self.text = reason

    def __enter__(self):
        self.previous, forbid_collectives.reason = forbid_collectives.reason, self.text

    def __exit__(self, *exc):
        forbid_collectives.reason = self.previous


def _run(name: str, world, args: tuple, run):
    if forbid_collectives.reason is not None:
        raise CollectiveError(forbid_collectives.reason.format(op=name))
    if _observer is None:
        return run()
    return _observer(name, world, args, run)


@dataclass(frozen=True)
class Transfer:
    """One point-to-point message: ``src`` sends a tensor of ``shape`` to ``dst``."""
    src: int
    dst: int
    shape: tuple


def _slab_bytes(shape: tuple, dim: int, dtype) -> int:
    """Bytes of one index along ``dim``."""
    return numel(shape[:dim] + shape[dim + 1:]) * dtype.itemsize


def all_reduce_bytes(group: tuple, numel: int, itemsize: int) -> Dict[int, int]:
    """Bytes each member sends in a ring all-reduce of ``numel`` elements: twice a reduce-scatter's."""
    chunk = [s * itemsize for s in balanced_sizes(numel, len(group))]
    return {r: 2 * b for r, b in stats.ring_bytes(group, chunk).items()}


def narrowed(t: torch.Tensor, cuts: tuple) -> torch.Tensor:
    """The view of ``t`` that ``cuts`` select: narrowings ``((dim, start, length), ...)``."""
    for d, start, length in cuts:
        t = t.narrow(d, start, length)
    return t


def tile_places(tile: tuple, dtype, device) -> tuple:
    """A new tensor of ``tile``'s shape and, per member, the view its block fills (None: empty)."""
    shape, places = tile
    out = torch.empty(shape, dtype=dtype, device=device)
    return out, [None if cuts is None else narrowed(out, cuts) for cuts in places]


class Started:
    """A collective started by a ``*_async`` call; ``wait()`` blocks until it is done and returns
    its pieces (again on later calls)."""

    def __init__(self, finish):
        self._finish, self._result = finish, None

    def wait(self) -> Pieces:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result


def done(pieces: Pieces) -> Started:
    """A collective that has already run."""
    return Started(lambda: pieces)


class World(ABC):
    size: int
    local_ranks: tuple
    simulated: bool

    def holds(self, rank: int) -> bool:
        return rank in self._local_set

    def report_failure(self, text: str) -> None:
        """Tell the peers that this rank failed (a process world publishes it for their error messages)."""

    def retime(self, seconds: float) -> None:
        """Apply a new collective timeout to the collectives already set up (gt.set_timeout)."""

    def prepare_groups(self, groups) -> None:
        """Make ready the communicators of ``groups``; every rank calls it with the same groups in
        the same order (a process world creates process groups here; nothing to do in one process)."""

    @abstractmethod
    def device(self, device_type: str, rank: int) -> torch.device:
        """The torch device that holds ``rank``'s pieces of a placement of ``device_type``."""

    # -- collectives: count, then move -------------------------------------------------
    def all_gather(self, group: tuple, pieces: Pieces, dim: int, sizes: Sequence[int], full_shape: tuple,
                   dtype) -> Pieces:
        """Concatenate the members' pieces (``sizes[i]`` long along ``dim``) into ``full_shape``; all get it."""
        slab = _slab_bytes(full_shape, dim, dtype)
        stats.record("all_gather", group, stats.ring_bytes(group, [s * slab for s in sizes]))
        return _run("all_gather", self, (group, pieces, dim, sizes, full_shape, dtype),
                    lambda: self._all_gather(group, pieces, dim, sizes))

    def reduce_scatter(self, group: tuple, pieces: Pieces, dim: int, sizes: Sequence[int]) -> Pieces:
        """Sum the members' full tensors; member i keeps the i-th part (``sizes[i]`` long) along ``dim``."""
        t = next(iter(pieces.values()))
        slab = _slab_bytes(tuple(t.shape), dim, t.dtype)
        stats.record("reduce_scatter", group, stats.ring_bytes(group, [s * slab for s in sizes]))
        return _run("reduce_scatter", self, (group, pieces, dim, sizes),
                    lambda: self._reduce_scatter(group, pieces, dim, sizes))

    def all_reduce(self, group: tuple, pieces: Pieces) -> Pieces:
        """Every member gets the sum of the members' tensors."""
        t = next(iter(pieces.values()))
        stats.record("all_reduce", group, all_reduce_bytes(group, t.numel(), t.element_size()))
        return _run("all_reduce", self, (group, pieces), lambda: self._all_reduce(group, pieces))

    def all_reduce_in_place(self, group: tuple, pieces: Pieces) -> Pieces:
        """``all_reduce`` that writes the sums into the pieces given and returns them (both worlds
        do; a world without its own version returns new tensors): give contiguous tensors nothing
        else reads, such as a gradient bucket's flat buffer. It spares the copy ``all_reduce``
        makes to leave its input as it was."""
        t = next(iter(pieces.values()))
        stats.record("all_reduce", group, all_reduce_bytes(group, t.numel(), t.element_size()))
        return _run("all_reduce_in_place", self, (group, pieces), lambda: self._all_reduce_in_place(group, pieces))

    def all_reduce_async(self, group: tuple, pieces: Pieces) -> Started:
        """``all_reduce_in_place``, started: the data moves while the caller goes on (process
        worlds: the backend's async work; simulated: a communication thread). Counted when started."""
        t = next(iter(pieces.values()))
        stats.record("all_reduce", group, all_reduce_bytes(group, t.numel(), t.element_size()))
        if _observer is not None:           # a traced call records it as the collective it is
            return done(_observer("all_reduce_in_place", self, (group, pieces),
                                  lambda: self._all_reduce_in_place(group, pieces)))
        return self._all_reduce_async(group, pieces)

    def reduce_scatter_async(self, group: tuple, pieces: Pieces, sizes: Sequence[int]) -> Started:
        """``reduce_scatter`` of flat (1-D) tensors, started as ``all_reduce_async`` is."""
        t = next(iter(pieces.values()))
        stats.record("reduce_scatter", group, stats.ring_bytes(group, [s * t.element_size() for s in sizes]))
        if _observer is not None:
            return done(_observer("reduce_scatter", self, (group, pieces, 0, sizes),
                                  lambda: self._reduce_scatter(group, pieces, 0, sizes)))
        return self._reduce_scatter_async(group, pieces, sizes)

    def all_to_all(self, group: tuple, chunks: Dict[int, List[torch.Tensor]], shapes: Sequence[Sequence[tuple]],
                   dtype, tiles: Dict[int, tuple]) -> Pieces:
        """Member i sends ``chunks[group[i]][j]`` to member j; returns, per member, a new tensor the
        blocks it received tile.

        ``shapes[i][j]`` is the shape member i sends member j, known on every process.
        ``tiles[r] = (shape, places)`` for each member r held here: its result's shape, and per
        member j where j's block lies in it, as narrowings ``((dim, start, length), ...)`` (None for
        an empty block); see :func:`tile_places`.
        """
        size = dtype.itemsize
        stats.record("all_to_all", group, {
            r: sum(numel(shapes[i][j]) for j in range(len(group)) if j != i) * size for i, r in enumerate(group)})
        return _run("all_to_all", self, (group, chunks, shapes, dtype, tiles),
                    lambda: self._all_to_all(group, chunks, shapes, dtype, tiles))

    def broadcast(self, group: tuple, src: int, pieces: Pieces, shape: tuple, dtype, device_type: str) -> Pieces:
        """Every member gets ``src``'s tensor of ``shape``; ``pieces`` holds ``src``'s tensor if it is here."""
        stats.record("broadcast", group, {src: numel(shape) * dtype.itemsize} if len(group) > 1 else {src: 0})
        return _run("broadcast", self, (group, src, pieces, shape, dtype, device_type),
                    lambda: self._broadcast(group, src, pieces, shape, dtype, device_type))

    def send_recv(self, transfers: Sequence[Transfer], payload: Dict[int, torch.Tensor], dtype,
                  device_type: str) -> Dict[int, torch.Tensor]:
        """Run the transfers at once; ``payload`` maps a transfer's index to the tensor its src sends.

        Returns index -> received tensor, for the transfers whose dst lives here. Transfers
        with src == dst are handed over without communication.
        """
        size = dtype.itemsize
        sent: Dict[int, int] = {}
        for t in transfers:
            if t.src != t.dst:
                sent[t.src] = sent.get(t.src, 0) + numel(t.shape) * size
        if sent:
            stats.record("send_recv", tuple(sorted({t.src for t in transfers} | {t.dst for t in transfers})), sent)
        return _run("send_recv", self, (transfers, payload, dtype, device_type),
                    lambda: self._send_recv(transfers, payload, dtype, device_type))

    def count(self, op: str, group: tuple, bytes_per_rank: Dict[int, int]) -> None:
        """A collective of a group this process holds no rank of: counted in gt.comm_stats(), not run."""
        _run("count", self, (op, group, bytes_per_rank), lambda: stats.record(op, group, bytes_per_rank))

    # -- implementations ----------------------------------------------------------------
    def _all_reduce_in_place(self, group, pieces) -> Pieces:
        return self._all_reduce(group, pieces)

    def _all_reduce_async(self, group, pieces) -> Started:
        return done(self._all_reduce_in_place(group, pieces))

    def _reduce_scatter_async(self, group, pieces, sizes) -> Started:
        return done(self._reduce_scatter(group, pieces, 0, sizes))

    @abstractmethod
    def _all_gather(self, group, pieces, dim, sizes) -> Pieces: ...

    @abstractmethod
    def _reduce_scatter(self, group, pieces, dim, sizes) -> Pieces: ...

    @abstractmethod
    def _all_reduce(self, group, pieces) -> Pieces: ...

    @abstractmethod
    def _all_to_all(self, group, chunks, shapes, dtype, tiles): ...

    @abstractmethod
    def _broadcast(self, group, src, pieces, shape, dtype, device_type) -> Pieces: ...

    @abstractmethod
    def _send_recv(self, transfers, payload, dtype, device_type): ...
