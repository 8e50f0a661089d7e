"""Where a captured step's ops sit in a pipeline: the stages, the model chunks, and each op's unit.

The stages are found from the step itself, not declared. Ranks that take part in one per-micro-batch
collective (a tensor- or sequence-parallel exchange), or send together / receive together in a
point-to-point transfer (the pieces of an activation moving on), hold one stage. Along the data
flow of one micro-batch, every edge from one stage to another starts a new *chunk*: the forward
passes chunks 0, 1, ..., V - 1, the backward comes back through V - 1, ..., 0 (a backward op reading
chunk c's saved activations or chunk c + 1's gradient belongs to chunk c's backward). Each chunk
must sit on one stage, chunk c on stage c mod p. For the zero-bubble schedule a chunk's backward
is split: the ops the input gradient needs -- what is sent to the previous chunk, through data
and through reads and writes of one storage in capture order -- are its ``B`` unit, the rest (the
weight gradients) its ``W``. Per-micro-batch ops after the backward (a loss detached for the
return) run after their chunk's backward, as unit ``P``. The stage of the step's first op is the
first stage; an op reading nothing but arguments and state runs with the first chunk of its
stage that uses it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

from torch.utils._pytree import tree_unflatten

from .graph import Captured, Node
from .program import CompileError


@dataclass
class PipelineLayout:
    stages: List[Tuple[int, ...]]            # the ranks of each stage, stage 0 first
    chunks: int                              # V: the model chunks, chunk c on stage c mod p
    unit_of: Dict[int, Tuple[str, int]]      # node index -> (kind "F" / "B" / "W" / "P", chunk)

    @property
    def per_stage(self) -> int:
        return self.chunks // len(self.stages)


def cannot_schedule(schedule: str, why: str):
    """Raise the CompileError of a schedule that cannot run the captured step, saying why."""
    raise CompileError(f"gt.compile(schedule={schedule!r}) cannot run this step: {why}")


class _Ranks:
    """Union-find over ranks."""

    def __init__(self):
        self.parent: Dict[int, int] = {}

    def find(self, r: int) -> int:
        self.parent.setdefault(r, r)
        while self.parent[r] != r:
            self.parent[r] = self.parent[self.parent[r]]
            r = self.parent[r]
        return r

    def union(self, ranks) -> None:
        ranks = list(ranks)
        for r in ranks[1:]:
            self.parent[self.find(r)] = self.find(ranks[0])


def _transfer_ends(n: Node) -> Tuple[Set[int], Set[int]]:
    transfers = tree_unflatten(*n.args)[0]
    return {x.src for x in transfers if x.src != x.dst}, {x.dst for x in transfers if x.src != x.dst}


def layout(cap: Captured, per_mb_nodes: List[int], last_backward: int, rank_of, schedule: str) -> PipelineLayout:
    """The stages, chunks and units of the per-micro-batch nodes (``rank_of(node)``: its task's rank)."""
    nodes, values = cap.nodes, cap.values
    ranks = _Ranks()
    for i in per_mb_nodes:
        n = nodes[i]
        if n.kind != "collective":
            ranks.find(rank_of(n))
        elif n.target == "send_recv":
            senders, receivers = _transfer_ends(n)
            ranks.union(senders)
            ranks.union(receivers)
        else:
            ranks.union(n.ranks)

    def group(n: Node) -> int:
        if n.kind == "collective" and n.target == "send_recv":
            senders, _ = _transfer_ends(n)
            return ranks.find(min(senders)) if senders else ranks.find(rank_of(n))
        return ranks.find(min(n.ranks) if n.kind == "collective" else rank_of(n))

    position: Dict[int, Optional[int]] = {}
    chunks = 0
    first = next((nodes[i] for i in per_mb_nodes if not nodes[i].backward and nodes[i].kind != "collective"), None)
    anchor = group(first) if first is not None else None
    for backward_pass in (False, True):
        for i in per_mb_nodes:
            n = nodes[i]
            if n.backward != backward_pass:
                continue
            here, found = group(n), []
            for v in n.inputs:
                if values[v].kind != "node" or values[v].node not in position or position[values[v].node] is None:
                    continue
                src = nodes[values[v].node]
                p = position[values[v].node]
                if backward_pass and not src.backward:
                    found.append(2 * chunks - 1 - p)       # chunk p's saved value: chunk p's backward
                else:
                    found.append(p + (group(src) != here))  # another stage's value: the next chunk
            if not found and not backward_pass and here == anchor:
                found = [0]                              # reads only arguments and state: the first chunk
            position[i] = max(found) if found else None
        if not backward_pass:
            chunks = 1 + max((p for p in position.values() if p is not None), default=0)
    _sources_from_users(cap, per_mb_nodes, position)
    stage_of_chunk: Dict[int, int] = {}
    for i in per_mb_nodes:
        n = nodes[i]
        if position.get(i) is None or n.segment > last_backward:
            continue
        chunk = position[i] if position[i] < chunks else 2 * chunks - 1 - position[i]
        if not 0 <= chunk < chunks:
            cannot_schedule(schedule, f"{n.name} follows the data flow back past the first chunk; a schedule needs "
                                      f"one forward and one backward per micro-batch, each through the chunks once")
        g = group(n)
        if stage_of_chunk.setdefault(chunk, g) != g:
            cannot_schedule(schedule, f"chunk {chunk} of the model runs on two stages (the ranks of rank {g} and of "
                                      f"rank {stage_of_chunk[chunk]}), at {n.name}")
    groups = []
    for c in range(chunks):
        g = stage_of_chunk.get(c)
        if g is None:
            cannot_schedule(schedule, f"chunk {c} of the model runs no op")
        if g not in groups:
            groups.append(g)
    p = len(groups)
    for c in range(chunks):
        if stage_of_chunk[c] != groups[c % p]:
            cannot_schedule(schedule, f"chunk {c} runs on stage {groups.index(stage_of_chunk[c])}, not on stage "
                                      f"{c % p}: the model's chunks must take the {p} stages in turn (chunk k on "
                                      f"stage k mod {p})")
    members: Dict[int, List[int]] = {}
    for r in list(ranks.parent):
        members.setdefault(ranks.find(r), []).append(r)
    unit_of = {}
    for i in per_mb_nodes:
        pos, n = position.get(i), nodes[i]
        if pos is None:
            continue
        if n.segment > last_backward:
            unit_of[i] = ("P", min(pos, 2 * chunks - 1 - pos) if pos >= chunks else pos)
        elif pos < chunks:
            unit_of[i] = ("F", pos)
        else:
            unit_of[i] = ("B", 2 * chunks - 1 - pos)
    return PipelineLayout([tuple(sorted(members[g])) for g in groups], chunks, unit_of)


def _sources_from_users(cap: Captured, per_mb_nodes: List[int], position: Dict[int, Optional[int]]) -> None:
    """A node that reads no other node (a factory, a view of an argument) takes the position of the
    earliest of its users."""
    users: Dict[int, List[int]] = {}
    for i in per_mb_nodes:
        for v in cap.nodes[i].inputs:
            if cap.values[v].kind == "node":
                users.setdefault(cap.values[v].node, []).append(i)
    for i in reversed(per_mb_nodes):
        if position.get(i) is None:
            known = [position[u] for u in users.get(i, ()) if position.get(u) is not None]
            position[i] = min(known) if known else None


def split_weight_gradients(cap: Captured, layout_: PipelineLayout, per_mb_nodes: List[int]) -> None:
    """Mark as ``W`` each backward op the chunk's input gradient does not need (in place on ``layout_``):
    ``B`` keeps the ancestors -- by data, and by earlier accesses to the storages they read or write --
    of the sends to the previous chunk's stage."""
    nodes, values = cap.nodes, cap.values
    by_chunk: Dict[int, List[int]] = {}
    for i in per_mb_nodes:
        if layout_.unit_of.get(i, ("", 0))[0] == "B":
            by_chunk.setdefault(layout_.unit_of[i][1], []).append(i)
    for chunk, members in by_chunk.items():
        inside = set(members)
        before: Dict[int, Set[int]] = {i: set() for i in members}
        accesses: Dict[tuple, List[Tuple[int, bool]]] = {}
        for i in members:
            n = nodes[i]
            before[i].update(values[v].node for v in n.inputs if values[v].kind == "node" and values[v].node in inside)
            for s in set(n.reads) | set(n.writes):
                write = s in n.writes
                before[i].update(j for j, w in accesses.get(s, ()) if w or write)
                accesses.setdefault(s, []).append((i, write))
        needed = [i for i in members if nodes[i].kind == "collective" and nodes[i].target == "send_recv"
                  and _leaves_stage(nodes[i], layout_)]
        keep: Set[int] = set()
        while needed:
            i = needed.pop()
            if i not in keep:
                keep.add(i)
                needed.extend(before[i])
        for i in members:
            if i not in keep:
                layout_.unit_of[i] = ("W", chunk)


def _leaves_stage(n: Node, layout_: PipelineLayout) -> bool:
    senders, receivers = _transfer_ends(n)
    stage_of = {r: s for s, rs in enumerate(layout_.stages) for r in rs}
    return any(stage_of.get(r) != stage_of.get(s) for r in receivers for s in senders)
