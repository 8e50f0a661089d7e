"""``gt.nn.plan_at_scale`` and its model: a transformer's shape read off a model built on the meta device,
its flops as Megatron-LM counts them and as the meta run tallies them, and the search over every
degree -- the chosen layout valid, fitting, and no slower than a published layout in the search."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

import globaltensor as gt
import globaltensor.nn as gnn
from globaltensor.nn.auto.scale_model import predict_scale

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

LLAMA_8B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256)
LLAMA_70B = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256)
LLAMA_405B = LlamaConfig(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                         num_key_value_heads=8, vocab_size=128256)

#: Llama 3.1 8B's shape as TransformerShape.of reads it, at sequences of 8,192
LLAMA_8B_SHAPE = gnn.TransformerShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                                      seq=8192)
#: the same at sequences of 4,096
LLAMA_8B_4K = replace(LLAMA_8B_SHAPE, seq=4096)


def _meta(model_class, config):
    with torch.device("meta"):
        return model_class(config)


@pytest.mark.parametrize("model_class,config", [
    (LlamaForCausalLM, LLAMA_8B), (LlamaForCausalLM, LLAMA_70B), (LlamaForCausalLM, LLAMA_405B),
    (MixtralForCausalLM, MixtralConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                                       num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                                       num_experts_per_tok=2, vocab_size=1000)),
], ids=["llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "mixtral"])
def test_the_shape_of_a_meta_model_counts_its_parameters(model_class, config):
    model = _meta(model_class, config)
    shape = gnn.TransformerShape.of(model, seq=8192)
    assert shape.params == sum(p.numel() for p in model.parameters())


def test_forward_flops_are_megatrons_formula():
    """For GPT blocks (a 4h-wide MLP of two matrices, as many key/value heads as heads, an untied
    head), three forwards' flops are Megatron-LM's 72 B s L h^2 (1 + s / 6h + V / 12hL)."""
    b, s, layers, h, vocab = 8, 4096, 24, 2048, 131072
    shape = gnn.TransformerShape(layers=layers, hidden=h, heads=16, kv_heads=16, ffn=4 * h, vocab=vocab, seq=s,
                                 gated=False)
    megatron = 72 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (12 * h * layers))
    assert 3 * shape.forward_flops(b * s) == pytest.approx(megatron, rel=1e-12)


def test_the_meta_run_tallies_the_shapes_matmul_flops(world4):
    """HF Llama (its own code) auto-planned on 4 simulated ranks with a next-token loss: the data-parallel
    option's matmul flops, over the ranks, are three forwards' of the shape read off the model (its
    attention kernels counted apart: torch counts their backward at 2.5 forwards)."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))

    def step(m, i):
        logits = m(input_ids=i).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 96), i[:, 1:].reshape(-1)).backward()
    plan = gnn.auto_plan(model, gt.placement("cpu", [0, 1, 2, 3]), (ids,), step=step)
    tally = plan.options[0].cost.tally
    matmul = sum(w.flops for per_rank in tally.kernels.values() for (kind, *_), w in per_rank.items() if kind == "matmul")
    shape = gnn.TransformerShape.of(model, seq=16)
    assert matmul == 3 * (shape.forward_flops(8 * 16) - shape.attention_flops(8 * 16))


