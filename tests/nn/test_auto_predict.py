"""``gt.nn.auto_plan``'s compute model and ``plan.predict()``.

The flops a meta run tallies are checked against torch's own FlopCounterMode on the same step run on
one device (an independent count: torch's formulas applied to the real ops), per rank as the layout
divides them; the ViT case -- a "sequence split" that split the 3 colour channels and left every
rank the whole model -- must lose to a layout that divides the work; a prediction's parts must add
up as the docs say, on this machine and on a GPU of the device table."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import globaltensor as gt
import globaltensor.nn as gnn
from globaltensor.nn.auto.devices import DEVICES, H100
from globaltensor.nn.auto.plan import AutoPlan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig, make_batch  # noqa: E402


def gpt_step(model, idx, targets):
    model.loss(idx, targets).backward()


def _gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{"vocab_size": 64, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32, **kw}))


def _args(model, batch=8, seq=16):
    return make_batch(model.cfg, batch, seq, torch.Generator().manual_seed(1))


def _one_device_flops(model, step, args) -> int:
    """torch's count of the step's matmul and attention flops on one device (its FlopCounterMode)."""
    with FlopCounterMode(display=False) as counter:
        step(model, *args)
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def _option(plan, roles, zero=False):
    return next(o for o in plan.options if o.candidate.roles == roles and o.candidate.zero == zero
                and not o.candidate.vocab and not o.candidate.blocked and not o.candidate.balanced)


def _rank_flops(option, rank) -> int:
    return sum(w.flops for (kind, _, _, _), w in option.cost.tally.on_rank(rank).items() if kind == "matmul")


def test_the_tallied_flops_are_torchs_count_of_the_one_device_step(p1):
    """Data parallel: the ranks' matmul flops add up to torch's count of one device's step (the sdpa
    of examples/gpt.py is causal: the attention the tally counts whole for MFU is torch's count too),
    and each rank does a quarter; Megatron splits the blocks' matmuls but repeats the head's."""
    model = _gpt(attention="matmul")
    args = _args(model)
    reference = _one_device_flops(model, gpt_step, args)
    plan = gnn.auto_plan(model, p1, args, step=gpt_step)
    dp = _option(plan, ("data",))
    assert dp.cost.tally.model_flops == reference
    assert [_rank_flops(dp, r) for r in range(4)] == [reference // 4] * 4
    tp = _option(plan, ("tensor",))
    head = 6 * 8 * 16 * model.cfg.n_embd * model.cfg.vocab_size          # forward 2 and backward 4 per weight
    assert _rank_flops(tp, 0) == (reference - head) // 4 + head


def test_a_split_that_divides_no_work_loses_to_one_that_does(p1):
    """HF ViT, 4 ranks: splitting ``pixel_values`` on dim 1 splits its 3 colour channels, and every rank
    then runs the whole model; bytes alone once chose it. With compute counted the chosen layout
    gives each rank at most half a device's matmuls."""
    import transformers
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=16,
        patch_size=4, num_channels=3, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    pixels = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(1))

    def step(m, x):
        m(pixel_values=x).logits.square().mean().backward()
    reference = _one_device_flops(model, step, (pixels,))
    plan = gnn.auto_plan(model, p1, (pixels,), step=step)
    channels = _option(plan, ("sequence",))
    assert _rank_flops(channels, 0) > 0.9 * reference    # all but its quarter of the patch embedding's conv
    assert max(_rank_flops(plan.chosen, r) for r in range(4)) <= reference // 2, plan.explain()
    assert plan.chosen.cost.seconds < channels.cost.seconds


def test_collectives_are_not_compute(p1):
    """A step whose only tensor work is a reduction's all-reduce tallies no kernel of it: the sum a
    simulated all-reduce runs is communication."""
    from globaltensor.nn.auto.compute import ComputeTally, TallyingWorld, tag_pieces
    from globaltensor.nn.auto.cost import MemoizedMeta, meta_global
    from globaltensor.comm import set_world
    world = TallyingWorld(4)
    previous = set_world(world)
    try:
        x = meta_global((8, 8), torch.float32, p1, (gt.sbp.partial_sum,), world)
        tag_pieces(x)
        tally = ComputeTally()
        with MemoizedMeta(None, tally, world):
            x.to_global(sbp=gt.sbp.broadcast)
    finally:
        set_world(previous)
    assert not any(tally.kernels.values()) and tally.host_ops == {}


