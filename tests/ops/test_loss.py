"""nll_loss / nll_loss2d rules (what cross_entropy reaches), cross_entropy on random layouts,
and loss parallelism: class-split logits whose [N, C] values never move."""
import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from harness import candidate_signatures, check_candidates, check_layouts
from storage_peaks import torchtitan_loss_peak

aten = torch.ops.aten
S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
NONE, MEAN, SUM = 0, 1, 2



def _targets(n, c, *rest, ignore=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, c, (n, *rest), generator=g)
    t.view(-1)[1] = ignore   # one ignored target
    return t


# (N, C): even, uneven, fewer classes and rows than the 4 ranks (empty pieces)
SHAPES = [(8, 6), (7, 5), (3, 2)]


@pytest.mark.parametrize("n,c", SHAPES)
@pytest.mark.parametrize("reduction", [NONE, MEAN, SUM])
def test_nll_loss_candidates(n, c, reduction):
    torch.manual_seed(n * 10 + reduction)
    x = torch.randn(n, c).log_softmax(1)
    t = _targets(n, c)
    w = torch.rand(c) + 0.5
    for weight in (None, w):
        assert check_candidates(aten.nll_loss_forward.default, x, t, weight, reduction, -100, max_2d=8) >= 3
        out, total = aten.nll_loss_forward.default(x, t, weight, reduction, -100)
        g = torch.randn(n) if reduction == NONE else torch.randn(())
        assert check_candidates(aten.nll_loss_backward.default, g, x, t, weight, reduction, -100, total,
                                max_2d=8) >= 3


@pytest.mark.parametrize("reduction", [NONE, MEAN, SUM])
def test_nll_loss_ignore_index_is_a_class(reduction):
    """ignore_index may name a real class: those targets are ignored on every rank, and no
    rank's shifted classes collide with the ignore_index of its local call."""
    torch.manual_seed(1)
    x = torch.randn(9, 7)
    t = torch.tensor([0, 2, 6, 2, 3, 5, 1, 2, 4])
    check_candidates(aten.nll_loss_forward.default, x, t, torch.rand(7), reduction, 2, max_2d=8)
    out, total = aten.nll_loss_forward.default(x, t, None, reduction, 2)
    g = torch.randn(9) if reduction == NONE else torch.randn(())
    check_candidates(aten.nll_loss_backward.default, g, x, t, None, reduction, 2, total, max_2d=8)


@pytest.mark.parametrize("reduction", [NONE, MEAN, SUM])
def test_nll_loss2d_candidates(reduction):
    torch.manual_seed(2)
    x = torch.randn(3, 5, 4, 2).log_softmax(1)
    t = _targets(3, 5, 4, 2)
    check_candidates(aten.nll_loss2d_forward.default, x, t, torch.rand(5), reduction, -100, max_2d=8)
    out, total = aten.nll_loss2d_forward.default(x, t, None, reduction, -100)
    g = torch.randn(3, 4, 2) if reduction == NONE else torch.randn(())
    check_candidates(aten.nll_loss2d_backward.default, g, x, t, None, reduction, -100, total, max_2d=8)


def test_nll_candidate_sets():
    """The batch split keeps the target split (a mean all-reduces its total weight, one scalar) or,
    for a mean, takes it whole; the class split always takes it whole."""
    x, t = torch.randn(8, 6), torch.randint(0, 6, (8,))
    cands = {red: {(c.inputs, c.outputs) for c in candidate_signatures(aten.nll_loss_forward.default, x, t, None,
                                                                       red, -100)} for red in (NONE, MEAN, SUM)}
    assert ((S(0), S(0)), (S(0), B)) in cands[NONE]
    assert ((S(0), S(0)), (P, P)) in cands[SUM]
    assert ((S(0), B), (P, B)) in cands[MEAN] and ((S(0), S(0)), (P, B)) in cands[MEAN]
    for red, outs in ((NONE, (P, B)), (SUM, (P, P)), (MEAN, (P, B))):
        assert ((S(1), B), outs) in cands[red]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_random_layouts(reduction):
    torch.manual_seed(3)
    x, t = torch.randn(7, 5), _targets(7, 5)
    w = torch.rand(5) + 0.5

    def ce(x, t):
        return F.cross_entropy(x, t, reduction=reduction)

    def ce_weighted(x, t):
        return F.cross_entropy(x, t, weight=w, reduction=reduction, ignore_index=3)

    check_layouts(ce, x, t, grad=True, trials=4)
    check_layouts(ce_weighted, x, t.clamp(min=0), grad=True, trials=3, seed=1)