def test_plan_at_scale_chooses_a_valid_layout_no_slower_than_a_published_one():
    """Llama 3.1 8B on 64 H100s, 256 sequences of 8,192 a step: the chosen layout uses every GPU, fits
    the H100's memory, and is no slower than torchtitan's published FSDP layout (64-way, full
    activation checkpointing), which the search also costs."""
    shape = gnn.TransformerShape.of(_meta(LlamaForCausalLM, LLAMA_8B), seq=8192)
    plan = gnn.plan_at_scale(shape, gpus=64, global_batch=256, device="H100")
    assert plan.layout.gpus == 64 and plan.prediction.peak_memory <= 0.9 * gnn.DEVICES["H100"].memory
    fsdp = gnn.ScaleLayout(dp=64, micro_batch=1, recompute="full", zero=3)
    assert any(lay == fsdp for lay, _ in plan.options)
    assert plan.prediction.seconds <= plan.predict(fsdp).seconds
    assert plan.layout.text() in plan.explain()
    searched = {(lay.schedule, lay.virtual > 1, lay.cut) for lay, _ in plan.options if lay.pp > 1}
    assert searched == {("1f1b", False, "even"), ("1f1b", True, "even"), ("zero_bubble", False, "even"),
                        ("zbv", False, "even"), ("1f1b", False, "params"), ("zero_bubble", False, "params")}


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("cut", ["even", "params"])
def test_a_stages_layers_are_those_pipeline_stages_gives(pp, cut):
    """ScaleLayout(cut=) takes the layers per stage that ``gt.nn.pipeline_stages(..., cut=)`` gives
    transformers' own Llama 3.1 8B (on the meta device): "even", the extra layers on the first
    stages; "params", a layer's weights against the final norm's and the head's on the last stage.
    Interleaved, a stage holds its chunks' layers; under zbv, its two halves'."""
    from globaltensor.nn.auto.scale_model import stage_layers
    from globaltensor.nn.pipeline_cut import chunk_sizes
    model = _meta(LlamaForCausalLM, LLAMA_8B)
    shape = gnn.TransformerShape.of(model, seq=8192)
    layers, tail = list(model.model.layers), [model.model.norm, model.lm_head]
    assert list(stage_layers(shape, gnn.ScaleLayout(dp=1, pp=pp, cut=cut))) == chunk_sizes(cut, layers, tail, pp)
    if cut == "even":
        chunks = chunk_sizes("even", layers, tail, 2 * pp)
        assert stage_layers(shape, gnn.ScaleLayout(dp=1, pp=pp, virtual=2)) == tuple(
            chunks[s] + chunks[s + pp] for s in range(pp))
        assert stage_layers(shape, gnn.ScaleLayout(dp=1, pp=pp, schedule="zbv")) == tuple(
            chunks[s] + chunks[-1 - s] for s in range(pp))


def test_a_params_cut_shortens_the_step_and_fills_the_first_stage():
    """Llama 3.1 8B over 4 stages, cut 9, 9, 8, 6 by weights: the slowest stage runs 9 layers where the
    even cut's last runs 8 and a head of 2.4 layers' weights, so the step is shorter; the first stage
    holds 9 layers' activations for its 4 micro-batches, the last 6 for its one."""
    device = gnn.DEVICES["H100"]
    even, params = (predict_scale(LLAMA_8B_SHAPE, gnn.ScaleLayout(dp=16, pp=4, cut=c), device, 256)
                    for c in ("even", "params"))
    assert params.seconds < even.seconds
    assert params.memory_parts["activations"] == pytest.approx(even.memory_parts["activations"] * 9 / 8, rel=1e-9)
    assert params.memory[0] > even.memory[0] and params.memory[48] < even.memory[48]
    assert "params cut" in gnn.ScaleLayout(dp=16, pp=4, cut="params").text()


def test_a_deepseek_v3_shape_plans_with_its_experts_split_where_asked():
    """DeepSeek-V3's config (256 routed experts, 8 a token, one shared, 3 dense layers first; its
    latent attention taken as grouped-query attention) on 2,048 H100s: the search costs expert
    parallelism, and splitting the experts over 8 of the data ranks shrinks a rank's memory."""
    from transformers import DeepseekV3Config
    shape = gnn.TransformerShape.of(DeepseekV3Config(), seq=4096)
    assert shape.experts == 256 and shape.top_k == 8 and shape.dense_layers == 3
    plan = gnn.plan_at_scale(shape, gpus=2048, global_batch=1920, device="H100")
    assert plan.layout.gpus == 2048 and any(lay.ep > 1 for lay, _ in plan.options)
    replicated = gnn.ScaleLayout(dp=16, tp=8, pp=16, micro_batch=1)
    split = gnn.ScaleLayout(dp=16, tp=8, pp=16, ep=8, micro_batch=1)
    assert plan.predict(split).peak_memory < plan.predict(replicated).peak_memory


def test_memory_grows_with_the_pipelines_warm_up_and_shrinks_with_recomputation():
    """1F1B's first stage holds pp micro-batches' activations, its last one; full recomputation keeps
    each block's input alone."""
    shape = LLAMA_8B_4K
    device = gnn.DEVICES["H100"]
    kept = predict_scale(shape, gnn.ScaleLayout(dp=2, tp=4, pp=4), device, 64)
    recomputed = predict_scale(shape, gnn.ScaleLayout(dp=2, tp=4, pp=4, recompute="full"), device, 64)
    first, last = kept.memory[0], kept.memory[max(kept.memory)]
    assert first > last and recomputed.memory[0] < first and recomputed.seconds > kept.seconds


