"""``gt.compile(fn, cuda_graphs=True)``'s plumbing, on CPU with a stand-in graph (graph_standin.py):
each capturable segment eager on a slot's first use, captured on its second, replayed after; static
inputs copied in, outputs read from the static outputs, one pool per stream, random keys fed so
that dropout draws the eager masks, a failed capture left eager with a warning, a new argument
shape captured again with a warning. Every step equals the eager step (float64, as
test_compile_training.py bounds it). On a GPU, tools/gpu_check.sh runs the real graphs."""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt
from compile_helpers import assert_close_rel, assert_parameters_close, module_maker
from graph_standin import StandInGraphs
from test_compile_training import ADAMW, SGD, DropNet, _batches

S, B = gt.sbp.split, gt.sbp.broadcast


@pytest.fixture
def standin(monkeypatch):
    backend = StandInGraphs()
    monkeypatch.setattr("globaltensor.actor_rt.compiled.graph_backend", lambda: backend)
    return backend


def _train(make, batches, steps, **compile_kw):
    """Both copies stepped alike, each step after the same seed (dropout draws the same masks)."""
    (m_e, _, step_e), (m_c, _, step_c) = make(), make()
    g = gt.compile(step_c, cuda_graphs=True, **compile_kw)
    losses = []
    for s in range(steps):
        gt.manual_seed(100 + s)
        loss_e = step_e(*batches(s))
        gt.manual_seed(100 + s)
        loss_c = g(*batches(s))
        losses.append((loss_c, loss_e.clone()))
        assert_close_rel(loss_c, loss_e, f"step {s}: loss")
        assert_parameters_close(m_c, m_e, f"step {s}")
    return g, losses


@pytest.mark.parametrize("registers", [2, 3])
@pytest.mark.parametrize("opt", [SGD, ADAMW], ids=["sgd-momentum", "adamw"])
def test_a_training_step_replayed_from_graphs_equals_eager(p1, standin, opt, registers):
    """Data parallel on 4 ranks: between the gradient all-reduce and the collectives, the compute runs
    are captured once per register slot and replayed; every step equals eager, and a returned loss
    keeps its value after later steps replay the slot it came from."""
    make = module_maker(p1, {}, opt)
    steps = 2 + 2 * registers            # an eager warm-up call, then iterations: each slot eager, captured, replayed
    g, losses = _train(make, _batches(p1, (S(0),)), steps, registers=registers)
    segments = [s for s in g.plan.segments if s.capturable]
    assert segments and all(s.reason.startswith(("a collective", "not on cpu")) for s in g.plan.segments
                                                    if not s.capturable)
    assert standin.captures == len(segments) * registers
    replayed = steps - 1 - 2 * registers                 # iterations after every slot's capture
    assert standin.replays == len(segments) * (registers + replayed)   # a capture replays at once
    assert len(standin.pools) == 1 and set(standin.captured_in) == {standin.pools[0]}   # one stream, one pool
    for s, (got, want) in enumerate(losses):
        assert_close_rel(got, want, f"the loss step {s} returned, read after the last step")


def test_dropout_inside_a_replayed_graph_draws_the_eager_masks(p1, standin):
    """The random keys are fed inputs, copied into the static buffers: each replay draws that step's
    mask (the eager step's after the same seed), and another seed draws another."""
    make = module_maker(p1, gt.nn.megatron_plan(column=["up"], row=["down"]), SGD, model=DropNet)
    g, losses = _train(make, _batches(p1, (B,)), steps=8)
    assert standin.replays > 0
    gt.manual_seed(12345)
    other = g(*_batches(p1, (B,))(7))
    gt.manual_seed(100 + 7)
    again = g(*_batches(p1, (B,))(7))
    assert not torch.allclose(other.full_tensor(), again.full_tensor(), rtol=1e-9, atol=0)


