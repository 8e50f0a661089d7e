"""``gt.nn.plan_at_scale``: the fastest layout of a transformer on thousands of GPUs, in seconds.

    shape = gt.nn.TransformerShape.of(model, seq=8192)        # a model built on the meta device
    plan = gt.nn.plan_at_scale(shape, gpus=1024, global_batch=512, device="H100")
    print(plan.explain())

Every layout of the degrees below is costed by scale_model.py on its representative ranks, with
the world's size a parameter -- nothing runs per GPU -- and the fastest that fits the device's
memory is kept:

- tensor parallelism 1, 2, 4 or 8 (within a node, dividing the heads);
- context parallelism 1 to 16 (ring attention over balanced halves of the sequence);
- pipeline parallelism over 1 to 64 stages of whole blocks, 1F1B non-interleaved or interleaved
  over 2, 4 or 8 chunks a stage, or a zero-bubble schedule (ZB-H1, or zbv: two halves a stage in a
  V); the layers cut as ``gt.nn.pipeline_stages`` cuts them: evenly (the extra ones on the first
  stages) or, for 1F1B and ZB-H1, by weights (``cut="params"``: the head's with the last stage);
- expert parallelism over the divisors of the experts that divide the data ranks (MoE shapes);
- data parallelism over the rest, ZeRO-1 or FSDP; micro-batches of 1, 2, 4 or 8 sequences;
  activations kept, selectively recomputed (torchtitan's op-level policy) or fully recomputed.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import List, Optional, Tuple

from .devices import Device, device_named
from .predict import Prediction
from .scale_model import RECOMPUTE, SCHEDULES, ScaleLayout, predict_scale
from .transformer_shape import TransformerShape

TENSOR = (1, 2, 4, 8)
CONTEXT = (1, 2, 4, 8, 16)
MICRO_BATCHES = (1, 2, 4, 8)
VIRTUAL = (1, 2, 4, 8)
MAX_STAGES = 64
#: the share of a device's memory a plan may fill by default: the CUDA context, the collectives'
#: buffers and the allocator's fragmentation take the rest (torchtitan's published runs peak at 88 %)
MEMORY_HEADROOM = 0.9


class ScalePlan:
    """What :func:`plan_at_scale` returns: the chosen ``layout`` (a :class:`ScaleLayout`) and its
    ``prediction``, ``options`` (every layout that fits, fastest first, with its prediction), and
    :meth:`predict` for any layout."""

    def __init__(self, shape: TransformerShape, gpus: int, global_batch: int, device: Device,
                 options: List[Tuple[ScaleLayout, Prediction]]):
        self.shape, self.gpus, self.global_batch, self.device = shape, gpus, global_batch, device
        self.options = options
        self.layout, self.prediction = options[0]

    def predict(self, layout: Optional[ScaleLayout] = None, device=None) -> Prediction:
        """The step of ``layout`` (default: the chosen one) on ``device`` (default: the planned one)."""
        layout = layout or self.layout
        target = device_named(device) or self.device
        problem = layout.problem(self.shape, self.gpus, self.global_batch, target.per_node)
        if problem:
            raise ValueError(f"ScalePlan.predict(layout=): this layout cannot run the plan's step: {problem}")
        return predict_scale(self.shape, layout, target, self.global_batch)

    def explain(self, top: int = 8) -> str:
        """The fastest layouts that fit: step time, tokens/s per GPU, MFU and memory per GPU."""
        rows = ["| layout | step s | tokens/s/GPU | MFU | memory GiB | bubble s | exposed communication s |",
                "|---|---|---|---|---|---|---|"]
        for lay, p in self.options[:top]:
            rows.append(f"| {lay.text()} | {p.seconds:.3f} | {p.tokens_per_second / self.gpus:,.0f} | "
                        f"{p.mfu:.1%} | {p.peak_memory / 2 ** 30:.1f} | {p.by_kind.get('pipeline bubble', 0.0):.3f} | "
                        f"{p.communication:.3f} |")
        head = (f"{self.shape.params / 1e9:.1f}B parameters on {self.gpus} {self.device.name}, "
                f"{self.global_batch} x {self.shape.seq} tokens a step: {len(self.options)} layouts fit")
        return head + "\n\n" + "\n".join(rows)

    def __repr__(self) -> str:
        p = self.prediction
        return f"ScalePlan({self.layout.text()}: {p.seconds:.3f} s a step, MFU {p.mfu:.1%})"


def layouts(shape: TransformerShape, gpus: int, global_batch: int, per_node: int):
    """Every layout of the search's degrees that can run ``shape`` on ``gpus``."""
    stages = [p for p in range(1, min(shape.layers, MAX_STAGES) + 1) if gpus % p == 0]
    for tp, cp, pp in itertools.product(TENSOR, CONTEXT, stages):
        if gpus % (tp * cp * pp):
            continue
        dp = gpus // (tp * cp * pp)
        experts = [e for e in range(1, shape.experts + 1) if shape.experts % e == 0 and (dp * cp) % e == 0] or [1]
        pipelines = ([(v, "1f1b", "even") for v in VIRTUAL] + [(1, s, "even") for s in SCHEDULES if s != "1f1b"]
                     + [(1, s, "params") for s in SCHEDULES if s != "zbv"]) if pp > 1 else [(1, "1f1b", "even")]
        for ep, mb, (virtual, schedule, cut), recompute, zero in itertools.product(experts, MICRO_BATCHES, pipelines,
                                                                                  RECOMPUTE, (1, 3)):
            lay = ScaleLayout(dp, tp, pp, cp, ep, mb, virtual, recompute, zero, schedule, cut)
            if lay.problem(shape, gpus, global_batch, per_node) is None:
                yield lay


