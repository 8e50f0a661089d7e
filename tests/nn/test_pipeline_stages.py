"""gt.nn.pipeline_stages: a model's layers cut into stages on placements of their own, its forward
untouched -- examples/gpt.py's GPT and transformers' Llama train under every schedule as on one
device (float64), with AdamW and clipping over every stage; what it cannot cut it refuses."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import globaltensor as gt
from fallback_guard import no_fallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig, make_batch  # noqa: E402

S, B = gt.sbp.split, gt.sbp.broadcast
EXACT = dict(rtol=1e-11, atol=1e-13)     # float64, the same sums in another order (micro-batch means)


def _train(model, reference, stages, loss_of, batches, schedule, batch_sbp=S(0), last=None):
    """Train 3 steps beside one device; the targets on ``last`` (the head's placement: the last stage's
    by default)."""
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))

    def step(x, y, model=model, opt=opt):
        loss = loss_of(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    g = gt.compile(step, micro_batches=4, schedule=schedule)
    for i, (x, y) in enumerate(batches):
        with no_fallback():
            loss = g(gt.distribute(x, stages[0], batch_sbp), gt.distribute(y, last or stages[-1], batch_sbp))
        want = step(x, y, reference, ref_opt)
        torch.testing.assert_close(loss.full_tensor(), want, **EXACT, msg=lambda e: f"{schedule} step {i}: {e}")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), **EXACT, msg=lambda e: f"{schedule} {name}: {e}")
    return g


def _cut(schedule: str) -> dict:
    """pipeline_stages' chunk options for a schedule: 2 chunks per stage taking the stages in turn
    (interleaved) or down and back up (zbv)."""
    return {"interleaved_1f1b": dict(chunks_per_stage=2), "zbv": dict(chunks_per_stage=2, v_shape=True)}.get(schedule, {})


def _train_gpt_in_stages(schedule, plan=None, batch_sbp=S(0)):
    """examples/gpt.py's 4-layer GPT cut into stages on [0, 1] and [2, 3] as ``schedule`` runs them,
    trained 3 steps beside one device; (the compiled step, the model, the stages, pipeline_stages' answer)."""
    cfg = GPTConfig(n_layer=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    stages = [gt.placement("cpu", [0, 1]), gt.placement("cpu", [2, 3])]
    held = gt.nn.pipeline_stages(model, stages, plan, **_cut(schedule))
    batches = [make_batch(cfg, 8, 16, torch.Generator().manual_seed(i)) for i in range(3)]
    g = _train(model, reference, stages, lambda m, x, y: m.loss(x, y), batches, schedule, batch_sbp,
               last=model.lm_head.weight.placement)
    return g, model, stages, held


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"])
def test_the_gpt_in_two_data_parallel_stages_trains_as_one_device(schedule, float64):
    with gt.simulate(4):
        g, model, stages, held = _train_gpt_in_stages(schedule)
        want = {"interleaved_1f1b": {0: ["blocks.0", "blocks.2"], 1: ["blocks.1", "blocks.3", "ln_f", "lm_head"]},
                "zbv": {0: ["blocks.0", "blocks.3", "ln_f", "lm_head"], 1: ["blocks.1", "blocks.2"]}}.get(
            schedule, {0: ["blocks.0", "blocks.1"], 1: ["blocks.2", "blocks.3", "ln_f", "lm_head"]})
        assert held == want
        head = stages[0] if schedule == "zbv" else stages[1]        # zbv: the first stage holds the last chunk
        assert model.wte.weight.placement == stages[0] and model.lm_head.weight.placement == head
        assert schedule in repr(g.plan)


FSDP = {"wte.weight": B, "wpe.weight": B, "*.weight": S(0), "*.bias": S(0)}


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "zbv"])
@pytest.mark.parametrize("plan, batch_sbp", [(FSDP, S(0)), (None, S(1, order="head_tail"))], ids=["fsdp", "sequence"])
def test_fsdp_and_sequence_parallel_stages_train_as_one_device(schedule, plan, batch_sbp, float64):
    """Each stage FSDP-style (its parameters split, gathered for use) or sequence-parallel (the
    tokens split on the sequence, balanced, attention as a ring inside each stage)."""
    with gt.simulate(4):
        _train_gpt_in_stages(schedule, plan, batch_sbp)


