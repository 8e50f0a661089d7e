"""SBP signatures: how an op's inputs and outputs are laid out along one placement axis.

A rule lists candidates such as ``"S(0), B -> S(0)"`` (one entry per tensor input, then
per tensor output). For an N-D placement the candidates are the product over the axes.
Inference picks the candidate whose boxing cost for the actual inputs is least; the cost
function is given by the caller, so this module stays free of boxing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from itertools import product
from typing import Callable, Sequence

from .values import broadcast, partial_sum, split


@dataclass(frozen=True)
class Signature:
    """A candidate of an op's rule on one placement axis: an SBP per input and per output."""
    inputs: tuple
    outputs: tuple

    def __repr__(self) -> str:
        return f"{', '.join(map(repr, self.inputs))} -> {', '.join(map(repr, self.outputs))}"


_TOKEN = re.compile(r"S\((-?\d+)\)|B|P")


def _parse_values(text: str) -> tuple:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = _TOKEN.fullmatch(part)
        if not m:
            raise ValueError(f"signature: cannot read {part!r}; expected S(d), B or P")
        out.append(split(int(m.group(1))) if m.group(1) is not None else broadcast if part == "B" else partial_sum)
    return tuple(out)


@lru_cache(maxsize=4096)
def parse(text: str) -> Signature:
    """``"S(0), B -> S(0)"`` as a Signature."""
    if "->" not in text:
        raise ValueError(f"signature: expected 'inputs -> outputs', got {text!r}")
    ins, outs = text.split("->")
    return Signature(_parse_values(ins), _parse_values(outs))


def as_signature(c) -> Signature:
    """A Signature from a Signature, a string (``"S(0), B -> S(0)"``) or an ``(inputs, outputs)`` pair."""
    if isinstance(c, Signature):
        return c
    if isinstance(c, str):
        return parse(c)
    ins, outs = c
    return Signature(tuple(ins), tuple(outs))


def all_broadcast(n_in: int, n_out: int) -> Signature:
    """``(B, ..., B) -> (B, ...)``: the candidate every op has."""
    return Signature((broadcast,) * n_in, (broadcast,) * n_out)


@dataclass(frozen=True)
class NdSignature:
    """One candidate per placement axis: ``inputs[i]`` is input i's nd-SBP, likewise outputs."""
    inputs: tuple
    outputs: tuple


def nd_candidates(per_axis: Sequence[Sequence[Signature]]) -> list:
    """The product of 1-D candidates over the placement axes, as nd-signatures."""
    out = []
    for combo in product(*per_axis):
        n_in, n_out = len(combo[0].inputs), len(combo[0].outputs)
        out.append(NdSignature(tuple(tuple(c.inputs[i] for c in combo) for i in range(n_in)),
                               tuple(tuple(c.outputs[i] for c in combo) for i in range(n_out))))
    return out


def choose(candidates: Sequence[NdSignature], cost: Callable[[NdSignature], tuple]) -> NdSignature:
    """The candidate of least cost; ties keep split outputs, then the rule's order."""
    def key(item):
        i, c = item
        splits = sum(v.is_split for nd in c.outputs for v in nd)
        partials = sum(v.is_partial for nd in c.outputs for v in nd)
        return cost(c) + (partials, -splits, i)
    return min(enumerate(candidates), key=key)[1]
