"""A small MoE layer in HuggingFace transformers' experts contract, for the expert-parallel tests.

``Experts`` stacks its experts' weights on a leading expert dim (``gate_up_proj`` or ``up_proj``,
``down_proj``, optional biases, optionally stored transposed) and computes, on one device, what
``transformers.integrations.moe``'s experts modules compute: per (token, slot) its expert's MLP,
weighted by the routing weight, the slots summed. ``ListedExperts`` computes the same with one
module per expert in an ``nn.ModuleList``. ``MoE`` puts a top-k router in front of either.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class Experts(nn.Module):
    def __init__(self, num_experts=4, hidden=6, inter=5, *, gate=True, bias=False, transposed=False):
        super().__init__()
        self.num_experts, self.has_gate, self.has_bias, self.is_transposed = num_experts, gate, bias, transposed
        self.has_post_expert_norm = False
        up = "gate_up_proj" if gate else "up_proj"
        width = 2 * inter if gate else inter
        shapes = {up: (width, hidden), "down_proj": (hidden, inter)}
        for name, (out, inp) in shapes.items():
            w = torch.randn(num_experts, out, inp) / inp ** 0.5
            setattr(self, name, nn.Parameter(w.transpose(1, 2).contiguous() if transposed else w))
            if bias:
                setattr(self, f"{name}_bias", nn.Parameter(torch.randn(num_experts, out) * 0.1))
        self.act_fn = nn.SiLU()

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def _linear(self, x, name, e):
        w = getattr(self, name)[e]
        out = x @ w if self.is_transposed else F.linear(x, w)
        return out + getattr(self, f"{name}_bias")[e] if self.has_bias else out

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros(top_k_index.shape + hidden_states.shape[-1:], dtype=hidden_states.dtype)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if self.has_gate:
                h = self._apply_gate(self._linear(hidden_states[token], "gate_up_proj", e))
            else:
                h = self.act_fn(self._linear(hidden_states[token], "up_proj", e))
            y = self._linear(h, "down_proj", e) * top_k_weights[token, slot, None]
            out = out.index_put((token, slot), y)
        return out.sum(dim=1).to(hidden_states.dtype)


class ExpertMLP(nn.Module):
    """One expert: a biased two-layer MLP, its output scaled by a buffer (so that buffers move too)."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, inter), nn.Linear(inter, hidden)
        self.register_buffer("scale", torch.rand(hidden) + 0.5)

    def forward(self, rows):
        return self.down(F.gelu(self.up(rows))) * self.scale


class ListedExperts(nn.Module):
    """Experts in a plain ``nn.ModuleList``, with the experts interface of HF transformers."""

    def __init__(self, num_experts=4, hidden=6, inter=5):
        super().__init__()
        self.experts = nn.ModuleList(ExpertMLP(hidden, inter) for _ in range(num_experts))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros(top_k_index.shape + hidden_states.shape[-1:], dtype=hidden_states.dtype)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(top_k_index == e)
            out = out.index_put((token, slot), expert(hidden_states[token]) * top_k_weights[token, slot, None])
        return out.sum(dim=1).to(hidden_states.dtype)


class MoE(nn.Module):
    """A softmax top-k router and :class:`Experts` (``listed``: :class:`ListedExperts`); tokens
    ``[batch, seq, hidden]`` in and out."""

    def __init__(self, num_experts=4, hidden=6, inter=5, top_k=2, listed=False, **experts_options):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = ListedExperts(num_experts, hidden, inter) if listed else \
            Experts(num_experts, hidden, inter, **experts_options)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(flat, index, weights).reshape(x.shape)
