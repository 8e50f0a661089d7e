"""Where a captured step's ops sit in a pipeline: the stages, the model chunks, and each op's unit.

The stages are found from the step itself, not declared. Ranks that take part in one per-micro-batch
collective (a tensor- or sequence-parallel exchange), or send together / receive together in a
point-to-point transfer (the pieces of an activation moving on), hold one stage. Along the data
flow of one micro-batch, every edge from one stage to another starts a new *chunk*: the forward
passes chunks 0, 1, ..., V - 1, the backward comes back through V - 1, ..., 0 (a backward op reading
chunk c's saved activations or chunk c + 1's gradient belongs to chunk c's backward). Each chunk
must sit on one stage, where the schedule runs it (schedules.stage_of: chunk c on stage c mod p, or
for ``zbv`` down the stages and back up). For the zero-bubble schedules a chunk's backward
is split: the ops the input gradient needs -- what is sent to the previous chunk, through data
and through reads and writes of one storage in capture order -- are its ``B`` unit, the rest (the
weight gradients) its ``W``. Per-micro-batch ops after the backward (a loss detached for the
return) run after their chunk's backward, as unit ``P``. The stage of the step's first op is the
first stage, where an op reading the step's arguments starts chunk 0; an op reading no other op
(a view of a weight, a buffer to receive into) runs with the earliest chunk that uses it. In a
process world, where each process captured only its own ranks' ops, the processes join their
views: see :func:`_joined_forward_positions`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set, Tuple

from torch.utils._pytree import tree_unflatten

from .graph import Captured, Node
from .program import CompileError
from ..schedules import chunk_count, stage_of


@dataclass
class PipelineLayout:
    stages: List[Tuple[int, ...]]            # the ranks of each stage, stage 0 first
    chunks: int                              # V: the model chunks, chunk c on stage schedules.stage_of(c)
    unit_of: Dict[int, Tuple[str, int]]      # node index -> (kind "F" / "B" / "W" / "P", chunk)


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


def layout(cap: Captured, per_mb_nodes: List[int], last_backward: int, rank_of, schedule: str,
           exchange: Optional[Callable[[object], list]] = None, rank: int = 0) -> PipelineLayout:
    """The stages, chunks and units of the per-micro-batch nodes (``rank_of(node)``: its task's rank).
    ``exchange``: in a process world (this process ``rank``), where each process captured its own
    ranks' ops only, the world's all-gather of an object, one per rank: the processes' views are
    joined into the whole pipeline."""
    nodes = cap.nodes
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

    groups: Dict[int, int] = {}                  # node index -> its stage's root rank (unions are done)

    def group(n: Node) -> int:
        g = groups.get(n.index)
        if g is None:
            if n.kind == "collective" and n.target == "send_recv":
                senders, _ = _transfer_ends(n)
                g = ranks.find(min(senders)) if senders else ranks.find(rank_of(n))
            else:
                g = ranks.find(min(n.ranks) if n.kind == "collective" else rank_of(n))
            groups[n.index] = g
        return g

    def first_rank(g: int) -> int:
        return min(r for r in list(ranks.parent) if ranks.find(r) == g)

    forward = [i for i in per_mb_nodes if not nodes[i].backward]
    backward = [i for i in per_mb_nodes if nodes[i].backward]
    if exchange is None:
        first = next((nodes[i] for i in forward if nodes[i].kind != "collective"), None)
        position = _forward_positions(cap, forward, group, group(first) if first is not None else None, {})
        chunks = 1 + max((p for i in forward for p in [position.get(i)] if p is not None), default=0)
    else:
        position = _joined_forward_positions(cap, forward, group, ranks.find, exchange, rank)
        chunks = 1 + max(exchange(max((p for i in forward for p in [position.get(i)] if p is not None), default=0)))
    _as_late_as_used(cap, forward, position, group)
    _settle(cap, backward, position, group, lambda n, p: 2 * chunks - 1 - p, None)
    _sources_from_users(cap, per_mb_nodes, position, group)
    if exchange is not None:
        _senders_say_where(cap, backward, position, group, ranks.find, exchange, rank)
    stage_of_chunk: Dict[int, int] = {}
    for i in per_mb_nodes:
        n = nodes[i]
        if position.get(i) is None or n.segment > last_backward:
            continue
        chunk = position[i] if position[i] < chunks else 2 * chunks - 1 - position[i]
        if not 0 <= chunk < chunks:
            cannot_schedule(schedule, f"{n.name} follows the data flow back past the first chunk; a schedule needs "
                                      f"one forward and one backward per micro-batch, each through the chunks once")
        g = first_rank(group(n))
        if stage_of_chunk.setdefault(chunk, g) != g:
            cannot_schedule(schedule, f"chunk {chunk} of the model runs on two stages (the ranks of rank {g} and of "
                                      f"rank {stage_of_chunk[chunk]}), at {n.name}")
    if exchange is not None:
        for theirs in exchange(stage_of_chunk):
            for c, g in theirs.items():
                if stage_of_chunk.setdefault(c, g) != g:
                    cannot_schedule(schedule, f"chunk {c} of the model runs on two stages (the ranks of rank {g} "
                                              f"and of rank {stage_of_chunk[c]})")
    groups: List[int] = []
    for c in range(chunks):
        g = stage_of_chunk.get(c)
        if g is None:
            cannot_schedule(schedule, f"chunk {c} of the model runs no op")
        if g not in groups:
            groups.append(g)
    _check_stages(schedule, [groups.index(stage_of_chunk[c]) for c in range(chunks)], len(groups))
    members: Dict[int, List[int]] = {}
    for r in list(ranks.parent):
        members.setdefault(first_rank(ranks.find(r)), []).append(r)
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
    return PipelineLayout([tuple(sorted(members.get(g, [g]))) for g in groups], chunks, unit_of)


def _check_stages(schedule: str, stages: List[int], p: int) -> None:
    """Each chunk on the stage the schedule runs it on (``stages[c]``: chunk c's, numbered by first use).
    A chunk count the schedule does not take is left to its own check (pipeline_order.py)."""
    if schedule == "zbv" and len(stages) != chunk_count(schedule, p, 2):
        return
    for c, s in enumerate(stages):
        if s != stage_of(schedule, c, p):
            how = (f"go down the {p} stages and back up (chunk k on stage min(k, {2 * p - 2} - k))" if schedule == "zbv"
                   else f"take the {p} stages in turn (chunk k on stage k mod {p})")
            cannot_schedule(schedule, f"chunk {c} runs on stage {s}, not on stage {stage_of(schedule, c, p)}: the "
                                      f"model's chunks must {how}")


def _positions(cap: Captured, todo: List[int], position: Dict[int, Optional[int]], group, saved, anchor,
               waits: Set[int] = frozenset()) -> None:
    """Each node's position from its inputs' (in capture order): the latest of them, one more across
    stages; a backward node reading a forward value at position p is at ``saved(node, p)``, the
    chunk's backward. A forward node reading the step's arguments on ``anchor``'s stage starts at 0.
    A node reading one of ``waits`` whose position is not known yet stays unplaced: its other inputs
    would place it too early (the loss reading the targets, on a first stage that also runs the last
    chunk, before the activation that reaches it through a receive buffer is placed)."""
    nodes, values = cap.nodes, cap.values
    for i in todo:
        n = nodes[i]
        here, found, waiting = group(n), [], False
        for v in n.inputs:
            if values[v].kind != "node":
                continue
            j = values[v].node
            if position.get(j) is None:
                waiting = waiting or j in waits
                continue
            src, p = nodes[j], position[j]
            if n.backward and not src.backward:
                found.append(saved(n, p))
            else:
                found.append(p + (group(src) != here))  # another stage's value: the next chunk
        if waiting:
            continue
        if not found and here == anchor and any(values[v].kind == "arg" for v in n.inputs):
            found = [0]
        position[i] = max(found) if found else None


def _as_late_as_used(cap: Captured, forward: List[int], position: Dict[int, Optional[int]], group) -> None:
    """A forward op runs with the earliest chunk of its stage that uses it, where that is later than
    its inputs make it: a rotary table received from the first stage for the fourth chunk's attention
    is the fourth chunk's (its backward reads it there), not the second's; and where the first stage
    also runs the last chunk (zbv), the loss's targets and their count over the data ranks (an
    all-reduce) are the last chunk's, not the first's. Transfers stay where their senders put them."""
    users = _users(cap, forward)
    for i in reversed(forward):
        n = cap.nodes[i]
        if n.kind == "collective" and n.target == "send_recv" or position.get(i) is None:
            continue
        here = group(n)
        later = [position[u] for u in users.get(i, ()) if position.get(u) is not None and group(cap.nodes[u]) == here]
        if later and min(later) > position[i]:
            position[i] = min(later)


def _senders_say_where(cap, backward, position, group, stage_of, exchange, rank: int) -> None:
    """In a process world: each backward transfer's receiver takes the position its sender gives it,
    so that both order their side of it alike (messages between two processes match in order)."""
    keys = _transfer_keys(cap, backward, stage_of)
    mine = stage_of(rank)
    sent = {k: position[i] for k, i in keys.items() if group(cap.nodes[i]) == mine and position.get(i) is not None}
    told: Dict[tuple, int] = {}
    for theirs in exchange(sent):
        told.update(theirs)
    for k, i in keys.items():
        if group(cap.nodes[i]) != mine and k in told:
            position[i] = told[k]


def _transfer_keys(cap: Captured, nodes: List[int], stage_of) -> Dict[tuple, int]:
    """The transfers from one stage to another among ``nodes``, each as (senders, receivers,
    occurrence): the same key in every process that records it."""
    seen: Dict[tuple, int] = {}
    keys = {}
    for i in nodes:
        n = cap.nodes[i]
        if n.kind == "collective" and n.target == "send_recv":
            senders, receivers = _transfer_ends(n)
            if senders and receivers and stage_of(min(senders)) != stage_of(min(receivers)):
                pair = (tuple(sorted(senders)), tuple(sorted(receivers)))
                seen[pair] = seen.get(pair, -1) + 1
                keys[pair + (seen[pair],)] = i
    return keys


def _forward_positions(cap: Captured, forward: List[int], group, anchor, known: Dict[int, int]) -> dict:
    """Forward positions by data flow: ops reading the step's arguments on ``anchor``'s stage start at
    0; a transfer node in ``known`` (node -> the sender's chunk) is where its sender put it."""
    position: Dict[int, Optional[int]] = dict(known)
    _settle(cap, forward, position, group, lambda n, p: None, anchor)
    return position


def _settle(cap: Captured, todo: List[int], position: Dict[int, Optional[int]], group, saved, anchor) -> None:
    """Positions from inputs, then from users, again until none is added: in a process world a
    chain can start from a value received from another process (a gradient), which only its
    users place; a node waits for every input of ``todo`` to be placed, and where all that are left
    wait on each other, the first that its placed inputs place goes ahead."""
    users = _users(cap, todo)
    while True:
        left = [i for i in todo if position.get(i) is None]
        _positions(cap, left, position, group, saved, anchor, waits=set(left))
        _sources_from_users(cap, todo, position, group, users)
        now = [i for i in todo if position.get(i) is None]
        if now and len(now) == len(left):
            # every node left waits on another (a receive buffer placed by its users, the writer
            # among them): the first in capture order that its known inputs place goes ahead
            for i in now:
                _positions(cap, [i], position, group, saved, anchor)
                if position.get(i) is not None:
                    break
            now = [i for i in todo if position.get(i) is None]
        if len(now) in (0, len(left)):
            return


def _joined_forward_positions(cap, forward, group, stage_of, exchange, rank: int) -> dict:
    """Forward positions in a process world, where this process holds some chunks of the pipeline and
    sees only the transfers it takes part in. The stage whose first transfer is a send holds chunk 0;
    each process numbers what the data flow reaches from there and from the transfers it has
    received, and tells the others where its sends leave from (an all-gather per round), until no
    process learns anything more -- every process ends its rounds together, on the same data."""
    keys = _transfer_keys(cap, forward, stage_of)
    mine = stage_of(rank)
    first = min(keys.values(), default=None)
    anchor = mine if first is None or group(cap.nodes[first]) == mine else None
    known: Dict[tuple, int] = {}
    while True:
        at = {keys[k]: p for k, p in known.items() if k in keys and group(cap.nodes[keys[k]]) != mine}
        position = _forward_positions(cap, forward, group, anchor, at)
        sent = {k: position[i] for k, i in keys.items() if group(cap.nodes[i]) == mine and position.get(i) is not None}
        learnt = dict(known)
        for theirs in exchange(sent):
            learnt.update(theirs)
        if learnt == known:
            return position
        known = learnt


def _users(cap: Captured, nodes: List[int]) -> Dict[int, List[int]]:
    """Node index -> the nodes among ``nodes`` that read it."""
    users: Dict[int, List[int]] = {}
    for i in nodes:
        for v in cap.nodes[i].inputs:
            if cap.values[v].kind == "node":
                users.setdefault(cap.values[v].node, []).append(i)
    return users


def _sources_from_users(cap: Captured, todo: List[int], position: Dict[int, Optional[int]], group,
                        users: Optional[Dict[int, List[int]]] = None) -> None:
    """A node whose position its inputs do not give (it reads no other node, or only such nodes: a
    view of a weight, a buffer to receive into, a rotary table) takes the earliest position its
    users need it at -- one chunk earlier for a user on another stage. ``users``: :func:`_users` of
    ``todo``, when the caller has it."""
    users = _users(cap, todo) if users is None else users
    for i in reversed(todo):
        if position.get(i) is None:
            here = group(cap.nodes[i])
            known = [position[u] - (group(cap.nodes[u]) != here) for u in users.get(i, ()) if position.get(u) is not None]
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
