"""gt.explicit() (ops/explicit.py): inside it no op converts a layout by itself -- it raises, naming the op,
its inputs' SBPs, the conversion with its bytes and the line to write; conversions the program writes,
the library's reductions and the backward pass run as always; eager, under gt.compile and torch.compile."""
import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import B, P, S

pytestmark = pytest.mark.usefixtures("float64")


def test_an_op_that_would_gather_raises_naming_the_op_the_inputs_the_conversion_and_the_fix(world4, p1):
    x, w = gt.randn(8, 6, placement=p1, sbp=S(0)), gt.randn(6, 4, placement=p1, sbp=S(0))
    y = x @ w                                           # outside: the dispatcher converts by itself
    with gt.explicit(), pytest.raises(gt.ImplicitBoxingError) as info:
        x @ w
    text = str(info.value)
    gather = gt.boxing_plan(w, sbp=B).bytes
    assert text.startswith(f"gt.explicit: aten.mm.default would convert its input 1 from S(0) to B (all_gather; "
                           f"{gather:,} bytes a rank) at "), text
    assert __file__ in text and '"x @ w"' in text and "its inputs are (S(0), S(0))" in text
    assert text.endswith("Write the conversion: x.to_global(sbp=B) for that input, or run it outside gt.explicit()")
    with gt.explicit():
        z = x @ w.to_global(sbp=B)                      # written: runs
    torch.testing.assert_close(z.full_tensor(), y.full_tensor(), rtol=0, atol=1e-12)


def test_a_signature_that_takes_the_inputs_as_they_are_is_chosen_partial_result_included(world4, p1):
    """(S(1), S(0)) inputs of a matmul: outside, a partial result is avoided where a gather is cheaper
    later; inside, the op takes its inputs as they are and leaves the sum to the program."""
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    x, w = gt.distribute(a, p1, S(1)), gt.distribute(b, p1, S(0))
    with gt.explicit(), gt.comm_stats() as stats:
        y = x @ w
        assert y.sbp == (P,) and stats.count == 0
        total = y.to_global(sbp=B)                      # the reduction, where the program says
    assert stats.ops() == ["all_reduce"]
    torch.testing.assert_close(total.full_tensor(), a @ b, rtol=0, atol=1e-12)


def test_plain_tensors_are_taken_as_broadcast_only_where_no_slice_is_needed(world4, p1):
    y = gt.randn(8, 4, placement=p1, sbp=B)
    with gt.explicit():
        assert (y + torch.ones(8, 4)).sbp == (B,)
        with pytest.raises(gt.ImplicitBoxingError, match=r"aten.add.Tensor would convert its input 1 from a plain "
                                                         r"tensor \(taken as broadcast\) to S\(0\) \(no collective: "
                                                         r"a slice of each rank's copy; 0 bytes a rank\).*Write the "
                                                         r"conversion: gt.distribute\(t, placement, S\(0\)\)"):
            y.to_global(sbp=S(0)) + torch.ones(8, 4)


def test_an_op_without_a_rule_is_not_gathered_silently(world4, p1):
    x = gt.randn(8, placement=p1, sbp=S(0))
    with gt.explicit(), pytest.raises(gt.ImplicitBoxingError, match=r"aten.nonzero.default would convert its "
                                                                    r"input 0 from S\(0\) to B \(all_gather"):
        torch.nonzero(x)


def test_a_training_step_written_with_its_conversions_runs_backward_included(world4, p1):
    """Data parallel: the forward takes every input as it is; the backward's conversions (the transposes
    of the forward's) and the gradient reduction are the library's, and run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 2))
    reference = torch.nn.Sequential(*(m for m in torch.nn.Sequential(*model)))
    weights = [p.detach().clone() for p in model.parameters()]
    gt.nn.distribute_module(model, p1)
    data = torch.randn(8, 6)
    with gt.explicit():
        model(gt.distribute(data, p1, S(0))).square().mean().backward()
    for p, w in zip(reference.parameters(), weights):
        p.data = w
    reference(data).square().mean().backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad, rtol=0, atol=1e-12)


def test_nesting_the_decorator_and_leaving_it(world4, p1):
    x = gt.randn(8, 6, placement=p1, sbp=S(0))
    w = gt.randn(6, 4, placement=p1, sbp=S(0))

    @gt.explicit()
    def product(a, b):
        return a @ b
    with gt.explicit():
        with gt.explicit():
            pass
        with pytest.raises(gt.ImplicitBoxingError):
            x @ w
    with pytest.raises(gt.ImplicitBoxingError):
        product(x, w)
    assert (x @ w).shape == (8, 4)                      # outside again: converted by itself


def test_under_gt_compile_the_capture_raises_the_same_error(world4, p1):
    x, w = gt.randn(8, 6, placement=p1, sbp=S(0)), gt.randn(6, 4, placement=p1, sbp=S(0))
    compiled = gt.compile(lambda a, b: a @ b)
    with gt.explicit(), pytest.raises(gt.ImplicitBoxingError, match="aten.mm.default would convert its input 1"):
        for _ in range(2):
            compiled(x, w)


def test_under_torch_compile_the_trace_raises_the_same_error(world4, p1):
    x, w = gt.randn(8, 6, placement=p1, sbp=S(0)), gt.randn(6, 4, placement=p1, sbp=S(0))
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: a @ b, backend="eager", fullgraph=True)
    with gt.explicit(), pytest.raises(Exception, match="aten.mm.default would convert its input 1 from S\\(0\\) to B"):
        compiled(x, w)
