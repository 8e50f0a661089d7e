"""g.pipeline(): many calls overlapped, outputs in order, each equal to the eager call; 2-stage
pipeline parallelism (stage 1 on ranks [0, 1], stage 2 on [2, 3]) and micro_batches=m training,
whose parameters equal the eager full-batch step and whose returned loss is the mean of the
micro-batches' losses."""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt
from compile_helpers import assert_close_rel, assert_parameters_close, module_maker
from globaltensor.tensor import GlobalTensor
from nn_models import training_step

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


# -- forward pipelines ---------------------------------------------------------------------------
@pytest.mark.parametrize("registers", [1, 2, 3])
def test_pipeline_outputs_equal_eager_per_item(p1, registers):
    w = gt.randn(7, 5, placement=p1, sbp=S(1))

    def fn(x):
        y = torch.tanh(x @ w)                       # S(0) @ S(1): boxing inside
        return y.to_global(sbp=B), y.sum(dim=0)
    xs = [gt.randn(10, 7, placement=p1, sbp=S(0)) for _ in range(6)]
    g = gt.compile(fn, registers=registers)
    outs = g.pipeline(xs)
    assert len(outs) == len(xs)
    for i, (x, (y, s)) in enumerate(zip(xs, outs)):
        y_ref, s_ref = fn(x)
        assert_close_rel(y, y_ref, f"item {i}: y")
        assert_close_rel(s, s_ref, f"item {i}: sum")
    again = g.pipeline(xs[::-1])                   # the captured graph again, other order
    for i, (x, (y, _)) in enumerate(zip(xs[::-1], again)):
        assert_close_rel(y, fn(x)[0], f"second pipeline, item {i}")
    assert g.captures == 1


def test_pipeline_items_tuples_and_keyword_free_single_arguments(p1):
    def two(x, y):
        return (x * y).to_global(sbp=B)
    pairs = [(gt.randn(8, 3, placement=p1, sbp=S(0)), gt.randn(8, 3, placement=p1, sbp=S(1))) for _ in range(4)]
    g = gt.compile(two, warmup=0)
    for i, (out, (x, y)) in enumerate(zip(g.pipeline(pairs), pairs)):
        assert_close_rel(out, two(x, y), f"pair {i}")

    def one(x):
        return x.to_global(sbp=S(1)) + 1.0
    xs = [gt.randn(8, 3, placement=p1, sbp=S(0)) for _ in range(4)]
    h = gt.compile(one, warmup=0)
    for i, (out, x) in enumerate(zip(h.pipeline(xs), xs)):
        assert_close_rel(out, one(x), f"single {i}")


def test_pipeline_with_several_metas_keeps_order(p1):
    def fn(x):
        return x.to_global(sbp=B) * 2.0
    xs = [gt.randn(n, 3, placement=p1, sbp=sbp) for n, sbp in
          [(8, S(0)), (8, S(0)), (9, S(0)), (8, S(0)), (9, S(0)), (8, S(1)), (8, S(0)), (9, S(0))]]
    g = gt.compile(fn, warmup=0)
    outs = g.pipeline(xs)
    for i, (out, x) in enumerate(zip(outs, xs)):
        assert_close_rel(out, fn(x), f"item {i}")
    assert g.captures == 3


def test_pipelined_training_steps_are_sequential_steps(p1):
    """Overlapped iterations of a step that updates state: item i sees the parameters after step
    i - 1 (each step's loss equals the eager step's); the parameters end as eager's."""
    make = module_maker(p1, {}, lambda m: torch.optim.AdamW(m.parameters(), lr=0.01))
    m_e, _, step_e = make()
    m_c, _, step_c = make()
    gen = torch.Generator().manual_seed(0)
    xs = [gt.distribute(torch.randn(8, 6, generator=gen), p1, S(0)) for _ in range(6)]
    g = gt.compile(step_c)
    losses = g.pipeline(xs)
    for i, (loss, x) in enumerate(zip(losses, xs)):
        assert_close_rel(loss, step_e(x), f"step {i}: loss")
    assert_parameters_close(m_c, m_e, "after the pipeline")


# -- two stages ----------------------------------------------------------------------------------
def two_stage(pa, pb, optimizer=None):
    """Stage 1 (ranks 0, 1) and stage 2 (ranks 2, 3), data parallel inside each stage; the
    activations move between them with to_global(placement=pb, ...)."""
    torch.manual_seed(0)
    w1 = torch.randn(6, 8).to_global(placement=pa, sbp=B).clone().requires_grad_()
    b1 = torch.randn(8).to_global(placement=pa, sbp=B).clone().requires_grad_()
    w2 = torch.randn(8, 3).to_global(placement=pb, sbp=B).clone().requires_grad_()
    params = [w1, b1, w2]
    opt = (optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)))(params)

    def forward(x):
        h = torch.tanh(x @ w1 + b1)
        h = h.to_global(placement=pb, sbp=S(0))
        return h @ w2
    return params, forward, training_step(lambda x, y: ((forward(x) - y) ** 2).mean(), opt)