def test_a_segment_that_cannot_be_captured_runs_eagerly_with_one_warning(p1, monkeypatch):
    backend = StandInGraphs(fail=True)
    monkeypatch.setattr("globaltensor.actor_rt.compiled.graph_backend", lambda: backend)
    make = module_maker(p1, {}, SGD)
    with pytest.warns(UserWarning, match="could not be captured .*it runs without a graph"):
        _train(make, _batches(p1, (S(0),)), steps=6)
    assert backend.captures == backend.replays == 0


def test_new_argument_shapes_capture_again_with_a_warning(p1, standin):
    make = module_maker(p1, {}, SGD)
    (m_e, _, step_e), (m_c, _, step_c) = make(), make()
    g = gt.compile(step_c, cuda_graphs=True)
    for s, rows in enumerate([8, 8, 8, 12, 12, 12]):
        batch = _batches(p1, (S(0),), rows=rows)(s)
        if s == 4:
            with pytest.warns(UserWarning, match="shapes or layouts changed; capturing the step and its CUDA graphs"):
                got = g(*batch)
        else:
            got = g(*batch)
        assert_close_rel(got, step_e(*batch), f"step {s}")
        assert_parameters_close(m_c, m_e, f"step {s}")
    assert g.captures == 2


def test_on_cpu_the_option_raises_a_clear_error(p1):
    g = gt.compile(lambda x: x * 2, cuda_graphs=True)
    x = gt.distribute(torch.ones(4, 2), p1, S(0))
    g(x)                                                   # the warm-up call runs eagerly
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no compute task of this step can be captured"):
            g(x)
    else:
        with pytest.raises(RuntimeError, match="CUDA graphs need a GPU"):
            g(x)
    with pytest.raises(TypeError, match="cuda_graphs=.*expected True or False"):
        gt.compile(lambda x: x, cuda_graphs="yes")


def _segment(body, in_place, backend=None):
    from globaltensor.actor_rt.cuda_graphs import SegmentGraph
    backend = backend or StandInGraphs()
    return SegmentGraph("test", body, 1, in_place, backend, backend.pool()), backend


def test_a_segment_writes_back_the_inputs_it_writes_and_reads_fixed_ones_in_place():
    """Input 0 is written by the segment (a bucket zeroed for the next accumulation): its static copy
    goes back after each replay. Input 1 is read in place: the static input is the tensor itself."""
    def body(inputs):
        total = inputs[0].sum() + inputs[1].sum()
        inputs[0].zero_()
        return (total,)
    fixed = torch.ones(3, dtype=torch.float64)
    seg, backend = _segment(body, [False, True])
    for it in range(4):
        bucket = torch.full((4,), float(it + 1), dtype=torch.float64)
        fixed.fill_(10.0 * it)
        (total,) = seg(it, [bucket, fixed])
        assert total.item() == 4 * (it + 1) + 3 * 10.0 * it and bucket.abs().sum() == 0, it
    assert seg.written == [True, False] and backend.captures == 1 and backend.replays == 3
    graph, static, _ = seg.slots[0]
    assert static[1] is fixed and static[0] is not bucket


def test_an_input_in_another_storage_layout_leaves_the_segment_eager_with_a_warning():
    seg, backend = _segment(lambda inputs: (inputs[0] * 2,), [False])
    base = torch.arange(8, dtype=torch.float64)
    for it in range(2):
        seg(it, [base[:4]])
    with pytest.warns(UserWarning, match="an input came as .* captured as"):
        (out,) = seg(2, [base[2:6]])                     # another offset in its storage
    assert torch.equal(out, base[2:6] * 2) and seg.failed is not None


def test_a_cuda_build_without_graph_support_raises_a_clear_error(monkeypatch):
    from globaltensor.actor_rt.cuda_graphs import CudaGraphs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delattr(torch.cuda, "CUDAGraph", raising=False)
    with pytest.raises(RuntimeError, match="has no CUDA graph support"):
        CudaGraphs().check()
