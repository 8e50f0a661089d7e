"""Pipeline schedules (schedules.py, actor_rt/pipeline_units.py, lower.py): each stage's sequence of
units is a valid execution with the bounds the schedule promises; a compiled pipeline trains as the
full-batch step under every schedule (float64), holds the micro-batches its schedule allows, and
says what it runs in its plan; the steps a schedule cannot run raise naming the reason."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import globaltensor as gt
from globaltensor import schedules as sch
from globaltensor.actor_rt.program import CompileError
from runtime_helpers import run_bounded

S, B = gt.sbp.split, gt.sbp.broadcast
EXACT = dict(rtol=1e-12, atol=1e-14)     # float64: the same sums per micro-batch, means in another order


# -- the schedules alone -------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(p=st.integers(1, 5), m=st.integers(1, 12), v=st.integers(1, 3), name=st.sampled_from(sch.SCHEDULES))
def test_every_schedule_runs_every_unit_once_in_an_order_that_can_run(p, m, v, name):
    if name in ("1f1b", "zero_bubble"):
        v = 1
    if name == "zbv":
        v = 2
    if name not in ("gpipe", "zbv") and m < p or name == "interleaved_1f1b" and m % p:
        return
    split = sch.splits_weight_gradients(name)
    seqs = sch.sequences(name, p, v, m)
    chunks = sch.chunk_count(name, p, v)
    kinds = "FBW" if split else "FB"
    for s, seq in enumerate(seqs):
        mine = [c for c in range(chunks) if sch.stage_of(name, c, p) == s]
        assert sorted(seq) == sorted((k, c, j) for k in kinds for c in mine for j in range(m)), f"stage {s}"
    start = sch.timeline(seqs, chunks, split, sch.sizes(name, p, chunks))
    assert len(start) == len(kinds) * chunks * m
    bounds = [sch.in_flight(q, split) for q in seqs]
    if name == "gpipe":
        assert bounds == [m * v] * p
    elif name == "1f1b":
        assert bounds == [min(p - s, m) for s in range(p)]
    elif name == "zero_bubble":
        # ZB-H1: p - s micro-batches whole (forward to input gradient), as 1F1B; p in all on every stage
        assert bounds == [min(p, m)] * p
        assert [sch.in_flight(q, False) for q in seqs] == [min(p - s, m) for s in range(p)]
    elif name == "zbv":
        # p micro-batches on every stage, as 1F1B's first: 2p halves, or p turning chunks on the last
        assert bounds == [min(2 * p, 2 * m)] * (p - 1) + [min(p, m)]


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16)])
def test_the_bubbles_are_the_schedules(p, m):
    """At unit durations: GPipe's and 1F1B's bubble is (p - 1) / (m + p - 1); ZB-H1's the paper's, (p - 1)
    (F + B - W) idle units beside each stage's 3m units of work, a third of 1F1B's idle time; interleaving
    2 chunks per stage less than 1F1B's; zbv's less than a third of 1F1B's (at 1F1B's first stage's memory)."""
    def bubble(name, v=1):
        return sch.bubble(name, p, m, v)
    ideal = (p - 1) / (m + p - 1)
    assert bubble("gpipe") == pytest.approx(ideal) and bubble("1f1b") == pytest.approx(ideal)
    assert bubble("zero_bubble") == pytest.approx((p - 1) / (3 * m + p - 1))
    assert bubble("interleaved_1f1b", v=2) < ideal
    assert bubble("zbv", v=2) < min(bubble("zero_bubble"), bubble("interleaved_1f1b", v=2), ideal / 3)


# -- compiled pipelines --------------------------------------------------------------------------
def layer_stage(name: str, c: int, layers: int, p: int) -> int:
    """The stage of layer ``c`` of ``layers``: in turn, or for zbv down the stages and back up (as
    ``pipeline_stages(..., v_shape=True)`` cuts)."""
    return min(c, layers - 1 - c) if name == "zbv" else c % p


