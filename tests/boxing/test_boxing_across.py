"""Boxing between placements: values, and bytes never above moving the tensor once plus
reducing a partial source."""
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from globaltensor.boxing import execute, plan_boxing

from boxing_helpers import B, P, S, check_pieces, layout, small_integers, make_pieces, nbytes, run_plan, sbp_values

WORLD = 8  # ranks 6 and 7 are in neither placement of most scenarios

SCENARIOS = {
    "overlapping": ([0, 1, 2], [1, 2, 3]),
    "overlapping_2_3": ([0, 1], [1, 2, 3]),
    "subset": ([0, 1, 2, 3], [1, 2]),
    "superset": ([1, 2], [0, 1, 2, 3]),
    "superset_2_5": ([0, 1], [0, 1, 2, 3, 4]),
    "superset_1_3": ([1], [1, 2, 3]),
    "disjoint": ([0, 1], [2, 3, 4]),
    "one_to_others": ([2], [0, 1]),
    "many_to_one": ([0, 1, 2, 3], [5]),
    "reversed": ([0, 1, 2, 3], [3, 2, 1, 0]),
    "1d_to_2d": ([0, 1, 2, 3], [[0, 1], [2, 3]]),
    "2d_to_1d": ([[0, 1], [2, 3]], [0, 1, 2, 3]),
    "2d_transposed": ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    "2d_disjoint": ([[0, 1], [2, 3]], [[4, 5], [6, 3]]),
    "2d_to_other_1d": ([[0, 1], [2, 3]], [4, 5, 6]),
    "1_to_2x4": ([0], [[0, 1, 2, 3], [4, 5, 6, 7]]),
}


def rs_bound(src) -> int:
    """Reducing a partial source: a ring reduce-scatter over all its ranks along the best dim
    (a 0-dim tensor: an all-reduce)."""
    if not src.has_partial:
        return 0
    T = nbytes(src.shape, src.dtype)
    p = src.placement.size
    if len(src.shape) == 0:
        return 2 * T if p > 1 else 0
    return min(T - (n // p) * (T // n) if n else T for n in src.shape)


def bound(src) -> int:
    return nbytes(src.shape, src.dtype) + rs_bound(src)


def nd_sbps(placement, ndim):
    return list(itertools.product(sbp_values(ndim), repeat=placement.ndim))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name):
    a, b = SCENARIOS[name]
    with gt.simulate(WORLD):
        sp, dp = gt.placement("cpu", a), gt.placement("cpu", b)
        cases = [(5, 3)]
        if sp.ndim == dp.ndim == 1:
            cases += [(8, 4), (3, 2), (0, 3), (), (12,)]
        for shape in cases:
            t = small_integers(shape, seed=len(shape))
            for x in nd_sbps(sp, len(shape)):
                for y in nd_sbps(dp, len(shape)):
                    src, dst = layout(shape, sp, x), layout(shape, dp, y)
                    plan, _ = run_plan(src, dst, t)
                    assert plan.bytes <= bound(src), (plan, bound(src))


@st.composite
def placements(draw, world=WORLD):
    k = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    ranks = draw(st.permutations(range(world)))[:k]
    shapes = [(k,)] + [(a, k // a) for a in range(2, k) if k % a == 0] + ([(2, 2, 2)] if k == 8 else [])
    h = draw(st.sampled_from(shapes))
    return gt.placement("cpu", np.array(ranks).reshape(h).tolist())


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_placements(data):
    with gt.simulate(WORLD):
        sp = data.draw(placements(), label="src placement")
        dp = data.draw(placements(), label="dst placement")
        ndim = data.draw(st.integers(0, 3), label="ndim")
        shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim), label="shape"))
        vals = sbp_values(ndim)
        x = tuple(data.draw(st.lists(st.sampled_from(vals), min_size=sp.ndim, max_size=sp.ndim), label="src sbp"))
        y = tuple(data.draw(st.lists(st.sampled_from(vals), min_size=dp.ndim, max_size=dp.ndim), label="dst sbp"))
        src, dst = layout(shape, sp, x), layout(shape, dp, y)
        plan, _ = run_plan(src, dst, small_integers(shape, seed=ndim), seed=ndim)
        assert plan.bytes <= bound(src), (plan, bound(src))


