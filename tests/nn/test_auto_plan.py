"""``gt.nn.auto_plan``: the chosen layouts train as one device, and a step sends no more than the hand plans.

Each auto-planned model trains a step of examples/gpt.py's GPT (or a HuggingFace model) in float64
beside the same model on one device (nn_models.TOL: sums in another order), and the step's bytes --
forward, backward and the optimizer's gradient reads, counted by ``gt.comm_stats`` on the simulated
world -- are compared with those of the hand plans on the same model and batch: pure data parallel,
Megatron (examples/gpt.py's TENSOR_PARALLEL), examples/demo.py's 2x2 hybrid. The bytes the plan
modelled (its meta run) must be what the real step sends."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import globaltensor as gt
import globaltensor.nn as gnn
from nn_models import TOL

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import TENSOR_PARALLEL, GPT, GPTConfig, make_batch  # noqa: E402

S, B = gt.sbp.split, gt.sbp.broadcast


def gpt_step(model, idx, targets):
    model.loss(idx, targets).backward()


def _batch(cfg, batch, seq):
    return make_batch(cfg, batch, seq, torch.Generator().manual_seed(1))


def _step_bytes(model, placement, plan, input_sbps, args, zero_axis=None):
    """One training step of a copy of ``model`` laid out by ``plan``: its bytes and loss, the reference's."""
    m = copy.deepcopy(model)
    gnn.distribute_module(m, placement, plan)
    opt = gnn.ZeroOptimizer(m.parameters(), torch.optim.AdamW, axis=zero_axis, lr=1e-2) if zero_axis is not None \
        else torch.optim.AdamW(m.parameters(), lr=1e-2)
    g_args = [gt.distribute(a, placement, sbp) for a, sbp in zip(args, input_sbps)]
    with gt.comm_stats() as st:
        loss = m.loss(*g_args)
        loss.backward()
        opt.step()
    return st.bytes_sent, m, loss


def _reference_step(model, args):
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    loss = ref.loss(*args)
    loss.backward()
    opt.step()
    return ref, loss


def _equal_one_device(m, ref, loss, ref_loss):
    torch.testing.assert_close(loss.full_tensor(), ref_loss, **TOL)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), **TOL, msg=name)


def _auto(model, placement, args, **kw):
    plan = gnn.auto_plan(model, placement, args, step=gpt_step, **kw)
    bytes_, m, loss = _step_bytes(model, placement, plan, plan.inputs, args, plan.zero_axis)
    ref, ref_loss = _reference_step(model, args)
    _equal_one_device(m, ref, loss, ref_loss)
    assert bytes_ == plan.cost.bytes, f"the plan modelled {plan.cost.bytes:,} bytes, the step sent {bytes_:,}"
    return plan, bytes_


def _gpt(seed=0, **cfg):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**cfg)).double()


def test_small_model_large_batch_is_no_dearer_than_data_parallel(p1):
    model = _gpt(n_embd=16, n_layer=2)
    args = _batch(model.cfg, 32, 16)
    plan, auto = _auto(model, p1, args)
    dp, _, _ = _step_bytes(model, p1, {}, [S(0), S(0)], args)
    assert auto <= dp


def test_wide_model_small_batch_is_no_dearer_than_megatron(p1):
    model = _gpt(n_embd=128, n_layer=2)
    args = _batch(model.cfg, 2, 16)
    plan, auto = _auto(model, p1, args)
    megatron, _, _ = _step_bytes(model, p1, gnn.megatron_plan(**TENSOR_PARALLEL), [B, B], args)
    dp, _, _ = _step_bytes(model, p1, {}, [S(0), S(0)], args)
    assert auto <= min(megatron, dp)


def test_2x2_is_no_dearer_than_the_demos_hybrid_plan(p2):
    model = _gpt(n_layer=1)     # a second block adds no op the first lacks; the 2x2 has 36 candidates to cost
    args = _batch(model.cfg, 8, 16)
    plan, auto = _auto(model, p2, args)
    hybrid, _, _ = _step_bytes(model, p2, gnn.megatron_plan(**TENSOR_PARALLEL, axis=1, ndim=2), [(S(0), B)] * 2, args)
    assert auto <= hybrid


