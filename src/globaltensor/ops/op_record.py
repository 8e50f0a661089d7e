"""What an op writes, aliases and returns: read from its schema once, into one cached record.

Every path an op can take -- a rule, a decomposition, the foreach and fused list ops, the
fallback, capture and lowering in the traced mode -- asks this record, never the schema, so
they cannot disagree about which arguments an op writes (``Tensor(a!)``), which of those it
returns (``add_``, ``out=``), which argument a view's result aliases (``Tensor(a) ->
Tensor(a)``) or whether it changes only metadata (``transpose_``).

An argument written but not returned (the fused optimizers' ``Tensor(b!)[] grads``,
``found_inf`` of GradScaler's unscale, batch norm's running statistics) is what a path that
runs the op on copies loses unless it writes back: :attr:`OpRecord.unreturned` names them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Arg:
    """One schema argument: its position, name, and whether it is a list or keyword-only."""
    index: int
    name: str
    is_list: bool
    kwarg_only: bool
    is_out: bool


@dataclass(frozen=True)
class OpRecord:
    name: str
    written: tuple             # Arg of every argument the op writes
    returns_written: dict      # return position -> schema index of the written argument it returns
    unreturned: tuple          # Arg of every written argument no return gives back
    view_of: Optional[int]     # schema index of the argument a (non-written) result aliases: a view op
    is_view: bool              # every result aliases an input without writing it
    returns_alias: bool        # the first result aliases an input (``to``, ``contiguous``: may return self)
    inplace_view: bool         # changes only metadata in place (``transpose_``, ``squeeze_``)
    aliases_nothing: bool      # no argument is aliased or written
    n_returns: int

    def written_values(self, args, kwargs) -> list:
        """The values given for the written arguments (list elements flattened; None where absent)."""
        out = []
        for a in self.written:
            v = args[a.index] if a.index < len(args) and not a.kwarg_only else kwargs.get(a.name)
            out.extend(v if isinstance(v, (list, tuple)) else [v])
        return out

    def written_tensors(self, args, kwargs) -> list:
        return [v for v in self.written_values(args, kwargs) if isinstance(v, torch.Tensor)]

    def argument(self, args, kwargs, index: int, name: str):
        return args[index] if index < len(args) else kwargs.get(name)


_RECORDS: dict = {}


def record(func) -> OpRecord:
    """The record of ``func`` (an ``OpOverload``), made on first use."""
    rec = _RECORDS.get(func)
    if rec is None:
        rec = _RECORDS[func] = _read(func)
    return rec


def _read(func) -> OpRecord:
    schema = func._schema
    args = [Arg(i, a.name, str(a.type).startswith("List["), a.kwarg_only, a.is_out)
            for i, a in enumerate(schema.arguments)]
    written = tuple(args[i] for i, a in enumerate(schema.arguments) if a.alias_info is not None
                    and a.alias_info.is_write)
    returns_written = {}
    for j, ret in enumerate(schema.returns):
        if ret.alias_info is None or not ret.alias_info.is_write:
            continue
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.before_set == ret.alias_info.before_set:
                returns_written[j] = i
    returned = set(returns_written.values())
    returns = schema.returns
    return OpRecord(
        name=str(func),
        written=written,
        returns_written=returns_written,
        unreturned=tuple(a for a in written if a.index not in returned),
        view_of=_view_of(schema),
        is_view=bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns),
        returns_alias=bool(returns) and returns[0].alias_info is not None,
        inplace_view=torch.Tag.inplace_view in func.tags,
        aliases_nothing=not any(a.alias_info is not None for a in schema.arguments),
        n_returns=len(returns))


def _view_of(schema) -> Optional[int]:
    """The schema position of the argument a view op's result aliases (None: not a view op)."""
    for ret in schema.returns:
        info = ret.alias_info
        if info is None or info.is_write:
            continue
        for i, a in enumerate(schema.arguments):
            arg = a.alias_info
            if arg is None or arg.is_write:
                continue
            # ``Tensor(a) -> Tensor(a)``; a list result (split, unbind): ``Tensor(a -> *) -> Tensor(a)[]``
            if arg.before_set & info.before_set or (not info.before_set and "*" in arg.after_set):
                return i
    return None
