"""Split kinds are the framework's (ops/registry.py ``any_order``, sbp/split_kinds.py): a rule that
runs the op on each rank's pieces says nothing of kinds and every kind passes through it; a rule
with a kernel passes them only where it says so; ``any_order=False`` opts a rule out."""
import pytest
import torch

import globaltensor as gt
from globaltensor.ops import registry
from globaltensor.ops.registry import RULES, find_rule
from globaltensor.sbp import split as S

aten = torch.ops.aten
HT = S(1, order="head_tail")
KINDS = [HT, S(1, blocks=2), S(1, blocks=2, order="head_tail")]
# hypot is correctly rounded to within an ulp, and its vectorised and scalar loops (a piece's length
# decides which runs where) round apart by one: 2 ulp of float64
TOL = dict(rtol=4.5e-16, atol=0)


@pytest.fixture
def hypot_rule():
    """Registers rules for ``aten.hypot`` in the test, and puts back the library's after it."""
    op = aten.hypot.default
    saved = RULES.get(op)
    yield lambda *a, **k: gt.register_rule(op, *a, **k)
    if saved is None:
        RULES.pop(op, None)
        for drop_decisions in registry._listeners:
            drop_decisions()
    else:
        gt.register_rule(op, saved.candidates, local=saved.local, check_shapes=saved.check_shapes,
                         kernel=saved.kernel, out_meta=saved.out_meta, kernel_bytes=saved.kernel_bytes,
                         admit=saved.admit, any_order=saved.any_order, keyed=saved.keyed)


def _both(sbp, shape=(3, 16)):
    a, b = torch.randn(*shape, dtype=torch.float64), torch.randn(*shape, dtype=torch.float64)
    p = gt.placement("cpu", [0, 1, 2, 3])
    return (a, b), (gt.distribute(a, p, sbp), gt.distribute(b, p, sbp))


@pytest.mark.parametrize("sbp", KINDS, ids=str)
def test_a_users_rule_on_plain_pieces_passes_every_split_kind_without_naming_one(world4, hypot_rule, sbp):
    hypot_rule(["S(0), S(0) -> S(0)", "S(1), S(1) -> S(1)"])
    (a, b), (ga, gb) = _both(sbp)
    with gt.comm_stats() as st:
        y = torch.hypot(ga, gb)
    assert st.count == 0 and y.sbp == (sbp,)
    torch.testing.assert_close(y.full_tensor(), torch.hypot(a, b), **TOL)


@pytest.mark.parametrize("sbp", KINDS, ids=str)
def test_a_kernel_rule_boxes_other_kinds_unless_it_says_its_candidates_hold_in_any_order(world4, hypot_rule, sbp):
    def kernel(func, args, kwargs, ins, outs, calls):
        return {r: func(*a, **kw) for r, (a, kw) in calls.items()}
    hypot_rule(["S(1), S(1) -> S(1)"], kernel=kernel)
    assert not find_rule(aten.hypot.default).takes_kinds
    (a, b), (ga, gb) = _both(sbp)
    y = torch.hypot(ga, gb)
    assert y.sbp != (sbp,)
    torch.testing.assert_close(y.full_tensor(), torch.hypot(a, b), **TOL)
    hypot_rule(["S(1), S(1) -> S(1)"], kernel=kernel, any_order=True)
    with gt.comm_stats() as st:
        y = torch.hypot(ga, gb)
    assert st.count == 0 and y.sbp == (sbp,)
    torch.testing.assert_close(y.full_tensor(), torch.hypot(a, b), **TOL)


def test_any_order_false_opts_a_plain_rule_out_and_a_function_names_some_candidates(world4, hypot_rule):
    hypot_rule(["S(0), S(0) -> S(0)", "S(1), S(1) -> S(1)"], any_order=False)
    (a, b), (ga, gb) = _both(HT)
    assert torch.hypot(ga, gb).sbp != (HT,)
    hypot_rule(["S(0), S(0) -> S(0)", "S(1), S(1) -> S(1)"], any_order=lambda x, y: ["S(0), S(0) -> S(0)"])
    assert torch.hypot(ga, gb).sbp != (HT,)                       # S(1) is not among those named
    (a, b), (ga, gb) = _both(S(0, order="head_tail"), shape=(16, 3))
    y = torch.hypot(ga, gb)
    assert y.sbp == (S(0, order="head_tail"),)
    torch.testing.assert_close(y.full_tensor(), torch.hypot(a, b), **TOL)


def test_any_order_of_another_type_is_a_type_error_at_registration():
    with pytest.raises(TypeError, match=r"any_order= must be True, False or a function .* got 'head_tail'"):
        gt.register_rule(aten.hypot.default, ["S(0), S(0) -> S(0)"], any_order="head_tail")
