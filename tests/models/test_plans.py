"""``gt.nn`` plans for HF-style modules: bias-less layers under strict ``distribute_module``."""
import pytest

import globaltensor as gt
from globaltensor.sbp import broadcast as B, split as S
from models_helpers import BATCH, HIDDEN, LAYERS, SEQ, make_model, train_hf_side_by_side


def test_megatron_plan_without_biases_is_strict_clean(p1):
    model = make_model("llama", "sdpa")
    column, row = ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"], ["*.o_proj", "*.down_proj"]
    with pytest.raises(ValueError, match="match no parameter"):
        gt.nn.match_plan(model, p1, gt.nn.megatron_plan(column, row))          # .bias entries, no biases
    layouts = gt.nn.match_plan(model, p1, gt.nn.megatron_plan(column, row, bias=False))
    assert layouts["model.layers.0.self_attn.q_proj.weight"] == (S(0),)
    assert layouts["model.layers.1.mlp.down_proj.weight"] == (S(1),)
    assert layouts == gt.nn.match_plan(model, p1, gt.nn.llama_plan(model, 4))


def test_plans_check_their_arguments():
    with pytest.raises(TypeError, match="bias"):
        gt.nn.megatron_plan(["a"], bias="no")
    with pytest.raises(ValueError, match="ranks"):
        gt.nn.llama_plan(make_model("llama", "sdpa"), 0)
    with pytest.raises(ValueError, match="num_attention_heads"):
        gt.nn.llama_plan(object(), 4)


def test_heads_that_do_not_divide_stay_replicated():
    model = make_model("llama", "sdpa")                     # 4 heads
    plan = gt.nn.llama_plan(model, 3)
    assert not any("self_attn" in k for k in plan) and "*.mlp.gate_proj.weight" in plan


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_sequence_parallel_plans_send_megatron_sps_collectives(p2, kind):
    """2x2, data x tensor, with Megatron's sequence parallelism: the step equals one device, and per
    layer and data group the activations move as in Megatron-SP -- an all-gather before each
    column-parallel pair and a reduce-scatter after each row-parallel one, forward, and the reverse
    backward: 4 of each per layer, each of (tp-1)/tp of a [batch/dp, seq, hidden] activation -- and
    no activation is all-reduced. One all-gather more: the broadcast embedding's gradient is taken
    from the whole activation gradient, cheaper than reducing the table."""
    model = make_model(kind, "sdpa")
    plan = getattr(gt.nn, f"{kind}_plan")(model, 2, axis=1, ndim=2, sequence_parallel=True)
    run = train_hf_side_by_side(kind, p2, plan, (S(0), B), "sdpa", shifted=True)
    share = BATCH // 2 * SEQ * HIDDEN * 8 // 2                      # (tp-1)/tp of a data group's activation
    for group in [(0, 1), (2, 3)]:
        ops = [r.op for r in run.records if tuple(r.group) == group and r.bytes == share]
        assert ops.count("reduce_scatter") == 4 * LAYERS and ops.count("all_gather") == 4 * LAYERS + 1, ops
        assert not any(r.op == "all_reduce" and tuple(r.group) == group for r in run.records)


def test_sequence_parallel_entries_box_module_inputs_and_outputs(p2):
    plan = gt.nn.megatron_plan(["*.up"], ["*.down"], axis=1, ndim=2, bias=False, sequence_parallel=True)
    assert plan["*.up:input"] == (None, B) and plan["*.down:output"] == (None, S(1))
    with pytest.raises(ValueError, match=r"plan pattern\(s\) \['\*.nowhere:input'\] match no module"):
        gt.nn.distribute_module(make_model("llama", "sdpa"), p2, {"*.nowhere:input": (None, B)})
    with pytest.raises(TypeError, match=r"plan\['\*.up:input'\]: expected an SBP, or a tuple with one SBP or None"):
        gt.nn.distribute_module(make_model("llama", "sdpa"), p2, {"*.up:input": (None, None)})
    with pytest.raises(TypeError, match="sequence_parallel"):
        gt.nn.megatron_plan(["a"], sequence_parallel="yes")