def chain(placements, chunks: int, width: int = 6, seed: int = 0, name: str = ""):
    """``chunks`` linear + tanh layers, layer c on ``placements[layer_stage(name, c, ...)]`` (broadcast
    weights), the activation moved on between them; returns (weights, the training step, its
    single-device twin)."""
    p = len(placements)
    at = [placements[layer_stage(name, c, chunks, p)] for c in range(chunks)]
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(width, width, generator=gen, dtype=torch.float64) / width ** 0.5 for _ in range(chunks)]
    ws = [gt.distribute(w, at[c], B).requires_grad_() for c, w in enumerate(init)]
    ref = [w.clone().requires_grad_() for w in init]
    opts = torch.optim.AdamW(ws, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)

    def forward(x, weights, move):
        for c, w in enumerate(weights):
            x = torch.tanh(move(x, c) @ w)
        return x

    def step(x, y, weights=ws, opt=opts[0], move=lambda x, c: x.to_global(placement=at[c])):
        loss = ((forward(x, weights, move) - move(y, chunks - 1)) ** 2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(weights, 0.5)        # the total norm over every stage
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def reference(x, y):
        return step(x, y, ref, opts[1], lambda x, c: x)
    return ws, ref, step, reference


def _batches(placement, n: int, rows: int = 16, width: int = 6):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, width, generator=gen, dtype=torch.float64),
             torch.randn(rows, width, generator=gen, dtype=torch.float64)) for _ in range(n)]


@pytest.mark.parametrize("name, stages, v, m", [
    ("gpipe", 2, 1, 4), ("1f1b", 2, 1, 4), ("1f1b", 4, 1, 8), ("zero_bubble", 2, 1, 4), ("zero_bubble", 4, 1, 4),
    ("interleaved_1f1b", 2, 2, 4), ("interleaved_1f1b", 4, 2, 8), ("zbv", 2, 2, 4), ("zbv", 4, 2, 8), ("zbv", 4, 2, 2),
    ("1f1b", 1, 1, 1), ("zero_bubble", 1, 1, 1), ("zbv", 2, 2, 1)])
def test_a_scheduled_pipeline_trains_as_one_device(name, stages, v, m):
    """Every schedule, and a single micro-batch under one (its clipping after the backward then runs
    once, after every unit, as for more)."""
    with gt.simulate(stages):
        placements = [gt.placement("cpu", [r]) for r in range(stages)]
        ws, ref, step, reference = chain(placements, stages * v, name=name)
        g = gt.compile(step, micro_batches=m, schedule=name)
        last = placements[layer_stage(name, stages * v - 1, stages * v, stages)]
        for i, (x, y) in enumerate(_batches(placements[0], 4)):
            loss = g(gt.distribute(x, placements[0], B), gt.distribute(y, last, B))
            want = reference(x, y)
            torch.testing.assert_close(loss.full_tensor(), want, **EXACT, msg=lambda e: f"step {i}: loss: {e}")
        for c, (w, r) in enumerate(zip(ws, ref)):
            torch.testing.assert_close(w.full_tensor(), r.detach(), **EXACT, msg=lambda e: f"weight {c}: {e}")
        assert g.captures == 1
        assert name in repr(g.plan) and (name == "gpipe" or f"over {stages} stages" in g.plan.pipeline)


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(sch.SCHEDULES), stages=st.sampled_from([2, 4]), seed=st.integers(0, 2 ** 16))
def test_every_schedule_runs_to_the_end_under_any_streams_and_registers(name, stages, seed):
    """lower.py's claim for every schedule: each stream follows the one reference order, so any
    stream assignment (three names per rank, drawn per task) and any register counts (1-3) finish,
    with the credits' dependencies in place, and train as one device."""
    import random
    draw = random.Random(seed)
    streams, registers = {}, {}
    with gt.simulate(stages):
        placements = [gt.placement("cpu", [r]) for r in range(stages)]
        chunks = 2 * stages if name in ("interleaved_1f1b", "zbv") else stages
        ws, ref, step, reference = chain(placements, chunks, name=name)
        g = gt.compile(step, micro_batches=2 * stages, schedule=name,
                       streams=lambda t: streams.setdefault(t.id, f"r{t.rank}:{draw.choice('abc')}"),
                       registers=lambda t: registers.setdefault(t.id, draw.randint(1, 3)))
        for i, (x, y) in enumerate(_batches(placements[0], 3)):
            loss = run_bounded(lambda: g(gt.distribute(x, placements[0], B),
                                         gt.distribute(y, placements[layer_stage(name, chunks - 1, chunks, stages)],
                                                       B)), 120, f"{name} step {i}")
            torch.testing.assert_close(loss.full_tensor(), reference(x, y), **EXACT)


