"""``gt.nn`` plans for HF-style modules: bias-less layers under strict ``distribute_module``."""
import pytest

import globaltensor as gt
from globaltensor.sbp import split as S
from models_helpers import make_model


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
