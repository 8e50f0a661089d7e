"""Split kinds: which of a split dim's indices each rank holds, and how candidates take them.

A split's kind is its ``(blocks, order)`` pair (values.py): ``(1, "plain")`` the balanced split,
``(f, "plain")`` the blocked one, ``(f, "head_tail")`` the balanced split of a causal sequence.
Every kind gives a rank as many of the dim's indices as the plain split of the same blocks; only
which indices differ. An op that relates index ``i`` of a dim to index ``i`` of the dims it maps
it to -- pointwise ops, a matrix product's rows, columns and contraction, a reduction's kept dims,
a sum over the dim, a complex view, a reshape that keeps the dim whole -- computes on a rank's
pieces the same whatever the kind, so long as every split of the signature on that placement axis
is of one kind. So a rule's candidates that hold in any order of their split dims' indices hold in
every kind: the dispatcher turns them into the kinds its inputs hold (:func:`kind_variants`), and
rules never name a kind. A kind added here (a new ``order``) passes through every such rule as it is.
"""
from __future__ import annotations

from typing import Iterable, Optional

from .signature import Signature
from .values import Split

PLAIN = (1, "plain")


def kind_of(v: Split) -> tuple:
    """The ``(blocks, order)`` of a split."""
    return (v.blocks, v.order)


def kinds_held(nd_sbps: Iterable[tuple]) -> list:
    """The split kinds other than the plain one among the splits of ``nd_sbps``, in a fixed order."""
    return sorted({kind_of(v) for nd in nd_sbps for v in nd if v.is_split} - {PLAIN})


def in_kind(c: Signature, kind: tuple) -> Optional[Signature]:
    """Candidate ``c`` with every split in ``kind``, or None where it does not apply.

    A candidate whose splits are all plain takes the kind's blocks and order. One that blocks a
    split itself (a view merging ``(batch, heads)`` into one dim gives ``S(0, blocks=b)``) keeps its
    blocks and takes the kind's order; blocking it again would not be its layout, so a kind in
    plain order does not apply to it. A candidate without a split has no variant.
    """
    splits = [v for v in c.inputs + c.outputs if v.is_split]
    if not splits:
        return None
    blocks, order = kind
    own_blocks = any(v.blocks > 1 for v in splits)
    if own_blocks and order == "plain":
        return None
    turn = (lambda v: Split(v.dim, v.blocks, order)) if own_blocks else (lambda v: Split(v.dim, blocks, order))
    return Signature(tuple(turn(v) if v.is_split else v for v in c.inputs),
                     tuple(turn(v) if v.is_split else v for v in c.outputs))


def kind_variants(candidates: Iterable[Signature], kinds: Iterable[tuple]) -> list:
    """Each candidate in each kind (where it applies), without repeats, in the candidates' order."""
    out = [in_kind(c, k) for k in kinds for c in candidates]
    return list(dict.fromkeys(v for v in out if v is not None))
