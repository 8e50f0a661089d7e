"""The current world: simulated when asked for, a process world when launched, else one rank."""
from __future__ import annotations

import os

import torch.distributed as dist

from ..placement import set_world_size_source
from .simulated import SimulatedWorld
from .timeouts import set_timeout_s
from .world import World

_world: World | None = None


def _from_environment() -> World:
    if dist.is_available() and (dist.is_initialized() or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)):
        from .process import ProcessWorld
        return ProcessWorld()
    return SimulatedWorld(1)


def get_world() -> World:
    """The current world: the simulated one ``gt.simulate`` set, else a process world made from the
    environment (a launcher's or torchrun's variables, or an initialised torch.distributed), else a
    world of one rank."""
    global _world
    if _world is None:
        _world = _from_environment()
    return _world


def set_world(world: World) -> World:
    global _world
    previous, _world = _world, world
    return previous


class simulate:
    """Switch this process to ``n`` CPU-simulated ranks; also a context manager that restores.

    ``gt.simulate(4)`` or ``with gt.simulate(4): ...``.
    """

    def __init__(self, n: int, cuda_device: int = 0):
        self.world = SimulatedWorld(n, cuda_device)
        self._previous = set_world(self.world)

    def __enter__(self) -> World:
        return self.world

    def __exit__(self, *exc) -> None:
        set_world(self._previous)


def rank() -> int:
    """This process's rank (0 in a simulated world, whose one process drives every rank)."""
    w = get_world()
    return 0 if w.simulated else w.rank


def world_size() -> int:
    """The number of ranks of the current world."""
    return get_world().size


set_world_size_source(world_size)


def set_timeout(seconds: float) -> float:
    """Collectives wait at most ``seconds`` (default 60, or ``GT_COLLECTIVE_TIMEOUT``) for their
    peers, then fail naming the ranks that did not arrive. Applies to collectives already set up;
    every rank should set the same value. Returns the previous timeout."""
    previous = set_timeout_s(seconds)
    if _world is not None:
        _world.retime(float(seconds))
    return previous
