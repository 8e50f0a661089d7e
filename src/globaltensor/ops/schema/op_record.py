"""What an op takes, writes, aliases and returns: read from its schema once, into one cached record.

This is the only module that reads torch schemas. Every path an op can take -- a rule, a
decomposition, the foreach and fused list ops, the fallback, capture and lowering in the traced
mode -- asks this record, so they cannot disagree about an argument's name or position, which
arguments an op writes (``Tensor(a!)``), which of those it returns (``add_``, ``out=``), which
argument a view's result aliases (``Tensor(a) -> Tensor(a)``), whether it changes only metadata
(``transpose_``), or which op is its functional twin.

An argument written but not returned (the fused optimizers' ``Tensor(b!)[] grads``,
``found_inf`` of GradScaler's unscale, batch norm's running statistics) is what a path that
runs the op on copies loses unless it writes back: :attr:`OpRecord.unreturned` names them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

@dataclass(frozen=True)
class Arg:
    """One schema argument: its position, name, type text (``Tensor``, ``int[]``, ``Device?``),
    whether it is a list, keyword-only or an ``out=`` argument, and its default (None where it has
    none)."""
    index: int
    name: str
    type: str
    is_list: bool
    kwarg_only: bool
    is_out: bool
    default: object


@dataclass(frozen=True)
class OpRecord:
    name: str
    args: tuple                # Arg of every schema argument, in order
    written: tuple             # Arg of every argument the op writes
    returns_written: dict      # return position -> schema index of the written argument it returns
    unreturned: tuple          # Arg of every written argument no return gives back
    view_of: Optional[int]     # schema index of the argument a (non-written) result aliases: a view op
    is_view: bool              # every result aliases an input without writing it
    returns_alias: bool        # the first result aliases an input (``to``, ``contiguous``: may return self)
    inplace_view: bool         # changes only metadata in place (``transpose_``, ``squeeze_``)
    aliases_nothing: bool      # no argument is aliased or written
    in_place: bool             # writes its first argument and returns it (``add_``, ``bernoulli_``)
    n_returns: int
    one_fresh_tensor: bool     # returns one Tensor that aliases nothing
    device_args: tuple         # Arg of every ``Device`` argument (out_meta puts its meta tensors on meta)
    functional: object         # the out-of-place twin of an in-place / out= op (OpOverload), else None
    per_tensor: Optional[tuple]    # a ``_foreach_*`` op's per-tensor op: (packet, capacity, keywords, out_is_self)
    by_name: dict = field(default=None, compare=False, hash=False, repr=False)     # name -> Arg

    def get(self, args, kwargs, name: str, default=None):
        """The value given for argument ``name``, positionally or by keyword (``default`` when absent)."""
        a = self.by_name[name]
        if a.index < len(args) and not a.kwarg_only:
            return args[a.index]
        return kwargs.get(name, default)

    def at(self, args, kwargs, index: int):
        """The value given for schema argument ``index`` (None when absent)."""
        a = self.args[index]
        if index < len(args) and not a.kwarg_only:
            return args[index]
        return kwargs.get(a.name)

    def written_values(self, args, kwargs) -> list:
        """The values given for the written arguments (list elements flattened; None where absent)."""
        out = []
        for a in self.written:
            v = self.at(args, kwargs, a.index)
            out.extend(v if isinstance(v, (list, tuple)) else [v])
        return out

    def written_tensors(self, args, kwargs) -> list:
        return [v for v in self.written_values(args, kwargs) if isinstance(v, torch.Tensor)]

    def bind(self, args, kwargs) -> dict:
        """The arguments by name, defaults filled in (None where there is no default)."""
        out = {}
        for a in self.args:
            if a.index < len(args) and not a.kwarg_only:
                out[a.name] = args[a.index]
            else:
                out[a.name] = kwargs.get(a.name, a.default)
        return out

    def call_args(self, named: dict) -> tuple:
        """``(args, kwargs)`` from arguments by name (keyword-only ones as keywords)."""
        args, kwargs = [], {}
        for a in self.args:
            if a.kwarg_only:
                kwargs[a.name] = named[a.name]
            else:
                args.append(named[a.name])
        return tuple(args), kwargs

    def with_arg(self, args, kwargs, name: str, value) -> tuple:
        """``(args, kwargs)`` with argument ``name`` set to ``value``, wherever the caller put it."""
        a = self.by_name[name]
        if a.index < len(args) and not a.kwarg_only:
            return tuple(args[:a.index]) + (value,) + tuple(args[a.index + 1:]), kwargs
        return args, dict(kwargs, **{name: value})

    @property
    def names(self) -> tuple:
        return tuple(a.name for a in self.args)

    @property
    def out_names(self) -> frozenset:
        """The names of the ``out=`` arguments."""
        return frozenset(a.name for a in self.args if a.is_out)


_RECORDS: dict = {}


def record(func) -> OpRecord:
    """The record of ``func`` (an ``OpOverload``), made on first use."""
    rec = _RECORDS.get(func)
    if rec is None:
        rec = _RECORDS[func] = _read(func)
    return rec


def _args(schema) -> tuple:
    return tuple(Arg(i, a.name, str(a.type), str(a.type).startswith("List["), a.kwarg_only, a.is_out,
                     a.default_value if a.has_default_value() else None)
                 for i, a in enumerate(schema.arguments))


def _read(func) -> OpRecord:
    schema = func._schema
    args = _args(schema)
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
    aliases_nothing = not any(a.alias_info is not None for a in schema.arguments)
    return OpRecord(
        name=str(func),
        args=args,
        written=written,
        returns_written=returns_written,
        unreturned=tuple(a for a in written if a.index not in returned),
        view_of=_view_of(schema),
        is_view=bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns),
        returns_alias=bool(returns) and returns[0].alias_info is not None,
        inplace_view=torch.Tag.inplace_view in func.tags,
        aliases_nothing=aliases_nothing,
        in_place=returns_written.get(0) == 0,
        n_returns=len(returns),
        one_fresh_tensor=len(returns) == 1 and returns[0].alias_info is None and str(returns[0].type) == "Tensor"
        and aliases_nothing,
        device_args=tuple(a for a in args if "Device" in a.type),
        functional=_functional_twin(func, schema, written),
        per_tensor=_per_tensor(func),
        by_name={a.name: a for a in args})


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


def _functional_twin(func, schema, written: tuple):
    """The op an in-place (``add_.Tensor``) or out= (``add.out``) op is the writing form of: the
    overload of the packet named without the ``_`` (or of its own packet, for out=) that takes the
    same arguments but the ``out`` ones -- and, a factory's, the keyword-only options an out= form
    leaves out (``dtype=``, ``device=``) -- writing none but what the op writes too
    (``rrelu_with_noise`` writes its ``noise`` as ``rrelu_with_noise_`` does); None for an op that
    is neither (``_native_batch_norm_legit`` writes its running statistics but has no twin)."""
    if not written:
        return None
    outs = {a.name for a in schema.arguments if a.is_out}
    name = func.overloadpacket.__name__
    if name.endswith("_") and not name.startswith("__"):
        base = name[:-1]
    elif outs:
        base = name
    else:
        return None
    packet = getattr(getattr(torch.ops, func.namespace), base, None)
    if packet is None:
        return None
    want = tuple((a.name, str(a.type)) for a in schema.arguments if a.name not in outs)
    names = {n for n, _ in want}
    writes = {a.name for a in written}
    for overload in packet.overloads():
        op = getattr(packet, overload)
        arguments = op._schema.arguments
        if op is func or any(a.alias_info is not None and a.alias_info.is_write and a.name not in writes
                             for a in arguments):
            continue
        core = tuple((a.name, str(a.type)) for a in arguments
                     if not (a.kwarg_only and a.has_default_value() and a.name not in names))
        if core == want:
            return op
    return None


def _per_tensor(func) -> Optional[tuple]:
    """A ``_foreach_*`` op's per-tensor op packet (``_foreach_add_`` -> ``add_``), how many positional
    arguments its overloads take at most, its keyword-only argument names in order, and whether an
    element's call writes its first tensor through ``out=`` (None for any other op).

    ``_foreach_addcdiv_(self, t1, t2, scalars)`` passes positionally what ``addcdiv_`` takes as
    ``value=``: arguments past the capacity go to the keyword-only ones. An in-place foreach op whose
    per-tensor op has no in-place form (``_foreach_maximum_``: there is no ``maximum_``) runs each
    element as the out-of-place op's ``out=`` form, writing the element: ``maximum(x, y, out=x)``."""
    name = func.overloadpacket.__name__
    if not name.startswith("_foreach_"):
        return None
    base = name[len("_foreach_"):]
    packet = getattr(torch.ops.aten, base, None)
    out_is_self = False
    if packet is None and base.endswith("_"):
        packet = getattr(torch.ops.aten, base[:-1], None)
        out_is_self = packet is not None and "out" in packet.overloads()
        if not out_is_self:
            return None
    if packet is None:
        return None
    overloads = [o for o in packet.overloads() if not (out_is_self and o != "out")]
    schemas = [getattr(packet, overload)._schema for overload in overloads]
    capacity = max(sum(not a.kwarg_only for a in s.arguments) for s in schemas)
    keywords = next(([a.name for a in s.arguments if a.kwarg_only and not a.is_out] for s in schemas
                     if any(a.kwarg_only and not a.is_out for a in s.arguments)), [])
    return packet, capacity, keywords, out_is_self