@pytest.mark.parametrize("virtual", [1, 2])
def test_torchtitans_runner_adds_dtensors_fourth_logits_and_the_pipelines_buffers(virtual):
    """predict_scale(runner=TORCHTITAN), where torchtitan's cut is the even one: every stage holds
    pipeline_buffer_bytes' more, the head's stage one more float32 logits-sized tensor at the loss's
    peak (DTensor's loss_parallel) and no freed block of the bf16 ones (kept with the pipeline's
    buffers) -- nothing else moves."""
    from globaltensor.nn.auto.runners import TORCHTITAN
    from globaltensor.nn.auto.scale_model import (block_backward_bytes, cached_logits_bytes, held_micro_batches,
                                                  loss_bytes, pipeline_buffer_bytes)
    shape = LLAMA_8B_4K
    lay = gnn.ScaleLayout(dp=2, tp=4, pp=4, virtual=virtual, recompute="full")
    device = gnn.DEVICES["H100"]
    ours, titan = (predict_scale(shape, lay, device, 64, *runner) for runner in ((), (TORCHTITAN,)))
    m, logits = lay.micro_batches(64), cached_logits_bytes(shape, lay)
    backward = block_backward_bytes(shape, lay)
    loss = max(backward, loss_bytes(shape, lay, 4)) - max(backward, loss_bytes(shape, lay) + logits)
    for s in range(lay.pp):
        rank = s * lay.gpus // lay.pp
        buffers = pipeline_buffer_bytes(lay, s, m, held_micro_batches(lay, m, s), shape.seq * shape.hidden * 2 / lay.tp,
                                        logits)
        assert titan.memory[rank] - ours.memory[rank] == pytest.approx(buffers + (loss if s == lay.pp - 1 else 0), abs=2)
    assert "pipeline buffers" in titan.memory_parts and "pipeline buffers" not in ours.memory_parts
    assert titan.seconds == ours.seconds


def test_without_a_pipeline_the_one_stage_holds_both_vocabularies():
    """The one stage holds the embedding and the head, all the model's weights: bf16, float32
    gradients, and the master weights and Adam's moments over the data ranks -- the final norm's
    weights aside, which the model leaves out (hidden x 7.5 bytes)."""
    shape = gnn.TransformerShape(layers=8, hidden=1024, heads=8, kv_heads=8, ffn=4096, vocab=32000, seq=1024)
    state = predict_scale(shape, gnn.ScaleLayout(dp=8), gnn.DEVICES["H100"], 64).memory_parts
    assert state["weights, gradients and optimizer state"] == pytest.approx(shape.params * (2 + 4 + 12 / 8),
                                                                            abs=shape.hidden * 7.5 + 1)


def test_torchtitans_cut_is_its_split_points_of_2024():
    """torchtitan's generate_split_points (2024-12): the first chunk the quotient, the ones after it one
    more while the remainder lasts, the last the rest; a stage holds its chunks' layers."""
    from globaltensor.nn.auto.runners import TORCHTITAN, titan_cut
    from globaltensor.nn.auto.scale_model import stage_layers
    assert titan_cut(126, 8) == [15, 16, 16, 16, 16, 16, 16, 15]
    assert titan_cut(126, 16) == [7] + [8] * 14 + [7]
    assert titan_cut(7, 4) == [1, 2, 2, 2] and titan_cut(32, 4) == [8] * 4 and titan_cut(5, 1) == [5]
    from published_runs import LLAMA_405B as llama_405b
    assert stage_layers(llama_405b, gnn.ScaleLayout(dp=8, tp=8, pp=8), TORCHTITAN) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert stage_layers(llama_405b, gnn.ScaleLayout(dp=8, tp=8, pp=8, virtual=2), TORCHTITAN) == (15,) + (16,) * 6 + (15,)
    assert stage_layers(llama_405b, gnn.ScaleLayout(dp=8, tp=8, pp=8)) == (16,) * 6 + (15, 15)


