"""The conformance runner itself: it must see wrong answers, compare values (not only shapes)
wherever the reference is a function of its inputs, and skip only what it says it skips."""
from types import SimpleNamespace

import pytest
import torch
from torch.utils._pytree import tree_flatten

pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest, a dev extra "
                                         "(pip install -e '.[dev]'; make test installs it)")

import opinfo_run as run  # noqa: E402

OPS = {run.op_id(op): op for op in run.load_ops()}


def _first(name):
    op = OPS[name]
    have = run.samples(op, run.SAMPLES_LOOKED_AT)
    i, recipe, seed = run.plan(op, have)[0]
    return op, have[i], recipe, seed


@pytest.mark.parametrize("name, values_defined", [("add", True), ("sin", True), ("bfloat16", True),
                                                  ("bernoulli", False), ("new_empty", False)])
def test_reference_knows_which_results_are_a_function_of_the_inputs(name, values_defined):
    op, sample, _, _ = _first(name)
    want, inputs_after, undefined, skip = run._reference(op, sample)
    assert skip is None and undefined == (not values_defined)
    inputs = [v for v in tree_flatten(run._args(sample))[0] if isinstance(v, torch.Tensor)]
    assert len(inputs) == len(inputs_after) and all(map(run._same, inputs, inputs_after.values()))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("where", ["forward", "backward", "input"])
def test_a_wrong_answer_is_classified_wrong(where):
    op, sample, recipe, seed = _first("sin")

    class _WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.sin()

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def broken(x):
        if where == "input":          # a right result, but the global run writes into its input
            y = torch.sin(x.detach())
            if getattr(x, "is_global", False):
                with torch.no_grad():
                    x.mul_(2)
            return y
        if not getattr(x, "is_global", False):
            return torch.sin(x)
        return torch.sin(x) + 1 if where == "forward" else _WrongGrad.apply(x)

    fake = SimpleNamespace(op=broken, supports_autograd=True, name="broken_sin", variant_test_name="")
    assert run.run_case(fake, sample, recipe, seed).cls == "wrong"
    assert run.run_case(op, sample, recipe, seed).cls == "clean"


def test_partial_pieces_sum_exactly():
    import random
    import globaltensor as gt
    t = torch.randn(5, 3) * 100
    with gt.simulate(4):
        for placement in (gt.placement("cpu", [0, 1, 2, 3]), gt.placement("cpu", [[0, 1], [2, 3]])):
            nd = (gt.sbp.partial_sum,) * placement.ndim
            x = run.lay_out(t, placement, nd, random.Random(0))
            assert torch.equal(x.full_tensor(), t)


@pytest.mark.parametrize("name", ["native_batch_norm", "_native_batch_norm_legit", "nn.functional.batch_norm"])
def test_the_plan_runs_batch_norm_in_eval_as_well_as_in_training(name):
    """The samples chosen at random may all train; every combination of boolean arguments runs too."""
    op = OPS[name]
    have = run.samples(op, run.FLAG_SAMPLES_LOOKED_AT)
    modes = set()
    for i, _, _ in run.plan(op, have):
        s = have[i]
        training = s.kwargs.get("training", next((a for a in s.args if isinstance(a, bool)), False))
        modes.add(training)
    assert modes == {True, False}