def plan_at_scale(shape: TransformerShape, gpus: int, global_batch: int, *, device="H100",
                  memory_limit: Optional[int] = None) -> ScalePlan:
    """The fastest layout of ``shape`` on ``gpus`` GPUs of ``device`` (a ``gt.nn.Device`` or a name of
    ``gt.nn.DEVICES``; nodes of its ``per_node``) training ``global_batch`` sequences a step, whose
    memory per GPU fits ``memory_limit`` (default: :data:`MEMORY_HEADROOM` of the device's)."""
    if not isinstance(shape, TransformerShape):
        raise TypeError(f"plan_at_scale(shape): expected a gt.nn.TransformerShape, got {type(shape).__name__}")
    for name, value in (("gpus", gpus), ("global_batch", global_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"plan_at_scale({name}=): expected a positive int, got {value!r}")
    target = device_named(device)
    if target is None:
        raise ValueError("plan_at_scale(device=): expected a gt.nn.Device or a name of gt.nn.DEVICES, got None")
    limit = memory_limit if memory_limit is not None else int(MEMORY_HEADROOM * target.memory)
    options = []
    smallest = None
    for lay in layouts(shape, gpus, global_batch, target.per_node):
        p = predict_scale(shape, lay, target, global_batch)
        if p.peak_memory <= limit:
            options.append((lay, p))
        elif smallest is None or p.peak_memory < smallest[1].peak_memory:
            smallest = (lay, p)
    if not options:
        least = "no layout can run it" if smallest is None else \
            f"the smallest, {smallest[0].text()}, needs {smallest[1].peak_memory / 2 ** 30:.1f} GiB a GPU"
        raise ValueError(f"plan_at_scale: no layout of {shape.params / 1e9:.1f}B parameters on {gpus} GPUs at "
                         f"{global_batch} sequences a step fits {limit / 2 ** 30:.1f} GiB a GPU; {least}")
    options.sort(key=lambda o: o[1].seconds)
    return ScalePlan(shape, gpus, global_batch, target, options)


def with_matmul_efficiency(device: Device, efficiency: float) -> Device:
    """``device`` with its matmuls (and attention, in proportion) sustained at ``efficiency`` of peak."""
    return replace(device, rate={dtype: peak * efficiency for dtype, peak in device.peak.items()})
