"""Split kinds (sbp/split_kinds.py): the kinds a set of layouts holds, and a candidate turned into a
kind -- every split of it, on every tensor, in that one kind; its broadcast and partial entries as
they were; a split a candidate blocks itself keeps its blocks and takes only an order."""
from hypothesis import given, strategies as st

from globaltensor.sbp import Signature, broadcast as B, partial_sum as P, split as S
from globaltensor.sbp.split_kinds import PLAIN, in_kind, kind_of, kind_variants, kinds_held
from globaltensor.sbp.values import ORDERS

KINDS = st.tuples(st.integers(1, 4), st.sampled_from(ORDERS))
PLAIN_VALUES = st.one_of(st.just(B), st.just(P), st.integers(0, 3).map(S))


@st.composite
def plain_candidates(draw):
    n_in, n_out = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    return Signature(tuple(draw(st.lists(PLAIN_VALUES, min_size=n_in, max_size=n_in))),
                     tuple(draw(st.lists(PLAIN_VALUES, min_size=n_out, max_size=n_out))))


@given(c=plain_candidates(), kind=KINDS)
def test_a_plain_candidate_takes_the_kind_on_every_split_and_nothing_else(c, kind):
    turned = in_kind(c, kind)
    if not any(v.is_split for v in c.inputs + c.outputs):
        assert turned is None
        return
    for was, now in zip(c.inputs + c.outputs, turned.inputs + turned.outputs):
        if was.is_split:
            assert now.dim == was.dim and kind_of(now) == kind
        else:
            assert now == was
    assert in_kind(c, PLAIN) == c


@given(blocks=st.integers(2, 4), kind=KINDS)
def test_a_split_the_candidate_blocks_itself_keeps_its_blocks_and_takes_only_an_order(blocks, kind):
    """A view merging ``(batch, heads)``: ``S(1) -> S(0, blocks=b)``."""
    own = Signature((S(1),), (S(0, blocks=blocks),))
    turned = in_kind(own, kind)
    if kind[1] == "plain":
        assert turned is None
    else:
        assert turned == Signature((S(1, order=kind[1]),), (S(0, blocks=blocks, order=kind[1]),))


@given(nds=st.lists(st.lists(st.one_of(PLAIN_VALUES, st.builds(lambda d, k: S(d, k[0], k[1]), st.integers(0, 3),
                                                                 KINDS)), min_size=1, max_size=2), max_size=4))
def test_kinds_held_are_every_kind_but_the_plain_one_once(nds):
    held = kinds_held(tuple(nd) for nd in nds)
    want = {kind_of(v) for nd in nds for v in nd if v.is_split} - {PLAIN}
    assert held == sorted(want)


def test_variants_keep_the_candidates_order_and_repeat_nothing():
    cands = [Signature((S(0), B), (S(0),)), Signature((B, S(1)), (S(1),)), Signature((P, B), (P,))]
    got = kind_variants(cands + cands[:1], [(2, "plain"), (1, "head_tail")])
    assert got == [Signature((S(0, 2), B), (S(0, 2),)), Signature((B, S(1, 2)), (S(1, 2),)),
                   Signature((S(0, order="head_tail"), B), (S(0, order="head_tail"),)),
                   Signature((B, S(1, order="head_tail")), (S(1, order="head_tail"),))]
