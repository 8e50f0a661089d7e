"""``gt.calibrate()``: this machine's collectives, kernels and host work, measured and cached.

Each collective kind -- all-reduce, all-gather, reduce-scatter, all-to-all, send/recv -- is timed on
the whole world through the boxing that issues it (``P -> B``, ``S(0) -> B``, ``P -> S(0)``,
``S(0) -> S(1)``, a move to a placement of the ranks in another order), at a small and a large
payload, as a step meets it: right after a burst of compute, its time what it adds to the burst's
(a rank that computed a little longer than its peer keeps the others waiting; on this machine's
gloo that wait is most of a small collective's cost). ``time = latency + bytes / bandwidth``
through the two points gives both, the bytes counted as ``gt.comm_stats()`` counts them (the most
any one rank sends). The kernels, the host's dispatch and its work per bucketed gradient are timed
by kernel_timing.py. Each figure is a median, agreed over the ranks. The result -- ``links``, and
the machine as a :class:`~.devices.Device` -- is cached per backend and world size for the process:
``gt.nn.auto_plan`` plans and predicts with it, and without one with :data:`DEFAULT`. Every rank
calls it (it runs collectives).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

import torch

from ...boxing import Layout
from ...comm import comm_stats, get_world
from ...placement import Placement
from ...sbp import broadcast, partial_sum, split
from ...tensor import GlobalTensor
from .devices import CPU_LINK, THIS_CPU, Device, Link
from .kernel_timing import fitted_device, host_gradient_seconds, host_op_seconds, kernel_points, line, typical
from .predict import HostCosts

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")


#: seconds of host dispatch per global op before a calibration: what this machine's calibrations give
HOST_OP_SECONDS = 15e-6
#: the host's seconds per gradient a gradient bucket takes before a calibration: what this machine's give
HOST_GRADIENT_SECONDS = 60e-6


@dataclass(frozen=True)
class Calibration:
    """Per collective kind, its latency and bandwidth (``links``); this machine's kernels
    (``compute``, a Device whose links are not used), ``host_op_seconds`` and
    ``host_gradient_seconds``; ``backend`` and ``world_size`` say where it was measured."""
    backend: str
    world_size: int
    links: Dict[str, Link] = field(default_factory=dict)
    compute: Device = THIS_CPU
    host_op_seconds: float = HOST_OP_SECONDS
    host_gradient_seconds: float = HOST_GRADIENT_SECONDS

    @property
    def host(self) -> HostCosts:
        """The host's seconds per global op and per bucketed gradient, as predict.py takes them."""
        return HostCosts(self.host_op_seconds, self.host_gradient_seconds)

    @property
    def device(self) -> Device:
        """This machine as a Device: its measured kernels and, per collective kind, its measured link."""
        return self.compute.with_links({k: self.links.get(k) or DEFAULT.links[k] for k in KINDS},
                                       max(self.world_size, 2))

    def seconds(self, kind: str, nbytes: int) -> float:
        """The modelled time of one collective of ``kind`` whose busiest rank sends ``nbytes``."""
        link = self.links.get(kind) or DEFAULT.links.get(kind) or DEFAULT.links["all_reduce"]
        return link.seconds(nbytes)

    def to_dict(self) -> dict:
        c = self.compute
        return {"backend": self.backend, "world_size": self.world_size,
                "links": {k: {"latency": v.latency, "bandwidth": v.bandwidth} for k, v in self.links.items()},
                "compute": {"matmul_rate": {str(d): v for d, v in c.rate.items()}, "matmul_latency": c.matmul_latency,
                            "memory_bandwidth": c.memory_bandwidth, "op_latency": c.op_latency},
                "host_op_seconds": self.host_op_seconds, "host_gradient_seconds": self.host_gradient_seconds}


#: The model without a calibration: THIS_CPU's kernels and its gloo link for every collective kind.
DEFAULT = Calibration("default", 0, {k: CPU_LINK for k in KINDS})

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
    kernels = kernel_points(repeats)
    host = [host_op_seconds(ranks, repeats), host_gradient_seconds(ranks, repeats)]
    times = _agreed([t for kind in KINDS for _, t in points[kind]] + [t for _, t in kernels.values()] + host)
    agreed = {name: (work, times[2 * len(KINDS) + j]) for j, (name, (work, _)) in enumerate(kernels.items())}
    machine = fitted_device(agreed)
    links = {}
    for k, kind in enumerate(KINDS):
        (b1, _), (b2, _) = points[kind]
        links[kind] = fitted_link(b1, times[2 * k], b2, times[2 * k + 1], machine.memory_bandwidth)
    result = Calibration(_backend(world), world.size, links, machine, *times[-2:])
    _CACHE[(result.backend, result.world_size)] = result
    return result


def fitted_link(b1: int, t1: float, b2: int, t2: float, ceiling: float) -> Link:
    """The line ``t = latency + bytes / bandwidth`` through a collective's two timings, its bandwidth
    no higher than ``ceiling`` (the machine's memory bandwidth: the measured collectives run among
    processes of this host, whose bytes pass through memory at least once). Where the larger
    payload took barely longer than the smaller -- the difference lost in the timings' jitter --
    the slope says nothing (one calibration in three on 2 gloo processes read an all-to-all at
    10^6 GB/s); the line then goes through the larger point at the ceiling."""
    latency, bandwidth = line(b1, t1, b2, t2)
    if bandwidth <= ceiling:
        return Link(latency, bandwidth)
    return Link(max(t2 - b2 / ceiling, 0.0), ceiling)


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


#: the compute burst before each timed collective: matmuls of this side, this many (about a
#: millisecond here); each timing is the mean of this many bursts
_BURST_SIDE, _BURST_MATMULS, _BURSTS = 128, 32, 4


def _measure(kind: str, ranks: list, nbytes: int, repeats: int) -> tuple:
    """(bytes the busiest rank sends, seconds) of the conversion that runs ``kind``: the median of a
    compute burst followed by it, less the median of the burst alone."""
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
    a = torch.ones(_BURST_SIDE, _BURST_SIDE)

    def burst():
        for _ in range(_BURST_MATMULS):
            torch.mm(a, a)

    def burst_then_collective():
        burst()
        x.to_global(placement=target, sbp=dst_sbp)
    steady = 2 * repeats + 1                  # a collective's time varies more than a kernel's
    return st.bytes_sent, max(typical(burst_then_collective, steady, _BURSTS) - typical(burst, steady, _BURSTS), 0.0)
