"""Boxing from and to blocked splits: planned on the factored tensor between ``refactor`` steps
(no bytes of their own), through the plain layout when the factoring cannot describe one side;
every conversion equals distributing the logical tensor to the target directly (float64, exact)."""
import torch
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from globaltensor.boxing import plan_boxing
from boxing_helpers import check_conversion, draw_sbp
from globaltensor.sbp import broadcast as B, partial_sum as P, split as S


def _values(f: int) -> list:
    return [B, P, S(0), S(1), S(1, blocks=f), S(1, blocks=2)]


@settings(max_examples=60, deadline=None)
@given(f=st.sampled_from([2, 3, 4]), m=st.integers(1, 5), rows=st.integers(1, 5), kind=st.sampled_from(["1d", "2x2"]),
       data=st.data())
def test_every_conversion_to_and_from_blocked_splits_equals_one_device(f, m, rows, kind, data):
    shape = (rows, f * m * 2)                       # every block count offered divides the columns
    check_conversion(shape, kind, draw_sbp(data, _values(f), kind), draw_sbp(data, _values(f), kind))


def test_a_blocked_split_to_its_factored_neighbours_moves_what_the_plain_one_would(p1):
    """S(1, blocks=3) -> B is the all-gather of the same pieces S(1) would gather: the refactor
    steps cost nothing."""
    x = gt.distribute(torch.randn(4, 12), p1, S(1, blocks=3))
    blocked = plan_boxing(x._layout, x._layout.with_sbp((B,)))
    plain = plan_boxing(x._layout.with_sbp((S(1),)), x._layout.with_sbp((B,)))
    assert [s.op for s in blocked.steps] == ["refactor", "all_gather", "refactor"]
    assert blocked.bytes == plain.bytes and blocked.collectives == plain.collectives