def _two_stages(name: str, m: int, width: int = 6, rows: int = 16, layers: int = 2, **options):
    """The chain of ``layers`` on 2 stages (ranks 0 and 1) compiled with ``schedule=name``, after 3 calls."""
    with gt.simulate(2):
        placements = [gt.placement("cpu", [0]), gt.placement("cpu", [1])]
        _, _, step, _ = chain(placements, layers, width=width, name=name)
        g = gt.compile(step, micro_batches=m, schedule=name, **options)
        x, y = _batches(placements[0], 1, rows=rows, width=width)[0]
        last = placements[layer_stage(name, layers - 1, layers, 2)]
        for _ in range(3):
            g(gt.distribute(x, placements[0], B), gt.distribute(y, last, B))
        return g


def test_zero_bubble_splits_the_weight_gradients_off():
    g = _two_stages("zero_bubble", 2)
    units = {t.unit for t in g.plan.tasks if t.unit is not None}
    assert {("W", 1, 0), ("B", 1, 0), ("W", 0, 1)} <= units
    grads = [t for t in g.plan.tasks if t.unit == ("W", 1, 0) and t.node.target == torch.ops.aten.mm.default]
    assert grads, "the last chunk's weight gradient (an mm) is a W task"


def test_zbv_runs_the_v_and_splits_the_weight_gradients_off():
    """Four layers down the 2 stages and back: 3 chunks (the second stage's two layers are one), the
    first stage running the first and the last (the loss's) chunk, each backward split into B and W."""
    g = _two_stages("zbv", 4, layers=4)
    assert "zbv over 2 stages ([0], [1]), 3 chunks, 4 micro-batches" in g.plan.pipeline
    ranks: dict = {}                        # unit -> the ranks of its computing tasks
    for t in g.plan.tasks:
        if t.unit is not None and t.node is not None and t.node.kind == "op":
            ranks.setdefault(t.unit, set()).add(t.rank)
    assert [ranks[("F", c, 0)] for c in range(3)] == [{0}, {1}, {0}]
    assert {("B", 2, 0), ("W", 2, 0), ("B", 1, 0), ("W", 1, 0), ("W", 0, 0)} <= set(ranks)


def _activations(name: str, m: int, layers: int = 2) -> dict:
    return _two_stages(name, m, width=64, rows=64 * m, layers=layers, measure_memory=True,
                       streams="rank").peak_activation_bytes_by_rank


@pytest.mark.parametrize("name", ["1f1b", "zero_bubble"])
def test_1f1b_holds_the_micro_batches_it_promises_on_threads_of_their_own(name):
    """Each rank on its own threads (streams="rank"), where nothing but the credits keeps a stage
    from running ahead: the first stage holds at most p micro-batches' activations, within p / m of
    GPipe's (which holds all m there) plus one micro-batch; no stage holds more than under GPipe
    (whose last stage takes each backward as soon as its forward is done)."""
    m, p = 8, 2
    gpipe, ours = _activations("gpipe", m), _activations(name, m)
    assert ours[0] <= (p + 1) / m * gpipe[0], (ours, gpipe)
    assert all(ours[s] <= gpipe[s] for s in range(p)), (ours, gpipe)


def test_zbv_holds_p_micro_batches_on_every_stage_on_threads_of_their_own():
    """zbv on 2 stages, 4 layers in a V, each rank on its own threads: every stage holds at most p
    micro-batches' activations (2p halves), within (p + 1) / m of GPipe's on the same V, which holds
    all m on every stage."""
    m, p = 8, 2
    gpipe, ours = _activations("gpipe", m, layers=4), _activations("zbv", m, layers=4)
    assert all(ours[s] <= (p + 1) / m * gpipe[s] for s in range(p)), (ours, gpipe)


def test_1f1b_credits_are_dependencies():
    """Stage 0's third forward waits for its first backward (the credit it gives back)."""
    tasks = _two_stages("1f1b", 4).plan.tasks
    waits = {tasks[d].unit for t in tasks if t.unit == ("F", 0, 2) for d, _ in t.deps}
    assert ("B", 0, 0) in waits, waits


def test_zero_bubbles_two_bounds_are_dependencies():
    """ZB-H1 on 2 stages: the last stage holds one micro-batch whole (its second forward waits for its
    first input gradient) and two in all (its third forward waits for its first weight gradient)."""
    tasks = _two_stages("zero_bubble", 4).plan.tasks

    def waits(unit):
        return {tasks[d].unit for t in tasks if t.unit == unit for d, _ in t.deps}
    assert ("B", 1, 0) in waits(("F", 1, 1)) and ("W", 1, 0) in waits(("F", 1, 2))


