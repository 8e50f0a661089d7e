"""The tensor-parallel plans users already have, as plans: DTensor's parallel styles and HuggingFace's
``tp_plan`` style names.

    plan = gt.nn.from_parallel_styles(model, {"layers.*.attention.wq": ColwiseParallel(), ...})
    plan = gt.nn.hf_tp_plan(hf_model)              # the model's own "colwise" / "rowwise" / ... plan
    gt.nn.distribute_module(model, placement, plan)

A style is keyed by a module-name pattern (fnmatch: ``*`` also crosses dots) and translated, for
each module it matches, into the SBPs of the module's parameters on the tensor-parallel axis and
activation entries where the style says how activations enter or leave (activation_layouts.py):

| style | ``nn.Linear`` | ``nn.Embedding`` | entries |
|---|---|---|---|
| ``ColwiseParallel`` | weight, bias ``S(0)`` | weight ``S(1)`` | input ``B``; output as ``output_layouts`` when not ``Shard(-1)`` |
| ``RowwiseParallel`` | weight ``S(1)``, bias ``B`` | weight ``S(0)`` | input ``S(-1)`` (an embedding's ``B``); output as ``output_layouts`` (``Replicate``: ``B``) |
| ``SequenceParallel(sequence_dim)`` | -- | -- | input ``S(sequence_dim)`` |
| ``PrepareModuleInput`` / ``Output`` / ``InputOutput`` | -- | -- | each desired layout on its argument or result |

HF's ``Conv1D`` (weight ``[in, out]``) takes the column and row splits swapped. ``Shard(d)`` is
``S(d)``, ``Replicate()`` is ``B``; a ``Partial()`` activation is refused (an entry boxes to a
split or broadcast). ``input_layouts`` of DTensor's styles say how a *local* input is to be read
and ``use_local_output`` whether to hand back a local one: global tensors carry their layout
between modules, so neither has a counterpart -- the desired layouts are what the entries box to.

HF's names (``transformers``' ``ALL_PARALLEL_STYLES``) map onto the same: ``colwise``,
``colwise_gather_output`` / ``colwise_rep`` (output ``B``), ``rowwise``, ``rowwise_split_input`` /
``rowwise_rep``, ``embedding_rowwise`` / ``embedding_colwise`` (output ``B``), ``packed_colwise``
(a fused ``[gate; up]`` weight: each rank its part of each half, ``S(-2, blocks=2)``),
``packed_rowwise`` (``S(-1, blocks=2)``), ``sequence_parallel``, ``all_reduce`` (output ``B``),
``replicate`` and ``replicated_with_grad_allreduce`` / ``mla_kv_a_proj`` / ``moe_tp_experts`` /
``moe_identity_expert`` (nothing to do: a global tensor's partial gradient and partial output are
reduced where they are read). A name keyed by a *parameter* (HF's MoE experts' 3-D weights) splits
that parameter: colwise ``S(-2)``, rowwise ``S(-1)``. ``local*`` styles and the expert-parallel
``grouped_gemm`` compute on local pieces by design: refused, naming ``gt.nn.expert_parallel``.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Mapping

from torch import nn

from ..sbp import broadcast, split
from .plans import _check_axis, on_axis

COLUMN, ROW = "colwise", "rowwise"
#: HF style name -> (kind, the desired output or None for the natural one); None: nothing to do
HF_STYLES = {
    "colwise": (COLUMN, None), "colwise_gather_output": (COLUMN, broadcast), "colwise_rep": (COLUMN, broadcast),
    "rowwise": (ROW, broadcast), "rowwise_split_input": (ROW, broadcast), "rowwise_rep": (ROW, broadcast),
    "embedding_rowwise": (ROW, broadcast), "embedding_colwise": (COLUMN, broadcast),
    "packed_colwise": ("packed_colwise", None), "packed_rowwise": ("packed_rowwise", None),
    "sequence_parallel": ("sequence", None), "all_reduce": ("output", broadcast),
    "replicate": None, "replicated_with_grad_allreduce": None, "mla_kv_a_proj": None, "moe_tp_experts": None,
    "moe_identity_expert": None,
}
_LOCAL = ("local", "local_colwise", "local_rowwise", "local_packed_rowwise", "local_params", "gather",
          "grouped_gemm", "ep_router")


def from_parallel_styles(module: nn.Module, styles: Mapping[str, object], *, axis: int = 0, ndim: int = 1) -> dict:
    """The plan for ``module`` that ``styles`` (``{module-name pattern: DTensor ParallelStyle or HF style
    name}``) describe, on placement axis ``axis`` of an ``ndim``-axis placement (broadcast, or kept as
    it comes for activations, on the others). ValueError for a pattern that matches nothing, a style
    on a module it does not fit, or a name without a counterpart; TypeError for a value that is no style."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"from_parallel_styles: expected an nn.Module, got {type(module).__name__}")
    if not isinstance(styles, Mapping):
        raise TypeError(f"from_parallel_styles(styles=): expected a dict of module-name pattern: style, got {styles!r}")
    _check_axis(axis, ndim)
    modules = dict(module.named_modules())
    params = dict(module.named_parameters())
    plan: dict = {}
    for pattern, style in styles.items():
        matched = {n: m for n, m in modules.items() if n and fnmatchcase(n, pattern)} or \
            {n: p for n, p in params.items() if fnmatchcase(n, pattern)}
        if not matched:
            raise ValueError(f"from_parallel_styles: pattern {pattern!r} matches no module or parameter of "
                             f"{type(module).__name__}; names look like {list(modules)[1:4]}")
        for name, target in matched.items():
            plan.update(_translate(name, target, style, axis, ndim))
    return plan


