"""Pipeline schedules: the order in which each stage runs its units.

Pure arithmetic on orders, below the layers that read it: the actor runtime orders a compiled
pipeline's tasks by it (actor_rt/pipeline_order.py), and ``plan_at_scale`` costs a schedule's
bubble by it (nn/auto/scale_model.py).

A *unit* ``(kind, chunk, mb)`` is the work of one model chunk for one micro-batch: ``"F"`` its
forward, ``"B"`` its backward -- for the zero-bubble schedules only the part that makes the input
gradients the previous chunk waits for, the weight gradients split off as ``"W"``. The model is cut
into ``V`` chunks on ``p`` stages: ``V = v * p`` taking the stages in turn, chunk ``c`` on stage
``c mod p``; for ``zbv`` ``V = 2p - 1`` in a V, down the stages and back up (:func:`stage_of`). A
unit waits for the units it needs: ``F(c, j)`` for ``F(c - 1, j)``, ``B(c, j)`` for ``F(c, j)`` and
``B(c + 1, j)``, ``W(c, j)`` for ``B(c, j)``.

A schedule is each stage's sequence of units (:func:`sequences`); :func:`timeline` runs the
sequences against those dependencies at unit durations (forward 1, backward 2 -- or input and
weight gradients 1 each -- times the chunk's size, :func:`sizes`) and gives each unit's start.
Sorted by start, the units are one valid sequential execution: lower.py's reference order, from
which every stream's static order follows (so the deadlock-freedom argument of lower.py holds for
every schedule). :func:`in_flight` is the most micro-batches a stage holds activations for, which
lower.py enforces with credits.

- ``gpipe``: every forward, then every backward; a stage holds all ``m`` micro-batches.
- ``1f1b``: stage ``s`` runs ``p - s - 1`` forwards ahead, then alternates one forward and one
  backward; it holds at most ``p - s``.
- ``interleaved_1f1b``: ``v`` chunks per stage, Megatron-LM's order (forwards in rounds of ``p``
  micro-batches per chunk); the bubble shrinks by ``v``, for ``v`` times the transfers.
- ``zero_bubble``: ZB-H1 (Qi et al. 2024), 1F1B's peak memory with the weight gradients deferred
  into the bubbles: stage ``s`` holds at most ``p - s`` micro-batches whole (forward to input
  gradient), as 1F1B, and at most ``p`` in all -- the others only what their weight gradients
  read -- so the later stages, whose input gradients the earlier ones wait for, run them at once
  and defer the weight gradients. Each stage runs a forward while both bounds allow, else a ready
  input gradient, else its oldest deferred weight gradient: at unit durations the bubble is the
  paper's ``(p - 1)(F + B - W)``, a third of 1F1B's.
- ``zbv``: the zero-bubble V schedule (ZB-V, Qi et al. 2024): the model cut into ``2p`` halves of a
  stage's share, half ``k`` on stage ``k`` going down and on stage ``2p - 1 - k`` coming back, so the
  first stage also holds the last chunk and the loss (the last stage's two halves, with no transfer
  between them, are one chunk of twice the size: ``V = 2p - 1``). Weight gradients split off as in
  ZB-H1, and each stage holds at most ``p`` micro-batches' activations (``2p`` halves) -- 1F1B's
  first stage's, on every stage -- with a far smaller bubble: each stage runs a ready input gradient
  first (the oldest micro-batch, the later chunk), else a forward of its returning chunk, else one
  of its first chunk while what it holds and has promised stays within the bound, else its oldest
  deferred weight gradient.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
Unit = Tuple[str, int, int]                  # (kind, chunk, micro-batch)
_DURATION = {"F": 1.0, "B": 2.0, "W": 1.0}


def splits_weight_gradients(schedule: str) -> bool:
    return schedule in ("zero_bubble", "zbv")


def chunk_count(schedule: str, p: int, v: int) -> int:
    """``V``: how many chunks the schedule runs on ``p`` stages of ``v`` chunks each (``zbv``: ``v`` is 2,
    the last stage's two halves one chunk)."""
    return 2 * p - 1 if schedule == "zbv" else v * p


def stage_of(schedule: str, chunk: int, p: int) -> int:
    """The stage that runs ``chunk``: in turn (``chunk mod p``), or for ``zbv`` down and back up."""
    return min(chunk, 2 * p - 2 - chunk) if schedule == "zbv" else chunk % p


def sizes(schedule: str, p: int, chunks: int) -> List[float]:
    """Each chunk's work in units of one chunk: ``zbv``'s halves are 1 each, so its turning chunk (the
    last stage's two halves) is 2; every other schedule's chunks are alike."""
    return [2.0 if schedule == "zbv" and c == p - 1 else 1.0 for c in range(chunks)]


def _needs(unit: Unit, chunks: int, split: bool) -> List[Unit]:
    kind, c, j = unit
    if kind == "F":
        return [("F", c - 1, j)] if c > 0 else []
    if kind == "B":
        return [("F", c, j)] + ([("B", c + 1, j)] if c + 1 < chunks else [])
    return [("B", c, j)]


def sequences(schedule: str, p: int, v: int, m: int) -> List[List[Unit]]:
    """Each stage's units in the order it runs them (``v`` chunks per stage, ``m`` micro-batches);
    ``schedule`` one of :data:`SCHEDULES` (``zbv``'s chunks are fixed by ``p``: ``v`` is not read)."""
    if schedule == "gpipe":
        return [[("F", c * p + s, j) for j in range(m) for c in range(v)] +
                [("B", c * p + s, j) for j in range(m) for c in reversed(range(v))] for s in range(p)]
    if schedule == "1f1b":
        out = []
        for s in range(p):
            ahead = min(p - s - 1, m)
            seq = [("F", s, j) for j in range(ahead)]
            for j in range(m):
                if ahead + j < m:
                    seq.append(("F", s, ahead + j))
                seq.append(("B", s, j))
            out.append(seq)
        return out
    if schedule == "interleaved_1f1b":
        return [_interleaved(s, p, v, m) for s in range(p)]
    if schedule == "zbv":
        chunks = chunk_count(schedule, p, 2)
        return _zero_bubble([sorted({s, 2 * p - 2 - s}) for s in range(p)], sizes(schedule, p, chunks), m,
                            [2.0 * p] * p)
    return _zero_bubble([[s] for s in range(p)], [1.0] * p, m, [float(p)] * p, [p - s for s in range(p)])


def _interleaved(s: int, p: int, v: int, m: int) -> List[Unit]:
    """Megatron-LM's interleaved 1F1B for stage ``s`` (``m`` a multiple of ``p``): the k-th forward is
    micro-batch ``(k // (p v)) p + k mod p`` of local chunk ``(k // p) mod v``, backwards alike over
    the chunks in reverse; ``2 (p - s - 1) + (v - 1) p`` forwards ahead, then one forward, one backward."""
    total = m * v

    def unit(kind: str, k: int) -> Unit:
        local = (k // p) % v
        chunk = (local if kind == "F" else v - 1 - local) * p + s
        return (kind, chunk, (k // (p * v)) * p + k % p)
    ahead = min(2 * (p - s - 1) + (v - 1) * p, total)
    seq = [unit("F", k) for k in range(ahead)]
    for k in range(total - ahead):
        seq += [unit("F", ahead + k), unit("B", k)]
    return seq + [unit("B", k) for k in range(total - ahead, total)]


def _zero_bubble(mine: List[List[int]], size: List[float], m: int, bound: List[float],
                 whole: Optional[List[int]] = None) -> List[List[Unit]]:
    """A zero-bubble schedule by simulation (stage ``s`` runs chunks ``mine[s]``, ascending; chunk ``c``'s
    units last ``size[c]``): whenever a stage is free it starts a ready input gradient (the oldest
    micro-batch's, the later chunk's first), else a ready forward of a chunk of its other than its
    first (room for it was promised), else one of its first chunk if what it holds and has promised,
    with this micro-batch's chunks here, stays within ``bound[s]`` (in chunk sizes; a micro-batch is
    held from its forward to its weight gradient), else its oldest deferred weight gradient. With
    ``whole`` (one chunk per stage), a forward comes first, while the stage holds fewer than
    ``whole[s]`` micro-batches from forward to input gradient. ZB-H1: one chunk per stage, bound
    ``p``, whole ``p - s``; ZB-V: ``zbv``'s chunks, bound ``2p``."""
    p, chunks = len(mine), len(size)
    entering = [sum(size[c] for c in cs) for cs in mine]      # what a micro-batch entering a stage promises
    end: Dict[Unit, float] = {}
    seqs: List[List[Unit]] = [[] for _ in range(p)]
    free = [0.0] * p
    next_f, next_b = [0] * chunks, [0] * chunks
    pending_w: List[List[Unit]] = [[] for _ in range(p)]
    promised = [0.0] * p
    while sum(len(q) for q in seqs) < 3 * chunks * m:
        now = min(free)
        started = False
        for s in (i for i in range(p) if free[i] == now):
            room = bound[s] - promised[s] >= entering[s]
            if whole is None:
                choice = _zero_bubble_choice(mine[s], chunks, m, now, end, next_f, next_b, pending_w[s], room)
            else:
                choice = _forward_first_choice(mine[s][0], chunks, m, now, end, next_f, next_b, pending_w[s],
                                               room and next_f[mine[s][0]] - next_b[mine[s][0]] < whole[s])
            if choice is None:
                continue
            kind, c, j = choice
            if kind == "B":
                next_b[c] += 1
                pending_w[s].append(("W", c, j))
            elif kind == "F":
                next_f[c] += 1
                if c == mine[s][0]:
                    promised[s] += entering[s]
            else:
                pending_w[s].pop(0)
                promised[s] -= size[c]
            seqs[s].append(choice)
            free[s] = end[choice] = now + size[c]
            started = True
        if not started:
            later = [t for t in end.values() if t > now]
            if not later:
                _stuck({s: pending_w[s][:1] for s in range(p)})
            free = [max(f, min(later)) for f in free]
    return seqs


def _ready(unit: Unit, chunks: int, end: Dict[Unit, float], now: float) -> bool:
    """Whether every unit ``unit`` needs has ended by ``now`` (weight gradients split)."""
    return all(end.get(d, float("inf")) <= now for d in _needs(unit, chunks, True))


def _zero_bubble_choice(mine, chunks, m, now, end, next_f, next_b, pending_w, has_room: bool):
    backwards = [("B", c, next_b[c]) for c in mine if next_b[c] < m and _ready(("B", c, next_b[c]), chunks, end, now)]
    if backwards:
        return min(backwards, key=lambda u: (u[2], -u[1]))
    for c in reversed(mine[1:]):
        if next_f[c] < m and _ready(("F", c, next_f[c]), chunks, end, now):
            return ("F", c, next_f[c])
    first = mine[0]
    if next_f[first] < m and has_room and _ready(("F", first, next_f[first]), chunks, end, now):
        return ("F", first, next_f[first])
    return pending_w[0] if pending_w else None


def _forward_first_choice(c, chunks, m, now, end, next_f, next_b, pending_w, has_room: bool):
    """ZB-H1's choice on the stage of chunk ``c``: a forward where there is room, else an input gradient,
    else the oldest deferred weight gradient."""
    for kind, j, room in (("F", next_f[c], has_room), ("B", next_b[c], True)):
        if j < m and room and _ready((kind, c, j), chunks, end, now):
            return (kind, c, j)
    return pending_w[0] if pending_w else None


def timeline(seqs: List[List[Unit]], chunks: int, split: bool, size: Optional[List[float]] = None) -> Dict[Unit, float]:
    """Each unit's start when every stage runs its sequence in order, a unit waiting for its stage
    and for the units it needs (durations: forward 1, backward 2, or 1 + 1 split; times its chunk's
    ``size``, 1 where not given)."""
    start: Dict[Unit, float] = {}
    end: Dict[Unit, float] = {}
    at = [0] * len(seqs)
    free = [0.0] * len(seqs)
    durations = _durations(split)
    size = size or [1.0] * chunks
    while any(at[s] < len(q) for s, q in enumerate(seqs)):
        moved = False
        for s, q in enumerate(seqs):
            while at[s] < len(q):
                unit = q[at[s]]
                needs = _needs(unit, chunks, split)
                if any(d not in end for d in needs):
                    break
                start[unit] = max([free[s]] + [end[d] for d in needs])
                end[unit] = free[s] = start[unit] + durations[unit[0]] * size[unit[1]]
                at[s] += 1
                moved = True
        if not moved:
            _stuck({s: q[at[s]] for s, q in enumerate(seqs) if at[s] < len(q)})
    return start


def _stuck(units) -> None:
    raise RuntimeError(f"pipeline schedule: the stages wait on each other, at units {units}")


def in_flight(seq: List[Unit], split: bool) -> int:
    """The most micro-batches ``seq`` holds activations for at once: from a chunk's forward to its
    backward (its weight gradient, when split)."""
    release = "W" if split else "B"
    held = peak = 0
    for kind, _, _ in seq:
        if kind == "F":
            held += 1
            peak = max(peak, held)
        elif kind == release:
            held -= 1
    return peak


def bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The idle fraction of ``schedule``'s ``p`` stages over its timeline's span (``v`` chunks a stage, ``m``
    micro-batches), at unit durations (times each chunk's size)."""
    seqs, chunks, split = sequences(schedule, p, v, m), chunk_count(schedule, p, v), splits_weight_gradients(schedule)
    size = sizes(schedule, p, chunks)
    start = timeline(seqs, chunks, split, size)
    durations = _durations(split)
    span = max(start[u] + durations[u[0]] * size[u[1]] for u in start)
    busy = sum(durations[u[0]] * size[u[1]] for u in start)
    return 1.0 - busy / (span * len(seqs))


def _durations(split: bool) -> Dict[str, float]:
    return dict(_DURATION, B=1.0 if split else 2.0)
