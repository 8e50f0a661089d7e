"""A small Llama written the way torchtitan writes its Llama 3 (plain PyTorch, nothing in it knows
about globaltensor): the same module names (``tok_embeddings``, ``layers.<i>.attention.wq`` ...,
``feed_forward.w1 / w2 / w3``, ``attention_norm``, ``ffn_norm``, ``norm``, ``output``) and the same
call signature (``attention(x, freqs_cis)``), so torchtitan's tensor-parallel styles dict applies to
it as written (docs/howto.md, "Coming from torchtitan"). Rotary embeddings by cos / sin rotation
of the two halves of each head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rotary(dim: int, seq: int, theta: float = 10000.0) -> torch.Tensor:
    """``[2, seq, dim]``: the cos and sin of each position's angle, per pair of features."""
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), theta ** -(torch.arange(0, dim, 2) / dim))
    return torch.stack([angles.cos(), angles.sin()]).repeat(1, 1, 2)


def rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[batch, heads, seq, head_dim]``."""
    cos, sin = freqs_cis.to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(rotate(q, freqs_cis), rotate(k, freqs_cis), v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.attention, self.feed_forward = Attention(dim, n_heads), FeedForward(dim, 2 * dim)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """``dim`` features, ``n_heads`` heads, ``n_layers`` blocks (in a ModuleDict, as torchtitan's),
    sequences up to ``max_seq``."""

    def __init__(self, dim: int = 16, n_heads: int = 4, n_layers: int = 2, vocab: int = 32, max_seq: int = 16):
        super().__init__()
        self.tok_embeddings, self.norm = nn.Embedding(vocab, dim), nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads) for i in range(n_layers)})
        self.register_buffer("freqs_cis", rotary(dim // n_heads, max_seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:, :tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))