# Gemma2 is left out: its norms compute in float32 whatever the model's dtype, so no float64 comparison holds
FAMILIES = ["LlamaConfig", "Qwen2Config", "MistralConfig", "Qwen3Config", "OlmoConfig", "Olmo2Config", "GraniteConfig",
            "Phi3Config", "GPTNeoXConfig"]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_own_tp_plan_trains_like_one_device(p1, family):
    """``gt.nn.hf_tp_plan(model)``: the model's own ``tp_plan`` ("colwise", "rowwise",
    "embedding_rowwise", "colwise_gather_output", ...) translated; a step's loss and gradients equal
    one device's, with no fallback (float64; TOL as every model test)."""
    import copy
    import torch
    import transformers
    from models_helpers import TOL, VOCAB, next_token_loss, no_fallback
    cfg = getattr(transformers, family)(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                                        head_dim=HIDDEN // 4, max_position_embeddings=4 * SEQ,
                                        pad_token_id=0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).double()
    reference = copy.deepcopy(model)
    plan = gt.nn.hf_tp_plan(model)
    assert any(v == S(0) for v in plan.values()) and any(v == S(1) for v in plan.values())
    gt.nn.distribute_module(model, p1, plan)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with no_fallback():
        loss = next_token_loss(model(input_ids=gt.distribute(ids, p1, B)).logits, gt.distribute(ids, p1, B))
        loss.backward()
    want = next_token_loss(reference(input_ids=ids).logits, ids)
    want.backward()
    torch.testing.assert_close(loss.full_tensor(), want, **TOL)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad, **TOL, msg=lambda m: f"{name}: {m}")


def test_llama_plan_for_any_model_names_what_it_has(p1):
    """Head counts as arguments where no config says them; biases split with their projections where
    the modules have them; no MLP entries for a model whose layers have none (an MoE's)."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, bias):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, 8, bias=bias) for _ in range(3))
            self.o_proj = nn.Linear(8, 8, bias=False)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attention(bias=True)

    model = nn.Module()
    model.layers = nn.ModuleList([Layer(), Layer()])
    with pytest.raises(ValueError, match="pass heads="):
        gt.nn.llama_plan(model, 4)
    plan = gt.nn.llama_plan(model, 4, heads=4, kv_heads=4)
    assert plan["*.self_attn.q_proj.bias"] == S(0) and plan["*.self_attn.v_proj.bias"] == S(0)
    assert not any("mlp" in k for k in plan)
    gt.nn.distribute_module(model, p1, plan)                      # strict: every entry names something
    assert model.layers[1].self_attn.k_proj.bias.sbp == (S(0),)
    assert "*.self_attn.k_proj.weight" not in gt.nn.llama_plan(nn.Module(), 4, heads=4, kv_heads=2)


MOE_CONFIGS = {
    "Qwen3MoeConfig": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8),
    "OlmoeConfig": dict(intermediate_size=48, num_experts=4, num_experts_per_tok=2),
    "DeepseekV3Config": dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                             n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                             qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8),
}


@pytest.mark.parametrize("family", list(MOE_CONFIGS))
def test_llama_plan_on_moe_models_splits_attention_and_what_is_dense(p1, family):
    """Strict distribute_module takes llama_plan of an MoE model: attention split (DeepSeek's latent
    attention by its per-head up-projections), a dense MLP split where a layer has one, the experts
    left to expert_parallel."""
    import torch
    import transformers
    cfg = getattr(transformers, family)(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0,
                                        bos_token_id=0, eos_token_id=0, **MOE_CONFIGS[family])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    plan = gt.nn.llama_plan(model, 4)
    gt.nn.distribute_module(model, p1, plan)                      # strict: every entry names something
    attention = model.model.layers[0].self_attn
    up = getattr(attention, "q_proj", None) or attention.q_b_proj
    assert up.weight.sbp == (S(0),) and attention.o_proj.weight.sbp == (S(1),)
    dense = [layer.mlp for layer in model.model.layers if getattr(layer.mlp, "gate_proj", None) is not None]
    assert all(mlp.gate_proj.weight.sbp == (S(0),) for mlp in dense) and (family == "DeepseekV3Config") == bool(dense)