def _llama_loss(m, x, y):
    logits = m(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _train_llama_in_stages(schedule: str, vocab: int, **cut):
    """transformers' Llama (4 layers, hidden 32, a vocabulary of ``vocab``) cut into stages on [0, 1] and
    [2, 3] by ``pipeline_stages(**cut)``, trained 3 steps under ``schedule`` beside one device; (the model,
    the stages, pipeline_stages' answer)."""
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    reference = copy.deepcopy(model)
    stages = [gt.placement("cpu", [0, 1]), gt.placement("cpu", [2, 3])]
    held = gt.nn.pipeline_stages(model, stages, **cut)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (8, 9), generator=gen) for _ in range(3)]
    _train(model, reference, stages, _llama_loss, [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in ids],
           schedule, last=model.lm_head.weight.placement)
    return model, stages, held


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zbv"])
def test_hf_llama_cut_into_stages_trains_as_one_device(schedule, float64):
    with gt.simulate(4):
        model, stages, held = _train_llama_in_stages(schedule, 64, **_cut(schedule))
        head = 0 if schedule == "zbv" else 1
        assert held[head][-2:] == ["model.norm", "lm_head"], held
        assert model.lm_head.weight.placement == stages[head]
        assert model.model.rotary_emb.inv_freq.placement == stages[0]        # no parameters: stays with the head


@pytest.mark.parametrize("cut, held_by_head", [("params", [3]), ([1, 3], [1, 2, 3])], ids=["params", "sizes"])
def test_hf_llama_with_a_heavy_head_cut_by_its_weights_trains_as_one_device(cut, held_by_head, float64):
    """A vocabulary of 512 makes the head (16,384 weights) weigh 1.8 layers (9,280 each): cut by
    weights, the head's stage takes one layer of the four; cut by sizes given, as told."""
    with gt.simulate(4):
        _, _, held = _train_llama_in_stages("1f1b", 512, cut=cut)
        assert held[1] == [f"model.layers.{i}" for i in held_by_head] + ["model.norm", "lm_head"], held


def test_what_pipeline_stages_refuses():
    with gt.simulate(4):
        stages = [gt.placement("cpu", [0, 1]), gt.placement("cpu", [2, 3])]
        with pytest.raises(ValueError, match="holds 2 layers, fewer than the 4 chunks"):
            gt.nn.pipeline_stages(GPT(GPTConfig(n_layer=2)), stages, chunks_per_stage=2)
        with pytest.raises(ValueError, match="v_shape=True goes down the stages and back up: it takes "
                                             "chunks_per_stage=2, got 1"):
            gt.nn.pipeline_stages(GPT(GPTConfig(n_layer=4)), stages, v_shape=True)
        with pytest.raises(ValueError, match="as many axes each"):
            gt.nn.pipeline_stages(GPT(), [stages[0], gt.placement("cpu", [[2], [3]])])
        with pytest.raises(ValueError, match="activation entries"):
            gt.nn.pipeline_stages(GPT(), stages, {"blocks.0:input": S(0)})
        tied = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, vocab_size=32, tie_word_embeddings=True))
        with pytest.raises(ValueError, match="tied weights"):
            gt.nn.pipeline_stages(tied, stages)
        with pytest.raises(ValueError, match="names no nn.ModuleList or nn.ModuleDict"):
            gt.nn.pipeline_stages(GPT(), stages, layers="wte")
        with pytest.raises(ValueError, match=r"cut=\): expected 2 chunks' layer counts summing to the 4 layers"):
            gt.nn.pipeline_stages(GPT(GPTConfig(n_layer=4)), stages, cut=[1, 2])
