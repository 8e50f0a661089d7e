"""The devices a step's time is predicted on: each one's compute and memory rates and its links.

A kernel's time is modelled as a fixed cost plus its work at a rate -- ``α + flops / rate`` for a
matmul or an attention kernel, ``α + bytes / bandwidth`` for everything else (elementwise ops,
reductions, copies: bound by memory). The fixed cost of a matmul is where the efficiency curve
comes from: a matmul of ``f`` flops reaches ``rate · f / (f + α · rate)`` of the rate, half of it at
``f = α · rate``. ``rate`` is the sustained rate of large matmuls, not the datasheet's peak
(``peak`` keeps that, for MFU).

A collective's time is ``latency + bytes / bandwidth`` on its link -- NVLink within a node,
InfiniBand between nodes -- with the bytes the busiest rank sends, as ``gt.comm_stats()`` counts
them. ``overlaps`` says whether the device computes while it communicates (a GPU's NCCL kernels run
on their own stream; this CPU's gloo shares its cores): where it does, gradient buckets' reductions
hide under the backward.

The datasheet figures are NVIDIA's dense (no sparsity) numbers for SXM parts. The sustained
fractions -- 80 % of a tensor-core peak for large matmuls, flash attention at 60 % of that, 90 % of
HBM bandwidth, 80 % of a link's per-direction bandwidth -- are commonly measured figures, stated once here; none is fitted to a
result this library predicts. The CPU's figures come from ``gt.calibrate()``, which times this
machine; :data:`THIS_CPU` is a placeholder of the right order until it has run.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Optional

import torch

MATMUL_EFFICIENCY = 0.8       # sustained / peak for large tensor-core matmuls
MEMORY_EFFICIENCY = 0.9       # sustained / peak HBM bandwidth
LINK_EFFICIENCY = 0.8         # sustained / peak per-direction link bandwidth
ATTENTION_FRACTION = 0.6      # flash attention's rate over large matmuls' (forward and backward)


@dataclass(frozen=True)
class Link:
    """A collective's cost on a link: ``latency`` seconds, then the busiest rank's bytes at ``bandwidth``."""
    latency: float            # seconds per collective
    bandwidth: float          # bytes per second the busiest rank sends

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Device:
    """One accelerator (or this CPU): its rates, its memory, and the links between such devices."""
    name: str
    peak: Dict[torch.dtype, float]       # datasheet matmul flops/s per dtype (MFU's denominator)
    rate: Dict[torch.dtype, float]       # sustained flops/s of large matmuls per dtype
    matmul_latency: float                # α of a matmul or attention kernel, seconds
    memory_bandwidth: float              # sustained bytes/s of memory-bound kernels
    op_latency: float                    # α of any other kernel, seconds
    attention_fraction: float            # attention kernels' rate over the matmul rate (flash, causal)
    memory: int                          # bytes of device memory
    intra_node: Link
    inter_node: Link
    per_node: int = 8
    overlaps: bool = True                # communication runs beside compute
    host_is_device: bool = False         # the host's dispatch and the kernels share the same cores
    links: Dict[str, Link] = field(default_factory=dict)     # per collective kind, where measured
    links_group: int = 2                 # the ranks the measured links were timed over

    def matmul_rate(self, dtype: torch.dtype) -> float:
        return self.rate.get(dtype) or self.rate[torch.float32]

    def peak_rate(self, dtype: torch.dtype) -> float:
        return self.peak.get(dtype) or self.peak[torch.float32]

    def link(self, kind: str, group: tuple) -> Link:
        """The link a collective of ``kind`` over ``group`` runs on: a measured one for its kind where
        there is one -- its latency scaled by the ring's steps, ``len(group) - 1`` over those of the
        group it was timed on -- else NVLink if the group sits in one node, else InfiniBand."""
        if kind in self.links:
            measured = self.links[kind]
            steps = max(len(group) - 1, 1) / max(self.links_group - 1, 1)
            return Link(measured.latency * steps, measured.bandwidth)
        nodes = {r // self.per_node for r in group}
        return self.intra_node if len(nodes) <= 1 else self.inter_node

    def with_links(self, links: Dict[str, Link], group: int) -> "Device":
        return replace(self, links=dict(links), links_group=group)


def _gpu(name: str, bf16: float, fp32: float, fp64: float, hbm: float, memory: int,
         nvlink: float, infiniband: float) -> Device:
    # float32 matmuls count at the float32 rate: torch leaves TF32 off for them by default
    peak = {torch.bfloat16: bf16, torch.float16: bf16, torch.float32: fp32, torch.float64: fp64}
    rate = {dtype: flops * MATMUL_EFFICIENCY for dtype, flops in peak.items()}
    # α of a matmul: a 1024^3 matmul (2.1 GFLOP) runs at about a quarter of the sustained rate
    matmul_latency = 3 * 2 * 1024 ** 3 / rate[torch.bfloat16]
    return Device(name, peak, rate, matmul_latency, hbm * MEMORY_EFFICIENCY, 3e-6, ATTENTION_FRACTION, memory,
                  Link(10e-6, nvlink * LINK_EFFICIENCY), Link(20e-6, infiniband * LINK_EFFICIENCY))


H100 = _gpu("H100", bf16=989.4e12, fp32=66.9e12, fp64=66.9e12, hbm=3.35e12, memory=80 * 2 ** 30,
            nvlink=450e9, infiniband=50e9)
H200 = _gpu("H200", bf16=989.4e12, fp32=66.9e12, fp64=66.9e12, hbm=4.8e12, memory=140 * 2 ** 30,
            nvlink=450e9, infiniband=50e9)
A100 = _gpu("A100", bf16=312e12, fp32=19.5e12, fp64=19.5e12, hbm=2.039e12, memory=80 * 2 ** 30,
            nvlink=300e9, infiniband=25e9)

#: This CPU before ``gt.calibrate()`` has timed it: one core of a current x86 server (50 GFLOP/s in
#: float32 matmuls, 10 GB/s through memory-bound kernels) and gloo between processes of one host
#: (0.2 ms and 2 GB/s a collective) -- this machine's order of magnitude, so that an uncalibrated
#: plan weighs a byte against a flop about as a calibrated one does.
CPU_LINK = Link(2e-4, 2e9)
THIS_CPU = Device("this CPU (uncalibrated)", {torch.float32: 50e9, torch.float64: 25e9},
                  {torch.float32: 50e9, torch.float64: 25e9}, 5e-6, 10e9, 2e-6, 0.3, 16 * 2 ** 30,
                  CPU_LINK, CPU_LINK, per_node=2 ** 20, overlaps=False, host_is_device=True)

DEVICES = {"H100": H100, "H200": H200, "A100": A100}


def device_named(device) -> Optional[Device]:
    """``device`` as a :class:`Device`: one already, a name of :data:`DEVICES`, or None (this machine)."""
    if device is None or isinstance(device, Device):
        return device
    if isinstance(device, str) and device.upper() in DEVICES:
        return DEVICES[device.upper()]
    raise ValueError(f"device=: expected a gt.nn.Device or one of {sorted(DEVICES)}, got {device!r}")
