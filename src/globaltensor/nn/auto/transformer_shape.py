"""A decoder-only transformer's shape, as the planner at scale needs it: read off a model or its config.

The planner at scale (scale_model.py, scale_search.py) costs a layout from the shape alone, so that
a model of hundreds of billions of parameters on thousands of GPUs plans in seconds: no module is
run. :meth:`TransformerShape.of` reads a HuggingFace config (Llama, Mistral, Qwen, Mixtral,
DeepSeek-V3 and their kin) or a model holding one -- a model built on the meta device costs no
memory -- and :attr:`params` is checked against such a model's own count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TransformerShape:
    """``layers`` blocks of attention (``heads`` query heads, ``kv_heads`` key/value heads of
    ``hidden / heads``) and an MLP (``ffn`` wide; ``gated``: SwiGLU's three matrices, else two), a
    ``vocab``-wide embedding and head (``tied``: one matrix), sequences of ``seq`` tokens. MoE:
    ``experts`` routed experts of ``expert_ffn``, ``top_k`` per token, ``shared_experts`` always
    on, in every layer but the first ``dense_layers``."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    gated: bool = True
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TransformerShape({name}=): expected a positive int, got {value!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"TransformerShape: expected hidden divisible by heads and heads by kv_heads, got "
                             f"hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}")
        if self.experts and not (0 < self.top_k <= self.experts and self.expert_ffn > 0):
            raise ValueError(f"TransformerShape: an MoE shape needs 0 < top_k <= experts and expert_ffn > 0, got "
                             f"experts={self.experts}, top_k={self.top_k}, expert_ffn={self.expert_ffn}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    def attention_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return h * (h + 2 * kv) + h * h

    def mlp_params(self, width: int) -> int:
        return (3 if self.gated else 2) * self.hidden * width

    def layer_params(self, moe: bool) -> int:
        """A block's weights (norms' included): attention, and its MLP -- the router, every expert
        and the shared ones in an MoE block."""
        norms = 2 * self.hidden
        if not moe:
            return self.attention_params() + self.mlp_params(self.ffn) + norms
        experts = (self.experts + self.shared_experts) * self.mlp_params(self.expert_ffn)
        return self.attention_params() + experts + self.hidden * self.experts + norms

    @property
    def params(self) -> int:
        """Every weight: the blocks, the embedding, the head (unless tied) and the final norm."""
        dense = self.layers - self.moe_layers
        blocks = dense * self.layer_params(False) + self.moe_layers * self.layer_params(True)
        return blocks + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def forward_flops(self, tokens: int) -> int:
        """A forward's matmul and attention flops for ``tokens`` tokens in sequences of ``seq``: every
        projection, each token's experts (``top_k`` and the shared ones), attention over the whole
        sequence (a causal mask's skipped half counted, as Megatron-LM counts it), and the head."""
        per_token = 2 * (self.attention_params() + self.mlp_params(self.ffn)) * (self.layers - self.moe_layers)
        moe = 2 * (self.attention_params() + self.hidden * self.experts +
                   (self.top_k + self.shared_experts) * self.mlp_params(self.expert_ffn))
        per_token += moe * self.moe_layers
        return tokens * (per_token + 2 * self.hidden * self.vocab) + self.attention_flops(tokens)

    def attention_flops(self, tokens: int) -> int:
        """A forward's attention flops (scores and their weighted sum) for ``tokens`` tokens, whole."""
        return tokens * 4 * self.seq * self.hidden * self.layers

    @classmethod
    def of(cls, model_or_config, seq: int, dtype: torch.dtype = torch.bfloat16) -> "TransformerShape":
        """The shape of a HuggingFace decoder (a model, or its config), for sequences of ``seq``."""
        cfg = getattr(model_or_config, "config", model_or_config)

        def get(*names, default=None):
            for n in names:
                v = getattr(cfg, n, None)
                if v is not None:
                    return v
            if default is None:
                raise ValueError(f"TransformerShape.of: expected a decoder config with {' or '.join(names)}, got "
                                 f"{type(cfg).__name__}")
            return default
        heads = get("num_attention_heads", "n_head")
        experts = get("num_local_experts", "n_routed_experts", "num_experts", default=0)
        return cls(layers=get("num_hidden_layers", "n_layer"), hidden=get("hidden_size", "n_embd"), heads=heads,
                   kv_heads=get("num_key_value_heads", default=heads), ffn=get("intermediate_size", "n_inner"),
                   vocab=get("vocab_size"), seq=seq, gated=get("hidden_act", default="silu") != "gelu",
                   tied=bool(get("tie_word_embeddings", default=False)), experts=experts,
                   top_k=get("num_experts_per_tok", default=0) if experts else 0,
                   expert_ffn=get("moe_intermediate_size", "intermediate_size") if experts else 0,
                   shared_experts=get("n_shared_experts", default=0) if experts else 0,
                   dense_layers=get("first_k_dense_replace", default=0) if experts else 0, dtype=dtype)
