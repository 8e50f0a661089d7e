"""``x.to_global`` of a tensor with no graph to record: run straight from a plan made ready once
(no autograd Function). The same values, SBPs and collectives as the differentiable path, a
fresh result every call, and no graph on the result's pieces."""
import torch

import globaltensor as gt

from boxing_helpers import B, P, S, check_pieces, layout, small_integers, sbp_values


def test_repeated_conversions_agree_with_the_differentiable_path():
    """Each 1-D conversion twice without grad, once with: equal pieces, SBPs and collectives, and the
    second result does not change the first (nothing of a result is reused by the next call)."""
    with gt.simulate(3):
        pl = gt.placement("cpu", [0, 1, 2])
        t = small_integers((7, 5))
        for x in sbp_values(2):
            for y in sbp_values(2):
                g = gt.distribute(t, pl, x)
                with gt.comm_stats() as plain:
                    first = g.to_global(sbp=y)
                    kept = {r: p.clone() for r, p in first.local_tensors().items()}
                    second = g.to_global(sbp=y)
                leaf = gt.distribute(t, pl, x).requires_grad_()
                with gt.comm_stats() as recorded:
                    graphed = leaf.to_global(sbp=y)
                assert graphed.grad_fn is not None and first.grad_fn is None
                assert first.sbp == second.sbp == graphed.sbp == (y,)
                assert plain.ops() == recorded.ops() * 2 and plain.bytes_sent == 2 * recorded.bytes_sent
                check_pieces(layout((7, 5), pl, y), second.local_tensors(), t)
                for r, piece in first.local_tensors().items():
                    assert torch.equal(piece, kept[r]) and torch.equal(piece, graphed.local_tensors()[r])


def test_a_piece_that_requires_grad_gives_no_graph():
    """A local tensor given to to_global under no_grad is a piece that requires grad; boxing it
    with grad mode on must not record a graph on the result's pieces (as the Function's forward)."""
    with gt.simulate(2):
        pl = gt.placement("cpu", [0, 1])
        local = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        with torch.no_grad():
            x = local.to_global(placement=pl, sbp=B)
        assert not x.requires_grad and x.local_tensors()[0].requires_grad
        for y in (S(0), S(1), P):
            out = x.to_global(sbp=y)
            assert not out.requires_grad
            assert not any(p.requires_grad for p in out.local_tensors().values()), y
            assert torch.equal(out.full_tensor(), local.detach())


def test_sbp_given_as_a_list_and_a_new_placement():
    with gt.simulate(4):
        pl = gt.placement("cpu", [0, 1, 2, 3])
        pl2 = gt.placement("cpu", [[0, 1], [2, 3]])
        t = small_integers((8, 6))
        x = gt.distribute(t, pl, S(0))
        for _ in range(2):
            check_pieces(layout((8, 6), pl, S(1)), x.to_global(sbp=[S(1)]).local_tensors(), t)
            out = x.to_global(placement=pl2, sbp=(S(1), S(0)))
            check_pieces(layout((8, 6), pl2, (S(1), S(0))), out.local_tensors(), t)