def _measured_peak(model, placement, plan, args) -> int:
    """The most bytes any rank holds during a real step of the plan: its parameters' pieces, plus the
    peak of every global tensor the step makes (activations, gradients, the optimizer's state)."""
    from globaltensor.nn.auto.cost import LiveBytes, observing_creation
    m = copy.deepcopy(model)
    gnn.distribute_module(m, placement, plan)
    opt = plan.optimizer(m.parameters(), torch.optim.AdamW, lr=1e-2)
    g_args = [gt.distribute(a, placement, sbp) for a, sbp in zip(args, plan.inputs)]
    live = LiveBytes()
    for p in m.parameters():                  # held: a view of a weight is not new memory
        for r, piece in p.local_tensors().items():
            live.held(r, piece, counted=False)
    with observing_creation(live.created):
        m.loss(*g_args).backward()
        opt.step()
    params = {r: sum(p.local_tensors()[r].numel() * p.element_size() for p in m.parameters())
              for r in placement.rank_list()}
    return max(params[r] + live.peak[r] for r in placement.rank_list())


def test_a_memory_limit_below_replicated_state_splits_parameters_or_state(p1):
    """Unlimited, a small model with a large batch is data parallel: replicated float64 parameters,
    gradients and AdamW's two moments, 4x the parameters per rank, beside the activations. A limit
    below that forces a split (here ZeRO's), and the chosen plan's measured peak per rank fits it."""
    model = _gpt(n_embd=32, n_layer=2)
    args = _batch(model.cfg, 32, 16)
    replicated = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    free = gnn.auto_plan(model, p1, args, step=gpt_step)
    assert free.chosen.candidate.roles == ("data",) and not free.chosen.candidate.zero
    limit = int(replicated * 0.8) + free.cost.memory_parts["activations"]
    plan, _ = _auto(model, p1, args, memory_limit=limit)
    assert plan.cost.memory <= limit < free.cost.memory
    assert plan.zero_axis is not None or any(v.is_split for nd in plan.values() for v in nd)
    assert _measured_peak(model, p1, plan, args) <= limit
    with pytest.raises(ValueError, match="no layout fits"):
        gnn.auto_plan(model, p1, args, step=gpt_step, memory_limit=1000)


