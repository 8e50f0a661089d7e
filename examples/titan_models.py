"""torchtitan's own models (the ``torchtitan`` package, 0.3), built small, for the tests, docs and
benchmarks that train them with globaltensor.

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
    model = llama3_config(**sizes).build()
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
    model = config.build()
    model.parallelize(dims)
    return model
