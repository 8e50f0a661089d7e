"""In-place and out= ops: the tensors they write keep their layout.

A candidate signature is admissible only if it leaves every written input's SBP as it is,
so the op can run on the input's own pieces. When no candidate is, the functional op runs
and its result is boxed into the written tensor's layout and copied into its pieces; an op
with no functional twin (a user's op updating an input besides its result) runs through the
fallback, which writes every written argument back.

In-place ops that change only metadata (``transpose_``, ``squeeze_``) are the exception: the
tensor takes a new layout; metadata_ops.py runs them.
"""
from __future__ import annotations

import torch

from ...tensor import GlobalTensor, write_into
from ..schema.op_record import record


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
    rec = record(func)
    out = {}
    for j, i in rec.returns_written.items():
        v = rec.at(args, kwargs, i)
        k = next((k for k, t in enumerate(tensors) if t is v), None)
        if k is not None:
            out[j] = k
    return out


def has_functional(func) -> bool:
    """Whether the op has an out-of-place twin that :func:`write_back` can run (``add.Tensor`` for
    ``add_.Tensor``, ``add.out`` without ``out=``: op_record.py). Ops that write some inputs besides
    returning their results (``_native_batch_norm_legit`` and its running statistics, a user's op)
    have none."""
    return record(func).functional is not None


def write_back(func, args, kwargs):
    """Run the functional twin, then box each result into the layout of the written tensor it stands
    for and copy it in; returns what the op returns."""
    rec = record(func)
    outs = rec.out_names
    result = rec.functional(*args, **{k: v for k, v in kwargs.items() if k not in outs})
    results = result if isinstance(result, (tuple, list)) else (result,)
    written = {j: rec.at(args, kwargs, i) for j, i in rec.returns_written.items()}
    for j, target in written.items():
        write_into(target, results[j])
    if not isinstance(result, (tuple, list)):
        return written.get(0, result)
    return type(result)(written.get(j, r) for j, r in enumerate(results))
