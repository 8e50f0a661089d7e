"""The candidate layouts ``gt.nn.auto_plan`` costs: roles per placement axis, read off a model's modules.

A model's linear layers (``nn.Linear``; ``Conv1D``, GPT-2's, whose weight is ``[in, out]``) are
grouped by the module that holds them, in the order the step runs them (Phi-3 defines ``o_proj``
before ``qkv_proj``). Within a group whose last layer takes as input what the others give out -- attention's ``qkv -> proj``, Llama's ``q, k, v -> o`` and ``gate, up -> down``,
Phi-3's fused ``qkv_proj -> o_proj`` -- the others are column parallel and the last row parallel
(Megatron's pairing). A column layer whose output is ``f`` times the row layer's input may be ``f``
blocks side by side (a fused ``[q | k | v]``, ``[gate | up]``): split block by block, each rank
holds whole heads of every block -- or its features may already be head-major (examples/gpt.py's
``[heads, 3, head_dim]``), where a plain split keeps heads whole: both are candidates. The head (a root-level linear as wide as an embedding table's
vocabulary) can be vocabulary-parallel.

Each placement axis then takes a role:

- ``data``: parameters broadcast, the inputs split along their batch dim;
- ``tensor``: the Megatron pairs split as above, everything else broadcast, the inputs broadcast;
- ``fsdp``: every parameter split along its largest dim (gathered where an op needs it whole),
  the inputs split along their batch dim;
- ``sequence``: parameters broadcast, the inputs split along dim 1 -- plainly, or (where a sequence
  split wins, plan.py costs its twin) balanced: head-tail, rank ``r`` of ``W`` holding chunks ``r``
  and ``2W - 1 - r``, so that under a causal mask every rank attends as much;
- ``expert`` (models with MoE experts modules, ``nn/moe``): the experts' stacked weights split over
  their experts, every other parameter broadcast, the inputs split along their batch dim; the
  tokens travel to their experts (``gt.nn.expert_parallel``). One axis at most.

A candidate is a role per axis, plus whether the optimizer state is split over the first data axis
(ZeRO) and whether the tensor role makes the head vocabulary-parallel. The pairing is a guess from
shapes and names; a wrong one only costs more in the evaluation (cost.py) and loses.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ...sbp import blocks_problem, broadcast, split
from ..moe.experts import find_experts

ROLES = ("data", "tensor", "fsdp", "sequence", "expert")


@dataclass(frozen=True)
class Linear:
    name: str                   # the module's qualified name
    weight: str                 # parameter names
    bias: Optional[str]
    in_features: int
    out_features: int
    transposed: bool            # Conv1D: weight [in, out]


@dataclass(frozen=True)
class Candidate:
    roles: Tuple[str, ...]      # one per placement axis
    zero: bool = False          # optimizer state split over the first data axis
    vocab: bool = False         # the tensor role also splits the head over the vocabulary
    blocked: bool = False       # the tensor role splits fused column layers block by block
    balanced: bool = False      # the sequence role splits the inputs head-tail

    @property
    def expert_axis(self) -> Optional[int]:
        return self.roles.index("expert") if "expert" in self.roles else None

    @property
    def name(self) -> str:
        names = {"data": "data parallel", "tensor": "tensor parallel (Megatron)", "fsdp": "FSDP",
                 "sequence": "sequence split", "expert": "expert parallel"}
        text = " x ".join(names[r] for r in self.roles)
        return (text + (", fused layers blocked" if self.blocked else "") + (" (balanced)" if self.balanced else "")
                + (" + ZeRO" if self.zero else "")
                + (" + vocabulary-parallel head" if self.vocab else ""))


def linears(model: nn.Module, order: Dict[str, int]) -> List[Linear]:
    """Every linear-like module with a 2-D weight, in the order the step ran them (``order``: module
    name -> first call; modules it did not call last, in definition order)."""
    out = []
    for name, m in model.named_modules():
        if not name or not is_linear(m):
            continue
        w = m.weight
        transposed = not isinstance(m, nn.Linear)
        bias = getattr(m, "bias", None)
        inp, out_f = (w.shape[0], w.shape[1]) if transposed else (w.shape[1], w.shape[0])
        out.append(Linear(name, f"{name}.weight", f"{name}.bias" if isinstance(bias, torch.Tensor) else None,
                          int(inp), int(out_f), transposed))
    return sorted(out, key=lambda layer: order.get(layer.name, len(order)))


def is_linear(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 2 and (isinstance(module, nn.Linear) or
                                                           type(module).__name__ == "Conv1D")


def megatron_pairs(layers: List[Linear]) -> Dict[str, Tuple[str, int]]:
    """``{module name: ("column" | "row", blocks)}`` for the layers of every group that pairs up."""
    groups: Dict[str, List[Linear]] = {}
    for layer in layers:
        groups.setdefault(layer.name.rpartition(".")[0], []).append(layer)
    out = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        *columns, row = members
        fits = [c.out_features % row.in_features == 0 or row.in_features % c.out_features == 0 for c in columns]
        if not all(fits) or not any(c.out_features >= row.in_features for c in columns):
            continue
        for c in columns:
            blocks = c.out_features // row.in_features if c.out_features % row.in_features == 0 else 1
            out[c.name] = ("column", blocks)
        out[row.name] = ("row", 1)
    return out


def vocabulary_head(model: nn.Module, layers: List[Linear]) -> Optional[Linear]:
    """A root-level linear as wide as an embedding table's rows (``lm_head``), if there is one."""
    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    return next((layer for layer in layers if "." not in layer.name and layer.out_features in vocab), None)


