"""The GPT of examples/gpt.py trains on global tensors exactly as on one device (in float64): data
parallel, tensor parallel (Megatron plan), 2x2 hybrid, and ZeRO-style sharded optimizer states."""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt
from training_helpers import CFG, SEQ, TOL, GPT, GPTConfig, S, B, megatron, train_gpt_side_by_side

SGD = (torch.optim.SGD, dict(lr=0.5, momentum=0.9))
# eps=1e-6: the key bias's gradient is zero in exact arithmetic (softmax ignores a constant added to
# every score); with eps=1e-8 Adam would turn its float noise into +-lr steps on both runs alike.
ADAMW = (torch.optim.AdamW, dict(lr=1e-2, eps=1e-6, weight_decay=0.1))
ADAMW_FOREACH = (torch.optim.AdamW, dict(lr=1e-2, eps=1e-6, foreach=True))


@pytest.fixture
def world():
    with gt.simulate(4) as w:
        yield w


def _pieces(t):
    return [tuple(x.shape) for x in t.local_tensors().values()]


def test_data_parallel(world):
    p = gt.placement("cpu", [0, 1, 2, 3])
    run = train_gpt_side_by_side(p, {}, S(0), ADAMW_FOREACH)
    m = run.model
    assert all(q.sbp == (B,) for q in m.parameters())
    assert _pieces(m.blocks[0].attn.qkv.weight) == [(96, 32)] * 4


def test_tensor_parallel(world):
    p = gt.placement("cpu", [0, 1, 2, 3])
    run = train_gpt_side_by_side(p, megatron(), B, SGD)
    m = run.model
    assert m.blocks[0].attn.qkv.weight.sbp == (S(0),) and _pieces(m.blocks[0].attn.qkv.weight) == [(24, 32)] * 4
    assert m.blocks[1].mlp.fc1.bias.sbp == (S(0),) and _pieces(m.blocks[1].mlp.fc1.bias) == [(32,)] * 4
    assert m.blocks[0].attn.proj.weight.sbp == (S(1),) and _pieces(m.blocks[0].attn.proj.weight) == [(32, 8)] * 4
    assert m.blocks[1].mlp.fc2.weight.sbp == (S(1),) and m.blocks[1].mlp.fc2.bias.sbp == (B,)
    assert m.wte.weight.sbp == (B,) and m.blocks[0].ln1.weight.sbp == (B,)


def test_hybrid_2x2(world):
    p = gt.placement("cpu", [[0, 1], [2, 3]])                  # axis 0: data, axis 1: tensor
    run = train_gpt_side_by_side(p, megatron(axis=1, ndim=2), (S(0), B), ADAMW)
    m = run.model
    assert m.blocks[0].attn.qkv.weight.sbp == (B, S(0)) and _pieces(m.blocks[0].attn.qkv.weight) == [(48, 32)] * 4
    assert m.blocks[0].mlp.fc2.weight.sbp == (B, S(1)) and _pieces(m.blocks[0].mlp.fc2.weight) == [(32, 64)] * 4


def test_zero_data_parallel(world):
    """Params B on the data axis, gradients reduce-scattered to shards, AdamW's moments split 4 ways."""
    p = gt.placement("cpu", [0, 1, 2, 3])
    run = train_gpt_side_by_side(p, {}, S(0), ADAMW, zero_axis=0)
    m, opt = run.model, run.optimizer
    for name, q in m.named_parameters():
        assert q.sbp == (B,), name
        shard = opt.shard_of(q)
        assert shard.sbp[0].is_split, name
        for key in ("exp_avg", "exp_avg_sq"):
            state = opt.state[shard][key]
            assert state.sbp == shard.sbp, (name, key)
            assert sum(t.numel() for t in state.local_tensors().values()) == q.numel(), (name, key)
    assert _pieces(opt.state[opt.shard_of(m.blocks[0].mlp.fc1.weight)]["exp_avg"]) == [(32, 32)] * 4


def test_zero_on_the_hybrid_data_axis(world):
    """2x2 Megatron plan, optimizer sharded over the data axis on top of the tensor axis's split."""
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    run = train_gpt_side_by_side(p, megatron(axis=1, ndim=2), (S(0), B), SGD, zero_axis=0)
    m, opt = run.model, run.optimizer
    qkv = opt.shard_of(m.blocks[0].attn.qkv.weight)            # [96, 32]: tensor axis S(0), data axis S(1)
    assert qkv.sbp == (S(1), S(0))
    assert _pieces(opt.state[qkv]["momentum_buffer"]) == [(48, 16)] * 4
    assert opt.shard_of(m.wte.weight).sbp == (S(0), B)          # [64, 32] replicated -> split on the data axis


def test_tensor_parallel_with_the_explicit_masked_softmax(world):
    p = gt.placement("cpu", [0, 1, 2, 3])
    run = train_gpt_side_by_side(p, megatron(), B, SGD, cfg=GPTConfig(attention="matmul"))
    assert run.model.blocks[0].attn.causal.sbp == (B,)


def test_attention_forms_agree_on_one_device():
    """The two attention forms of the example are the same causal function (in float64: see TOL)."""
    torch.manual_seed(0)
    ref = GPT(GPTConfig(attention="sdpa")).double()
    m = GPT(GPTConfig(attention="matmul")).double()
    m.load_state_dict(ref.state_dict())
    idx = torch.randint(0, CFG.vocab_size, (3, SEQ))
    torch.testing.assert_close(m(idx), ref(idx), **TOL)
    torch.testing.assert_close(m(idx[:, :5]), ref(idx[:, :5]), **TOL)
    changed = idx.clone()                   # causal: logits at a position ignore later tokens
    changed[:, 8:] = (changed[:, 8:] + 1) % CFG.vocab_size
    for model in (m, ref):
        torch.testing.assert_close(model(changed)[:, :8], model(idx)[:, :8])
        assert not torch.allclose(model(changed)[:, 8:], model(idx)[:, 8:])