@pytest.mark.parametrize("name", sch.SCHEDULES)
def test_three_d_pipeline_of_data_and_tensor_parallel_stages_trains_as_one_device(name):
    """2 stages x 2 data x 2 tensor on 8 ranks: each chunk a Megatron MLP (column then row
    parallel) on its stage's 2x2 placement, the batch split over the data axis, AdamW and clipping
    over both stages; every schedule (interleaved: 4 chunks taking the stages in turn; zbv: 4 going
    down and back up) equals one device."""
    width, chunks = 8, 4 if name in ("interleaved_1f1b", "zbv") else 2
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(width, width, generator=gen, dtype=torch.float64) / width ** 0.5 for _ in range(2 * chunks)]
    with gt.simulate(8):
        stages = [gt.placement("cpu", [[0, 1], [2, 3]]), gt.placement("cpu", [[4, 5], [6, 7]])]
        ws = [gt.distribute(w, stages[layer_stage(name, i // 2, chunks, 2)], (B, S(1) if i % 2 == 0 else S(0)))
              .requires_grad_() for i, w in enumerate(init)]
        ref = [w.clone().requires_grad_() for w in init]
        opt, ref_opt = torch.optim.AdamW(ws, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)

        def step(x, y, weights=ws, opt=opt, stage_of=lambda x, c: x.to_global(
                placement=stages[layer_stage(name, c, chunks, 2)], sbp=(S(0), B))):
            h = x
            for c in range(chunks):
                h = stage_of(h, c)
                h = torch.tanh(h @ weights[2 * c]) @ weights[2 * c + 1]
            loss = ((h - stage_of(y, chunks - 1)) ** 2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(weights, 0.3)
            opt.step()
            opt.zero_grad()
            return loss.detach()
        g = gt.compile(step, micro_batches=4, schedule=name)
        for i, (x, y) in enumerate(_batches(stages[0], 3, rows=16, width=width)):
            loss = g(gt.distribute(x, stages[0], (S(0), B)),
                     gt.distribute(y, stages[layer_stage(name, chunks - 1, chunks, 2)], (S(0), B)))
            want = step(x, y, ref, ref_opt, lambda x, c: x)
            torch.testing.assert_close(loss.full_tensor(), want, **EXACT, msg=lambda e: f"{name} step {i}: {e}")
        for i, (w, r) in enumerate(zip(ws, ref)):
            torch.testing.assert_close(w.full_tensor(), r.detach(), **EXACT, msg=lambda e: f"{name} w{i}: {e}")


# -- what a schedule cannot run ------------------------------------------------------------------
def _compile_chain(stages: int, chunks: int, m: int, name: str):
    with gt.simulate(stages):
        placements = [gt.placement("cpu", [r]) for r in range(stages)]
        _, _, step, _ = chain(placements, chunks)
        g = gt.compile(step, micro_batches=m, schedule=name)
        x, y = _batches(placements[0], 1, rows=24)[0]
        for _ in range(3):
            g(gt.distribute(x, placements[0], B), gt.distribute(y, placements[(chunks - 1) % stages], B))


@pytest.mark.parametrize("stages, chunks, m, name, reason", [
    (4, 4, 2, "1f1b", "2 micro-batches for 4 stages"),
    (2, 4, 2, "1f1b", "the model runs 4 chunks on 2 stages, and 1f1b takes one chunk per stage"),
    (2, 4, 2, "zero_bubble", "takes one chunk per stage"),
    (2, 4, 2, "zbv", "the model runs 4 chunks on 2 stages, and zbv takes 3: two halves per stage, down the stages "
                     "and back up"),
    (2, 2, 2, "zbv", "the model runs 2 chunks on 2 stages, and zbv takes 3"),
    (3, 5, 3, "zbv", "chunk 3 runs on stage 0, not on stage 1: the model's chunks must go down the 3 stages and back up"),
    (4, 8, 6, "interleaved_1f1b", "6 micro-batches on 4 stages; it runs the micro-batches in rounds of 4")])
def test_a_schedule_that_cannot_run_the_step_says_why(stages, chunks, m, name, reason):
    with pytest.raises(CompileError, match=f"schedule='{name}'\\) cannot run this step: .*{reason}"):
        _compile_chain(stages, chunks, m, name)


def test_a_schedule_needs_a_backward_and_a_known_name():
    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        g = gt.compile(lambda x: x * 2, micro_batches=2, schedule="1f1b")
        with pytest.raises(CompileError, match="runs no backward"):
            for _ in range(3):
                g(gt.randn(4, 2, placement=p, sbp=S(0)))
    with pytest.raises(ValueError, match="expected one of 'gpipe', '1f1b'"):
        gt.compile(lambda x: x, schedule="1F1B")
