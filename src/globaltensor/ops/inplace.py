"""In-place and out= ops: the tensors they write keep their layout.

A candidate signature is admissible only if it leaves every written input's SBP as it is,
so the op can run on the input's own pieces. When no candidate is, the functional op runs
and its result is boxed into the written tensor's layout and copied into its pieces; an op
with no functional twin (a user's op updating an input besides its result) runs through the
fallback, which writes every written argument back.

In-place ops that change only metadata (``transpose_``, ``squeeze_``) are the exception: the
tensor takes a new layout; inplace_view.py runs them.
"""
from __future__ import annotations

import torch

from ..tensor import GlobalTensor, write_into
from .op_record import record


def written_objects(func, args, kwargs) -> list:
    """The tensors an in-place or out= op writes into."""
    objs = record(func).written_values(args, kwargs)
    for v in objs:
        if isinstance(v, torch.Tensor) and not isinstance(v, GlobalTensor):
            raise TypeError(f"{func}: cannot write a global result into a plain (local) tensor; make the written "
                            f"tensor global first. Torch code that computes into buffers it allocates itself "
                            f"(torch.empty, then out=) cannot run on global tensors: such as the backward of "
                            f"torch_nn._linear_cross_entropy_batch_chunked_no_reduction (F.linear_cross_entropy "
                            f"with options= and reduction='none'); call that without options=, or with "
                            f"reduction='mean' or 'sum'")
    return objs


def returned_inputs(func, args, kwargs, tensors: list) -> dict:
    """Output position -> tensor-input position, for outputs that are a written input (``add_``, out=)."""
    arguments = func._schema.arguments
    out = {}
    for j, i in record(func).returns_written.items():
        v = args[i] if i < len(args) else kwargs.get(arguments[i].name)
        k = next((k for k, t in enumerate(tensors) if t is v), None)
        if k is not None:
            out[j] = k
    return out


def _functional(func):
    """The out-of-place op of an in-place (``add_``) or out= op, resolved by argument matching
    (None: its namespace has none)."""
    name = func.overloadpacket.__name__
    return getattr(getattr(torch.ops, func.namespace), name[:-1] if name.endswith("_") else name, None)


def has_functional(func) -> bool:
    """Whether the op has an out-of-place op of its name that :func:`write_back` can run (``add`` for
    ``add_``, the op itself without ``out=``). Ops that write some inputs besides returning their
    results (``_native_batch_norm_legit`` and its running statistics, a user's op) have none."""
    functional = _functional(func)
    return functional is not None and (functional is not func.overloadpacket or
                                       any(a.is_out for a in func._schema.arguments))


def write_back(func, args, kwargs):
    """Run the functional op, then box its result into the written tensor's layout and copy it in."""
    target = written_objects(func, args, kwargs)[0]
    kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    write_into(target, _functional(func)(*args, **kwargs))
    return target
