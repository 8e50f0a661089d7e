"""HuggingFace ``GPT2LMHeadModel`` (tiny config, its own code: ``Conv1D`` layers, fused ``c_attn``)
trained on 4 simulated ranks with tensor, data and 2x2 hybrid parallelism: values, gradient
SBPs and parameters equal one device's in float64, no fallback, bytes against Megatron's.

GPT-2's ``c_attn`` packs ``[q | k | v]`` side by side; ``gt.nn.gpt2_plan`` splits its weight as
three blocks (``S(1, blocks=3)``), so ``split`` hands out q, k and v split by heads, as
Megatron's interleaved weight does."""
import copy

import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import broadcast as B, split as S
from models_helpers import (BATCH, SEQ, VOCAB, gradient_all_reduce_bytes, make_model, megatron_collectives,
                            next_token_loss, train_hf_side_by_side)
from test_llama import _sent


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tensor_parallel_step_is_megatrons(p1, attn):
    """Attention and the MLP split by heads with no communication; each row-parallel layer's
    output (its bias joining the partial sum) is all-reduced once each way: Megatron's 8."""
    run = train_hf_side_by_side("gpt2", p1, gt.nn.gpt2_plan(make_model("gpt2", attn), 4), B, attn)
    assert [(r.op, r.bytes) for r in run.records] == megatron_collectives(tp=4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hybrid_step(p2, attn):
    model = make_model("gpt2", attn)
    run = train_hf_side_by_side("gpt2", p2, gt.nn.gpt2_plan(model, 2, axis=1, ndim=2), (S(0), B), attn)
    megatron = megatron_collectives(tp=2, dp=2)
    assert _sent(run.records) <= 1.1 * (sum(b for _, b in megatron) // 2 + gradient_all_reduce_bytes(run.model, 0))


def test_conv1d_column_parallel_is_weight_s1_bias_s0(p1):
    """A Conv1D stores its weight [in, out]: a column-parallel c_fc splits the weight's dim 1."""
    model = make_model("gpt2", "eager")
    gt.nn.distribute_module(model, p1, gt.nn.megatron_plan(["*.mlp.c_fc"], ["*.mlp.c_proj"], conv1d=True))
    fc, proj = model.transformer.h[0].mlp.c_fc, model.transformer.h[0].mlp.c_proj
    assert (fc.weight.sbp, fc.bias.sbp, proj.weight.sbp, proj.bias.sbp) == ((S(1),), (S(0),), (S(0),), (B,))


def test_zero_shards_the_blocked_fused_qkv_where_a_plain_split_can_join_it(p2):
    """2x2 with ZeroOptimizer over the data axis: c_attn's weight shards its rows, its bias
    ``S(0, blocks=3)`` cannot be cut over 2 data ranks as well and keeps its state whole; AdamW's
    step equals one device's (float64; Adam's division by sqrt(v) scales rounding: 1e-10)."""
    model = make_model("gpt2", "sdpa")
    ref = copy.deepcopy(model)
    gt.nn.distribute_module(model, p2, gt.nn.gpt2_plan(model, 2, axis=1, ndim=2))
    opt = gt.nn.ZeroOptimizer(model.parameters(), torch.optim.AdamW, axis=0, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    gids = gt.distribute(ids, p2, (S(0), B))
    next_token_loss(model(input_ids=gids).logits, gids).backward()
    next_token_loss(ref(input_ids=ids).logits, ids).backward()
    opt.step()
    ref_opt.step()
    attn = model.transformer.h[0].attn.c_attn
    assert gt.nn.shard_sbp(attn.weight, 0) == (S(0), S(1, blocks=3))
    assert gt.nn.shard_sbp(attn.bias, 0) == attn.bias.sbp
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
