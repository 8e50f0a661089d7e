"""Sharding plans as data: ``{parameter-name pattern: sbp}``.

A plan maps fnmatch-style patterns over a module's parameter (and buffer) names --
``"*.attn.qkv.weight"``, ``"blocks.*.mlp.fc?.bias"`` -- to an SBP (1-D placements) or an
nd-SBP tuple, one value per placement axis. Names no pattern matches are broadcast on
every axis. The first matching pattern, in the plan's order, decides.

The Megatron-style tensor-parallel layouts of an ``nn.Linear`` (weight ``[out, in]``):

- column parallel: the output features are split -- weight ``S(0)``, bias ``S(0)``; the
  layer's output comes out split on its last dim, no communication;
- row parallel: the input features are split -- weight ``S(1)``, bias ``B``; fed a
  last-dim-split input, the layer's output is a partial sum, reduced where it is needed.

A column-parallel layer followed by a row-parallel one (attention's qkv -> proj, the MLP's
fc1 -> fc2) needs one reduction per pair in the forward pass.

Layers without a bias (Llama's, ``nn.Linear(..., bias=False)``) take ``bias=False``: a plan
entry for a bias that does not exist would make strict ``distribute_module`` raise.

GPT-2's ``Conv1D`` (HuggingFace ``transformers.pytorch_utils.Conv1D``) stores its weight
transposed, ``[in, out]`` (``y = x @ W + b``), so its splits swap: column parallel is weight
``S(1)`` + bias ``S(0)`` (:data:`CONV1D_COLUMN_PARALLEL`), row parallel weight ``S(0)`` + bias
``B`` (:data:`CONV1D_ROW_PARALLEL`).

Model-family plans read the sizes they need from a HuggingFace-style config (or a model with
``.config``): :func:`llama_plan` (Llama, Mistral, Qwen2 and their kin: ``q/k/v/o_proj``,
``gate/up/down_proj``) and :func:`gpt2_plan`.

``sequence_parallel=True`` adds Megatron's sequence parallelism (activation entries,
activation_layouts.py): between the tensor-parallel regions the activations -- norms, residual
adds, dropout -- stay split on the sequence over the tensor axis; each column-parallel layer's
input is all-gathered (``":input"``: broadcast on the axis; the layers reading one input share
one gather) and each row-parallel layer's partial output reduce-scattered onto the sequence
(``":output"``: ``S(1)``), in place of the pair's all-reduce: the same bytes, activations a
tensor-parallel rank holds cut by the axis's size. Inputs ``[batch, seq, ...]``.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Iterable, Mapping, Optional

from torch import nn

from ..sbp import broadcast, split

#: Per-parameter SBPs, on the tensor-parallel axis, of a column-parallel ``nn.Linear``.
COLUMN_PARALLEL: Mapping[str, object] = {"weight": split(0), "bias": split(0)}
#: Per-parameter SBPs, on the tensor-parallel axis, of a row-parallel ``nn.Linear``.
ROW_PARALLEL: Mapping[str, object] = {"weight": split(1), "bias": broadcast}
#: A replicated layer: every parameter broadcast.
REPLICATED: Mapping[str, object] = {"weight": broadcast, "bias": broadcast}
#: Column parallel for a ``Conv1D`` (weight ``[in, out]``): output features split.
CONV1D_COLUMN_PARALLEL: Mapping[str, object] = {"weight": split(1), "bias": split(0)}
#: Row parallel for a ``Conv1D`` (weight ``[in, out]``): input features split.
CONV1D_ROW_PARALLEL: Mapping[str, object] = {"weight": split(0), "bias": broadcast}
#: Column parallel for a ``Conv1D`` whose outputs are three blocks side by side (GPT-2's fused
#: ``[q | k | v]`` ``c_attn``): each rank holds its part of every block.
CONV1D_FUSED_QKV_COLUMN_PARALLEL: Mapping[str, object] = {"weight": split(1, blocks=3), "bias": split(0, blocks=3)}


def _check_axis(axis: int, ndim: int) -> None:
    if not isinstance(ndim, int) or ndim < 1:
        raise ValueError(f"ndim: expected the placement's number of axes (>= 1), got {ndim!r}")
    if not isinstance(axis, int) or not 0 <= axis < ndim:
        raise ValueError(f"axis: expected a placement axis in 0..{ndim - 1}, got {axis!r}")


def on_axis(sbp, axis: int = 0, ndim: int = 1):
    """``sbp`` on placement axis ``axis`` and broadcast on the others: an nd-SBP tuple
    (a bare SBP when ``ndim`` is 1)."""
    _check_axis(axis, ndim)
    if ndim == 1:
        return sbp
    return tuple(sbp if a == axis else broadcast for a in range(ndim))


def layer_plan(pattern: str, layout: Mapping[str, object], axis: int = 0, ndim: int = 1) -> dict:
    """The plan entries of one layer kind: ``layout`` maps a parameter's own name (``"weight"``)
    to its SBP on ``axis``; ``pattern`` names the module (``"*.attn.qkv"``)."""
    if not isinstance(pattern, str):
        raise TypeError(f"layer_plan: expected a module-name pattern (str), got {pattern!r}")
    return {f"{pattern}.{name}": on_axis(sbp, axis, ndim) for name, sbp in layout.items()}


def _weight_only(layout: Mapping[str, object], bias: bool) -> Mapping[str, object]:
    return layout if bias else {k: v for k, v in layout.items() if k != "bias"}


def column_parallel(pattern: str, axis: int = 0, ndim: int = 1, *, bias: bool = True) -> dict:
    """Plan entries making the ``nn.Linear`` modules matching ``pattern`` column parallel on ``axis``."""
    return layer_plan(pattern, _weight_only(COLUMN_PARALLEL, bias), axis, ndim)


def row_parallel(pattern: str, axis: int = 0, ndim: int = 1, *, bias: bool = True) -> dict:
    """Plan entries making the ``nn.Linear`` modules matching ``pattern`` row parallel on ``axis``."""
    return layer_plan(pattern, _weight_only(ROW_PARALLEL, bias), axis, ndim)


def sequence_parallel_entries(column: Iterable[str], row: Iterable[str], axis: int = 0, ndim: int = 1) -> dict:
    """Megatron's sequence parallelism on ``axis`` for these column- and row-parallel module patterns:
    each column layer's input gathered there, each row layer's output reduce-scattered onto the
    sequence (dim 1); the other axes keep what they have. Put the module whose output starts the
    residual stream (the embeddings' sum) among ``row``: its output, broadcast, is sliced onto
    the sequence for free, so that the first norm runs split too."""
    _check_axis(axis, ndim)

    def on(sbp):
        return tuple(sbp if a == axis else None for a in range(ndim))
    return {**{f"{p}:input": on(broadcast) for p in column}, **{f"{p}:output": on(split(1)) for p in row}}


def megatron_plan(column: Iterable[str] = (), row: Iterable[str] = (), *, axis: int = 0, ndim: int = 1,
                  extra: Optional[Mapping[str, object]] = None, bias: bool = True, conv1d: bool = False,
                  sequence_parallel: bool = False) -> dict:
    """A tensor-parallel plan: the ``column`` module patterns column parallel, the ``row`` ones row
    parallel, on placement axis ``axis`` of an ``ndim``-axis placement (broadcast on the others, e.g.
    the data axis); ``extra`` entries come first and so take precedence. ``bias=False`` for layers
    without biases; ``conv1d=True`` for GPT-2-style ``Conv1D`` layers (weight ``[in, out]``);
    ``sequence_parallel=True`` for Megatron's sequence parallelism (the module docstring)."""
    if not all(isinstance(b, bool) for b in (bias, conv1d, sequence_parallel)):
        raise TypeError(f"megatron_plan: bias, conv1d and sequence_parallel must be bools, got bias={bias!r}, "
                        f"conv1d={conv1d!r}, sequence_parallel={sequence_parallel!r}")
    for name, patterns in (("column", column), ("row", row)):
        if isinstance(patterns, str) or not isinstance(patterns, Iterable):
            raise TypeError(f"megatron_plan({name}=): expected a list of module-name patterns, got {patterns!r}")
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"megatron_plan(extra=): expected a plan (a dict of pattern: sbp) or None, got {extra!r}")
    column, row = list(column), list(row)
    col_layout, row_layout = (CONV1D_COLUMN_PARALLEL, CONV1D_ROW_PARALLEL) if conv1d else (COLUMN_PARALLEL,
                                                                                          ROW_PARALLEL)
    plan: dict = dict(extra or {})
    entries = ([layer_plan(p, _weight_only(col_layout, bias), axis, ndim) for p in column] +
               [layer_plan(p, _weight_only(row_layout, bias), axis, ndim) for p in row])
    if sequence_parallel:
        entries.append(sequence_parallel_entries(column, row, axis, ndim))
    for group in entries:
        for key, sbp in group.items():
            plan.setdefault(key, sbp)
    return plan


