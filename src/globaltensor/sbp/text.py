"""SBP as text and as plain data: ``S(0)`` for a 1-D nd-SBP, ``(S(0), B)`` for more axes, and
lists a JSON file can hold (``[["S", 0, 1], ["B"]]``) and back."""
from __future__ import annotations

from .values import broadcast, partial_sum, split


def sbp_text(nd_sbp: tuple) -> str:
    """``S(0)`` for a 1-D nd-SBP, ``(S(0), B)`` for more axes."""
    return repr(nd_sbp[0]) if len(nd_sbp) == 1 else "(" + ", ".join(map(repr, nd_sbp)) + ")"


def nd_to_list(nd: tuple) -> list:
    """An nd-SBP as plain data: ``["S", dim, blocks]`` (``["S", dim, blocks, "head_tail"]``), ``["B"]``
    or ``["P"]`` per axis."""
    return [["S", v.dim, v.blocks] + ([v.order] if v.head_tail else []) if v.is_split else
            ["P"] if v.is_partial else ["B"] for v in nd]


def nd_from_list(values: list) -> tuple:
    """The nd-SBP :func:`nd_to_list` wrote."""
    return tuple(split(*v[1:]) if v[0] == "S" else partial_sum if v[0] == "P" else broadcast for v in values)