def _exact_bubble_steps(schedule, p, m):
    """The schedule's bubble in micro-batches of a stage's work, simulated over all ``m`` micro-batches."""
    from globaltensor import schedules
    idle = schedules.bubble(schedule, p, m)
    return idle / (1 - idle) * m


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8, 12, 16])
def test_the_zero_bubble_schedules_bubble_is_their_orders_simulated(p):
    """ZB-H1's bubble is (pp - 1) / 3 micro-batches of a stage's work (1F1B's: pp - 1) at every m >= pp;
    zbv's from (pp - 1) / 6 up; both as the simulation of the whole run gives them,
    where the model simulates the steady state's period alone."""
    from globaltensor.nn.auto.scale_model import bubble_steps
    for m in (p, p + 1, 2 * p, 4 * p, 4 * p + 1, 5 * p + 1, 6 * p + 3, 64, 9 * p + 1):
        zb = bubble_steps(gnn.ScaleLayout(dp=1, pp=p, schedule="zero_bubble"), m)
        zbv = bubble_steps(gnn.ScaleLayout(dp=1, pp=p, schedule="zbv"), m)
        assert zb == pytest.approx((p - 1) / 3, rel=1e-9)
        assert zbv >= (p - 1) / 6 - 1e-9
        assert zbv == pytest.approx(_exact_bubble_steps("zbv", p, m), rel=1e-9), m
    assert bubble_steps(gnn.ScaleLayout(dp=1, pp=p), 8) == p - 1


def test_a_zero_bubble_layout_holds_what_its_schedule_does():
    """ZB-H1 holds 1F1B's micro-batches on its first stage (pp) and pp on its last too (counted whole,
    where 1F1B's holds one); zbv pp on every stage, its first stage the embedding, the head and the
    loss's peak as well (where a block's backward was the larger); both for less bubble than 1F1B's."""
    from globaltensor.nn.auto.scale_model import activations_per_block, block_backward_bytes, cached_logits_bytes, loss_bytes
    shape = LLAMA_8B_4K
    device = gnn.DEVICES["H100"]
    one, zb, zbv = (predict_scale(shape, gnn.ScaleLayout(dp=2, tp=4, pp=4, schedule=s), device, 64)
                    for s in ("1f1b", "zero_bubble", "zbv"))
    assert zbv.by_kind["pipeline bubble"] < zb.by_kind["pipeline bubble"] < one.by_kind["pipeline bubble"]
    assert zbv.seconds < one.seconds and zb.seconds < one.seconds
    lay = gnn.ScaleLayout(dp=2, tp=4, pp=4)
    last = max(one.memory)
    loss, backward = loss_bytes(shape, lay) + cached_logits_bytes(shape, lay), block_backward_bytes(shape, lay)
    assert loss > backward                                  # the loss's peak is the larger, here
    vocabulary = 128256 * 4096 / 4 * (2 + 4 + 12 / 2)      # a rank's head: bf16, float32 gradients, state over dp 2
    blocks = 8 * activations_per_block(shape, lay)          # one micro-batch's activations of a stage's 8 blocks
    assert zb.memory[0] == one.memory[0] and zb.memory[last] == pytest.approx(one.memory[last] + 3 * blocks, rel=1e-9)
    assert zbv.memory[0] == pytest.approx(one.memory[0] + vocabulary + loss - backward, rel=1e-9)
    assert zbv.memory[last] == pytest.approx(one.memory[last] - vocabulary - loss + backward + 3 * blocks, rel=1e-9)
    assert "zbv" in gnn.ScaleLayout(dp=2, pp=4, schedule="zbv").text()


def test_selective_recomputation_sits_between_keeping_and_recomputing_everything():
    """torchtitan's op-level policy keeps every other matmul's output and attention's: less memory
    than keeping all and more than keeping the block's input alone; it recomputes half the
    projections' matmuls where full recomputation recomputes them all."""
    shape = LLAMA_8B_SHAPE
    device = gnn.DEVICES["H100"]
    runs = {r: predict_scale(shape, gnn.ScaleLayout(dp=8, micro_batch=2, recompute=r, zero=3), device, 16)
            for r in ("none", "selective", "full")}
    memory = [runs[r].memory_parts["activations"] for r in ("none", "selective", "full")]
    seconds = [runs[r].by_kind["matmul"] for r in ("none", "selective", "full")]
    assert memory[0] > memory[1] > memory[2] and seconds[0] < seconds[1] < seconds[2]
    assert "selective recompute" in gnn.ScaleLayout(dp=8, recompute="selective").text()


