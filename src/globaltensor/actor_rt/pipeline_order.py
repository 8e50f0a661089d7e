"""A pipeline schedule applied to a lowered step (lower.py): which unit each task belongs to, the key
that orders it (its unit's start on the schedule's timeline), the credits that hold each stage to
its bound on the micro-batches in flight, and how far communication_first may move a task.
The schedules themselves are globaltensor/schedules.py; the stages and units, pipeline_units.py."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

from .fuse_views import is_layout_view
from .graph import Captured
from .pipeline_units import PipelineLayout, cannot_schedule, layout as pipeline_layout, split_weight_gradients
from .program import TaskSpec
from ..schedules import chunk_count, in_flight, sequences, sizes, splits_weight_gradients, stage_of, timeline


class PipelineSchedule:
    """A pipeline schedule over the step's stages: each per-micro-batch op's unit, the units' starts
    (globaltensor/schedules.py), which order the tasks, and the credits that bound each stage."""

    def __init__(self, name: str, cap: Captured, nodes: List[int], m: int, last_backward: int, rank_of,
                 exchange: Optional[Callable], rank: Optional[int]):
        """``nodes``: the per-micro-batch nodes; ``rank_of(node)``: its task's rank; ``exchange`` and
        ``rank``: in a process world, the world's all-gather of an object and this process's rank."""
        self.name, self.m = name, m
        self.layout: PipelineLayout = pipeline_layout(cap, nodes, last_backward, rank_of, name, exchange, rank or 0)
        self.split = splits_weight_gradients(name)
        if self.split:
            split_weight_gradients(cap, self.layout, nodes)
        p, chunks = len(self.layout.stages), self.layout.chunks
        _check_schedule(name, p, chunks, m)
        self.sequences = sequences(name, p, chunks // p, m)
        self.start = timeline(self.sequences, chunks, self.split, sizes(name, p, chunks))
        self.unit_tasks: Dict[tuple, List[int]] = {}

    def unit(self, node: int, mb: int) -> tuple:
        kind, chunk = self.layout.unit_of.get(node, ("F", None))
        if chunk is None:                        # reads and feeds nothing: with the micro-batch's first unit
            return ("F", 0, mb)
        return (kind, chunk, mb)

    def key(self, node: int, mb: int, offset: float = 0.0) -> tuple:
        kind, chunk, _ = self.unit(node, mb)
        if kind == "P":                          # after the chunk's backward
            release = ("W" if self.split else "B", chunk, mb)
            return (0, self.start[release], self._stage(chunk), 3, mb, node + offset)
        return (0, self.start[(kind, chunk, mb)], self._stage(chunk), "FBW".index(kind), mb, node + offset)

    def _stage(self, chunk: int) -> int:
        return stage_of(self.name, chunk, len(self.layout.stages))

    def credits(self, tasks: List[TaskSpec], position: Dict[int, int]) -> None:
        """Each stage's bounds on the micro-batches it holds, as credits: its i-th forward waits for the
        (i - K)-th backward, K the most it holds whole (forward to input gradient); where the weight
        gradients are split, also for the (i - K')-th weight gradient, K' the most it holds in all.
        (A receive stays where its sender's unit puts it, which both sides agree on: the messages
        between two processes must come in the same order on both.)"""
        for seq in self.sequences:
            forwards = [u for u in seq if u[0] == "F"]
            for release in ("B", "W") if self.split else ("B",):
                bound = in_flight(seq, release == "W")
                releases = [u for u in seq if u[0] == release]
                for i in range(bound, len(forwards)):
                    _, chunk, mb = releases[i - bound]
                    freed = self.unit_tasks.get((release, chunk, mb), []) + \
                        (self.unit_tasks.get(("B", chunk, mb), []) if release == "W" else [])
                    _credit(tasks, self.unit_tasks.get(forwards[i], []), freed, position)

    def describe(self) -> str:
        stages = ", ".join(str(list(r)) for r in self.layout.stages)
        bounds = [in_flight(q, self.split) for q in self.sequences]
        whole = [in_flight(q, False) for q in self.sequences]
        return (f"{self.name} over {len(self.layout.stages)} stages ({stages}), {self.layout.chunks} chunks, "
                f"{self.m} micro-batches; micro-batches held per stage at most {bounds}"
                + (f", whole (forward to input gradient) at most {whole}" if self.split else ""))


def unit_ends(tasks: List[TaskSpec], order: List[int]) -> Dict[int, int]:
    """Task id -> the position of the last task of its pipeline unit: how far communication_first
    may postpone it without moving work into another unit."""
    position = {tid: p for p, tid in enumerate(order)}
    end: Dict[tuple, int] = {}
    for t in tasks:
        if t.unit is not None:
            end[t.unit] = max(end.get(t.unit, -1), position[t.id])
    return {t.id: end[t.unit] for t in tasks if t.unit is not None}


def _check_schedule(name: str, p: int, chunks: int, m: int) -> None:
    if name in ("1f1b", "zero_bubble") and chunks != p:
        cannot_schedule(name, f"the model runs {chunks} chunks on {p} stages, and {name} takes one chunk per stage "
                              f"(schedule='interleaved_1f1b' for chunks that take the stages in turn)")
    if name == "zbv" and chunks != chunk_count(name, p, 2):
        cannot_schedule(name, f"the model runs {chunks} chunks on {p} stages, and zbv takes {chunk_count(name, p, 2)}: "
                              f"two halves per stage, down the stages and back up "
                              f"(pipeline_stages(..., chunks_per_stage=2, v_shape=True))")
    if m < p and name != "zbv":            # zbv's simulation takes any number (globaltensor/schedules.py)
        cannot_schedule(name, f"{m} micro-batches for {p} stages; it needs at least as many micro-batches as stages")
    if name == "interleaved_1f1b" and m % p:
        cannot_schedule(name, f"{m} micro-batches on {p} stages; it runs the micro-batches in rounds of {p}, so "
                              f"their number must be a multiple of {p}")


def _credit(tasks: List[TaskSpec], waiting: List[int], freed: List[int], position: Dict[int, int]) -> None:
    """Per rank: every task of ``waiting`` that computes (not a view) waits for the last computing
    task of ``freed`` on each of the rank's streams."""
    last: Dict[tuple, int] = {}
    for i in freed:
        t = tasks[i]
        if not is_layout_view(t.node):
            key = (t.rank, t.stream)
            if key not in last or position[i] > position[last[key]]:
                last[key] = i
    for i in waiting:
        t = tasks[i]
        if not is_layout_view(t.node):
            t.deps.extend((j, 0) for (rank, _), j in last.items() if rank == t.rank)
