"""The cross-rank consistency check: ``gt.set_check(True)`` or ``GLOBALTENSOR_CHECK=1``.

Every rank runs the same program, so before each op and each boxing every rank should see the
same op, the same placements, SBPs, shapes and dtypes, the same plain tensors (taken as
broadcast, so equal on every rank) and the same scalars; and the pieces that a layout says
are replicas of each other (ranks whose pieces cover the same block of a broadcast axis)
should hold the same values. A rank-dependent branch breaks that, and without the check it
shows up as wrong numbers or a hang far from its cause.

With the check on, each rank describes what it is about to do (:class:`View`) and the ranks
compare one short vector of hashes each (one small all-gather in a process world; a
simulated world compares the views of its ranks in place). Only when they disagree are the
full descriptions exchanged, to name the op, the differing ranks and what differs; then
:class:`ConsistencyError` is raised on every rank. Off, it costs the callers one attribute
test (``if CHECK.enabled:``).

This module knows layouts only by their attributes (``shape dtype placement nd_sbp``,
``box(rank)``, ``piece_shape(rank)``), so it sits in the comm layer below them.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Dict, List

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..comm.errors import ConsistencyError

SLOTS = 4       # replica value checks per exchange; the tensors of an op share them round-robin


class _Switch:
    enabled: bool = os.environ.get("GLOBALTENSOR_CHECK", "") not in ("", "0")


CHECK = _Switch()


def set_check(on: bool = True) -> bool:
    """Turn the cross-rank consistency check on or off (every rank alike); returns the previous state."""
    if not isinstance(on, bool):
        raise TypeError(f"set_check(on): expected True or False, got {on!r}")
    previous, CHECK.enabled = CHECK.enabled, on
    return previous


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def value_hash(t: torch.Tensor) -> int:
    """A hash of a tensor's dtype, shape and values (its bytes). Outside any dispatch mode, reading
    memory through the C method: while the traced mode captures, neither the mode records these
    ops nor does its guard on ``Tensor.numpy`` (there for the user's host reads) stop them."""
    with _disable_current_modes():
        flat = t.detach().reshape(-1).contiguous().cpu()
        raw = flat.view(torch.uint8) if flat.numel() and flat.dtype != torch.uint8 else flat
        h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=8)
        h.update(memoryview(torch._C.TensorBase.numpy(raw)))
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass
class View:
    """What one rank is about to do: ``facts`` every rank must share, its ``replicas`` -- ``(label,
    replica class, value hash)`` of pieces that must equal the pieces of the ranks in the same
    class -- and ``problems`` found in its own pieces."""
    facts: List[tuple] = field(default_factory=list)
    replicas: List[tuple] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)

    def vector(self) -> List[int]:
        keys, values = [0] * SLOTS, [0] * SLOTS
        for i, (label, cls, h) in enumerate(self.replicas):
            keys[i % SLOTS] = _digest(repr((keys[i % SLOTS], label, cls)).encode())
            values[i % SLOTS] = _digest(repr((values[i % SLOTS], h)).encode())
        return [_digest(repr(self.facts).encode()), len(self.problems), *keys, *values]


# -- describing what a rank is about to do ----------------------------------------------------
def _replica_class(layout, rank: int):
    """Ranks of one class hold the same block and the same partial share: their pieces must be equal."""
    coord = layout.placement.coord(rank)
    return (layout.cells(rank), tuple(c for c, v in zip(coord, layout.nd_sbp) if v.is_partial))


def _has_replicas(layout) -> bool:
    return any(v.is_broadcast and n > 1 for v, n in zip(layout.nd_sbp, layout.placement.hierarchy))


def describe_layout(view: View, label: str, layout) -> None:
    view.facts += [(label, "shape", tuple(layout.shape)), (label, "dtype", str(layout.dtype)),
                   (label, "placement", repr(layout.placement)), (label, "sbp", repr(tuple(layout.nd_sbp)))]


def describe_global(views: Dict[int, View], label: str, layout, pieces: dict, values: bool = True) -> None:
    """A global tensor: its meta (a fact), each held rank's piece against the layout (a problem when
    it does not fit) and, where the layout has replicas and ``values``, the piece's values."""
    replicas = values and _has_replicas(layout)
    for r, view in views.items():
        describe_layout(view, label, layout)
        if r not in layout.placement:
            continue
        piece = pieces.get(r)
        want = layout.piece_shape(r)
        if piece is None:
            view.problems.append(f"{label}: rank {r} holds no piece, its layout gives it one of shape {want}")
        elif tuple(piece.shape) != want or piece.dtype != layout.dtype:
            view.problems.append(f"{label}: rank {r}'s piece has shape {tuple(piece.shape)} and dtype {piece.dtype}; "
                                 f"{tuple(layout.nd_sbp)} of {tuple(layout.shape)} gives it {want} and {layout.dtype}")
        elif replicas:
            view.replicas.append((label, _replica_class(layout, r), value_hash(piece)))


