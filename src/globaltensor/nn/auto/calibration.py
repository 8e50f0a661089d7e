"""``gt.calibrate()``: the latency and bandwidth of the world's collectives, measured and cached.

Each collective kind -- all-reduce, all-gather, reduce-scatter, all-to-all, send/recv -- is timed on
the whole world through the boxing that issues it (``P -> B``, ``S(0) -> B``, ``P -> S(0)``,
``S(0) -> S(1)``, a move to a placement of the ranks in another order), at a small and a large
payload; ``time = latency + bytes / bandwidth`` through the two points gives both, the bytes counted
as ``gt.comm_stats()`` counts them (the most any one rank sends). The result is cached per backend
and world size for the process: ``gt.nn.auto_plan`` costs each collective with it, and without one
with :data:`DEFAULT`. Every rank calls it (it runs collectives).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict

import torch

from ...boxing import Layout
from ...comm import comm_stats, get_world
from ...placement import Placement
from ...sbp import broadcast, partial_sum, split
from ...tensor import GlobalTensor

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")


@dataclass(frozen=True)
class LinkCost:
    latency: float          # seconds per collective
    bandwidth: float        # bytes per second, of the bytes the busiest rank sends

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Calibration:
    """Per collective kind, its latency and bandwidth; ``backend`` and ``world_size`` say where."""
    backend: str
    world_size: int
    links: Dict[str, LinkCost] = field(default_factory=dict)

    def seconds(self, kind: str, nbytes: int) -> float:
        """The modelled time of one collective of ``kind`` whose busiest rank sends ``nbytes``."""
        link = self.links.get(kind) or DEFAULT.links.get(kind) or DEFAULT.links["all_reduce"]
        return link.seconds(nbytes)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "world_size": self.world_size,
                "links": {k: {"latency": v.latency, "bandwidth": v.bandwidth} for k, v in self.links.items()}}


#: The model without a calibration: the bytes (at 10 GB/s), each collective counting as 1 KB more --
#: a tie-breaker toward fewer collectives, not a latency: the plans then minimise bytes, and a
#: calibration tells when a collective's latency is worth bytes.
DEFAULT = Calibration("default", 0, {k: LinkCost(1e-7, 10e9) for k in KINDS})

_CACHE: Dict[tuple, Calibration] = {}


def _backend(world) -> str:
    if world.simulated:
        return "simulated"
    import torch.distributed as dist
    return str(dist.get_backend())


def current_calibration() -> Calibration:
    """This world's calibration if :func:`calibrate` measured a world like it in this process, else DEFAULT."""
    world = get_world()
    return _CACHE.get((_backend(world), world.size), DEFAULT)


def calibrate(small: int = 16 * 1024, large: int = 4 * 2 ** 20, repeats: int = 5) -> Calibration:
    """Measure every collective kind on the whole world and cache the result for this backend and world
    size. ``small`` / ``large``: the payload's bytes (a float32 tensor of that size per conversion)."""
    for name, value in (("small", small), ("large", large), ("repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"calibrate({name}=): expected a positive int, got {value!r}")
    if large <= small:
        raise ValueError(f"calibrate: expected large > small, got small={small}, large={large}")
    world = get_world()
    ranks = list(range(world.size))
    if world.size < 2:
        raise ValueError(f"calibrate: needs a world of 2 or more ranks to measure collectives, got {world.size}")
    points = {kind: [_measure(kind, ranks, n, repeats) for n in (small, large)] for kind in KINDS}
    times = _agreed([t for kind in KINDS for _, t in points[kind]])
    links = {}
    for k, kind in enumerate(KINDS):
        (b1, _), (b2, _) = points[kind]
        t1, t2 = times[2 * k], times[2 * k + 1]
        bandwidth = (b2 - b1) / max(t2 - t1, 1e-9)
        links[kind] = LinkCost(max(t1 - b1 / bandwidth, 0.0), bandwidth)
    result = Calibration(_backend(world), world.size, links)
    _CACHE[(result.backend, result.world_size)] = result
    return result


def _agreed(times: list) -> list:
    """The ranks' mean of each time, the same on every rank (plans made from them must agree)."""
    world = get_world()
    if world.simulated:
        return times
    mine = torch.tensor(times, dtype=torch.float64)
    total = world.all_reduce(tuple(range(world.size)), {world.rank: mine})[world.rank]
    return (total / world.size).tolist()


_CONVERSIONS = {             # kind -> (source sbp, target sbp, target ranks rotated)
    "all_reduce": (partial_sum, broadcast, False),
    "all_gather": (split(0), broadcast, False),
    "reduce_scatter": (partial_sum, split(0), False),
    "all_to_all": (split(0), split(1), False),
    "send_recv": (split(0), split(0), True),
    "broadcast": (broadcast, broadcast, True),
}


def _measure(kind: str, ranks: list, nbytes: int, repeats: int) -> tuple:
    """(bytes the busiest rank sends, fastest seconds) of the conversion that runs ``kind``."""
    src_sbp, dst_sbp, rotated = _CONVERSIONS[kind]
    p = len(ranks)
    side = max(p, int((nbytes // 4) ** 0.5) // p * p)
    source = Placement("cpu", ranks)
    target = Placement("cpu", ranks[1:] + ranks[:1]) if rotated else source
    if kind == "broadcast":
        source = Placement("cpu", ranks[:1])
    layout = Layout((side, side), torch.float32, source, (src_sbp,))
    world = get_world()
    x = GlobalTensor(layout, {r: torch.ones(layout.piece_shape(r)) for r in source.rank_list() if world.holds(r)})
    x.to_global(placement=target, sbp=dst_sbp)            # first call: groups and plans made
    with comm_stats() as st:
        x.to_global(placement=target, sbp=dst_sbp)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.to_global(placement=target, sbp=dst_sbp)
        best = min(best, time.perf_counter() - start)
    return st.bytes_sent, best