def test_the_prediction_adds_up(p1):
    """On this machine the host dispatches and computes on the same cores: the step is their sum with the
    communication; tokens/s is the batch's tokens over it; MFU the one-device flops over the time, the
    ranks and the peak. On an H100 the host runs ahead of the kernels and the gradient buckets'
    reductions hide under the backward."""
    model = _gpt()
    args = _args(model)
    plan = gnn.auto_plan(model, p1, args, step=gpt_step)
    dp = AutoPlan(p1, _option(plan, ("data",)), plan.options, None, None, plan.tokens, plan.dtype)
    here = dp.predict()
    assert here.seconds == pytest.approx(here.compute + here.communication + here.host)
    assert here.tokens_per_second == pytest.approx(8 * 16 / here.seconds)
    assert here.peak_memory == dp.cost.memory
    gpu = dp.predict("H100")
    assert gpu.seconds == pytest.approx(max(gpu.host, gpu.compute + gpu.communication))
    assert gpu.hidden_communication > 0
    assert gpu.mfu == pytest.approx(plan.options[0].cost.tally.model_flops / (gpu.seconds * 4 * H100.peak[torch.float32]))
    assert "predicted step on H100" in gpu.table()
    assert set(DEVICES) == {"H100", "H200", "A100"}


def test_the_host_work_counts_each_gradient_the_buckets_take(p1):
    """A data-parallel step's host work is its global ops' dispatch and its gradient hooks: on every
    rank one per gradient the buckets take in the real step -- the gradients a run without buckets
    leaves partial -- at the calibration's seconds each."""
    from globaltensor.nn.auto.calibration import current_calibration
    model = _gpt()
    args = _args(model)
    plan = gnn.auto_plan(model, p1, args, step=gpt_step)
    dp = AutoPlan(p1, _option(plan, ("data",)), plan.options, None, None, plan.tokens, plan.dtype)
    unbucketed = copy.deepcopy(model)
    gnn.distribute_module(model, p1, dp)
    gnn.distribute_module(unbucketed, p1, dp, bucket_bytes=0)
    taken = []
    model._gt_grad_buckets.on_bucketed = taken.append
    for m in (model, unbucketed):
        gpt_step(m, *(gt.distribute(a, p1, nd) for a, nd in zip(args, dp.inputs)))
    left_partial = [p for p in unbucketed.parameters() if torch._C.TensorBase.grad.__get__(p)._layout.has_partial]
    assert len(taken) == len(left_partial) > 0
    assert dict(dp.chosen.cost.tally.bucketed) == {r: len(taken) for r in range(4)}
    here = dp.predict()
    assert here.by_kind["gradient hooks"] == pytest.approx(len(taken) * current_calibration().host_gradient_seconds)
    assert here.host == pytest.approx(here.by_kind["gradient hooks"] + here.by_kind["host dispatch"])


def test_planning_for_a_named_device_takes_its_memory_as_the_limit(p1):
    model = _gpt()
    args = _args(model)
    plan = gnn.auto_plan(model, p1, args, step=gpt_step, device="A100")
    assert plan.memory_limit == DEVICES["A100"].memory and plan.predict().device == "A100"


def test_a_bad_device_names_the_argument(p1):
    model = _gpt()
    with pytest.raises(ValueError, match=r"device=: expected a gt.nn.Device or one of \['A100', 'H100', 'H200'\], got 'TPU'"):
        gnn.auto_plan(model, p1, _args(model), step=gpt_step, device="TPU")


def test_a_loaded_plan_says_it_cannot_predict(p1):
    model = _gpt()
    plan = gnn.auto_plan(model, p1, _args(model), step=gpt_step)
    loaded = AutoPlan.from_dict(plan.to_dict())
    with pytest.raises(ValueError, match="loaded with from_dict"):
        loaded.predict()


def test_predicting_a_laid_out_model_is_predicting_its_plan(p1):
    """A model laid out by hand as data parallel predicts the step auto_plan predicts for its data-parallel
    option: the same meta run, from the model's own layouts."""
    import copy
    model = _gpt()
    args = _args(model)
    plan = gnn.auto_plan(model, p1, args, step=gpt_step)
    dp = _option(plan, ("data",))
    laid_out = copy.deepcopy(model)
    gnn.distribute_module(laid_out, p1, {})
    g_args = [gt.distribute(a, p1, gt.sbp.split(0)) for a in args]
    mine = gnn.predict_step(laid_out, g_args, step=gpt_step)
    theirs = AutoPlan(p1, dp, plan.options, None, None, plan.tokens, plan.dtype).predict()
    assert mine.seconds == pytest.approx(theirs.seconds, rel=1e-9) and mine.memory == theirs.memory


