"""gt.local_map (nn/local_map.py): per-rank code on the pieces, checked against the same computation on
one device, forward and backward, in every layout of a 2-D placement; its errors; under gt.compile."""
import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from globaltensor.sbp import B, P, S

pytestmark = pytest.mark.usefixtures("float64")

AXIS_VALUES = [S(0), S(1), B, P]
ND_SBPS = list(itertools.product(AXIS_VALUES, repeat=2))


def _scale(a):
    return a * 3.0


def _grads(fn, *leaves):
    out = fn(*leaves)
    loss = (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).sin()).sum()
    return out, torch.autograd.grad(loss, leaves)


def _full(t):
    return t.full_tensor() if isinstance(t, gt.GlobalTensor) else t


@settings(max_examples=40, deadline=None)
@given(nd=st.sampled_from(ND_SBPS), rows=st.integers(1, 9), cols=st.integers(1, 7))
def test_a_linear_function_keeps_any_layout_and_its_gradient(nd, rows, cols):
    """``3 a`` is linear, so it maps every layout -- splits, broadcast copies, partial sums -- to itself."""
    t = torch.randn(rows, cols)
    with gt.simulate(4):
        p = gt.placement("cpu", [[0, 1], [2, 3]])
        x = gt.distribute(t, p, nd).requires_grad_()
        y, (gx,) = _grads(gt.local_map(_scale, (nd,), nd), x)
        want, (gt_,) = _grads(_scale, t.clone().requires_grad_())
        assert y.sbp == nd and y.shape == want.shape
        torch.testing.assert_close(y.full_tensor(), want, rtol=0, atol=1e-12)
        torch.testing.assert_close(gx.full_tensor(), gt_, rtol=0, atol=1e-12)


@pytest.mark.parametrize("nd", [(S(0), S(1)), (S(1), B), (B, B), (B, S(0))], ids=str)
def test_a_nonlinear_function_of_splits_and_copies(nd):
    t, w = torch.randn(7, 5), torch.randn(5, 3)

    def local(a, b, scale):
        return torch.tanh(a) * scale, torch.sigmoid(b)

    with gt.simulate(4):
        p = gt.placement("cpu", [[0, 1], [2, 3]])
        x = gt.distribute(t, p, (S(0), S(0))).requires_grad_()
        v = gt.distribute(w, p, (B, B)).requires_grad_()
        y, s = gt.local_map(local, (nd, (B, S(1)), None), (nd, (B, S(1))))(x, v, 2.0)
        assert y.sbp == nd and s.sbp == (B, S(1))
        tx, tw = t.clone().requires_grad_(), w.clone().requires_grad_()
        wy, ws = local(tx, tw, 2.0)
        ((y * y).sum() + s.sum()).backward()
        ((wy * wy).sum() + ws.sum()).backward()
        for got, want in [(y, wy), (s, ws), (x.grad, tx.grad), (v.grad, tw.grad)]:
            torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=0, atol=1e-12)


def test_a_matmul_with_a_broadcast_weight_sums_the_weights_gradient_over_ranks():
    """The weight's copies each get the gradient of their own rank's rows: the weight's gradient is
    their sum, which one device gets as one matmul."""
    t, w = torch.randn(10, 6), torch.randn(6, 3)
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        x, v = gt.distribute(t, p, S(0)).requires_grad_(), gt.distribute(w, p, B).requires_grad_()
        y, (gx, gw) = _grads(gt.local_map(torch.mm, (S(0), B), S(0)), x, v)
        want, (wx, ww) = _grads(torch.mm, t.clone().requires_grad_(), w.clone().requires_grad_())
        for got, ref in [(y, want), (gx, wx), (gw, ww)]:
            torch.testing.assert_close(got.full_tensor(), ref, rtol=0, atol=1e-12)


def test_arguments_are_boxed_to_the_declared_layout_first():
    t = torch.randn(8, 4)
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        x = gt.distribute(t, p, S(1))
        seen = {}

        def local(a):
            seen[gt.local_map.rank()] = tuple(a.shape)
            return a.sum(0)

        with gt.comm_stats() as stats:
            y = gt.local_map(local, (S(0),), P)(x)
        assert stats.ops() == ["all_to_all"]
        assert seen == {0: (2, 4), 1: (2, 4), 2: (2, 4), 3: (2, 4)} and y.sbp == (P,)
        torch.testing.assert_close(y.full_tensor(), t.sum(0), rtol=0, atol=1e-12)


def test_plain_arguments_and_keywords_reach_every_rank():
    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        x = gt.distribute(torch.arange(4.0), p, S(0))
        y = gt.local_map(lambda a, b, *, c: a + b + c, (S(0), None), S(0))(x, torch.ones(2), c=10.0)
        assert y.full_tensor().tolist() == [11.0, 12.0, 13.0, 14.0]