def hf_tp_plan(model: nn.Module, *, axis: int = 0, ndim: int = 1) -> dict:
    """The plan of a HuggingFace model's own tensor-parallel plan (``model._tp_plan``, or its config's
    ``base_model_tp_plan`` under the base model's prefix), through :func:`from_parallel_styles`."""
    styles = getattr(model, "_tp_plan", None)
    if not styles:
        config = getattr(model, "config", None)
        base = getattr(config, "base_model_tp_plan", None)
        if not base:
            raise ValueError(f"hf_tp_plan: {type(model).__name__} has no tensor-parallel plan (no _tp_plan and no "
                             f"config.base_model_tp_plan)")
        prefix = getattr(model, "base_model_prefix", "")
        nested = prefix and prefix in dict(model.named_children())
        styles = {f"{prefix}.{k}" if nested else k: v for k, v in base.items()}
    return from_parallel_styles(model, styles, axis=axis, ndim=ndim)


def is_parallel_style(value) -> bool:
    """A DTensor ``ParallelStyle`` or an HF style name (a plan value :func:`from_parallel_styles` reads)."""
    if isinstance(value, str):
        return True
    from torch.distributed.tensor.parallel import ParallelStyle
    return isinstance(value, ParallelStyle)


def _translate(name: str, target, style, axis: int, ndim: int) -> dict:
    if isinstance(style, str):
        return _hf(name, target, style, axis, ndim)
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   PrepareModuleOutput, RowwiseParallel, SequenceParallel)
    if isinstance(style, ColwiseParallel):
        out = _sbp(style.output_layouts[0], name)
        return _column(name, target, None if out == split(-1) else out, axis, ndim)
    if isinstance(style, RowwiseParallel):
        return _row(name, target, _sbp(style.output_layouts[0], name), axis, ndim)
    if isinstance(style, SequenceParallel):
        return {f"{name}:input": _entry(_sbp(style.sequence_sharding[0], name), axis, ndim)}
    if isinstance(style, PrepareModuleInputOutput):
        return {**_inputs(name, style.prepare_module_input, axis, ndim),
                **_outputs(name, style.prepare_module_output, axis, ndim)}
    if isinstance(style, PrepareModuleInput):
        return _inputs(name, style, axis, ndim)
    if isinstance(style, PrepareModuleOutput):
        return _outputs(name, style, axis, ndim)
    raise TypeError(f"from_parallel_styles[{name!r}]: expected a DTensor ParallelStyle (ColwiseParallel, "
                    f"RowwiseParallel, SequenceParallel, PrepareModuleInput / Output / InputOutput) or an HF style "
                    f"name, got {style!r}")


def _hf(name: str, target, style: str, axis: int, ndim: int) -> dict:
    if style in _LOCAL:
        raise ValueError(f"from_parallel_styles[{name!r}]: HF's {style!r} computes on local pieces; use "
                         f"gt.nn.expert_parallel for experts, or a plan of SBPs")
    if style not in HF_STYLES:
        raise ValueError(f"from_parallel_styles[{name!r}]: unknown HF style {style!r}; known: {sorted(HF_STYLES)}")
    known = HF_STYLES[style]
    if known is None:
        return {}
    kind, out = known
    if isinstance(target, nn.Parameter):
        return _parameter(name, target, kind, axis, ndim)
    if kind == COLUMN:
        return _column(name, target, out, axis, ndim)
    if kind == ROW:
        return _row(name, target, out, axis, ndim)
    if kind == "sequence":
        return {f"{name}:input": _entry(split(1), axis, ndim)}
    if kind == "output":
        return {f"{name}:output": _entry(out, axis, ndim)}
    return _packed(name, target, kind, axis, ndim)