def test_pipeline_stages_add_up(p1):
    """examples/gpt.py's GPT cut into 2 stages on ranks [0, 1] and [2, 3], each data parallel, run eagerly:
    a stage waits for the other, so the step is longer than any rank's own work, and each stage's
    ranks hold that stage's parameters only."""
    stages = [gt.placement("cpu", [0, 1]), gt.placement("cpu", [2, 3])]
    model = _gpt(n_layer=2)
    args = _args(model)
    held = gnn.pipeline_stages(model, stages)
    g_args = [gt.distribute(args[0], stages[0], gt.sbp.split(0)), gt.distribute(args[1], stages[1], gt.sbp.split(0))]
    pr = gnn.predict_step(model, g_args, step=gpt_step)
    assert held == {0: ["blocks.0"], 1: ["blocks.1", "ln_f", "lm_head"]}
    first = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith(("blocks.1", "ln_f", "lm_head")))
    assert pr.memory_parts["parameters"] == max(first, sum(p.numel() * 4 for p in model.parameters()) - first)
    assert pr.seconds > pr.compute + pr.communication + pr.host


def test_a_view_of_a_held_storage_is_not_the_steps_memory():
    """A storage held across steps (a weight, a gradient bucket) counts once, in ``kept`` if it is
    counted at all, never in the step's peak, however many views of it the step makes."""
    from globaltensor.nn.auto.cost import LiveBytes
    live = LiveBytes()
    weight, bucket = torch.empty(64, 32), torch.empty(128)
    live.held(0, weight, counted=False)
    live.held(0, bucket)
    live.held(0, bucket[:64])
    transposed, out = weight.t(), torch.empty(16, 32)
    live.made(0, transposed)
    live.made(0, bucket[64:])
    live.made(0, out)
    assert (live.peak[0], live.kept[0]) == (16 * 32 * 4, 128 * 4)


def test_a_linear_layers_step_holds_its_output_and_gradient_beside_the_held_state(p1):
    """A bias-free linear layer, data parallel on 4 ranks, one SGD step: each rank holds the weight,
    the momentum and the gradient bucket from step to step (one weight's bytes each). At the step's
    peak, in the matmul's backward, it holds the weight's gradient before it is copied into the
    bucket, the contiguous transpose of the output's gradient (2 rows a rank) that backward makes,
    and the loss and its gradient (scalars). The transpose of the weight the forward makes is a
    view of the weight, not memory of its own."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 128, bias=False)
    plan = gnn.auto_plan(model, p1, (torch.randn(8, 256),), step=lambda m, x: m(x).sum().backward(),
                         optimizer=torch.optim.SGD)
    parts = _option(plan, ("data",)).cost.memory_parts
    weight, output_grad, scalars = 128 * 256 * 4, 2 * 128 * 4, 2 * 4
    assert parts == {"parameters": weight, "optimizer state": weight, "gradient buckets": weight,
                     "gradients": 0, "activations": weight + output_grad + scalars}


def test_a_linear_layers_zero_step_holds_the_reduce_scatters_buffers_to_the_backwards_end(p1):
    """The same layer with ZeRO: between steps each rank holds the weight, its quarter of the
    momentum and its shard of the weight (the shard's gradient, made by the reduce-scatter, lives
    from the backward's end to zero_grad: not across steps). At the peak, in the backward, it holds
    the weight's partial gradient, the bucket's flat copy of it handed to the reduce-scatter -- held
    until the backward ends, as the started collective holds it -- and the reduce-scatter's whole
    sum, whose shard is the new gradient (a gloo process receives the whole bucket too), beside
    the scalars."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 128, bias=False)
    plan = gnn.auto_plan(model, p1, (torch.randn(8, 256),), step=lambda m, x: m(x).sum().backward(),
                         optimizer=torch.optim.SGD)
    parts = _option(plan, ("data",), zero=True).cost.memory_parts
    weight, scalars = 128 * 256 * 4, 2 * 4
    assert parts == {"parameters": weight, "optimizer state": 2 * weight // 4, "gradient buckets": 0,
                     "gradients": weight, "activations": 2 * weight + scalars}