def _config(model_or_config):
    return getattr(model_or_config, "config", model_or_config)


def _size(config, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"config: expected an int attribute {' or '.join(names)} (a HuggingFace-style config), "
                     f"got {type(config).__name__} without one")


def _check_ranks(ranks: int) -> None:
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks: expected the number of ranks on the tensor-parallel axis (an int >= 1), "
                         f"got {ranks!r}")


#: a Llama's module names: HuggingFace's, torchtitan's (``qkv`` its fused projection, rows grouped by
#: kv head: ``[kv_heads, heads / kv_heads + 2, head_dim]``) and those of torchtitan before 0.3
_HF_NAMES = dict(attn="self_attn", q="q_proj", k="k_proj", v="v_proj", o="o_proj", mlp="mlp", gate="gate_proj",
                 up="up_proj", down="down_proj", embed="*embed_tokens")
_TITAN_NAMES = dict(attn="attention", q="qkv_linear.wq", k="qkv_linear.wk", v="qkv_linear.wv", qkv="qkv_linear.wqkv",
                    o="wo", mlp="feed_forward", gate="w1", up="w3", down="w2", embed="*tok_embeddings")
_OLD_TITAN_NAMES = dict(_TITAN_NAMES, q="wq", k="wk", v="wv")


def _names(modules: Optional[dict]) -> dict:
    if modules is None:
        return _HF_NAMES
    for names in (_TITAN_NAMES, _OLD_TITAN_NAMES):
        if any(n.endswith(f".attention.{names['q']}") or n.endswith(f".attention.{names['qkv']}") for n in modules):
            return names
    return _HF_NAMES


