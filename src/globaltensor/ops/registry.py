"""The rule registry: for each aten op, how to find its candidate SBP signatures.

A rule is a function of the op's arguments -- tensors given as meta tensors of the global
shape, everything else as passed -- returning candidate signatures for one placement axis
(strings like ``"S(0), B -> S(0)"``), one entry per tensor input in argument order, then one
per tensor output. ``(B, ..., B) -> B`` is always added. A rule may also give ``local``:
a function rewriting the non-tensor arguments for one rank (a view's target shape, say),
``check_shapes``: verify each rank's output piece has the balanced shape before the
candidate is used (for ops whose pieces only line up on some shapes); and ``kernel``: how
one call runs on the ranks this process holds, in place of the aten op on each rank's
pieces -- ``kernel(func, args, kwargs, in_layouts, out_layouts, calls)``, given the call's
own (global) arguments and ``calls`` mapping each held rank to its ``(args, kwargs)`` of
pieces (after ``local``), returns ``{rank: result}``. ``any_order``: which candidates hold in any order of their split dims' indices, so in
every split kind (blocked, head-tail: sbp/split_kinds.py), which the dispatcher then offers where
the inputs hold that kind -- a rule never names a kind. A rule without ``kernel`` and ``local``
runs the op on each rank's pieces, and a candidate right for every split of every size, as each
must be, reads no index's position: all of its candidates hold in any order, and ``any_order``
is not needed. A ``kernel`` or ``local`` may read positions, so such a rule says which of its
candidates do not, or read them only through the layout's segments (``Layout.segments``, the
generator's positions): True for all, or a function of the op's arguments returning those
candidates (sdpa's sequence signatures: ring attention's blocks are the segments). ``out_meta``: where the op's meta kernel and its
device kernel disagree on an output's shape (eval batch norm's saved statistics are ``[C]`` on
meta, ``[0]`` on CPU), ``out_meta(meta_out, device_type, *args, **kwargs)`` returns the device's. It is called
once per call even when this process holds no rank of the placement (random ops reserve
their counters there, so every process agrees), for ops whose pieces are not simply the
aten op on the pieces (a random mask drawn from the rank's box, a vocabulary-split lookup).
``kernel_bytes``: what a candidate costs beyond its boxing, in bytes --
``kernel_bytes(inputs' layouts as they come, their layouts under the candidate, the outputs' layouts
under it, recorded) -> int``: the most bytes a rank sends where the ``kernel`` communicates by itself
(ring attention passing its key and value blocks around, a norm combining its pieces' norms; ``recorded``: autograd records the op, so its backward's count too, as
the gradients' way back does for boxing), and the bytes of gathered inputs a rank holds until the
backward where holding them is what the layout exists to avoid (sdpa's whole k and v under a
sequence split): the cost model adds them to the candidate's boxing. ``admit``: where a
candidate is right only for some layouts of the call, ``admit(inputs' layouts as they come, their
layouts under the candidate) -> bool`` leaves out the others (sdpa: no signature that gathers the
queries or takes a rank's attention work away, as a head split with fewer heads than ranks would).
``keyed``: the numbers the candidates read, where the schema makes them a factor or a fill
(``Scalar``, ``float``): ``{argument name: function of its value}`` -- the function's result enters
the dispatch cache's key (ops/call_key.py), None for the value itself. Without it such a number
enters by its type only, so a rule that reads one must say so (``masked_fill`` keeps a partial sum
only for a zero fill: ``keyed={"value": is_zero}``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from ..sbp import as_signature
from ..compat.torch_ops import MissingOp, aten  # noqa: F401  (the rule modules take aten from here)
from .schema.op_record import record



@dataclass(frozen=True)
class Rule:
    candidates: Callable
    local: Optional[Callable] = None
    check_shapes: bool = False
    kernel: Optional[Callable] = None
    out_meta: Optional[Callable] = None
    kernel_bytes: Optional[Callable] = None
    admit: Optional[Callable] = None
    any_order: Union[None, bool, Callable] = None
    keyed: Optional[dict] = None

    @property
    def takes_kinds(self) -> bool:
        """Whether some of the rule's candidates hold in any order (``any_order``; see the module)."""
        return bool(self.any_order) if self.any_order is not None else self.kernel is None and self.local is None

    def order_free(self, candidates: list, meta_args, meta_kwargs) -> list:
        """The candidates (of ``candidates``, the rule's own for this call) that hold in any order of
        their split dims' indices (``any_order``, see the module's docstring)."""
        if not self.takes_kinds:
            return []
        if self.any_order is None or self.any_order is True:
            return candidates
        return [as_signature(c) for c in self.any_order(*meta_args, **meta_kwargs)]