def test_long_sequences_few_of_them_and_a_memory_limit_give_the_sequence_split_with_ring_attention(p1):
    """2 sequences of 256 tokens, 2 heads, 4 ranks. Data parallel leaves half the ranks without a
    sequence and the others holding whole ones; the sequence split holds a quarter of each, its
    attention a ring (fewer heads than ranks), and it holds less at its busiest rank (the gradient
    buckets and the parameters' state are the same). Under a limit below data parallel's memory the
    sequence split is chosen -- balanced (head-tail), which sends what the
    plain one sends per collective (its busiest rank 16 bytes more in all: where the loss's scalar
    all-reduce lands), holds less than data parallel (a little more than the plain split: 4 % at
    its busiest rank, and a real step of each holds more too), and gives every rank the same causal
    attention work -- and it trains like one device, sending what it modelled: the ring's blocks
    among it."""
    model = _gpt(n_embd=32, n_layer=2, n_head=2, block_size=256)
    args = _batch(model.cfg, 2, 256)
    free = gnn.auto_plan(model, p1, args, step=gpt_step)
    by_role = {(o.candidate.roles, o.candidate.balanced): o for o in free.options if not o.candidate.zero}
    plain, data = by_role[("sequence",), False], by_role[("data",), False]
    assert plain.cost.memory < data.cost.memory
    plan, _ = _auto(model, p1, args, memory_limit=(plain.cost.memory + data.cost.memory) // 2)
    balanced = plan.chosen
    ht = S(1, order="head_tail")
    assert balanced.candidate.roles == ("sequence",) and balanced.candidate.balanced and plan.inputs == [(ht,), (ht,)]
    assert plain.cost.bytes <= balanced.cost.bytes <= plain.cost.bytes + 16
    assert balanced.cost.memory < data.cost.memory
    assert "sequence split (balanced)" in plan.explain()
    again = gnn.AutoPlan.from_dict(plan.to_dict())
    assert again.inputs == plan.inputs and again.chosen.candidate.balanced
    m = copy.deepcopy(model)
    gnn.distribute_module(m, p1, plan)
    with gt.comm_stats() as stats:
        m.loss(*(gt.distribute(a, p1, sbp) for a, sbp in zip(args, plan.inputs))).backward()
    assert "send_recv" in stats.ops() and "all_gather" not in stats.ops(), stats.ops()


def test_the_plan_explains_itself_and_round_trips(p1):
    model = _gpt()
    args = _batch(model.cfg, 8, 16)
    plan = gnn.auto_plan(model, p1, args, step=gpt_step)
    text = plan.explain()
    assert "blocks.0.attn.qkv" in text and "memory per rank" in text
    for name in ("data parallel", "tensor parallel (Megatron)", "data parallel + ZeRO"):
        assert f"| {name} |" in text, text
    again = gnn.AutoPlan.from_dict(plan.to_dict())
    assert dict(again) == dict(plan) and again.inputs == plan.inputs and again.zero_axis == plan.zero_axis
    assert again.to_dict() == plan.to_dict()
    assert gnn.auto_plan(model, p1, args, step=gpt_step) is plan          # cached by structure and meta


def test_shapes_as_example_arguments(p1):
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).double()
    plan = gnn.auto_plan(model, p1, [(64, 8)])
    assert set(plan) == {n for n, _ in model.named_parameters()}
    m = copy.deepcopy(model)
    gnn.distribute_module(m, p1, plan)
    x = torch.randn(64, 8, dtype=torch.float64)
    torch.testing.assert_close(m(gt.distribute(x, p1, plan.inputs[0])).full_tensor(), model(x), **TOL)


def test_a_compiled_step_of_an_auto_planned_model_equals_eager(p1):
    model = _gpt()
    args = _batch(model.cfg, 8, 16)
    plan = gnn.auto_plan(model, p1, args, step=gpt_step)
    models = [copy.deepcopy(model) for _ in range(2)]
    steps = []
    for m in models:
        gnn.distribute_module(m, p1, plan)
        opt = plan.optimizer(m.parameters(), torch.optim.AdamW, lr=1e-2)

        def step(idx, targets, m=m, opt=opt):
            loss = m.loss(idx, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        steps.append(step)
    eager, compiled = steps[0], gt.compile(steps[1])
    for _ in range(3):
        g_args = [gt.distribute(a, p1, sbp) for a, sbp in zip(args, plan.inputs)]
        torch.testing.assert_close(compiled(*g_args).full_tensor(), eager(*g_args).full_tensor(), **TOL)
    for p, q in zip(models[1].parameters(), models[0].parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), **TOL)