@pytest.mark.parametrize("x", [B, P, S(0), S(1)])
@pytest.mark.parametrize("y", [B, P, S(0), S(1)])
def test_to_global_between_placements(x, y):
    """The user API: placement= and sbp= change at once; the world has a rank in neither."""
    with gt.simulate(6):
        p1, p2 = gt.placement("cpu", [0, 1, 2]), gt.placement("cpu", [2, 3, 4])
        t = small_integers((7, 5))
        g = gt.distribute(t, p1, x)
        with gt.comm_stats() as st_:
            out = g.to_global(placement=p2, sbp=y)
        assert out.placement == p2 and out.sbp == (y,)
        check_pieces(layout(t.shape, p2, y), out.local_tensors(), t)
        assert st_.bytes_sent == gt.boxing_plan(g, placement=p2, sbp=y).bytes <= bound(layout(t.shape, p1, x))
        # and back onto a 2-D placement of other ranks
        p3 = gt.placement("cpu", [[1, 5], [0, 3]])
        back = out.to_global(placement=p3, sbp=(x, y))
        check_pieces(layout(t.shape, p3, (x, y)), back.local_tensors(), t)
        assert torch.equal(back.full_tensor(), t) if not (x.is_partial or y.is_partial) else \
            torch.allclose(back.full_tensor(), t)


def test_partial_pieces_between_placements():
    with gt.simulate(5):
        sp, dp = gt.placement("cpu", [[0, 1], [2, 3]]), gt.placement("cpu", [1, 4])
        t = small_integers((6, 4))
        src = layout(t.shape, sp, (P, S(1)))
        g = gt.GlobalTensor(src, make_pieces(src, t, seed=3))
        out = g.to_global(placement=dp, sbp=B)
        check_pieces(layout(t.shape, dp, B), out.local_tensors(), t)


def test_full_tensor_of_a_tensor_on_some_ranks():
    """full_tensor() reaches ranks outside the placement (a B -> B move to a superset)."""
    with gt.simulate(4):
        t = small_integers((5, 2))
        for ranks in ([0, 1], [2, 3], [1], [3, 1]):
            g = gt.distribute(t, gt.placement("cpu", ranks), S(0))
            assert torch.equal(g.full_tensor(), t)
            assert torch.equal(torch.as_tensor(g.numpy()), t)


def test_b_to_b_superset_keeps_and_broadcasts():
    """Ranks in both placements keep their copy; the others get the tensor from a holder in one
    collective (a broadcast, or sends spread over the replicas), |T| from the busiest rank."""
    with gt.simulate(4):
        src = layout((4, 4), gt.placement("cpu", [1, 2]), B)
        dst = layout((4, 4), gt.placement("cpu", [0, 1, 2, 3]), B)
        plan, st_ = run_plan(src, dst, small_integers((4, 4)))
        assert st_.count == 1 and st_.ops()[0] in ("broadcast", "send_recv")
        assert plan.bytes == nbytes((4, 4))
        assert plan.bytes_per_rank.get(0, 0) == plan.bytes_per_rank.get(3, 0) == 0


def test_same_ranks_same_pieces_move_nothing():
    """[0..3] S(0) and [[0,1],[2,3]] (S(0), S(0)) hold the same blocks when the dim divides evenly."""
    with gt.simulate(4):
        src = layout((8, 3), gt.placement("cpu", [0, 1, 2, 3]), S(0))
        dst = layout((8, 3), gt.placement("cpu", [[0, 1], [2, 3]]), (S(0), S(0)))
        plan, st_ = run_plan(src, dst, small_integers((8, 3)))
        assert plan.bytes == 0 and st_.count == 0
        plan, st_ = run_plan(dst, src, small_integers((8, 3)))
        assert plan.bytes == 0 and st_.count == 0