def _module_heads(modules: Optional[dict]) -> Optional[tuple]:
    """``(n_heads, n_kv_heads)`` of the first attention module holding them as ints (torchtitan's, whose
    model config has no head counts of its own), or None."""
    for m in (modules or {}).values():
        heads = getattr(m, "n_heads", None)
        if isinstance(heads, int) and not isinstance(heads, bool):
            kv = getattr(m, "n_kv_heads", None)
            return heads, kv if isinstance(kv, int) and not isinstance(kv, bool) else heads
    return None


def llama_plan(model_or_config, ranks: int, *, axis: int = 0, ndim: int = 1, sequence_parallel: bool = False,
               heads: Optional[int] = None, kv_heads: Optional[int] = None) -> dict:
    """Megatron's plan for a Llama-family model (HF's ``LlamaForCausalLM``, Mistral, Qwen2, ... and
    torchtitan's ``Llama3Model``: ``attention.qkv_linear.wqkv`` or ``.wq/wk/wv``, ``attention.wo``,
    ``feed_forward.w1/w3/w2``; torchtitan before 0.3: ``attention.wq/wk/wv``) over ``ranks`` ranks on
    placement axis ``axis``: ``q/k/v`` and ``gate/up`` column parallel, ``o`` and ``down`` row
    parallel; norms, embedding and head broadcast. torchtitan's fused ``wqkv`` holds its rows kv
    group by kv group, so it is split only when the kv heads divide over ``ranks``.

    Given a model, the plan names only the projections it has -- an MoE model's layers without a
    dense MLP get the attention plan (``gt.nn.expert_parallel`` splits the experts); multi-head latent
    attention (DeepSeek's) splits its per-head ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` -- and splits
    every bias of a split projection with it (StableLM's q/k/v biases); given a config, biases follow
    ``attention_bias`` / ``use_qkv_bias`` / ``qkv_bias`` and ``mlp_bias``. ``heads`` / ``kv_heads``
    give the head counts where no HF-style config says them (``num_attention_heads`` /
    ``num_key_value_heads``, or torchtitan's ``n_heads`` / ``n_kv_heads``); else a model's first
    attention module with ``n_heads`` (and ``n_kv_heads``) gives them, as torchtitan's do.

    Heads are never cut: the query heads are split only when they divide evenly over ``ranks``
    (else attention stays replicated), and grouped-query key/value heads only when they do too --
    with fewer kv heads than ranks, ``k`` / ``v`` stay broadcast (each rank computes every kv head,
    the small part of attention), and each rank takes the kv heads its query heads read, with no
    communication. ``sequence_parallel=True``: Megatron's sequence parallelism (the module
    docstring); attention left replicated gathers its input and slices its output the same way."""
    _check_ranks(ranks)
    config = _config(model_or_config)
    module = model_or_config if isinstance(model_or_config, nn.Module) else None
    modules = dict(module.named_modules()) if module is not None else None
    names = _names(modules)
    found = _module_heads(modules) if heads is None and not _has_int(config, ("num_attention_heads", "n_heads")) \
        else None
    if found:
        heads, kv_heads = found[0], kv_heads or found[1]
    heads = heads if heads is not None else _heads(config, ("num_attention_heads", "n_heads"), "heads")
    kv_heads = kv_heads or getattr(config, "num_key_value_heads", None) or getattr(config, "n_kv_heads", None) or heads
    attn, mlp = names["attn"], names["mlp"]

    def named(*parts: str) -> str:
        return "*." + ".".join(parts)

    def present(pattern: str) -> bool:
        return modules is None or any(fnmatchcase(n, pattern) for n in modules)

    def biased(pattern: str, configured: bool) -> bool:
        if modules is None:
            return configured
        return any(fnmatchcase(n, pattern) and getattr(m, "bias", None) is not None for n, m in modules.items())

    attn_bias = any(bool(getattr(config, k, False)) for k in ("attention_bias", "use_qkv_bias", "qkv_bias"))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    split_attention = heads % ranks == 0
    column = [named(attn, names["q"])] + ([named(attn, names["k"]), named(attn, names["v"])]
                                           if kv_heads % ranks == 0 else []) if split_attention else []
    fused = "qkv" in names and modules is not None and present(named(attn, names["qkv"]))
    if fused:
        # the fused rows go kv group by kv group: a rank's rows are whole groups only when kv heads divide
        column = [named(attn, names["qkv"])] if split_attention and kv_heads % ranks == 0 else []
    if split_attention and not present(named(attn, names["k"])) and present(named(attn, "kv_b_proj")):
        # multi-head latent attention (DeepSeek): the per-head up-projections split, the latent ones whole
        column = [p for p in (named(attn, "q_proj"), named(attn, "q_b_proj"), named(attn, "kv_b_proj")) if present(p)]
    column = [p for p in column if present(p)]
    heads_split = bool(column)
    row = [named(attn, names["o"])] if heads_split else []
    dense = present(named(mlp, names["gate"]))
    if dense:
        column += [named(mlp, names["gate"]), named(mlp, names["up"])]
        row.append(named(mlp, names["down"]))
    plan: dict = {}
    for pattern in column:
        plan.update(column_parallel(pattern, axis, ndim, bias=biased(pattern, mlp_bias if mlp in pattern else attn_bias)))
    for pattern in row:
        plan.update(row_parallel(pattern, axis, ndim, bias=biased(pattern, False)))
    if sequence_parallel:
        inputs = [named(attn, names["qkv"])] if fused else [named(attn, names[k]) for k in "qkv"]
        attention = (inputs, [named(attn, names["o"])]) if heads_split else ([named(attn)], [named(attn)])
        mlps = ([named(mlp, names["gate"]), named(mlp, names["up"])], [named(mlp, names["down"])]) if dense \
            else ([], [])
        plan.update(sequence_parallel_entries(attention[0] + mlps[0], [names["embed"]] + attention[1] + mlps[1],
                                              axis, ndim))
    return plan


