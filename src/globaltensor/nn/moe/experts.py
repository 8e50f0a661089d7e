"""The MoE experts modules expert parallelism recognises, and one expert's computation on its rows.

An experts module takes HuggingFace transformers' interface, ``forward(hidden_states [tokens,
hidden], top_k_index [tokens, k], top_k_weights [tokens, k])``, and returns each token's experts'
outputs weighted by its routing weights and summed. Shared experts and the router live outside
it, as ordinary layers. Two kinds hold the experts:

- *stacked* (:class:`Stacked`): HF transformers' own (``transformers.integrations.moe``: Mixtral,
  Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, gpt-oss, ...) keep every expert's weights stacked on a leading
  expert dim -- ``gate_up_proj`` (or ``up_proj`` without a gate) and ``down_proj``, optional
  ``*_bias``;
- *listed* (:class:`Listed`): a plain ``nn.ModuleList`` named ``experts``, one module per expert
  (any module taking rows ``[n, hidden]`` to ``[n, hidden]``), as Megatron-Core's SequentialMLP
  and most hand-written MoE layers hold them.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from ...placement import Placement
from ...sbp import split
from ...sbp.shape import balanced_sizes
from ...tensor import GlobalTensor
from ..local_map import dual_layout, pieces_of


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

    def local_weights(self, module, placement: Placement, axis: int, ranks: tuple) -> Dict[int, dict]:
        """Each held rank's pieces of the stacked weights (its experts' slices), by weight name."""
        pieces = {n: pieces_of(getattr(module, n), ranks) for n in self.weights}
        return {r: {n: pieces[n][i] for n in self.weights} for i, r in enumerate(ranks)}

    def run(self, module, mine: dict, e: int, rows: torch.Tensor) -> torch.Tensor:
        """This rank's ``e``-th expert on its ``rows``."""
        return run_expert(module, self, mine, e, rows)

    def unheld(self, module, placement: Placement, axis: int, ranks: tuple) -> list:
        """The experts' tensors this process holds no piece of: none, the weights span the placement."""
        return []


@dataclass(frozen=True)
class Listed:
    """An experts module holding one module per expert in its ``nn.ModuleList`` ``experts``. Each
    expert's parameters and buffers live, whole, on the ranks of the expert axis's member that owns
    it (the placement's slice at that coordinate), broadcast there: ``expert_parallel`` moves them."""
    num_experts: int
    weights = ()                # nothing for the stacked layout check: the experts are placed, not split

    def local_weights(self, module, placement: Placement, axis: int, ranks: tuple) -> Dict[int, list]:
        """Each held rank's experts, in order: ``(expert module, its tensors' pieces by name)``."""
        mine = {r: [] for r in ranks}
        for e, expert in enumerate(module.experts):
            owners = tuple(r for r in ranks if r in owner_placement(placement, axis, self.num_experts, e))
            named = dict(expert.named_parameters())
            named.update(expert.named_buffers())
            pieces = {n: pieces_of(t, owners) for n, t in named.items()}
            for i, r in enumerate(owners):
                mine[r].append((expert, {n: p[i] for n, p in pieces.items()}))
        return mine

    def run(self, module, mine: list, e: int, rows: torch.Tensor) -> torch.Tensor:
        expert, tensors = mine[e]
        return functional_call(expert, tensors, (rows,))

    def unheld(self, module, placement: Placement, axis: int, ranks: tuple) -> list:
        """The parameters of the experts none of ``ranks`` owns (a process outside their owners)."""
        return [t for e, expert in enumerate(module.experts)
                if not any(r in owner_placement(placement, axis, self.num_experts, e) for r in ranks)
                for t in expert.parameters() if t.requires_grad]


class _Bystanders(torch.autograd.Function):
    """``out`` as it is, with tensors it does not depend on here as inputs: the experts this process
    holds no piece of. Their gradient then exists on every process (with no piece where none is
    held), as after any op on them, so that code reading ``.grad`` (an optimizer, gradient clipping,
    ``full_tensor``) makes the same calls on every process."""

    @staticmethod
    def forward(ctx, out, *bystanders):
        ctx.layouts = [t._layout for t in bystanders]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + tuple(GlobalTensor(dual_layout(layout), {}) for layout in ctx.layouts)


def with_bystanders(out: GlobalTensor, bystanders: list) -> GlobalTensor:
    """``out``, its gradient also reaching ``bystanders`` (see :class:`_Bystanders`)."""
    if not bystanders or not torch.is_grad_enabled():
        return out
    return _Bystanders.apply(out, *bystanders)


@functools.lru_cache(maxsize=4096)
def owner_placement(placement: Placement, axis: int, num_experts: int, e: int) -> Placement:
    """The ranks holding expert ``e`` of a listed experts module: the placement's slice at the
    coordinate along ``axis`` whose balanced run of experts contains ``e``."""
    own = balanced_sizes(num_experts, placement.hierarchy[axis])
    j = int(np.searchsorted(np.cumsum(own), e, side="right"))
    ranks = np.take(placement.ranks, j, axis=axis)
    return Placement(placement.type, ranks.tolist() if ranks.ndim else [int(ranks)])


def listed_experts(module: torch.nn.Module):
    """The module's :class:`Listed` description, or None unless it holds a non-empty ``nn.ModuleList``
    ``experts`` and its forward takes the experts interface's three arguments."""
    experts = module._modules.get("experts")
    if not isinstance(experts, torch.nn.ModuleList) or len(experts) == 0 or not _takes_routing(module):
        return None
    return Listed(len(experts))


def _takes_routing(module: torch.nn.Module) -> bool:
    """Whether ``module.forward`` takes (hidden_states, top_k_index, top_k_weights): three positional
    parameters with no default."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 3 and all(p.default is p.empty for p in positional)


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


def find_experts(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, object]]:
    """Every experts module of ``model``, stacked or listed: ``(qualified name, module, description)``."""
    return [(name, m, kind) for name, m in model.named_modules()
            if (kind := stacked_experts(m) or listed_experts(m)) is not None]


def unusable_expert_lists(model: torch.nn.Module) -> List[str]:
    """The names of ``nn.ModuleList`` s called ``experts`` whose owner's forward does not take the
    experts interface (a block that routes and loops over its experts itself)."""
    return [f"{name}.experts" if name else "experts" for name, m in model.named_modules()
            if isinstance(m._modules.get("experts"), torch.nn.ModuleList) and listed_experts(m) is None]


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