def test_cross_entropy_spatial_and_label_smoothing():
    torch.manual_seed(4)
    x4, t4 = torch.randn(3, 5, 4, 2), _targets(3, 5, 4, 2)
    check_layouts(lambda x, t: F.cross_entropy(x, t), x4, t4, grad=True, trials=3)
    x3, t3 = torch.randn(3, 5, 6), _targets(3, 5, 6)      # [N, C, L] reaches nll_loss2d through views
    check_layouts(lambda x, t: F.cross_entropy(x, t, reduction="sum"), x3, t3, grad=True, trials=3)
    x, t = torch.randn(7, 5), torch.randint(0, 5, (7,))
    check_layouts(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), x, t, grad=True, trials=3)


def _single(x, t, **kw):
    xr = x.clone().requires_grad_(True)
    out = F.cross_entropy(xr, t, **kw)
    (out.sum() if out.dim() else out).backward()
    return out.detach(), xr.grad


@pytest.mark.parametrize("place,sbp", [([0, 1, 2, 3], (S(1),)), ([[0, 1], [2, 3]], (S(0), S(1))),
                                       ([[0, 1], [2, 3]], (S(1), S(1)))])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_class_split_nll_moves_no_logits(place, sbp, reduction):
    """nll_loss on class-split log-probabilities: exact, gradient keeps the split, and forward +
    backward move nothing (the whole target is given; the loss is a partial sum until read)."""
    torch.manual_seed(5)
    n, c = 10, 37
    x = torch.randn(n, c).log_softmax(1)
    t = _targets(n, c)
    xr = x.clone().requires_grad_(True)
    want = F.nll_loss(xr, t, reduction=reduction)
    (want.sum() if want.dim() else want).backward()
    with gt.simulate(4):
        p = gt.placement("cpu", place)
        xg = gt.distribute(x, p, sbp).detach().requires_grad_(True)
        tg = gt.distribute(t, p, (B,) * p.ndim)
        with gt.comm_stats() as st:
            got = F.nll_loss(xg, tg, reduction=reduction)
            if reduction == "none":
                got.backward(gt.distribute(torch.ones(n), p, (B,) * p.ndim))
            else:
                got.backward()
        assert st.bytes_sent == 0
        assert xg.grad.sbp == xg.sbp
        torch.testing.assert_close(got.full_tensor(), want.detach())
        torch.testing.assert_close(xg.grad.full_tensor(), xr.grad)


def test_batch_split_mean_moves_one_scalar():
    """Data parallel: the mean over a batch split needs the global count of the rows not ignored:
    each rank counts its own and one scalar is all-reduced -- neither the logits nor the targets
    move, and nothing else until the loss is read."""
    torch.manual_seed(6)
    n, c = 16, 50
    x, t = torch.randn(n, c), _targets(n, c)
    want, want_grad = _single(x, t)
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        xg = gt.distribute(x, p, S(0)).detach().requires_grad_(True)
        tg = gt.distribute(t, p, S(0))
        with gt.comm_stats() as st:
            got = F.cross_entropy(xg, tg)
            got.backward()
        assert st.ops() == ["all_reduce"] and st.bytes_sent <= 16        # the total weight, one float64
        assert xg.grad.sbp == (S(0),)
        torch.testing.assert_close(got.full_tensor(), want)
        torch.testing.assert_close(xg.grad.full_tensor(), want_grad)


# -- loss parallel: the softmax over the split class dim (rules/softmax.py) ----------------------------------------

_SOFTMAX = [aten._log_softmax.default, aten._softmax.default]
_SOFTMAX_BACKWARD = [aten._log_softmax_backward_data.default, aten._softmax_backward_data.default]



@pytest.mark.parametrize("op", _SOFTMAX)
def test_split_softmax_candidates(op):
    torch.manual_seed(7)
    for shape, dim in (((6, 10), 1), ((7, 5), -1), ((3, 2, 5), 1)):
        x = torch.randn(shape) * 4
        check_candidates(op, x, dim, False, max_2d=8)
        y = op(x, dim, False)
        backward = _SOFTMAX_BACKWARD[_SOFTMAX.index(op)]
        check_candidates(backward, torch.randn(shape), y, dim, torch.float32, max_2d=8)


