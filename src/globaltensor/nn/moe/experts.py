"""The MoE experts modules expert parallelism recognises, and one expert's computation on its rows.

An experts module takes HuggingFace transformers' interface, ``forward(hidden_states [tokens,
hidden], top_k_index [tokens, k], top_k_weights [tokens, k])``, and returns each token's experts'
outputs weighted by its routing weights and summed. Shared experts and the router live outside
it, as ordinary layers. Two kinds of module hold the experts:

- *stacked* (:class:`Stacked`): HF transformers' own (``transformers.integrations.moe``: Mixtral,
  Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, gpt-oss, ...) keep every expert's weights stacked on a leading
  expert dim -- ``gate_up_proj`` (or ``up_proj`` without a gate) and ``down_proj``, optional
  ``*_bias``;
- *listed* (:class:`Listed`): a plain ``nn.ModuleList`` named ``experts``, one module per expert
  (any module taking rows ``[n, hidden]`` to ``[n, hidden]``), as Megatron-Core's SequentialMLP
  and most hand-written MoE layers hold them.

A third kind, torchtitan's routed experts (:class:`Routed`), takes the same routing in another form:
``RoutedExperts.forward(x [batch, seq, hidden], scores [batch, seq, k], expert ids [batch, seq, k],
tokens per expert)``, a token dispatcher beside ``inner_experts``, a ``GroupedExperts`` of stacked
``w1_EFD`` / ``w2_EDF`` / ``w3_EFD`` run by ``torch._grouped_mm`` in bfloat16. Each expert runs through
``GroupedExperts``' own forward (one group), and the routing weights are applied in float32, as its
dispatcher's ``combine`` applies them.
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


def combine(rows: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each (token, slot) row ``[tokens * k, hidden]``, in slot order, weighted by its routing weight
    (``weights [tokens, k]``) and a token's slots summed, as HF's experts modules do; in ``dtype``."""
    return sum_slots(rows * weights.reshape(-1, 1), weights.shape, dtype)


def sum_slots(rows: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A token's ``k`` slot rows summed (``shape``: ``(tokens, k)``), in ``dtype``."""
    tokens, k = shape
    return rows.view(tokens, k, rows.shape[-1]).sum(dim=1).to(dtype)


class _StackedWeights:
    """What the kinds whose experts' weights are stacked on a leading expert dim share."""

    def local_weights(self, module, placement: Placement, axis: int, ranks: tuple) -> Dict[int, dict]:
        """Each held rank's pieces of the stacked weights (its experts' slices), by weight name."""
        pieces = {n: pieces_of(weight_of(module, n), ranks) for n in self.weights}
        return {r: {n: pieces[n][i] for n in self.weights} for i, r in enumerate(ranks)}

    def unheld(self, module, placement: Placement, axis: int, ranks: tuple) -> list:
        """The experts' tensors this process holds no piece of: none, the weights span the placement."""
        return []


@dataclass(frozen=True)
class Stacked(_StackedWeights):
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


    def run(self, module, mine: dict, e: int, rows: torch.Tensor) -> torch.Tensor:
        """This rank's ``e``-th expert on its ``rows``."""
        return run_expert(module, self, mine, e, rows)

    @property
    def tensor_parallel(self) -> bool:
        """Whether an axis may split every expert Megatron's way (:meth:`tensor_split`): without biases."""
        return not self.has_bias

    combine = staticmethod(combine)


@dataclass(frozen=True)
class Routed(_StackedWeights):
    """torchtitan's ``RoutedExperts`` (see the module doc): its ``inner_experts``' stacked weights."""
    num_experts: int
    weights = ("inner_experts.w1_EFD", "inner_experts.w2_EDF", "inner_experts.w3_EFD")
    #: no tensor-parallel experts: the grouped kernels round each product to bfloat16, so partial
    #: sums over split hidden features would not add up to the one-device result
    tensor_parallel = False

    def run(self, module, mine: dict, e: int, rows: torch.Tensor) -> torch.Tensor:
        """This rank's ``e``-th expert on its ``rows``: ``GroupedExperts.forward`` with that expert alone."""
        one = {n.split(".", 1)[1]: mine[n][e:e + 1] for n in self.weights}
        counts = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
        return functional_call(module.inner_experts, one, (rows, counts))

    @staticmethod
    def combine(rows: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """As :func:`combine`, each row weighted in float32 and rounded back to its own dtype first,
        as torchtitan's dispatcher does."""
        return sum_slots((rows.to(torch.float32) * weights.reshape(-1, 1)).to(rows.dtype), weights.shape, dtype)


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

    tensor_parallel = False
    combine = staticmethod(combine)


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


def weight_of(module: torch.nn.Module, name: str) -> torch.Tensor:
    """The tensor an experts description names (``down_proj``, ``inner_experts.w1_EFD``) on ``module``."""
    return functools.reduce(getattr, name.split("."), module)


def routed_experts(module: torch.nn.Module):
    """The module's :class:`Routed` description, or None unless it holds ``inner_experts`` with
    torchtitan's stacked ``w1_EFD`` / ``w2_EDF`` / ``w3_EFD`` (``num_experts`` on dim 0) and a
    ``token_dispatcher``."""
    inner = module._modules.get("inner_experts")
    n = getattr(inner, "num_experts", None)
    if not isinstance(n, int) or not hasattr(module, "token_dispatcher"):
        return None
    stacked = [getattr(inner, w.split(".", 1)[1], None) for w in Routed.weights]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == n for t in stacked):
        return None
    return Routed(n)


def find_experts(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, object]]:
    """Every experts module of ``model``, stacked, routed or listed: ``(qualified name, module,
    description)``."""
    return [(name, m, kind) for name, m in model.named_modules()
            if (kind := stacked_experts(m) or routed_experts(m) or listed_experts(m)) is not None]


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
