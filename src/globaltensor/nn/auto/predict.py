"""A step's predicted time, throughput, MFU and peak memory per rank, from one meta run's tallies.

Per rank, on a :class:`~.devices.Device`:

- **compute**: each kernel the rank runs (compute.py) at the device's rates -- ``α + flops / rate``
  for matmul and attention kernels, ``α + bytes / bandwidth`` for memory-bound ones;
- **communication**: each collective the rank takes part in, ``latency + bytes / bandwidth`` on its
  link. Where the device overlaps (GPUs), the gradient buckets' reductions run under the backward's
  compute and ring attention's block exchanges under its attention kernels, and only what outlasts
  them shows (eager FSDP gathers a parameter when an op needs it, with nothing to hide under);
- **host**: the global ops its process dispatches, at the calibrated seconds per op, and the
  gradients its gradient buckets take, at the calibrated seconds per gradient (the hooks' Python, the
  copy into and out of the flat buffer, the collectives' launch: a data-parallel step's work on the
  host that is no global op).

A GPU's host dispatches ahead of its kernels, so a rank's step is the longer of host and device
(compute plus the communication that shows); on this CPU the same cores do both, so they add. The
step is the slowest rank's: collectives make every rank wait for the last. An eager step over
pipeline stages (parameters on disjoint placements, ``predict_step.py``) is their sum instead: each
stage waits for the one before it, forward and backward. One process per rank is assumed (a
launched job), not the simulated world's one process driving all ranks.

MFU is the one-device step's flops (``model_flops``: matmul and attention flops, causal attention
counted whole as Megatron-LM counts it) over the step's time, the ranks and the device's peak.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .compute import ComputeTally
from .devices import Device


@dataclass(frozen=True)
class HostCosts:
    """The host's seconds per global op dispatched and per gradient a gradient bucket takes."""
    op_seconds: float
    gradient_seconds: float


@dataclass
class RankTime:
    compute: float = 0.0
    communication: float = 0.0          # what shows: not hidden under compute
    hidden: float = 0.0                 # gradient reductions run under the backward
    host: float = 0.0
    device_bound: bool = True           # host and device overlap, and the device is the longer
    by_kind: Dict[str, float] = field(default_factory=lambda: defaultdict(float))
    by_module: Dict[str, float] = field(default_factory=lambda: defaultdict(float))