def test_split_softmax_low_precision():
    """16-bit inputs are computed in float32 and rounded once, as the CPU kernels do."""
    x = torch.randn(4, 9) * 3
    check_candidates(aten._log_softmax.default, x.half(), 1, False, placements=("1d",), rtol=1e-3, atol=1e-3)
    check_candidates(aten._softmax.default, x.bfloat16(), 1, False, placements=("1d",), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("place,sbp", [([0, 1, 2, 3], (S(1),)), ([[0, 1], [2, 3]], (S(0), S(1))),
                                       ([[0, 1], [2, 3]], (S(1), S(1)))])
@pytest.mark.parametrize("kw", [{}, {"reduction": "sum", "ignore_index": 4}, {"label_smoothing": 0.1}])
def test_loss_parallel_cross_entropy(place, sbp, kw):
    """F.cross_entropy on class-split logits: exact, grad keeps the split, and the traffic is
    O(N * ranks) -- row maxima gathered, row sums all-reduced -- never the N x C logits."""
    torch.manual_seed(8)
    n, c = 12, 301
    x = torch.randn(n, c) * 3
    t = _targets(n, c, ignore=kw.get("ignore_index", -100))
    want, want_grad = _single(x, t, **kw)
    with gt.simulate(4):
        p = gt.placement("cpu", place)
        xg = gt.distribute(x, p, sbp).detach().requires_grad_(True)
        tg = gt.distribute(t, p, (B,) * p.ndim)
        with gt.comm_stats() as st:
            got = F.cross_entropy(xg, tg, **kw)
            got.backward()
        torch.testing.assert_close(got.full_tensor(), want)
        assert xg.grad.sbp == xg.sbp
        torch.testing.assert_close(xg.grad.full_tensor(), want_grad)
    assert 0 < st.bytes_sent <= 4 * n * 4 * 4      # a few [N, ranks] float32 exchanges
    assert st.bytes_sent * 20 < n * c * 4           # far below the logits


def test_split_softmax_extreme_rows():
    """Rows whose maximum sits on another rank, huge logits and -inf entries stay exact."""
    x = torch.randn(5, 12)
    x[0, 11] = 1e4
    x[1, :6] = -float("inf")
    x[2] = -1e4
    x[3, 0] = 80.0
    check_candidates(aten._log_softmax.default, x, 1, False, placements=("1d",))
    check_candidates(aten._softmax.default, x, 1, False, placements=("1d",))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_parallel_random_layouts(reduction):
    """With the split softmax in place, cross_entropy stays exact on any layout."""
    torch.manual_seed(9)
    x, t = torch.randn(7, 11), _targets(7, 11)
    check_layouts(lambda x, t: F.cross_entropy(x, t, reduction=reduction), x, t, grad=True, trials=4, seed=2)


# -- F.linear_cross_entropy: the unchunked path and the chunked one ----------------------------------

LCE_CASES = [("none", False), ("mean", False), ("mean", True), ("sum", True)]
LCE_IDS = [f"{r}-{'chunked' if c else 'plain'}" for r, c in LCE_CASES]
needs_lce = pytest.mark.skipif(not (hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")),
                               reason="F.linear_cross_entropy and nn.LinearCrossEntropyOptions came with torch 2.13")


@needs_lce
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("reduction,chunked", LCE_CASES, ids=LCE_IDS)
def test_linear_cross_entropy_equals_one_device(world4, reduction, chunked):
    """Row-split input and targets, broadcast classifier: loss and gradients as on one device
    (float64; the chunked op runs on gathered replicas, the unchunked path through its rules)."""
    p = gt.placement("cpu", [0, 1, 2, 3])
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 3, dtype=torch.float64, generator=g), torch.randn(5, 3, dtype=torch.float64, generator=g)
    t = torch.randint(0, 5, (7,), generator=g)
    opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2, allow_retain_graph=True) if chunked else None
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = F.linear_cross_entropy(xr, wr, t, reduction=reduction, options=opts)
    want.sum().backward()
    gx, gw = gt.distribute(x, p, S(0)).requires_grad_(), gt.distribute(w, p, B).requires_grad_()
    got = F.linear_cross_entropy(gx, gw, gt.distribute(t, p, S(0)), reduction=reduction, options=opts)
    got.sum().backward()
    for a, b in ((got, want), (gx.grad, xr.grad), (gw.grad, wr.grad)):
        torch.testing.assert_close(a.full_tensor(), b, rtol=1e-12, atol=1e-12)


@needs_lce
@pytest.mark.filterwarnings("ignore")
def test_chunked_linear_cross_entropy_without_reduction_names_why_its_backward_cannot_run(world4):
    """Its custom op's backward recomputes the gradients in Python, above the dispatcher, into plain
    buffers it allocates (torch.empty, then mm(out=)): no rule reaches it. The forward works."""
    p = gt.placement("cpu", [0, 1, 2, 3])
    x = gt.distribute(torch.randn(6, 3), p, S(0)).requires_grad_()
    w = gt.distribute(torch.randn(5, 3), p, B)
    opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)
    t = gt.distribute(torch.randint(0, 5, (6,)), p, S(0))
    loss = F.linear_cross_entropy(x, w, t, reduction="none", options=opts)
    torch.testing.assert_close(loss.full_tensor(), F.linear_cross_entropy(x.full_tensor(), w.full_tensor(),
                                                                          t.full_tensor(), reduction="none"))
    with pytest.raises(TypeError, match="_linear_cross_entropy_batch_chunked_no_reduction.*without options="):
        loss.sum().backward()


