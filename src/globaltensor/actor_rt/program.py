"""The lowered program: per-rank tasks bound to streams, in one reference order (lower.py makes it,
runtime.py runs it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .graph import Node


class CompileError(RuntimeError):
    """A captured graph that cannot be scheduled as asked."""


@dataclass
class TaskSpec:
    id: int
    name: str
    node: Optional[Node]            # None: an accumulator (fold)
    mb: Optional[int]               # the micro-batch (None: once per call)
    rank: int
    stream: str
    inputs: list                    # per input value: ("task", id, out) | ("feed", key) | ("const", tensor)
    deps: List[Tuple[int, int]] = field(default_factory=list)   # ordering edges: (task id, delay 0 or 1)
    registers: int = 2
    nbytes: int = 0                 # bytes one register of its outputs holds
    device: object = None
    fold: Optional[Tuple[int, int]] = None     # an accumulator: (micro-batch j, of m)
    unit: Optional[tuple] = None    # its pipeline schedule's unit: (kind, chunk, micro-batch)


@dataclass
class Program:
    tasks: List[TaskSpec]
    order: Dict[str, List[int]]    # stream -> task ids in static order
    outputs: list                   # per Output leaf: as in Captured, refs resolved
    rebinds: list                   # (weakref, rank, input ref)
    grad_rebinds: list              # (leaf index, layout, {rank: input ref})
    feeds: list                     # feed keys: ("arg", leaf, rank, mb) | ("keys", vid, mb) | ("number", leaf, dtype, device)
    feed_specs: dict                # feed key -> how to make it
    micro_batches: int
    schedule: str = "gpipe"
    pipeline: str = ""              # the schedule's stages and bounds, for the plan ("" for gpipe)

    @property
    def memory_bound(self) -> int:
        """Bytes the registers may hold at once: every task's register count times its outputs' bytes."""
        return sum(t.registers * t.nbytes for t in self.tasks)