@dataclass
class Prediction:
    """One layout's predicted step on ``device``: the slowest ``rank``'s ``seconds``, split into
    ``compute``, ``communication`` (exposed) and ``host`` work; per rank ``memory`` (bytes) with
    ``memory_parts``; ``tokens_per_second`` and ``mfu`` where the tokens and flops are known; and the
    slowest rank's seconds ``by_kind`` (kernel kinds, collective kinds, host dispatch, gradient hooks) and
    ``by_module``."""
    device: str
    seconds: float
    rank: int
    compute: float
    communication: float
    hidden_communication: float
    host: float
    memory: Dict[int, int]
    memory_parts: Dict[str, int]
    tokens_per_second: Optional[float]
    mfu: Optional[float]
    by_kind: Dict[str, float]
    by_module: Dict[str, float]

    @property
    def peak_memory(self) -> int:
        return max(self.memory.values(), default=0)

    def table(self) -> str:
        """The prediction as text: the step, its parts, throughput, memory, and where the time goes."""
        lines = [f"predicted step on {self.device}: {self.seconds * 1e3:.3f} ms (rank {self.rank}: compute "
                 f"{self.compute * 1e3:.3f} ms, communication {self.communication * 1e3:.3f} ms shown"
                 f" + {self.hidden_communication * 1e3:.3f} ms hidden, host {self.host * 1e3:.3f} ms)"]
        if self.tokens_per_second is not None:
            lines.append(f"throughput: {self.tokens_per_second:,.0f} tokens/s"
                         + (f", MFU {self.mfu * 100:.1f} %" if self.mfu is not None else ""))
        parts = ", ".join(f"{k} {v:,}" for k, v in self.memory_parts.items())
        lines.append(f"peak memory per rank: {self.peak_memory:,} bytes ({parts})")
        lines.append("by kind: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in _largest(self.by_kind)))
        lines.append("by module: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in _largest(self.by_module)))
        return "\n".join(lines)


def _largest(seconds: Dict[str, float], n: int = 8) -> list:
    return sorted(seconds.items(), key=lambda kv: -kv[1])[:n]


def rank_time(rank: int, tally: ComputeTally, events, device: Device, host: HostCosts) -> RankTime:
    """One rank's compute, communication and host work in the step on ``device``."""
    t = RankTime()
    backward = 0.0
    for (kind, dtype, phase, module), work in tally.on_rank(rank).items():
        if kind == "memory":
            s = work.kernels * device.op_latency + work.bytes / device.memory_bandwidth
        elif kind == "attention":
            s = work.kernels * device.matmul_latency + work.flops / (device.matmul_rate(dtype) *
                                                                    device.attention_fraction)
        else:
            s = work.kernels * device.matmul_latency + work.flops / device.matmul_rate(dtype)
        t.compute += s
        t.by_kind[kind] += s
        t.by_module[module] += s
        if phase == "backward":
            backward += s
    buckets = ring = 0.0
    for e in events:
        if rank not in e.group:
            continue
        s = device.link(e.collective, e.group).seconds(e.bytes_per_rank.get(rank, 0))
        t.by_kind[e.collective] += s
        if device.overlaps and e.op == "gradient bucket":
            buckets += s
            continue
        if device.overlaps and e.collective == "send_recv" and "scaled_dot_product" in e.op:
            ring += s
            continue
        t.communication += s
        t.by_module[e.module] += s
    for pool, under in ((buckets, backward), (ring, t.by_kind.get("attention", 0.0))):
        shown = max(0.0, pool - under)
        t.communication += shown
        t.hidden += pool - shown
    dispatch = tally.host_ops.get(rank, 0) * host.op_seconds
    hooks = tally.bucketed.get(rank, 0) * host.gradient_seconds
    t.host = dispatch + hooks
    t.by_kind["host dispatch"] += dispatch
    t.by_kind["gradient hooks"] += hooks
    t.device_bound = t.compute + t.communication >= t.host
    return t


def step_seconds(t: RankTime, device: Device) -> float:
    if device.host_is_device:
        return t.host + t.compute + t.communication
    return max(t.host, t.compute + t.communication)


def predict_cost(cost, ranks, device: Device, host: HostCosts, tokens: Optional[int] = None,
                 model_flops: Optional[int] = None, dtype: torch.dtype = torch.float32,
                 stages: Optional[List[List[int]]] = None) -> Prediction:
    """The prediction of a costed layout (cost.py's ``Cost``) on ``device``; ``tokens``: a step's
    tokens; ``model_flops``: the one-device step's flops (for MFU); ``stages``: the ranks of the
    pipeline stages of an eager step, which run one after another -- the step is then each stage's
    slowest rank without its transfers, summed, and the transfers between stages once."""
    times = {r: rank_time(r, cost.tally, cost.events, device, host) for r in ranks}
    slowest = max(ranks, key=lambda r: step_seconds(times[r], device))
    t = times[slowest]
    seconds = step_seconds(t, device) if not stages else _chained(stages, times, cost.events, device)
    mfu = None
    if model_flops and seconds > 0:
        mfu = model_flops / (seconds * len(ranks) * device.peak_rate(dtype))
    return Prediction(device.name, seconds, slowest, t.compute, t.communication, t.hidden, t.host,
                      dict(cost.memory_by_rank), dict(cost.memory_parts),
                      tokens / seconds if tokens and seconds > 0 else None, mfu,
                      {k: v for k, v in t.by_kind.items() if v > 0},
                      {k: v for k, v in t.by_module.items() if v > 0})


def _chained(stages: List[List[int]], times: Dict[int, RankTime], events, device: Device) -> float:
    """An eager pipeline's step: a stage waits for the one before it, forward and backward alike."""
    stage_of = {r: s for s, members in enumerate(stages) for r in members}
    crossing = [e for e in events if e.collective == "send_recv" and len({stage_of.get(r) for r in e.group}) > 1]
    transfers = sum(device.link(e.collective, e.group).seconds(max(e.bytes_per_rank.values(), default=0))
                    for e in crossing)
    own = {r: step_seconds(t, device) - t.by_kind.get("send_recv", 0.0) for r, t in times.items()}
    return sum(max(own[r] for r in members) for members in stages) + transfers
