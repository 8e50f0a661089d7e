"""Pipeline schedules: the order in which each stage runs its units.

A *unit* ``(kind, chunk, mb)`` is the work of one model chunk for one micro-batch: ``"F"`` its
forward, ``"B"`` its backward -- for the zero-bubble schedule only the part that makes the input
gradients the previous chunk waits for, the weight gradients split off as ``"W"``. The model is cut
into ``V = v * p`` chunks on ``p`` stages, chunk ``c`` on stage ``c mod p``. A unit waits for the
units it needs: ``F(c, j)`` for ``F(c - 1, j)``, ``B(c, j)`` for ``F(c, j)`` and ``B(c + 1, j)``,
``W(c, j)`` for ``B(c, j)``.

A schedule is each stage's sequence of units (:func:`sequences`); :func:`timeline` runs the
sequences against those dependencies at unit durations (forward 1, backward 2 -- or input and
weight gradients 1 each) and gives each unit's start. Sorted by start, the units are one valid
sequential execution: lower.py's reference order, from which every stream's static order follows
(so the deadlock-freedom argument of lower.py holds for every schedule). :func:`in_flight` is the
most micro-batches a stage holds activations for, which lower.py enforces with credits.

- ``gpipe``: every forward, then every backward; a stage holds all ``m`` micro-batches.
- ``1f1b``: stage ``s`` runs ``p - s - 1`` forwards ahead, then alternates one forward and one
  backward; it holds at most ``p - s``.
- ``interleaved_1f1b``: ``v`` chunks per stage, Megatron-LM's order (forwards in rounds of ``p``
  micro-batches per chunk); the bubble shrinks by ``v``, for ``v`` times the transfers.
- ``zero_bubble``: 1F1B's memory with the weight gradients deferred into the bubbles (ZB-H1):
  each stage runs a ready input gradient first, else a forward while it holds fewer than
  ``p - s`` micro-batches, else its oldest deferred weight gradient.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
Unit = Tuple[str, int, int]                  # (kind, chunk, micro-batch)
_DURATION = {"F": 1.0, "B": 2.0, "W": 1.0}


def splits_weight_gradients(schedule: str) -> bool:
    return schedule == "zero_bubble"


def _needs(unit: Unit, chunks: int, split: bool) -> List[Unit]:
    kind, c, j = unit
    if kind == "F":
        return [("F", c - 1, j)] if c > 0 else []
    if kind == "B":
        return [("F", c, j)] + ([("B", c + 1, j)] if c + 1 < chunks else [])
    return [("B", c, j)]


def sequences(schedule: str, p: int, v: int, m: int) -> List[List[Unit]]:
    """Each stage's units in the order it runs them (``v`` chunks per stage, ``m`` micro-batches);
    ``schedule`` one of :data:`SCHEDULES`."""
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
    return _zero_bubble(p, m)


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


def _zero_bubble(p: int, m: int) -> List[List[Unit]]:
    """ZB-H1 by simulation at unit durations 1: whenever a stage is free it starts a ready input
    gradient, else a forward while it holds fewer than ``p - s`` micro-batches (a micro-batch is held
    from its forward to its weight gradient), else its oldest deferred weight gradient."""
    end: Dict[Unit, float] = {}
    seqs: List[List[Unit]] = [[] for _ in range(p)]
    free = [0.0] * p
    next_f, next_b, pending_w = [0] * p, [0] * p, [[] for _ in range(p)]
    held = [0] * p
    total = 3 * p * m
    while sum(len(q) for q in seqs) < total:
        now = min(free)
        started = False
        for s in (i for i in range(p) if free[i] == now):
            choice = _zero_bubble_choice(s, p, m, now, end, next_f, next_b, pending_w, held)
            if choice is None:
                continue
            kind = choice[0]
            if kind == "B":
                next_b[s] += 1
                pending_w[s].append(("W", s, choice[2]))
            elif kind == "F":
                next_f[s] += 1
                held[s] += 1
            else:
                pending_w[s].pop(0)
                held[s] -= 1
            seqs[s].append(choice)
            free[s] = end[choice] = now + 1.0
            started = True
        if not started:
            later = [t for t in end.values() if t > now]
            if not later:
                _stuck({s: pending_w[s][:1] for s in range(p)})
            free = [max(f, min(later)) for f in free]
    return seqs


def _zero_bubble_choice(s, p, m, now, end, next_f, next_b, pending_w, held):
    def ready(u: Unit) -> bool:
        return all(end.get(d, float("inf")) <= now for d in _needs(u, p, True))
    if next_b[s] < m and ready(("B", s, next_b[s])):
        return ("B", s, next_b[s])
    if next_f[s] < m and held[s] < p - s and ready(("F", s, next_f[s])):
        return ("F", s, next_f[s])
    return pending_w[s][0] if pending_w[s] else None


def timeline(seqs: List[List[Unit]], chunks: int, split: bool) -> Dict[Unit, float]:
    """Each unit's start when every stage runs its sequence in order, a unit waiting for its stage
    and for the units it needs (durations: forward 1, backward 2, or 1 + 1 split)."""
    start: Dict[Unit, float] = {}
    end: Dict[Unit, float] = {}
    at = [0] * len(seqs)
    free = [0.0] * len(seqs)
    durations = dict(_DURATION, B=1.0 if split else 2.0)
    while any(at[s] < len(q) for s, q in enumerate(seqs)):
        moved = False
        for s, q in enumerate(seqs):
            while at[s] < len(q):
                unit = q[at[s]]
                needs = _needs(unit, chunks, split)
                if any(d not in end for d in needs):
                    break
                start[unit] = max([free[s]] + [end[d] for d in needs])
                end[unit] = free[s] = start[unit] + durations[unit[0]]
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


def bubble(seqs: List[List[Unit]], chunks: int, split: bool) -> float:
    """The idle fraction of the stages over the timeline's span, at unit durations."""
    start = timeline(seqs, chunks, split)
    durations = dict(_DURATION, B=1.0 if split else 2.0)
    span = max(start[u] + durations[u[0]] for u in start)
    busy = sum(durations[u[0]] for u in start)
    return 1.0 - busy / (span * len(seqs))
