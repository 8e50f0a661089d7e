"""``gt.nn.auto_plan`` on HuggingFace models: Llama and GPT-2 auto-planned train as one device at no more
bytes a step than their hand plans (docs/models.md), and Phi-3 -- fused ``qkv_proj`` and ``gate_up_proj``,
which ``llama_plan`` refuses -- is planned with blocked splits that keep heads whole.

Each runs models_helpers.train_side_by_side (float64, no fallback, gradients in their parameters'
layouts); its last step's collectives are the step's bytes (the gradients' reductions included:
data-parallel buckets reduce them in the backward)."""
from __future__ import annotations

import torch
from transformers import Phi3Config, Phi3ForCausalLM

import globaltensor as gt
import globaltensor.nn as gnn
from models_helpers import BATCH, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, make_model, next_token_loss, \
    train_side_by_side

S, B = gt.sbp.split, gt.sbp.broadcast


def lm_step(model, ids):
    next_token_loss(model(input_ids=ids).logits, ids).backward()


def _bytes(run) -> int:
    per_rank: dict = {}
    for rec in run.records:
        for r, b in rec.bytes_per_rank.items():
            per_rank[r] = per_rank.get(r, 0) + b
    return max(per_rank.values())


def _auto_run(kind, placement, model=None):
    model = model if model is not None else make_model(kind, "sdpa")
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    plan = gnn.auto_plan(model, placement, (ids,), step=lm_step, optimizer=torch.optim.SGD)
    return plan, train_side_by_side(kind, placement, plan, plan.inputs[0])


def test_llama_auto_plan_trains_as_one_device_at_no_more_than_the_hand_plans(p1):
    plan, run = _auto_run("llama", p1)
    tp = train_side_by_side("llama", p1, gnn.llama_plan(make_model("llama", "sdpa"), ranks=4), B)
    dp = train_side_by_side("llama", p1, {}, S(0))
    assert _bytes(run) <= min(_bytes(tp), _bytes(dp))


def test_gpt2_auto_plan_trains_as_one_device_at_no_more_than_the_hand_plans(p1):
    plan, run = _auto_run("gpt2", p1)
    tp = train_side_by_side("gpt2", p1, gnn.gpt2_plan(make_model("gpt2", "sdpa"), ranks=4), B)
    dp = train_side_by_side("gpt2", p1, {}, S(0))
    assert _bytes(run) <= min(_bytes(tp), _bytes(dp))


def phi3(hidden: int = HIDDEN) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Phi3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=4 * SEQ,
                     pad_token_id=0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return Phi3ForCausalLM(cfg).double()


def test_phi3_no_hand_plan_covers_is_auto_planned_with_heads_kept_whole(p1, monkeypatch):
    """Wide enough for tensor parallelism to pay: the fused layers are split block by block (q, k, v and
    gate, up each over the ranks), and the step sends no more than data parallelism."""
    import models_helpers
    model = phi3(hidden=256)
    monkeypatch.setattr(models_helpers, "make_model", lambda kind, attn, kv_heads=HEADS: phi3(hidden=256))
    plan, run = _auto_run("phi3", p1, model)
    qkv, gate_up = plan["model.layers.0.self_attn.qkv_proj.weight"], plan["model.layers.0.mlp.gate_up_proj.weight"]
    assert qkv == (S(0, blocks=3),) and gate_up == (S(0, blocks=2),), plan.explain()
    dp = train_side_by_side("phi3", p1, {}, S(0))
    assert _bytes(run) <= _bytes(dp)