def _has_int(config, attrs: tuple) -> bool:
    return any(isinstance(getattr(config, name, None), int) for name in attrs)


def _heads(config, attrs: tuple, argument: str) -> int:
    """The head count a config gives under one of ``attrs``; ValueError naming ``argument`` to pass."""
    for name in attrs:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"llama_plan: expected a config (or a model with .config) with an int attribute "
                     f"{' or '.join(attrs)}, got {type(config).__name__} without one; pass {argument}= (and "
                     f"kv_heads=) for a model without such a config")


def gpt2_plan(model_or_config, ranks: int, *, axis: int = 0, ndim: int = 1, sequence_parallel: bool = False) -> dict:
    """Megatron's plan for HuggingFace ``GPT2LMHeadModel`` (``Conv1D`` layers, weight ``[in, out]``) over
    ``ranks`` ranks on placement axis ``axis``: the MLP's ``c_fc`` column parallel (weight ``S(1)``,
    bias ``S(0)``) and ``c_proj`` row parallel (weight ``S(0)``, bias ``B``); attention's fused
    ``c_attn`` column parallel per head and its ``c_proj`` row parallel, when the heads divide
    over ``ranks``.

    ``c_attn``'s output is ``[q | k | v]`` side by side: its weight is split as three blocks
    (:data:`CONV1D_FUSED_QKV_COLUMN_PARALLEL`: weight ``S(1, blocks=3)``, bias ``S(0, blocks=3)``),
    so each rank holds the columns of its heads of q, of k and of v, as Megatron's interleaved
    fused weight does, and ``split`` hands each of q, k, v out split by heads with no
    communication. Embeddings, norms and the (tied) head are broadcast. ``sequence_parallel=True``:
    Megatron's sequence parallelism (the module docstring)."""
    _check_ranks(ranks)
    config = _config(model_or_config)
    heads = _size(config, "n_head", "num_attention_heads")
    plan: dict = {}
    if heads % ranks == 0:
        plan.update(layer_plan("*.attn.c_attn", CONV1D_FUSED_QKV_COLUMN_PARALLEL, axis, ndim))
        plan.update(layer_plan("*.attn.c_proj", CONV1D_ROW_PARALLEL, axis, ndim))
    plan.update(layer_plan("*.mlp.c_fc", CONV1D_COLUMN_PARALLEL, axis, ndim))
    plan.update(layer_plan("*.mlp.c_proj", CONV1D_ROW_PARALLEL, axis, ndim))
    if sequence_parallel:
        attention = (["*.attn.c_attn"], ["*.attn.c_proj"]) if heads % ranks == 0 else (["*.attn"], ["*.attn"])
        plan.update(sequence_parallel_entries(attention[0] + ["*.mlp.c_fc"],
                                              ["*transformer.drop"] + attention[1] + ["*.mlp.c_proj"], axis, ndim))
    return plan
