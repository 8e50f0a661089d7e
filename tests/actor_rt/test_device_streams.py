"""Stream assignment in a simulated world: by default (``streams="shared"``) the ranks share their
device's streams -- one stream for the CPU, run on the caller's thread --; ``"device"`` gives each
device its compute / collective streams, ``"rank"`` each rank its own (lower.py)."""
import threading

import pytest
import torch

import globaltensor as gt
from nn_models import training_step

S, B = gt.sbp.split, gt.sbp.broadcast


def _step(p):
    torch.manual_seed(0)
    w1 = torch.randn(8, 16).to_global(placement=p, sbp=(B, S(1))).requires_grad_()
    w2 = torch.randn(16, 4).to_global(placement=p, sbp=(B, S(0))).requires_grad_()
    opt = torch.optim.AdamW([w1, w2], lr=1e-2)
    return training_step(lambda x, y: ((torch.tanh(x @ w1) @ w2 - y) ** 2).mean(), opt), (w1, w2)


def _compiled_trains_as_eager(streams):
    """Four steps compiled with ``streams`` beside the eager steps, on a 2x2 placement; the graph."""
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    eager, eager_params = _step(p)
    step, params = _step(p)
    g = gt.compile(step, streams=streams)
    for i in range(4):
        x, y = gt.randn(8, 8, placement=p, sbp=(S(0), B)), gt.randn(8, 4, placement=p, sbp=(S(0), B))
        want, got = eager(x, y), g(x, y)
        # float64 (conftest): the compiled step differs from eager by rounding of a few operations
        torch.testing.assert_close(got.full_tensor(), want.full_tensor(), rtol=1e-12, atol=0)
        for a, b in zip(params, eager_params):
            torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-12, atol=1e-15)
    return g


def test_simulated_ranks_share_one_compute_and_one_collective_stream_and_train_as_eager(world4):
    g = _compiled_trains_as_eager("device")
    assert set(g.plan.streams) == {"cpu:compute", "cpu:collective"}, g.plan
    assert {t.rank for t in g.plan.tasks} == {0, 1, 2, 3}


@pytest.mark.parametrize("streams", [None, "shared"])
def test_a_simulated_cpu_world_runs_its_graph_on_the_callers_thread(world4, streams):
    before = set(threading.enumerate())     # threads of earlier tests may end meanwhile: count only new ones
    g = _compiled_trains_as_eager(streams)
    assert set(g.plan.streams) == {"cpu"}, g.plan
    assert any(t.node is not None and t.node.kind == "collective" for t in g.plan.tasks), "collectives run inline too"
    started = [t for t in threading.enumerate() if t not in before]
    assert not started, f"the graph started threads: {started}"


def test_rank_streams_give_each_rank_its_own(world4):
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    step, _ = _step(p)
    g = gt.compile(step, streams="rank")
    x, y = gt.randn(8, 8, placement=p, sbp=(S(0), B)), gt.randn(8, 4, placement=p, sbp=(S(0), B))
    for _ in range(3):
        g(x, y)
    assert {f"r{r}:compute" for r in range(4)} <= set(g.plan.streams), g.plan
    assert all(t.stream.startswith(f"r{t.rank}:") for t in g.plan.tasks)


def test_streams_must_be_none_device_or_a_function():
    with pytest.raises(ValueError, match="streams"):
        gt.compile(lambda x: x, streams="per-thread")