def describe_plain(views: Dict[int, View], label: str, t: torch.Tensor) -> None:
    """A plain tensor joining global ones: taken as broadcast, so its values must be equal everywhere."""
    fact = (label, "plain tensor", f"shape {tuple(t.shape)}, dtype {t.dtype}, values #{value_hash(t) & 0xffffffff:08x}")
    for view in views.values():
        view.facts.append(fact)


def describe_value(views: Dict[int, View], label: str, v) -> None:
    """A scalar argument. A device counts by its type: each rank's own CUDA device has its index."""
    fact = (label, "value", repr(v.type if isinstance(v, torch.device) else v))
    for view in views.values():
        view.facts.append(fact)


# -- comparing ------------------------------------------------------------------------------
def _agree(vectors: Dict[int, List[int]]) -> bool:
    rows = list(vectors.values())
    if any(row[0] != rows[0][0] or row[1] for row in rows):
        return False
    for j in range(SLOTS):
        seen: dict = {}
        for row in rows:
            if seen.setdefault(row[2 + j], row[2 + SLOTS + j]) != row[2 + SLOTS + j]:
                return False
    return True


def _groups(values: Dict[int, object]) -> str:
    by_value: dict = {}
    for r, v in sorted(values.items()):
        by_value.setdefault(str(v), []).append(r)
    return ", ".join(f"ranks {rs}: {v}" for v, rs in by_value.items())


def _steps_differ(views: Dict[int, View]):
    """The message when the ranks are at different steps (their other facts would only add noise)."""
    steps = {r: v.facts[0][2] for r, v in views.items()}
    first = min(views)
    if len(set(steps.values())) == 1:
        return None
    odd = sorted(r for r, s in steps.items() if s != steps[first])
    return (f"globaltensor consistency check: ranks {odd} are at another step of the program than rank {first} "
            f"({_groups(steps)}); a branch on the rank?")


def _differences(views: Dict[int, View]) -> tuple:
    """(the ranks that differ from the lowest rank, the differences in words), for ranks at one step."""
    out, odd = [], set()
    first = min(views)
    facts = {r: {(f[0], f[1]): f[2] for f in v.facts[1:]} for r, v in views.items()}
    names = list(dict.fromkeys(k for fs in facts.values() for k in fs))
    for name in names:
        values = {r: fs.get(name, "nothing") for r, fs in facts.items()}
        if len({str(v) for v in values.values()}) > 1:
            out.append(f"{name[0]} {name[1]} ({_groups(values)})")
            odd |= {r for r, v in values.items() if str(v) != str(values[first])}
    for r, v in sorted(views.items()):
        for p in v.problems:
            out.append(p)
            odd.add(r)
    classes: dict = {}
    for r, v in views.items():
        for label, cls, h in v.replicas:
            classes.setdefault((label, repr(cls)), {})[r] = h
    for (label, _), hashes in classes.items():
        if len(set(hashes.values())) > 1:
            groups = {}
            for r, h in sorted(hashes.items()):
                groups.setdefault(h, []).append(r)
            parts = sorted(groups.values(), key=len, reverse=True)    # the most common value first
            out.append(f"{label}: the pieces of ranks {' and '.join(str(p) for p in parts)} differ, though its layout "
                       f"makes them replicas of one block")
            odd |= {r for p in parts[1:] for r in p}
    return sorted(odd), out


def confirm(what: str, views: Dict[int, View], world) -> None:
    """Every rank's view of ``what`` agrees, else :class:`ConsistencyError` on every rank."""
    for view in views.values():
        view.facts.insert(0, ("", "step", what))
    if world.simulated:
        if _agree({r: v.vector() for r, v in views.items()}):
            return
        everyone = views
    else:
        (mine,) = views.values()
        with _disable_current_modes():     # the traced mode, capturing, must not record the check's collectives
            if _agree(dict(enumerate(world.gather_check(mine.vector())))):
                return
            everyone = dict(enumerate(world.gather_objects(mine)))
    steps = _steps_differ(everyone)
    if steps is not None:
        raise ConsistencyError(steps)
    odd, differences = _differences(everyone)
    raise ConsistencyError(f"globaltensor consistency check before {what}: ranks {odd} disagree with rank "
                           f"{min(everyone)}: " + "; ".join(differences))


def confirm_boxing(plan, pieces: dict, world) -> None:
    """Before a boxing: the same source and target layouts everywhere, the source pieces fit and agree."""
    views = {r: View() for r in world.local_ranks}
    describe_global(views, "the source", plan.src, pieces)
    for view in views.values():
        describe_layout(view, "the target", plan.dst)
    confirm(f"boxing {tuple(plan.src.nd_sbp)} -> {tuple(plan.dst.nd_sbp)}", views, world)
