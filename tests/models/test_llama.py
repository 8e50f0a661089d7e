"""HuggingFace ``LlamaForCausalLM`` (tiny config, its own code) trained on 4 simulated ranks with
tensor, data and 2x2 hybrid parallelism: values, gradient SBPs and parameters equal one device's
in float64 (models_helpers.TOL), no op falls back, and a step's collectives are Megatron's."""
import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import broadcast as B, split as S
from models_helpers import gradient_all_reduce_bytes, make_model, megatron_collectives, no_fallback, train_hf_side_by_side


def _sent(records) -> int:
    """The most bytes any one rank sent over these collectives."""
    ranks = {r for rec in records for r in rec.bytes_per_rank}
    return max(sum(rec.bytes_per_rank.get(r, 0) for rec in records) for r in ranks)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tensor_parallel_step_is_megatrons(p1, attn):
    """Megatron: per layer one all-reduce of the [8, 16, 64] activations after attention and one
    after the MLP, in the forward and again in the backward -- 8 all-reduces, nothing else.
    Eager attention's 4-D ``matmul`` merges the split heads into its batch dim: a blocked split,
    kept through ``bmm`` and the view back, so the heads stay where they are."""
    run = train_hf_side_by_side("llama", p1, gt.nn.llama_plan(make_model("llama", attn), 4), B, attn)
    assert [(r.op, r.bytes) for r in run.records] == megatron_collectives(tp=4)


@pytest.mark.parametrize("kind", ["tp", "dp", "2x2"])
def test_eager_attention_trains_like_one_device(world4, kind):
    p = gt.placement("cpu", [[0, 1], [2, 3]] if kind == "2x2" else [0, 1, 2, 3])
    model = make_model("llama", "eager")
    plan = {"tp": gt.nn.llama_plan(model, 4), "dp": {}, "2x2": gt.nn.llama_plan(model, 2, axis=1, ndim=2)}[kind]
    batch = {"tp": B, "dp": S(0), "2x2": (S(0), B)}[kind]
    train_hf_side_by_side("llama", p, plan, batch, "eager")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hybrid_step_is_megatron_plus_one_gradient_all_reduce_over_the_data_axis(p2, attn):
    """2x2: tensor parallel on axis 1 (Megatron's all-reduces, in each data group), data parallel on
    axis 0 (each parameter's piece all-reduced once over it)."""
    model = make_model("llama", attn)
    run = train_hf_side_by_side("llama", p2, gt.nn.llama_plan(model, 2, axis=1, ndim=2), (S(0), B), attn)
    megatron = megatron_collectives(tp=2, dp=2)
    ideal_bytes = sum(b for _, b in megatron) // 2 + gradient_all_reduce_bytes(run.model, axis=0)
    ideal_count = len(megatron) + 2 * len(list(run.model.parameters()))     # per parameter, one per data group
    assert _sent(run.records) <= 1.1 * ideal_bytes
    assert len(run.records) <= 1.1 * ideal_count


def test_grouped_query_heads_fewer_than_ranks_are_not_cut(p1):
    """2 key/value heads on 4 ranks: k_proj / v_proj stay broadcast, the 4 query heads split."""
    model = make_model("llama", "sdpa", kv_heads=2)
    plan = gt.nn.llama_plan(model, 4)
    assert "*.self_attn.q_proj.weight" in plan and "*.self_attn.k_proj.weight" not in plan
    assert plan == {k: v for k, v in gt.nn.llama_plan(model.config, 4).items()}
    train_hf_side_by_side("llama", p1, plan, B, "sdpa", kv_heads=2)
    train_hf_side_by_side("llama", p1, plan, B, "eager", kv_heads=2)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sequence_split_with_fewer_kv_heads_than_ranks_equals_one_device(p1, attn):
    """Long-context layout: 2 sequences of 32 tokens split over 4 ranks on the sequence, 2 key/value
    heads (so no head split), parameters broadcast, the labels shifted beforehand. Under sdpa the
    attention is ring attention: k and v blocks pass between ranks (send_recv) and no activation is
    gathered -- the collectives are the blocks, the gradients' all-reduce and the loss's scalar.
    Eager attention is matmul, softmax, matmul to the dispatcher: its batched matmuls gather k and v."""
    run = train_hf_side_by_side("llama", p1, {}, S(1), attn, kv_heads=2, shape=(2, 32), shifted=True)
    if attn == "sdpa":
        assert {r.op for r in run.records} == {"send_recv", "all_reduce"}, [(r.op, r.bytes) for r in run.records]
        reduced = sorted(r.bytes for r in run.records if r.op == "all_reduce")
        assert reduced[0] == 16 and len(reduced) == 2                         # the loss's scalar, one bucket


def test_grouped_query_attention_keeps_the_head_split(p1):
    """HF passes ``enable_gqa=True`` to sdpa (no mask): with 2 kv heads on 4 ranks the query heads stay
    split and each rank reads its kv heads from the broadcast k and v, so the step's collectives are
    all-reduces only -- no all-to-all to a batch split, no gathered weight. Megatron repeats the kv
    projections over the ranks: its 8 all-reduces, and the kv weights' gradients reduced. Here the
    k and v gradients' contributions to the layer input's gradient stay partial and join the query
    projection's, reduced once (ops/gradient_sinks.py), RoPE's backward and ``k_proj``'s included;
    the k and v weights' gradients join the bucket: Megatron's bytes, in fewer collectives
    (benchmarks/models.py's llama-gqa row: 9 against 12)."""
    model = make_model("llama", "sdpa", kv_heads=2)
    run = train_hf_side_by_side("llama", p1, gt.nn.llama_plan(model, 4), B, "sdpa", kv_heads=2)
    records = [(r.op, r.bytes) for r in run.records]
    assert {op for op, _ in records} == {"all_reduce"}, records
    kv_weights = [p for n, p in run.model.named_parameters() if n.endswith(("k_proj.weight", "v_proj.weight"))]
    megatron = sum(b for _, b in megatron_collectives(tp=4)) + sum(2 * 3 * p.numel() * 8 // 4 for p in kv_weights)
    assert len(records) <= len(megatron_collectives(tp=4)) + len(kv_weights), records
    assert sum(b for _, b in records) <= megatron, (records, megatron)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_greedy_generate_on_the_tensor_parallel_model_gives_the_same_tokens(p1, kv_heads):
    """HF ``generate`` casts masks with ``.to(device=, dtype=)`` and reads ``bool(x)`` of global
    tensors: under rules now (a cast, a collective read), no fallback. With 2 kv heads the KV cache's
    decoding steps (one query row) keep the query heads split too."""
    model, reference = make_model("llama", "sdpa", kv_heads=kv_heads), make_model("llama", "sdpa", kv_heads=kv_heads)
    gt.nn.distribute_module(model, p1, gt.nn.llama_plan(model, 4))
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    want = reference.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with no_fallback():
        got = model.generate(gt.distribute(ids, p1, B), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got.full_tensor(), want)