def _stage_batches(pa, pb, n: int, rows: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [(gt.distribute(torch.randn(rows, 6, generator=gen), pa, S(0)),
             gt.distribute(torch.randn(rows, 3, generator=gen), pb, S(0))) for _ in range(n)]


def test_two_stage_forward_pipelined(pa, pb):
    _, forward, _ = two_stage(pa, pb)
    xs = [x for x, _ in _stage_batches(pa, pb, 6)]
    g = gt.compile(forward)
    outs = g.pipeline(xs)
    for i, (out, x) in enumerate(zip(outs, xs)):
        ref = forward(x)
        assert out.placement == pb
        assert_close_rel(out, ref, f"item {i}")
    with gt.comm_stats() as st:
        g.pipeline(xs[:2])
    assert st.count >= 2, "the activations cross from stage 1 to stage 2 in every call"


@pytest.mark.parametrize("registers", [1, 2, 4])
def test_two_stage_micro_batch_training_equals_full_batch_step(pa, pb, registers):
    params_e, forward_e, step_e = two_stage(pa, pb)
    params_c, _, step_c = two_stage(pa, pb)
    g = gt.compile(step_c, registers=registers, micro_batches=4)
    for s, (x, y) in enumerate(_stage_batches(pa, pb, 4)):
        with torch.no_grad():                    # the micro-batches' own losses, eagerly, before the step
            mb_losses = [((forward_e(x_j) - y_j) ** 2).mean().full_tensor()
                         for x_j, y_j in zip(_micro(x, 4), _micro(y, 4))]
        loss_e = step_e(x, y)                    # the full-batch step
        loss_c = g(x, y)
        assert_close_rel(loss_c, loss_e, f"step {s}: loss")
        torch.testing.assert_close(loss_c.full_tensor(), torch.stack(mb_losses).mean(), rtol=1e-12, atol=0,
                                   msg=lambda m: f"step {s}: the mean of the micro-batches' losses: {m}")
        for i, (pc, pe) in enumerate(zip(params_c, params_e)):
            assert_close_rel(pc, pe, f"step {s}: parameter {i}")
    assert g.captures == 1


def _micro(t: GlobalTensor, m: int) -> list:
    """The m micro-batches of a batch split S(0): each rank's piece split along dim 0."""
    pieces = t.local_tensors()
    out = []
    for j in range(m):
        local = {r: p.narrow(0, j * (p.shape[0] // m), p.shape[0] // m) for r, p in pieces.items()}
        out.append(gt.distribute(torch.cat([local[r] for r in sorted(local)]), t.placement, S(0)))
    return out


def test_two_stage_micro_batches_pipelined(pa, pb):
    """g.pipeline of micro-batched steps: each step's loss is eager's full-batch loss, and the
    parameters end as after the eager steps."""
    params_e, _, step_e = two_stage(pa, pb)
    params_c, _, step_c = two_stage(pa, pb)
    batches = _stage_batches(pa, pb, 5, seed=3)
    g = gt.compile(step_c, micro_batches=4)
    losses = g.pipeline(batches)
    for s, (loss, (x, y)) in enumerate(zip(losses, batches)):
        assert_close_rel(loss, step_e(x, y), f"step {s}: loss")
    for i, (pc, pe) in enumerate(zip(params_c, params_e)):
        assert_close_rel(pc, pe, f"after the pipeline: parameter {i}")


def test_micro_batches_data_parallel_adamw(p1):
    """micro_batches=4 on a 1-D data-parallel gt.nn model with AdamW: the full-batch step."""
    make = module_maker(p1, {}, lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1))
    m_e, _, step_e = make()
    m_c, _, step_c = make()
    g = gt.compile(step_c, micro_batches=4)
    gen = torch.Generator().manual_seed(5)
    for s in range(3):
        x = gt.distribute(torch.randn(16, 6, generator=gen), p1, S(0))
        assert_close_rel(g(x), step_e(x), f"step {s}: loss")
        assert_parameters_close(m_c, m_e, f"step {s}")


def test_micro_batches_need_an_even_split(pa, pb):
    _, _, step = two_stage(pa, pb)
    g = gt.compile(step, micro_batches=4, warmup=0)
    x = gt.distribute(torch.randn(6, 6), pa, S(0))            # 3 rows a rank: not 4 micro-batches
    y = gt.distribute(torch.randn(6, 3), pb, S(0))
    with pytest.raises(ValueError, match="micro"):
        g(x, y)