def _tensor_sbp(name: str, pairs: dict, layers: Dict[str, Linear], head: Optional[str], blocked: bool):
    """A parameter's SBP on a tensor axis: split as its layer's Megatron role says, else broadcast."""
    module, _, attr = name.rpartition(".")
    layer = layers.get(module)
    if layer is None:
        return broadcast
    role, blocks = pairs.get(module, ("column", 1) if module == head else (None, 1))
    if role is None:
        return broadcast
    blocks = blocks if blocked else 1
    out_dim = 1 if layer.transposed else 0
    if attr == "bias":
        return split(0, blocks) if role == "column" else broadcast
    return split(out_dim, blocks) if role == "column" else split(1 - out_dim)


def _fsdp_sbp(t: torch.Tensor):
    if t.dim() == 0:
        return broadcast
    return split(max(range(t.dim()), key=lambda d: (t.shape[d], -d)))


def parameter_layouts(model: nn.Module, candidate: Candidate, tensors: Dict[str, torch.Tensor],
                      hierarchy: tuple, order: Dict[str, int]) -> Dict[str, tuple]:
    """The nd-SBP of each parameter (``tensors``, by name) under ``candidate``; where a blocked split
    leaves a plain split of a dim no room on another axis, that axis splits another dim, or none."""
    layers = linears(model, order)
    pairs = megatron_pairs(layers)
    by_name = {layer.name: layer for layer in layers}
    head = vocabulary_head(model, layers)
    head_name = head.name if head is not None and candidate.vocab else None
    experts = expert_weights(model)
    out = {}
    for name, t in tensors.items():
        per_axis = []
        for role in candidate.roles:
            if role == "tensor":
                per_axis.append(_tensor_sbp(name, pairs, by_name, head_name, candidate.blocked))
            elif role == "fsdp":
                per_axis.append(_fsdp_sbp(t))
            elif role == "expert" and name in experts:
                per_axis.append(split(0))
            else:
                per_axis.append(broadcast)
        out[name] = _fitted(tuple(t.shape), hierarchy, per_axis)
    return out


def _fitted(shape: tuple, hierarchy: tuple, per_axis: list) -> tuple:
    """``per_axis`` with each plain split that conflicts with a blocked one moved to another dim, or broadcast."""
    for a, v in enumerate(per_axis):
        if not blocks_problem(shape, hierarchy, tuple(per_axis)):
            break
        if v.is_split and v.blocks == 1:
            others = [split(d) for d in range(len(shape)) if d != v.dim]
            per_axis[a] = next((o for o in others if not blocks_problem(shape, hierarchy, tuple(
                per_axis[:a] + [o] + per_axis[a + 1:]))), broadcast)
    return tuple(per_axis) if not blocks_problem(shape, hierarchy, tuple(per_axis)) else \
        tuple(v if not v.is_split or v.blocks > 1 else broadcast for v in per_axis)


def expert_weights(model: nn.Module) -> set:
    """The qualified names of every MoE experts module's stacked weights."""
    return {f"{name}.{w}" for name, _, kind in find_experts(model) for w in kind.weights}


def input_layout(t: torch.Tensor, roles: Tuple[str, ...], balanced: bool = False) -> tuple:
    """An input's nd-SBP: its batch dim split on data and fsdp axes, dim 1 on sequence axes (head-tail
    where ``balanced``)."""
    out = []
    for role in roles:
        if role in ("data", "fsdp", "expert") and t.dim() >= 1:
            out.append(split(0))
        elif role == "sequence" and t.dim() >= 2:
            out.append(split(1, order="head_tail" if balanced else "plain"))
        else:
            out.append(broadcast)
    return tuple(out)


def candidates(model: nn.Module, ndim: int, sequence: bool, order: Dict[str, int]) -> List[Candidate]:
    """Every role per axis (the sequence role where the inputs have a dim 1), ZeRO where an axis is a
    data axis, the vocabulary-parallel head where an axis is a tensor axis and the model has a head."""
    layers = linears(model, order)
    pairs = megatron_pairs(layers)
    has_pairs = bool(pairs)
    fused = any(blocks > 1 for _, blocks in pairs.values())
    has_head = vocabulary_head(model, layers) is not None
    roles = [r for r in ROLES if (r != "tensor" or has_pairs or has_head) and (r != "sequence" or sequence)
             and (r != "expert" or expert_weights(model))]
    out = []
    for combo in itertools.product(roles, repeat=ndim):
        if combo.count("sequence") > 1 or combo.count("expert") > 1:
            continue
        out.append(Candidate(combo))
        if "data" in combo:
            out.append(Candidate(combo, zero=True))
        if "tensor" in combo and fused:
            out.append(Candidate(combo, blocked=True))
        if "tensor" in combo and has_head and has_pairs:
            out.append(Candidate(combo, vocab=True))
    return out
