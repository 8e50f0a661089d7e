"""PyTorch's OpInfo database on global tensors, compared with one device (DTensor's test_dtensor_ops
for globaltensor).

Every OpInfo op supporting float32 on CPU, variants included (opinfo_run.load_ops), on 4
simulated ranks. Which cases run -- a fixed, seeded subset, to fit the suite's time budget:
of each op's first 8 sample inputs, the one with the most tensor dims runs on a 1-D split
(every tensor split along a random dim, uneven where the size is not a multiple of 4) and a
2x2 nd-SBP (each tensor a random pair of split / broadcast / partial), and two more samples
picked at random each run on one random recipe of split, broadcast, partial (pieces summing
exactly to the value), nd; then, of its first 32, one sample of every combination of boolean
arguments those left out (batch norm in eval as in training), on a random recipe
(opinfo_run.plan). Forward, and backward where the OpInfo supports autograd; every seed derives
from the op's name, so a run is reproducible. The tensors an op writes (``native_batch_norm``'s
running statistics, an in-place op's input) are compared after the call like its outputs.

An op's class is its worst case's: clean < fallback (some aten op gathered to broadcast) <
raises < wrong. On a torch other than the development pin (expectations.PINNED) only wrong
answers and unclear errors fail: which ops decompose, and into what, differs between releases;
and there only the richest sample runs, on the nd recipe (each tensor split, broadcast or partial
along either axis of the 2x2), with the flag combinations: what a release changes is the op -- its
decomposition, kernel, schema --, which that sample meets; the other samples and the 1-D split
widen the layouts, the library's own logic, checked at the pin (the ends' runs are two of CI's
three). The test fails on any wrong answer, on an error globaltensor raises that is not a
ValueError / TypeError / NotImplementedError with a message (torch's own errors above the
dispatcher, e.g. a kernel reading a global index tensor's data, are listed with their reason), on
an op worse than expected.json says, and on an op better than it says (so the lists shrink);
regenerate them with ``PYTHONPATH=src python tools/op_coverage.py --update-expected``. A failure
names the op, the sample index and the layouts of its tensor arguments.

The same run holds every rule to the dispatch cache's key (tests/key_check.py): each decision made
is made again with every number the key takes by its type only (an ``alpha``, a fill) changed, and
must offer and choose the same signatures -- else the rule reads a value it must declare ``keyed=``.
"""
import pytest

pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest, a dev extra "
                                         "(pip install -e '.[dev]'; make test installs it)")

import expectations  # noqa: E402
import opinfo_run as run  # noqa: E402
from key_check import value_free_keys_checked  # noqa: E402

OPS = run.load_ops()
LISTED = expectations.load()


def _cases(outcomes, classes) -> str:
    return "\n".join(f"  sample {i}, {recipe} {o.layouts}: {o.cls}: {o.detail}"
                     for i, recipe, o in outcomes if o.cls in classes)


@pytest.mark.skipif(not expectations.on_pinned_torch(),
                    reason=f"expected.json lists the OpInfo ops of torch {expectations.PINNED}, the development pin")
def test_expectation_lists_name_only_opinfo_ops():
    names = {run.op_id(op) for op in OPS}
    unknown = sorted(set(LISTED) - names)
    assert not unknown, f"expected.json lists ops that are not in op_db: {unknown}"


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("op", OPS, ids=run.op_id)
def test_opinfo_op_matches_one_device(op):
    name = run.op_id(op)
    with value_free_keys_checked() as findings:
        outcomes = (run.classify_op(op) if expectations.on_pinned_torch()
                    else run.classify_op(op, samples_per_op=1, first_recipes=("nd",)))
    assert not findings, f"{name}:\n" + "\n".join(dict.fromkeys(findings))
    assert not any(o.cls == "wrong" for _, _, o in outcomes), \
        f"{name} gives a wrong answer:\n{_cases(outcomes, ('wrong',))}"
    unclear = run.unclear_errors(outcomes)
    assert not unclear, f"{name}: globaltensor raised an unclear error:\n{_cases(unclear, ('raises',))}"
    if not expectations.on_pinned_torch():
        return          # the classes of expected.json are the pinned torch's (expectations.PINNED)
    got, want = run.worst(outcomes), expectations.expected_class(LISTED, name)
    order = run.CLASSES.index
    assert order(got) <= order(want), \
        f"{name} is now {got}, expected {want}:\n{_cases(outcomes, ('fallback', 'raises'))}"
    assert order(got) >= order(want), \
        (f"{name} is now {got}, better than the {want} expected.json lists: take it off the list "
         f"(PYTHONPATH=src python tools/op_coverage.py --update-expected)")
