"""torchtitan's own models (the ``torchtitan`` package, 0.3), built small, for the tests, docs and
benchmarks that train them with globaltensor: its Llama 3 and its DeepSeek-V3 (latent attention,
MoE layers of routed and shared experts).

``llama3(...)`` builds torchtitan's ``Llama3Model`` from its own configs (``_build_llama3_layers``
with torchtitan's initialisers), as its ``debugmodel`` does, at the sizes given. One change: the
inner attention is torchtitan's ``ScaledDotProductAttention`` (causal ``F.scaled_dot_product_attention``)
instead of its language models' FlexAttention / varlen backends, which need a per-document
block mask (``attention_masks``) built for a compiled flex kernel; with one document per sequence
the two compute the same causal attention.

``sharded_llama3(...)`` is the same model laid out by torchtitan itself -- its sharding configs
(``set_llama3_sharding_config``) and ``Module.parallelize`` over a DTensor mesh
(``spmd_backend="partial_dtensor"``): the peer our benchmarks measure against.
"""
from __future__ import annotations

import torch

from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import Llama3Model
from torchtitan.models.llama3 import _build_llama3_layers, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init


def llama3_config(dim: int = 64, heads: int = 4, kv_heads: int = 4, layers: int = 2, vocab: int = 128,
                  fuse_qkv: bool = True, max_seq_len: int = 256) -> Llama3Model.Config:
    """torchtitan's Llama 3 config at these sizes (its feed-forward 4x dim), sdpa attention."""
    blocks = _build_llama3_layers(
        fuse_qkv=fuse_qkv, n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv_heads, hidden_dim=4 * dim,
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=max_seq_len, theta=500000, scaling="llama"),
        attn_backend="flex")
    for block in blocks:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=blocks)


def llama3(seed: int = 0, dtype: torch.dtype = torch.float32, **sizes) -> torch.nn.Module:
    """torchtitan's ``Llama3Model`` (:func:`llama3_config`'s sizes), initialised from ``seed``, its
    parameters in ``dtype``. Its RoPE cache stays complex64 (``Module.to(float64)`` would drop its
    imaginary part): torchtitan's rotary embedding computes in float32 whatever the parameters."""
    torch.manual_seed(seed)
    return _in_dtype(llama3_config(**sizes).build(), dtype)


def _in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` initialised as torchtitan's trainer does (``init_states``: its initialisers, its RoPE
    caches; the experts' weights are allocated empty until then), its parameters in ``dtype``."""
    model.init_states()
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def sharded_llama3(tp: int, sequence_parallel: bool = True, seed: int = 0, **sizes) -> torch.nn.Module:
    """torchtitan's tensor parallelism of its Llama 3 over ``tp`` processes (the default process
    group's), as its ``parallelize_llama`` applies it: its sharding configs, then
    ``model.parallelize``, DTensor for the tensor-parallel axis. torchtitan picks CUDA for its mesh
    whenever no accelerator is found; here the mesh is on the CPU (gloo)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    config = llama3_config(**sizes)
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1, world_size=tp,
                                      spmd_backend="partial_dtensor")
    parallel_dims.device_type = "cpu"
    set_spmd_backend("partial_dtensor")      # what torchtitan's Trainer sets from its config
    dims.build_mesh()
    torch.manual_seed(seed)
    model = _in_dtype(config.build(), torch.float32)
    model.parallelize(dims)
    return model


def deepseek_v3_config(dim: int = 64, heads: int = 4, layers: int = 2, vocab: int = 128, experts: int = 4,
                       top_k: int = 2, max_seq_len: int = 256):
    """torchtitan's DeepSeek-V3 config at these sizes: multi-head latent attention, the first layer's
    feed-forward dense and the others' MoE (``experts`` routed experts, ``top_k`` per token, softmax
    scores, one shared expert), as its ``debugmodel`` lays them out; sdpa attention (see above)."""
    import torchtitan.models.deepseek_v3 as dsv3
    blocks = dsv3._build_dsv3_layers(
        n_layers=layers, n_dense_layers=1, dim=dim, n_heads=heads, q_lora_rank=0, kv_lora_rank=dim // 2,
        qk_nope_head_dim=dim // heads, qk_rope_head_dim=dim // heads // 2, v_head_dim=dim // heads, mscale=0.7,
        dense_hidden_dim=4 * dim, moe_hidden_dim=dim, num_experts=experts, num_shared_experts=1, router_top_k=top_k,
        router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=dim // heads // 2, max_seq_len=max_seq_len, theta=10000.0, scaling="yarn",
                                rope_factor=40.0, beta_fast=32.0, beta_slow=1.0, original_seq_len=max_seq_len // 4))
    for block in blocks:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    return dsv3.DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=blocks, mtp_layers=[])


def deepseek_v3(seed: int = 0, dtype: torch.dtype = torch.float32, **sizes) -> torch.nn.Module:
    """torchtitan's ``DeepSeekV3Model`` (:func:`deepseek_v3_config`'s sizes), initialised from ``seed``, its
    parameters in ``dtype`` (its RoPE cache complex, as :func:`llama3` keeps it)."""
    torch.manual_seed(seed)
    return _in_dtype(deepseek_v3_config(**sizes).build(), dtype)