def _packed(name: str, module, kind: str, axis: int, ndim: int) -> dict:
    """A fused ``nn.Linear`` of two blocks (``[gate; up]``): each rank holds its part of each block --
    column: of the output features, its input broadcast; row: of the input features."""
    if _layer(name, module) != "linear":
        raise ValueError(f"from_parallel_styles[{name!r}]: {kind} fits a fused nn.Linear, got {type(module).__name__}")
    if kind == "packed_colwise":
        plan = _params(name, module, {"weight": split(0, blocks=2), "bias": split(0, blocks=2)}, axis, ndim)
        plan[f"{name}:input"] = _entry(broadcast, axis, ndim)
        return plan
    return _params(name, module, {"weight": split(1, blocks=2), "bias": broadcast}, axis, ndim)


def _parameter(name: str, p: nn.Parameter, kind: str, axis: int, ndim: int) -> dict:
    """A style keyed by a parameter (HF's experts' ``[experts, out, in]`` weights)."""
    d = p.dim()
    dims = {COLUMN: split(d - 2), ROW: split(d - 1), "packed_colwise": split(d - 2, blocks=2),
            "packed_rowwise": split(d - 1, blocks=2)}
    if kind not in dims or d < 2:
        raise ValueError(f"from_parallel_styles[{name!r}]: a parameter of {d} dims takes colwise, rowwise or "
                         f"packed styles only, got {kind!r}")
    return {name: on_axis(dims[kind], axis, ndim)}


def _layer(name: str, module) -> str:
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return "conv1d"
    raise ValueError(f"from_parallel_styles[{name!r}]: column / row parallel fit nn.Linear, nn.Embedding and "
                     f"HF's Conv1D, got {type(module).__name__}")


def _column(name: str, module, out, axis: int, ndim: int) -> dict:
    layer = _layer(name, module)
    params = {"linear": {"weight": split(0), "bias": split(0)}, "conv1d": {"weight": split(1), "bias": split(0)},
              "embedding": {"weight": split(1)}}[layer]
    plan = _params(name, module, params, axis, ndim)
    if layer != "embedding":
        plan[f"{name}:input"] = _entry(broadcast, axis, ndim)
    if out is not None:
        plan[f"{name}:output"] = _entry(out, axis, ndim)
    return plan


def _row(name: str, module, out, axis: int, ndim: int) -> dict:
    layer = _layer(name, module)
    params = {"linear": {"weight": split(1), "bias": broadcast}, "conv1d": {"weight": split(0), "bias": broadcast},
              "embedding": {"weight": split(0)}}[layer]
    plan = _params(name, module, params, axis, ndim)
    plan[f"{name}:input"] = _entry(broadcast if layer == "embedding" else split(-1), axis, ndim)
    plan[f"{name}:output"] = _entry(out, axis, ndim)
    return plan


def _params(name: str, module, layout: dict, axis: int, ndim: int) -> dict:
    return {f"{name}.{k}": on_axis(v, axis, ndim) for k, v in layout.items() if getattr(module, k, None) is not None}


def _inputs(name: str, style, axis: int, ndim: int) -> dict:
    plan = {f"{name}:input[{i}]": _entry(_sbp(d, name), axis, ndim)
            for i, d in enumerate(style.desired_input_layouts or ()) if d is not None}
    plan.update({f"{name}:input[{k}]": _entry(_sbp(d, name), axis, ndim)
                 for k, d in (style.desired_input_kwarg_layouts or {}).items() if d is not None})
    return plan


def _outputs(name: str, style, axis: int, ndim: int) -> dict:
    desired = style.desired_output_layouts
    if len(desired) == 1:
        return {f"{name}:output": _entry(_sbp(desired[0], name), axis, ndim)}
    return {f"{name}:output[{i}]": _entry(_sbp(d, name), axis, ndim) for i, d in enumerate(desired) if d is not None}


def _sbp(placement, name: str):
    """DTensor's ``Shard(d)`` / ``Replicate()`` as ``S(d)`` / ``B``."""
    kind = type(placement).__name__
    if kind == "Replicate":
        return broadcast
    if kind == "Shard":
        return split(placement.dim)
    raise ValueError(f"from_parallel_styles[{name!r}]: an activation boxes to Shard or Replicate, got {placement!r}")


def _entry(sbp, axis: int, ndim: int) -> tuple:
    """An activation entry's value: ``sbp`` on ``axis``, the other axes kept as they come."""
    return tuple(sbp if a == axis else None for a in range(ndim))