def test_fsdp_within_a_pipeline_gathers_once_a_step():
    """Within a pipeline FSDP keeps a stage's weights gathered and its gradients whole from the first
    micro-batch to the last (torchtitan's reshard_after_forward=False), so its step costs and holds
    what ZeRO-1's does, whatever the micro-batches; without a pipeline it holds one block's gathered
    weights beside its shards and gathers them every micro-batch."""
    shape = LLAMA_8B_SHAPE
    device = gnn.DEVICES["H100"]
    for batch in (8, 64):
        fsdp = predict_scale(shape, gnn.ScaleLayout(dp=2, tp=4, pp=4, zero=3), device, batch)
        zero1 = predict_scale(shape, gnn.ScaleLayout(dp=2, tp=4, pp=4, zero=1), device, batch)
        assert (fsdp.seconds, fsdp.memory) == (zero1.seconds, zero1.memory)
    flat = [predict_scale(shape, gnn.ScaleLayout(dp=32, zero=3), device, batch) for batch in (32, 64)]
    assert all(p.memory_parts["gathered weights"] > 0 for p in flat)
    hidden = [p.by_kind["hidden communication"] for p in flat]
    assert hidden[1] == pytest.approx(2 * hidden[0], rel=1e-9)


def test_torchtitans_published_runs_are_predicted_to_fit_exactly_where_they_trained():
    """benchmarks/published_runs.py's torchtitan runs on its 96 GB H100s: every run that trained is
    predicted to fit, and the run that went out of memory (405B, FSDP alone on 128 GPUs) is not."""
    import published_runs
    for (table, run, *_, published, _), prediction in published_runs.titan_predictions():
        fits = prediction.peak_memory <= published_runs.TITAN_H100.memory
        assert fits == (published is not None), f"table {table}, {run}: {prediction.peak_memory / 2 ** 30:.1f} GiB"


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match=r"TransformerShape\(layers=\): expected a positive int, got 0"):
        gnn.TransformerShape(layers=0, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100, seq=16)
    shape = gnn.TransformerShape(layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100, seq=16)
    with pytest.raises(ValueError, match=r"plan_at_scale\(gpus=\): expected a positive int, got 0"):
        gnn.plan_at_scale(shape, gpus=0, global_batch=8)
    with pytest.raises(ValueError, match="no layout of .* fits 0.0 GiB a GPU"):
        gnn.plan_at_scale(shape, gpus=8, global_batch=8, memory_limit=1)
    plan = gnn.plan_at_scale(shape, gpus=8, global_batch=8)
    with pytest.raises(ValueError, match=r"ScalePlan.predict\(layout=\): this layout cannot run"):
        plan.predict(gnn.ScaleLayout(dp=4))
    with pytest.raises(ValueError, match=r"schedule='zero_bubble' \(expected one of \('1f1b', 'zero_bubble', 'zbv'\);"
                                         r" the zero-bubble ones over 2 or more stages, virtual=1\) with pp=1"):
        plan.predict(gnn.ScaleLayout(dp=8, schedule="zero_bubble"))
    with pytest.raises(ValueError, match=r"schedule='gpipe'"):
        plan.predict(gnn.ScaleLayout(dp=4, pp=2, schedule="gpipe"))
    four = gnn.TransformerShape(layers=4, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100, seq=16)
    assert gnn.ScaleLayout(dp=2, pp=2, virtual=2, schedule="zbv").problem(four, 4, 8, 8).endswith(
        "with pp=2, virtual=2")
    with pytest.raises(ValueError, match=r"zbv cuts 2 layers into 2 x pp=2 halves"):
        plan.predict(gnn.ScaleLayout(dp=4, pp=2, schedule="zbv"))
    for lay in (gnn.ScaleLayout(dp=8, cut="params"), gnn.ScaleLayout(dp=4, pp=2, cut="weights"),
                gnn.ScaleLayout(dp=4, pp=2, schedule="zbv", cut="params")):
        with pytest.raises(ValueError, match=r"cut='(params|weights)' \(expected one of \('even', 'params'\); "
                                             r"'params' over 2 or more stages, virtual=1, not zbv\)"):
            plan.predict(lay)


def test_the_losss_logits_copies_are_what_torchs_cross_entropy_holds():
    """torchtitan's loss: bfloat16 logits cast to float, cross entropy, the logits let go, backward.
    Every storage each op makes is followed (the logits' inputs held apart): at its peak the step
    holds LOSS_LOGITS_COPIES float32 logits-sized tensors, and less than one more of anything else."""
    from globaltensor.nn.auto.runners import LOSS_LOGITS_COPIES
    from storage_peaks import torchtitan_loss_peak

    tokens, hidden, vocab = 512, 16, 1024
    h = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    logits = tokens * vocab * 4
    assert LOSS_LOGITS_COPIES * logits <= torchtitan_loss_peak(h, w, labels) < (LOSS_LOGITS_COPIES + 1) * logits