# -- sequence-split logits: the loss stays local ------------------------------------------------------------------

SEQUENCE_LAYOUTS = {   # placement, the logits' [b, t, V] nd-SBP, the targets' [b, t]
    "sequence": ([0, 1, 2, 3], (S(1),), (S(1),)),
    "sequence_x_vocabulary": ([[0, 1], [2, 3]], (S(1), S(2)), (S(1), B)),
}


@pytest.mark.parametrize("layout", SEQUENCE_LAYOUTS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", ["plain", "ignore_index", "label_smoothing", "weight"])
def test_cross_entropy_on_sequence_split_logits_moves_no_logits(layout, reduction, options, float64):
    """``logits.reshape(-1, V)`` of sequence-split ``[b, t, V]`` logits is split on its rows in blocks
    (``S(0, blocks=b)``): the softmax and the loss take it as it is. Nothing of ``[tokens, V]`` moves:
    at most a scalar per reduction (the mean's total weight), and with the vocabulary split too,
    loss parallel's row statistics (a number or two per row)."""
    ranks, logits_sbp, target_sbp = SEQUENCE_LAYOUTS[layout]
    b, t, v = 2, 16, 10
    torch.manual_seed(7)
    logits, target, weight = torch.randn(b, t, v), _targets(b, v, t, ignore=3), torch.rand(v) + 0.5
    kw = {"plain": {}, "ignore_index": {"ignore_index": 3}, "label_smoothing": {"label_smoothing": 0.1},
          "weight": {"weight": weight}}[options]
    x = logits.clone().requires_grad_()
    want = F.cross_entropy(x.reshape(-1, v), target.reshape(-1), reduction=reduction, **kw)
    (want.sum() if reduction == "none" else want).backward()
    with gt.simulate(4):
        p = gt.placement("cpu", ranks)
        xg = gt.distribute(logits, p, logits_sbp).requires_grad_()
        gkw = {k: gt.distribute(w, p, (B,) * p.ndim) if k == "weight" else w for k, w in kw.items()}
        with gt.comm_profile() as prof:
            got = F.cross_entropy(xg.reshape(-1, v), gt.distribute(target, p, target_sbp).reshape(-1),
                                  reduction=reduction, **gkw)
            (got.sum() if reduction == "none" else got).backward()
        torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(xg.grad.full_tensor(), x.grad, rtol=0, atol=1e-12)
        moved = [e.conversion.shape for e in prof.events if e.conversion is not None]
        assert all(len(shape) == 0 or shape[-1] <= 2 for shape in moved), prof.table()
        assert len(moved) == len(prof.events), prof.table()


def test_a_class_split_loss_holds_what_torchs_whole_vocabulary_loss_holds():
    """Per rank, the vocabulary-split loss holds at its peak what torch's own loss over the whole
    vocabulary holds on one device, in units of that rank's float32 logits (3 of them; DTensor's
    loss_parallel holds 4): the split log_softmax writes its output over the shifted logits and
    sums the exponentials a block of rows at a time, and its backward makes one logits-sized
    tensor. Its forward holds less than torch's whole step, the exponentials of one block beside
    the logits (their bfloat16 original, the float32 copy, the output)."""
    from globaltensor.nn.auto.runners import LOSS_LOGITS_COPIES
    from globaltensor.ops.rules.softmax import EXP_BLOCKS
    torch.manual_seed(0)
    tokens, hidden, vocab, ranks = 256, 8, 512, 2
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    one = tokens * vocab * 4
    assert torchtitan_loss_peak(x, w, labels) == pytest.approx(LOSS_LOGITS_COPIES * one, rel=0.01)
    with gt.simulate(ranks):
        p = gt.placement("cpu", list(range(ranks)))
        gx = gt.distribute(x.detach(), p, B).requires_grad_()
        gw = gt.distribute(w.detach(), p, S(0)).requires_grad_()
        g_labels = gt.distribute(labels, p, B)
        local = one / ranks                 # every simulated rank's pieces are alive in this one process
        step, forward = torchtitan_loss_peak(gx, gw, g_labels), torchtitan_loss_peak(gx, gw, g_labels, before_backward=True)
    assert step / ranks <= LOSS_LOGITS_COPIES * local * 1.01
    assert forward / ranks <= (0.5 + 1 + 1 + 1 / EXP_BLOCKS) * local * 1.01