def test_repeated_calls_follow_a_result_whose_shape_changes():
    """A simulated world reads the shapes off its pieces again when they no longer fit the layout an
    earlier call with the same arguments gave (a process world raises: docs/errors.md)."""
    rows = [2]
    mapped = gt.local_map(lambda a: a[:rows[0]] * 2, (S(0),), S(0))
    with gt.simulate(2):
        x = gt.distribute(torch.arange(6.0), gt.placement("cpu", [0, 1]), S(0))
        assert mapped(x).full_tensor().tolist() == [0.0, 2.0, 6.0, 8.0]
        assert mapped(x).full_tensor().tolist() == [0.0, 2.0, 6.0, 8.0]
        rows[0] = 1
        assert mapped(x).full_tensor().tolist() == [0.0, 6.0]


def test_rank_coord_and_group_say_whose_pieces_the_function_holds():
    with gt.simulate(4):
        p = gt.placement("cpu", [[0, 1], [2, 3]])
        x = gt.zeros(2, 2, placement=p, sbp=(S(0), S(1)))
        seen = []

        def local(a):
            seen.append((gt.local_map.rank(), gt.local_map.coord(), gt.local_map.group(0), gt.local_map.group(1)))
            return a + gt.local_map.rank()

        y = gt.local_map(local, ((S(0), S(1)),), (S(0), S(1)))(x)
        assert seen == [(0, (0, 0), (0, 2), (0, 1)), (1, (0, 1), (1, 3), (0, 1)),
                        (2, (1, 0), (0, 2), (2, 3)), (3, (1, 1), (1, 3), (2, 3))]
        assert y.full_tensor().tolist() == [[0.0, 1.0], [2.0, 3.0]]
    with pytest.raises(RuntimeError, match=r"rank\(\) is only defined inside"):
        gt.local_map.rank()


def test_a_non_tensor_result_is_returned_once_and_must_agree():
    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        x = gt.zeros(4, placement=p, sbp=S(0))
        y, n = gt.local_map(lambda a: (a + 1, a.numel()), (S(0),), (S(0), None))(x)
        assert n == 2 and y.sbp == (S(0),)
        with pytest.raises(ValueError, match=r"result 1 differs between ranks \(\[0, 1\]\)"):
            gt.local_map(lambda a: (a, gt.local_map.rank()), (S(0),), (S(0), None))(x)


def test_no_argument_global_needs_a_placement():
    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        y = gt.local_map(lambda: torch.full((2,), float(gt.local_map.rank())), (), S(0), placement=p)()
        assert y.full_tensor().tolist() == [0.0, 0.0, 1.0, 1.0]
        with pytest.raises(ValueError, match="no argument is a global tensor; give placement="):
            gt.local_map(lambda: torch.zeros(2), (), S(0))()


@pytest.mark.parametrize("call, error, match", [
    (lambda x, p: gt.local_map(lambda a: a, S(0), S(0))(x), TypeError, "in_sbp must be a sequence"),
    (lambda x, p: gt.local_map(lambda a: a, (S(0), B), S(0))(x), ValueError,
     "in_sbp has 2 entries, the call gave 1 positional arguments"),
    (lambda x, p: gt.local_map(lambda a: a, (None,), S(0))(x), TypeError,
     "argument 0 is a global tensor but in_sbp\\[0\\] is None"),
    (lambda x, p: gt.local_map(lambda a: a, (S(0),), S(0))(torch.zeros(4)), TypeError,
     "argument 0 must be a global tensor, got Tensor"),
    (lambda x, p: gt.local_map(lambda a, b: a, (S(0),), S(0))(x, b=x), TypeError,
     "keyword argument 'b' is a global tensor"),
    (lambda x, p: gt.local_map(lambda a: a, (S(0),), None)(x), TypeError,
     "the result is a tensor but its out_sbp entry is None"),
    (lambda x, p: gt.local_map(lambda a: (a, a), (S(0),), S(0))(x), ValueError,
     "fn returned 2 values, so out_sbp must be a sequence of 2 entries"),
    (lambda x, p: gt.local_map(lambda a: a[: gt.local_map.rank()], (S(0),), S(0))(x), ValueError,
     "rank 0's local tensor has shape \\(0,\\)"),
    (lambda x, p: gt.local_map(lambda a: a, (S(2),), S(0))(x), ValueError, "split dim 2 is out of range"),
    (lambda x, p: gt.local_map(lambda a, b: a, (S(0), S(0)), S(0))(
        x, gt.zeros(4, placement=gt.placement("cpu", [1, 0]), sbp=S(0))), ValueError,
     "arguments 0 and 1 live on different placements"),
    (lambda x, p: gt.local_map(3, (S(0),), S(0)), TypeError, "fn must be callable"),
], ids=["in-sbp-bare", "arity", "global-without-sbp", "plain-with-sbp", "global-keyword", "result-without-sbp",
        "tuple-result", "unbalanced-pieces", "split-dim", "two-placements", "not-callable"])
def test_errors_name_the_function_the_argument_and_what_was_expected(call, error, match):
    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        with pytest.raises(error, match=match):
            call(gt.zeros(4, placement=p, sbp=S(0)), p)


