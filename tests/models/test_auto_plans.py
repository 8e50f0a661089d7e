"""``gt.nn.auto_plan`` on HuggingFace models: Llama and GPT-2 auto-planned train as one device, sending
the bytes their plans modelled, and Phi-3 -- fused ``qkv_proj`` and ``gate_up_proj``, which
``llama_plan`` refuses -- is planned with blocked splits that keep heads whole.

Each runs models_helpers.train_hf_side_by_side (float64, no fallback, gradients in their parameters'
layouts); its last step's collectives are the step's bytes (the gradients' reductions included:
data-parallel buckets reduce them in the backward)."""
from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

import globaltensor as gt
import globaltensor.nn as gnn
from models_helpers import BATCH, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, make_model, next_token_loss, \
    train_hf_side_by_side

S, B = gt.sbp.split, gt.sbp.broadcast


def lm_step(model, ids):
    next_token_loss(model(input_ids=ids).logits, ids).backward()


def _bytes(run) -> int:
    per_rank: dict = {}
    for rec in run.records:
        for r, b in rec.bytes_per_rank.items():
            per_rank[r] = per_rank.get(r, 0) + b
    return max(per_rank.values())


def _auto_run(kind, placement, model=None, **kw):
    model = model if model is not None else make_model(kind, "sdpa")
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    plan = gnn.auto_plan(model, placement, (ids,), step=lm_step, optimizer=torch.optim.SGD, **kw)
    return plan, train_hf_side_by_side(kind, placement, plan, plan.inputs[0])


def _option(plan, roles):
    return next(o for o in plan.options if o.candidate.roles == roles and not o.candidate.zero
                and not o.candidate.vocab and not o.candidate.blocked)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_an_auto_plan_trains_as_one_device_sending_what_it_modelled(p1, kind):
    """Tiny configs: the collectives' latency outweighs their bytes and data parallelism's two or
    three reductions win over Megatron's eight or more all-reduces of fewer bytes; the chosen plan
    trains like one device and its step sends exactly the bytes its meta run counted."""
    plan, run = _auto_run(kind, p1)
    assert plan.chosen.candidate.roles == ("data",) and plan.chosen.cost.collectives < \
        _option(plan, ("tensor",)).cost.collectives, plan.explain()
    assert _bytes(run) == plan.cost.bytes, plan.explain()


def phi3(hidden: int = HIDDEN) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Phi3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=4 * SEQ,
                     pad_token_id=0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return Phi3ForCausalLM(cfg).double()


def test_phi3_no_hand_plan_covers_is_auto_planned_with_heads_kept_whole(p1, monkeypatch):
    """Replicated, Phi-3 at hidden 256 takes 60 MB a rank; under a 20 MB limit tensor parallelism must
    split it, and its fused layers are split block by block (q, k, v and gate, up each over the
    ranks): fewer bytes and collectives than splitting them plainly, which cuts heads apart, or FSDP;
    the step sends no more than data parallelism."""
    import models_helpers
    model = phi3(hidden=256)
    monkeypatch.setattr(models_helpers, "make_model", lambda kind, attn, kv_heads=HEADS: phi3(hidden=256))
    plan, run = _auto_run("phi3", p1, model, memory_limit=20_000_000)
    qkv, gate_up = plan["model.layers.0.self_attn.qkv_proj.weight"], plan["model.layers.0.mlp.gate_up_proj.weight"]
    assert qkv == (S(0, blocks=3),) and gate_up == (S(0, blocks=2),), plan.explain()
    dp = train_hf_side_by_side("phi3", p1, {}, S(0))
    assert _bytes(run) <= _bytes(dp)


def test_models_whose_mask_code_reads_values_are_planned(p1):
    """BERT's padding mask, Gemma2 without a cache, Whisper's decoder: their mask code reads values on
    the host, answered by one real step (nn/auto/cost.py); BERT's plan then runs like one device."""
    import copy
    import transformers
    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, max_position_embeddings=4 * SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)).double()
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ids[0, -3:] = 0
    mask = (ids != 0).long()

    def masked_step(model, ids, mask):
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    plan = gnn.auto_plan(bert, p1, (ids, mask), step=masked_step)
    reference = copy.deepcopy(bert)
    gnn.distribute_module(bert, p1, plan)
    got = bert(input_ids=gt.distribute(ids, p1, plan.inputs[0]), attention_mask=gt.distribute(mask, p1, plan.inputs[1]))
    torch.testing.assert_close(got.logits.full_tensor(), reference(input_ids=ids, attention_mask=mask).logits,
                               rtol=1e-10, atol=1e-10)
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HIDDEN // HEADS, max_position_embeddings=4 * SEQ,
        pad_token_id=0, bos_token_id=0, eos_token_id=0))
    assert gnn.auto_plan(gemma, p1, (ids,), step=lambda m, i: m(input_ids=i, use_cache=False).logits.sum().backward())
    whisper = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=2 * HIDDEN, decoder_ffn_dim=2 * HIDDEN, num_mel_bins=8,
        max_source_positions=SEQ, max_target_positions=SEQ, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        decoder_start_token_id=0))
    features = torch.randn(2, 8, 2 * SEQ)
    assert gnn.auto_plan(whisper, p1, (features, ids[:2, :6]),
                         step=lambda m, f, i: m(input_features=f, decoder_input_ids=i).logits.sum().backward())
