"""A product's candidates from how its dims map, written as in ``torch.einsum``: ``"mk,kn->mn"``.

An index the output keeps splits every operand that carries it (broadcast in one that does not)
and the output alike; an index every operand carries and the output does not is summed over, so
split alike in each it gives a partial sum; and a product is linear in each operand, so one
partial operand with the others broadcast gives a partial product. Each maps a dim's indices one to
one, so the candidates hold in any order of them (sbp/split_kinds.py).
"""
from __future__ import annotations

from .common import B, P, S, sig


def contraction(spec: str) -> list:
    """The candidates of the product ``spec`` (``"bmk,bkn->bmn"``): one per output index, one per
    summed index, then one per operand taken partial."""
    ins, out = spec.replace(" ", "").split("->")
    operands = ins.split(",")
    kept = [sig([S(op.index(i)) if i in op else B for op in operands], [S(d)]) for d, i in enumerate(out)]
    summed = [sig([S(op.index(i)) for op in operands], [P]) for i in dict.fromkeys(ins.replace(",", ""))
              if i not in out and all(i in op for op in operands)]
    linear = [sig([P if j == k else B for j in range(len(operands))], [P]) for k in range(len(operands))]
    return kept + summed + linear


def plus_term(term, out_shape: tuple, candidates: list) -> list:
    """``candidates`` of a product with a term added first (``addmm``'s bias), as the added term: split
    with the output where it has the output's split dim (broadcast where it broadcasts along it), and
    partial with a partial output -- a bias joining a row-parallel sum (one rank adds it)."""
    def entry(out):
        if not out.is_split:
            return P
        k = out.dim - (len(out_shape) - term.dim())
        return S(k) if k >= 0 and term.shape[k] != 1 else B
    return [sig([entry(c.outputs[0])] + list(c.inputs), c.outputs) for c in candidates]