def test_s_to_b_on_overlapping_ranks_within_one_tensor():
    """[0,1] S(0) -> [1,2,3] B: the busiest rank sends at most |T| (a landing on [1,2,3] and an
    all-gather there costs rank 1 |T|/2 + 2|T|/3)."""
    with gt.simulate(4):
        src = layout((12, 4), gt.placement("cpu", [0, 1]), S(0))
        dst = layout((12, 4), gt.placement("cpu", [1, 2, 3]), B)
        plan, _ = run_plan(src, dst, small_integers((12, 4)))
        assert plan.bytes <= nbytes((12, 4))


# -- gt.boxing_plan ----------------------------------------------------------------------

def test_boxing_plan_runs_nothing():
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        p2 = gt.placement("cpu", [[0, 1], [2, 3]])
        t = small_integers((8, 6))
        x = gt.distribute(t, p, S(0))
        before = {r: v.clone() for r, v in x.local_tensors().items()}
        with gt.comm_stats() as st_:
            plan = gt.boxing_plan(x, sbp=B)
            plan2 = gt.boxing_plan(x, placement=p2, sbp=(S(1), B))
            plan3 = gt.boxing_plan(x)
        assert st_.count == 0 and st_.bytes_sent == 0
        assert isinstance(plan, gt.Plan)
        (step,) = plan.steps
        assert isinstance(step, gt.Step)
        assert step.op == "all_gather" and step.groups == ((0, 1, 2, 3),)
        assert step.bytes == plan.bytes == 3 * nbytes((8, 6)) // 4
        assert plan3.steps == () and plan3.bytes == 0
        assert plan2.steps and all(s.op and isinstance(s.groups, tuple) for s in plan2.steps)
        assert "all_gather" in repr(plan)
        for r, v in x.local_tensors().items():
            assert torch.equal(v, before[r])
        # running it costs what the plan says
        with gt.comm_stats() as st_:
            x.to_global(placement=p2, sbp=(S(1), B))
        assert st_.bytes_sent == plan2.bytes


def test_boxing_plan_bad_input():
    with gt.simulate(4):
        x = gt.distribute(small_integers((4, 4)), gt.placement("cpu", [0, 1, 2, 3]), S(0))
        with pytest.raises(TypeError, match="global tensor"):
            gt.boxing_plan(torch.zeros(3), sbp=B)
        with pytest.raises(ValueError, match=r"split dim 2 is out of range"):
            gt.boxing_plan(x, sbp=S(2))
        with pytest.raises(ValueError, match=r"expected 2 SBP value"):
            gt.boxing_plan(x, placement=gt.placement("cpu", [[0, 1], [2, 3]]), sbp=B)


def test_plan_boxing_rejects_shape_or_dtype_change():
    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        with pytest.raises(ValueError, match="same shape and dtype"):
            plan_boxing(layout((4,), p, B), layout((5,), p, B))
        with pytest.raises(ValueError, match="same shape and dtype"):
            plan_boxing(layout((4,), p, B), layout((4,), p, B, torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("x", [B, P, S(0)])
@pytest.mark.parametrize("y", [B, P, S(1)])
def test_between_device_types(x, y):
    with gt.simulate(4):
        t = small_integers((5, 3))
        for a, b in [(gt.placement("cpu", [0, 1]), gt.placement("cuda", [1, 2, 3])),
                     (gt.placement("cuda", [[0, 1], [2, 3]]), gt.placement("cpu", [3, 0]))]:
            src, dst = layout(t.shape, a, (x,) * a.ndim), layout(t.shape, b, (y,) * b.ndim)
            pieces = {r: v.to(a.type) for r, v in make_pieces(src, t).items()}
            with gt.comm_stats() as st_:
                out = execute(plan_boxing(src, dst), pieces, gt.get_world())
            assert all(v.device.type == b.type for v in out.values())
            check_pieces(dst, {r: v.cpu() for r, v in out.items()}, t)
            assert st_.bytes_sent == plan_boxing(src, dst).bytes <= bound(src)