def test_calibration_is_measured_and_used(world4, monkeypatch):
    import globaltensor.nn.auto.calibration as calibration
    monkeypatch.setattr(calibration, "_CACHE", {})       # the other tests plan with the default model
    cal = gt.calibrate(small=4096, large=65536, repeats=2)
    assert set(cal.links) >= {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"}
    assert all(v.bandwidth > 0 and v.latency >= 0 for v in cal.links.values())
    assert calibration.current_calibration() is cal
    machine = cal.device                  # the kernels and dispatch timed too, and the links of this world
    assert machine.matmul_rate(torch.float32) > 0 and machine.matmul_rate(torch.float64) > 0
    assert machine.memory_bandwidth > 0 and 0 < machine.attention_fraction <= 1 and cal.host_op_seconds > 0
    assert cal.host_gradient_seconds > 0 and cal.to_dict()["host_gradient_seconds"] == cal.host_gradient_seconds
    assert machine.link("all_reduce", (0, 1, 2, 3)).bandwidth == cal.links["all_reduce"].bandwidth


def test_a_collectives_line_without_a_slope_goes_through_its_larger_point_at_the_memory_bandwidth():
    """Two timings of a collective fit ``latency + bytes / bandwidth``; where the larger payload
    took hardly longer than the smaller (jitter), the slope's bandwidth is past anything the host's
    memory moves, and the line goes through the larger timing at the memory bandwidth instead."""
    from globaltensor.nn.auto.calibration import fitted_link
    small, large, ceiling = 16 * 1024, 4 * 2 ** 20, 5e9
    measured = fitted_link(small, 1e-3 + small / 1e9, large, 1e-3 + large / 1e9, ceiling)
    assert measured.latency == pytest.approx(1e-3) and measured.bandwidth == pytest.approx(1e9)
    flat = fitted_link(small, 2.0e-3, large, 2.0001e-3, ceiling)           # 4 MiB in 0.1 µs more
    assert flat.bandwidth == ceiling and flat.seconds(large) == pytest.approx(2.0001e-3)
    assert flat.latency == pytest.approx(2.0001e-3 - large / ceiling)


@pytest.mark.parametrize("bad,kw,match", [
    ("model", {}, "expected an nn.Module"),
    ("args", {}, "expected a tuple of tensors or shapes"),
    (None, {"memory_limit": -1}, "expected a positive number of bytes"),
    (None, {"step": 3}, "expected a function"),
])
def test_bad_arguments_raise_naming_them(p1, bad, kw, match):
    model = torch.nn.Linear(4, 4)
    with pytest.raises((TypeError, ValueError), match=match):
        gnn.auto_plan("net" if bad == "model" else model, p1, "x" if bad == "args" else [(8, 4)], **kw)


def test_the_balanced_sequence_split_wins_within_its_slack_and_only_there():
    """A chosen plain sequence split gives way to its balanced twin where the twin models at most 1%
    more time and fits the memory limit; a plain split cheaper by more stays (a model whose ops need
    plain order, say), and so does one whose twin needs more memory than the limit."""
    from globaltensor.nn.auto.candidates import Candidate
    from globaltensor.nn.auto.cost import Cost
    from globaltensor.nn.auto.plan import BALANCED_SLACK, Option, balanced_or

    def option(balanced, seconds, memory=0):
        return Option(Candidate(("sequence",), balanced=balanced), {}, {}, [], Cost(0, 0, seconds, memory))
    plain = option(False, 1.0, memory=10)
    assert balanced_or(plain, option(True, 1.0 + BALANCED_SLACK / 2, memory=10), 10).candidate.balanced
    assert not balanced_or(plain, option(True, 1.0 + 2 * BALANCED_SLACK), None).candidate.balanced
    assert not balanced_or(plain, option(True, 1.0, memory=11), 10).candidate.balanced


class ReadsAValue(torch.nn.Module):
    """A forward that asks a question of its input's values (as HF's mask code does): the branch taken
    depends on the data, not on the layout."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.norm = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)

    def forward(self, x):
        h = self.norm(self.fc(x))
        if bool((x > 0).any()):
            h = h * 2
        return h


def _value_step(model, x):
    model(x).square().sum().backward()


def test_auto_plan_answers_host_reads_from_one_real_step(p1):
    """The meta runs cannot read a value: one real step on the example tensors answers them, and leaves
    the model as it was (no gradient, BatchNorm's running statistics put back)."""
    m = ReadsAValue()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(16, 8)
    plan = gnn.auto_plan(m, p1, (x,), step=_value_step)
    assert plan.cost.bytes > 0
    assert all(p.grad is None for p in m.parameters())
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    ref = copy.deepcopy(m)
    gnn.distribute_module(m, p1, plan)
    got = m(gt.distribute(x, p1, plan.inputs[0]))
    torch.testing.assert_close(got.full_tensor(), ref(x), rtol=1e-5, atol=1e-6)   # float32: sums in another order


def test_auto_plan_with_shapes_names_the_line_that_reads_a_value(p1):
    with pytest.raises(ValueError, match=r"reads a tensor's value on the host at .*test_auto_plan.py:\d+, in forward: "
                                         r"\"if bool\(\(x > 0\).any\(\)\):\"; give example_args as tensors"):
        gnn.auto_plan(ReadsAValue(), p1, ((12, 8),), step=_value_step)     # a shape no earlier plan is cached for
