"""The candidate filters (ops/decide/filters.py), each on its own: a candidate it must keep and one
it must leave out, on layouts built by hand, with no op run but the meta one of ``pieces_line_up``."""
import torch

import globaltensor as gt
from globaltensor.boxing import Layout
from globaltensor.ops.decide.filters import (FILTERS, Call, admitted, admitted_by_rule, keeps_written, lays_out_blocks,
                                             pieces_line_up, same_chunks)
from globaltensor.ops.registry import Rule, find_rule
from globaltensor.ops.schema.args import tensor_positions
from globaltensor.sbp import NdSignature, broadcast as B, split as S

aten = torch.ops.aten
F64 = torch.float64


def _call(in_shapes_sbps, out_shapes, *, func=aten.add.Tensor, args=(), rule=None, written=(), returned=None):
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
    layouts = [Layout(shape, F64, p, (sbp,)) for shape, sbp in in_shapes_sbps]
    return Call(func, args, {}, tensor_positions(args, {}), rule or Rule(lambda *a: []), p, layouts,
                [(shape, F64) for shape in out_shapes], list(written), returned or {})


def _c(ins, outs) -> NdSignature:
    return NdSignature(tuple((v,) for v in ins), tuple((v,) for v in outs))


def test_keeps_written_holds_a_written_input_and_the_output_returning_it_in_their_layouts():
    call = _call([((8, 4), S(0)), ((8, 4), B)], [(8, 4)], written=[0], returned={0: 0})
    assert keeps_written(_c([S(0), B], [S(0)]), call)
    assert not keeps_written(_c([B, B], [B]), call)              # the written input would be boxed
    assert not keeps_written(_c([S(0), S(0)], [S(1)]), call)     # the output returning it in another layout


def test_lays_out_blocks_leaves_out_blocks_that_do_not_divide_the_dim():
    call = _call([((12, 4), B)], [(12, 4)])
    assert lays_out_blocks(_c([S(0, blocks=3)], [S(0, blocks=3)]), call)
    assert not lays_out_blocks(_c([S(0, blocks=5)], [S(0, blocks=5)]), call)
    assert lays_out_blocks(_c([S(0, blocks=5)], [B]), _call([((10, 4), B)], [(10, 4)]))


def test_same_chunks_keeps_a_merge_that_keeps_the_sequences_chunks_apart():
    """``[b, t] -> [b*t]`` with t split head-tail: chunks of t / 8 in both; ``[t, h] -> [t*h]``: chunks
    of t / 8 in, (t*h) / 8 out -- chunk i is not the same indices."""
    ht = dict(order="head_tail")
    merge_batch = _call([((2, 16), S(1, **ht))], [(32,)])
    assert same_chunks(_c([S(1, **ht)], [S(0, blocks=2, **ht)]), merge_batch)
    merge_heads = _call([((16, 2), S(0, **ht))], [(32,)])
    assert not same_chunks(_c([S(0, **ht)], [S(0, **ht)]), merge_heads)
    assert same_chunks(_c([S(0)], [S(0)]), merge_heads)           # plain order: nothing to agree on


def test_admitted_by_rule_asks_the_rules_admit_with_the_layouts_as_they_come_and_as_asked():
    seen = []

    def admit(ins, asked):
        seen.append(([lay.nd_sbp for lay in ins], [lay.nd_sbp for lay in asked]))
        return asked[0].nd_sbp == ins[0].nd_sbp
    call = _call([((8, 4), S(0))], [(8, 4)], rule=Rule(lambda *a: [], admit=admit))
    assert admitted_by_rule(_c([S(0)], [S(0)]), call)
    assert not admitted_by_rule(_c([S(1)], [S(1)]), call)
    assert seen == [([(S(0),)], [(S(0),)]), ([(S(0),)], [(S(1),)])]
    assert admitted_by_rule(_c([S(1)], [S(1)]), _call([((8, 4), S(0))], [(8, 4)]))   # no admit: all pass


def test_pieces_line_up_runs_the_view_on_each_distinct_piece_shape():
    """``[4, 6] -> [24]`` with rows split: pieces of 6 each, as the balanced split of 24 gives;
    ``[3, 8] -> [24]``: rows 1, 1, 1, 0 give 8, 8, 8, 0 against 6 each."""
    view = aten.view.default
    fits = _call([((4, 6), S(0))], [(24,)], func=view, args=(torch.empty(4, 6, dtype=F64, device="meta"), [24]),
                 rule=find_rule(view))
    assert pieces_line_up(_c([S(0)], [S(0)]), fits)
    misfits = _call([((3, 8), S(0))], [(24,)], func=view, args=(torch.empty(3, 8, dtype=F64, device="meta"), [24]),
                    rule=find_rule(view))
    assert not pieces_line_up(_c([S(0)], [S(0)]), misfits)


def test_admitted_runs_every_filter_in_order():
    assert FILTERS == (keeps_written, lays_out_blocks, same_chunks, admitted_by_rule, pieces_line_up)
    call = _call([((12, 4), S(0))], [(12, 4)], written=[0])
    kept, boxed, unfit = _c([S(0)], [S(0)]), _c([B], [B]), _c([S(0, blocks=5)], [S(0, blocks=5)])
    assert admitted([kept, boxed, unfit], call) == [kept]