def test_a_collective_inside_the_function_is_an_error_that_says_why():
    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        x = gt.zeros(4, placement=p, sbp=S(0))
        other = gt.zeros(4, placement=p, sbp=S(0))

        def local(a):
            return a + other.full_tensor()[:2]

        with pytest.raises(gt.CollectiveError, match=r"collective all_gather called inside gt.local_map\(local\)'s "
                                                      r"function: it runs once per rank in turn"):
            gt.local_map(local, (S(0),), S(0))(x)
        assert other.full_tensor().shape == (4,)           # collectives run again once it returned


def test_a_compiled_step_through_local_map_equals_eager():
    """Under gt.compile each rank's call is one task of the graph, its backward another (the
    function's own ops are not in the graph); forward and backward replay equal the eager step on
    new data."""
    def local(a, w):
        return torch.nn.functional.gelu(a @ w)

    mapped = gt.local_map(local, (S(0), B), S(0))

    def step(x, w):
        y = mapped(x, w)
        loss = (y * y).sum()
        loss.backward()
        return loss

    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        w_eager = gt.distribute(torch.randn(6, 3), p, B).requires_grad_()
        w_comp = gt.distribute(w_eager.full_tensor().detach(), p, B).requires_grad_()
        compiled = gt.compile(step)
        for i in range(3):
            x = gt.distribute(torch.randn(10, 6), p, S(0))
            want, got = step(x, w_eager), compiled(x, w_comp)
            torch.testing.assert_close(got.full_tensor(), want.full_tensor(), rtol=0, atol=1e-12)
            torch.testing.assert_close(w_comp.grad.full_tensor(), w_eager.grad.full_tensor(), rtol=0, atol=1e-12)
            w_eager.grad = w_comp.grad = None
        names = [t.name.split(":", 1)[1] for t in compiled.plan.tasks]
        assert sorted(n for n in names if n.startswith("local_map")) == sorted(
            [f"local_map(local)@r{r}" for r in range(4)] + [f"local_map(local) (backward)@r{r}" for r in range(4)])
        assert not any(op in n for n in names for op in ("gelu", "mm."))


def _compiled_against_eager(fn, in_sbp, make_args, micro_batches=1, calls=4):
    """gt.compile of a training step through ``gt.local_map(fn)`` (loss, backward, SGD), against the
    same step eagerly on the same new data every call: the loss and the weight after each step."""
    mapped = gt.local_map(fn, in_sbp, S(0))

    def step_of(w):                 # w closed over: micro-batches split every argument
        opt = torch.optim.SGD([w], lr=0.1)

        def step(x):
            loss = mapped(x, w).square().mean()    # a mean: micro-batches average
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        w_eager = gt.distribute(torch.randn(6, 3), p, B).requires_grad_()
        w_comp = gt.distribute(w_eager.full_tensor().detach(), p, B).requires_grad_()
        eager, compiled = step_of(w_eager), gt.compile(step_of(w_comp), micro_batches=micro_batches)
        for _ in range(calls):
            x = gt.distribute(make_args(), p, S(0))
            torch.testing.assert_close(compiled(x).full_tensor(), eager(x).full_tensor(), rtol=0, atol=1e-12)
            torch.testing.assert_close(w_comp.full_tensor(), w_eager.full_tensor(), rtol=0, atol=1e-12)


def test_a_compiled_mapped_function_reads_values_on_the_host_anew_every_call():
    """A host read inside the function (a scale taken with .item()) would be frozen into an op-by-op
    graph, which the capture refuses; as one task it runs every call, so new data gets its own scale."""
    def normalised(a, w):
        return (a @ w) / float(a.abs().max().item())

    _compiled_against_eager(normalised, (S(0), B), lambda: torch.randn(12, 6) * torch.rand(1) * 10)


def test_a_compiled_mapped_function_with_micro_batches():
    _compiled_against_eager(lambda a, w: torch.tanh(a @ w), (S(0), B), lambda: torch.randn(16, 6), micro_batches=2)


def test_a_compiled_mapped_dropout_keeps_its_mask_for_the_backward():
    """Each replay draws a new mask; the backward goes through the graph of the same call, so the
    input's gradient is zero exactly where the output was dropped."""
    mapped = gt.local_map(lambda a: torch.nn.functional.dropout(a, 0.5), (S(0),), S(0))

    def step(x):
        y = mapped(x)
        y.square().sum().backward()
        return y

    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        compiled = gt.compile(step)
        masks = []
        for _ in range(4):
            x = gt.distribute(torch.rand(16, 5) + 1, p, S(0)).requires_grad_()
            y = compiled(x).full_tensor()
            torch.testing.assert_close(x.grad.full_tensor(), 2 * y * 2, rtol=0, atol=0)   # dy/dx = mask * 2
            masks.append(y != 0)
        assert len({tuple(m.flatten().tolist()) for m in masks}) > 1