RULES: dict = {}
_listeners: list = []


def on_rules_changed(fn) -> None:
    """Call ``fn()`` whenever a rule is registered (the dispatcher drops its cached decisions)."""
    _listeners.append(fn)


def _overloads(op) -> list:
    """The overloads a rule for ``op`` covers; none for an op this torch lacks (torch_ops.py)."""
    if isinstance(op, MissingOp):
        return []
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def register_rule(ops, candidates=None, *, local=None, check_shapes=False, kernel=None, out_meta=None,
                  kernel_bytes=None, admit=None, any_order=None, keyed=None):
    """Register a rule for one op, an op packet (every overload) or a list of them.

    ``candidates`` is a list of signature strings or a function of the op's arguments
    returning one. Usable as a decorator: ``@register_rule(aten.mm)``.
    """
    def install(fn):
        _check_rule(ops, fn, {"local": local, "kernel": kernel, "out_meta": out_meta, "kernel_bytes": kernel_bytes,
                              "admit": admit}, keyed, any_order)
        rule = Rule(fn if callable(fn) else (lambda *a, **k: fn), local, check_shapes, kernel, out_meta,
                    kernel_bytes, admit, any_order, keyed)
        for op in (ops if isinstance(ops, (list, tuple)) else [ops]):
            for overload in _overloads(op):
                RULES[overload] = rule
        for listener in _listeners:
            listener()
        return fn
    if candidates is None:
        return install
    install(candidates)
    return candidates


def _check_rule(ops, candidates, hooks: dict, keyed, any_order) -> None:
    """Bad arguments fail here, at registration, not at the op's first call."""
    for op in (ops if isinstance(ops, (list, tuple)) else [ops]):
        if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, MissingOp)):
            raise TypeError(f"register_rule: expected an aten op such as torch.ops.aten.mm, got {op!r}")
    if not callable(candidates):
        if not isinstance(candidates, (list, tuple)):
            raise TypeError(f"register_rule: candidates must be a list of signatures such as 'S(0), B -> S(0)' "
                            f"or a function returning one, got {candidates!r}")
        for c in candidates:
            try:
                as_signature(c)
            except (TypeError, ValueError) as e:
                raise ValueError(f"register_rule: candidate {c!r}: {e}") from None
    for name, fn in hooks.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"register_rule: {name}= must be a function, got {fn!r}")
    if not (any_order is None or isinstance(any_order, bool) or callable(any_order)):
        raise TypeError(f"register_rule: any_order= must be True, False or a function returning the candidates "
                        f"that hold in any order, got {any_order!r}")
    if keyed is not None and not (isinstance(keyed, dict) and all(
            isinstance(k, str) and (f is None or callable(f)) for k, f in keyed.items())):
        raise TypeError(f"register_rule: keyed= must map argument names to a function of the value (or None), "
                        f"got {keyed!r}")
    for op in (ops if isinstance(ops, (list, tuple)) else [ops]) if keyed else ():
        for overload in _overloads(op):
            names = record(overload).names
            unknown = sorted(set(keyed) - set(names))
            if unknown:
                raise ValueError(f"register_rule(keyed=) for {overload}: no argument named {unknown}; its arguments "
                                 f"are {list(names)}")


_TAGGED: list = []


def register_tag_rule(tag, rule_fn) -> None:
    """A rule for every op carrying ``tag`` (``torch.Tag.pointwise``) that has no rule of its own."""
    _TAGGED.append((tag, Rule(rule_fn)))


def find_rule(func) -> Optional[Rule]:
    rule = RULES.get(func)
    if rule is None:
        for tag, tagged in _TAGGED:
            if tag in func.tags:
                RULES[func] = rule = tagged
                break
    return rule
