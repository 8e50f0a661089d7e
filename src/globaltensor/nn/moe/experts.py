"""The MoE experts modules expert parallelism recognises, and one expert's computation on its rows.

HuggingFace transformers' experts (``transformers.integrations.moe``: Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3, gpt-oss, ...) keep every expert's weights stacked on a leading expert dim --
``gate_up_proj`` (or ``up_proj`` without a gate) and ``down_proj``, optional ``*_bias`` -- and take
``forward(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k])``.
Shared experts and the router live outside that module, as ordinary layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F

from ...sbp import split


@dataclass(frozen=True)
class Stacked:
    """An experts module of stacked weights, and how its forward uses them."""
    num_experts: int
    up: str                     # "gate_up_proj", or "up_proj" for experts without a gate
    has_bias: bool
    transposed: bool            # weights stored [expert, in, out] rather than [expert, out, in]
    post_norm: bool

    @property
    def weights(self) -> Tuple[str, ...]:
        names = (self.up, "down_proj")
        return names + tuple(f"{n}_bias" for n in names) if self.has_bias else names

    def tensor_split(self, name: str):
        """The split a tensor-parallel axis gives weight ``name``: the up projection's output features
        (gate and up, ``[gate | up]``, each split alike: blocked in two) and the down projection's
        input features, as Megatron splits an MLP; None for a bias (not split that way)."""
        if name == self.up:
            return split(2 if self.transposed else 1, 2 if self.up == "gate_up_proj" else 1)
        if name == "down_proj":
            return split(1 if self.transposed else 2)
        return None


def stacked_experts(module: torch.nn.Module):
    """The module's :class:`Stacked` description, or None when it is not a stacked experts module."""
    n = getattr(module, "num_experts", None)
    up = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    down, first = getattr(module, "down_proj", None), getattr(module, up, None)
    if not isinstance(n, int) or not all(isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == n
                                         for t in (down, first)):
        return None
    return Stacked(n, up, bool(getattr(module, "has_bias", False)), bool(getattr(module, "is_transposed", False)),
                   bool(getattr(module, "has_post_expert_norm", False)))


def find_experts(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, Stacked]]:
    """Every stacked experts module of ``model``: ``(qualified name, module, description)``."""
    return [(name, m, kind) for name, m in model.named_modules() if (kind := stacked_experts(m)) is not None]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias, transposed: bool) -> torch.Tensor:
    out = x @ weight if transposed else F.linear(x, weight)
    return out if bias is None else out + bias


def run_expert(module: torch.nn.Module, kind: Stacked, pieces: Dict[str, torch.Tensor], e: int,
               rows: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of this rank's pieces of the stacked weights, on its ``rows``: what the module's
    own forward computes for the tokens it routes to that expert, before the routing weight."""
    up_bias = pieces[f"{kind.up}_bias"][e] if kind.has_bias else None
    down_bias = pieces["down_proj_bias"][e] if kind.has_bias else None
    h = _linear(rows, pieces[kind.up][e], up_bias, kind.transposed)
    h = module._apply_gate(h) if kind.up == "gate_up_proj" else module.act_fn(h)
    out = _linear(h, pieces["down_proj"][e], down_bias, kind.transposed)
    return module.post_expert_norm(out) if kind.post_norm else out


def combine(rows: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each (token, slot) row ``[tokens * k, hidden]``, in slot order, weighted by its routing weight
    (``weights [tokens, k]``) and a token's slots summed, as HF's experts modules do; in ``dtype``."""
    tokens, k = weights.shape
    return (rows * weights.reshape(-1, 1)).view(tokens, k, rows.shape[-1]).sum(dim=1).to(dtype)
