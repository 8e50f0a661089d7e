"""A small GPT in plain PyTorch: the same module runs on one device and, after
``gt.nn.distribute_module``, on global tensors.

token embedding + learned position embedding -> N blocks of
[layer norm -> causal self-attention (qkv linear, heads, scaled_dot_product_attention
or an explicit masked softmax, out proj) -> residual, layer norm -> MLP (fc1, GELU, fc2) -> residual]
-> final layer norm -> lm head; ``loss(idx, targets)`` is the cross-entropy. With ``n_experts``
the MLP is a mixture of experts: a top-k softmax router and gated SiLU experts, their weights
stacked as HuggingFace transformers' MoE models stack them.

Nothing here knows about globaltensor: on a global tensor ``x.shape`` is the logical
shape, so the code reads the same on one device and on many.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

#: Megatron-style tensor parallelism for this model, as data: the module-name patterns of the
#: column-parallel linears (qkv, fc1: output features split) and of the row-parallel ones that
#: follow them (proj, fc2: input features split). ``gt.nn.megatron_plan(**TENSOR_PARALLEL, ...)``
#: turns it into a plan.
TENSOR_PARALLEL = {"column": ["*.attn.qkv", "*.mlp.fc1"], "row": ["*.attn.proj", "*.mlp.fc2"]}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 16      # the longest sequence (the position table's length)
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    mlp_ratio: int = 4
    attention: str = "sdpa"   # or "matmul": the explicit masked softmax (see CausalSelfAttention)
    n_experts: int = 0        # > 0: the MLP is a mixture of this many experts (MoE)
    top_k: int = 2            # the experts each token is routed to


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention.

    The qkv projection's output features are laid out head-major, ``[heads, 3, head_dim]``,
    so that splitting them over tensor-parallel ranks (column parallel) gives each rank whole
    heads with their q, k and v. ``cfg.attention`` picks how attention is computed:
    ``"sdpa"``: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``; ``"matmul"``: the
    explicit ``softmax(masked(q @ k^T) / sqrt(head_dim)) @ v``. Both give the same values.
    """

    IMPLS = ("sdpa", "matmul")

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be a multiple of n_head ({cfg.n_head})")
        if cfg.attention not in self.IMPLS:
            raise ValueError(f"attention: expected one of {self.IMPLS}, got {cfg.attention!r}")
        self.impl = cfg.attention
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        if self.impl == "matmul":
            causal = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
            self.register_buffer("causal", causal, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(x).view(b, t, self.n_head, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)                 # 3 x [b, heads, t, head_dim]
        if self.impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            att = att.masked_fill(~self.causal[:t, :t], float("-inf")).softmax(dim=-1)
            y = att @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Experts(nn.Module):
    """``num_experts`` gated SiLU MLPs, their weights stacked on a leading expert dim (``gate_up_proj``
    ``[experts, 2 * hidden, n_embd]``, ``down_proj`` ``[experts, n_embd, hidden]``): for each token
    and each of its experts, that expert's MLP, weighted by the routing weight; a token's experts
    summed. The layout and contract of HuggingFace transformers' experts modules."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_experts, hidden = cfg.n_experts, cfg.mlp_ratio * cfg.n_embd // cfg.top_k
        self.gate_up_proj = nn.Parameter(torch.randn(cfg.n_experts, 2 * hidden, cfg.n_embd) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(cfg.n_experts, cfg.n_embd, hidden) * 0.02)
        self.act_fn = nn.SiLU()

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(top_k_index.shape + x.shape[-1:], dtype=x.dtype, device=x.device)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            h = self._apply_gate(F.linear(x[token], self.gate_up_proj[e]))
            y = F.linear(h, self.down_proj[e]) * top_k_weights[token, slot, None]
            out = out.index_put((token, slot), y)
        return out.sum(dim=1)


class MoE(nn.Module):
    """A top-k softmax router over :class:`Experts` (the router's weights renormalised over the k)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, index = torch.topk(torch.softmax(self.router(flat), dim=-1), self.top_k, dim=-1)
        return self.experts(flat, index, weights / weights.sum(dim=-1, keepdim=True)).reshape(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # positions 0..block_size-1 as a (non-trainable) buffer, so that on global tensors
        # they live on the model's placement like every other state
        self.register_buffer("pos", torch.arange(cfg.block_size), persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits [b, t, vocab] for token ids [b, t]."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        x = self.wte(idx) + self.wpe(self.pos[:t])
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batch(cfg: GPTConfig, batch: int, seq: int, generator: torch.Generator):
    """A batch of token ids and next-token targets from a tiny learnable language:
    each sequence counts upward modulo the vocabulary from a random start, with a random stride."""
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    seqs = (start + stride * torch.arange(seq + 1)) % cfg.vocab_size
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
