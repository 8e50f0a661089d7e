"""Arguments an op writes are kept, whatever path it takes (ops/schema/op_record.py, ops/schema/written_args.py).

The schema scan walks every aten op of the installed torch: an op writing an argument it does not
return must be listed with the path that keeps the write, so a newer torch with a new such op
fails here until it is handled. Each listed path is then exercised: the fallback writes every
written argument back (returned or not), a user's op whose rule cannot keep a written layout runs
through it, and the dispatcher's path for each listed op is the one listed."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch._decomp import decomposition_table

import globaltensor as gt
from globaltensor.ops.schema import written_args
from globaltensor.ops.decide import list_kind
from globaltensor.ops.schema.op_record import record
from globaltensor.ops.registry import find_rule

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
EXACT = dict(rtol=0, atol=0)


def _aten_ops():
    for full in sorted(torch._C._dispatch_get_all_op_names()):
        namespace, _, rest = full.partition("::")
        if namespace != "aten":
            continue
        name, _, overload = rest.partition(".")
        op = getattr(getattr(torch.ops.aten, name, None), overload or "default", None)
        if op is not None:
            yield op


UNRETURNED = [op for op in _aten_ops() if record(op).unreturned]


def unlisted(handled: dict) -> list:
    return [str(op) for op in UNRETURNED if written_args.handling(op, handled) is None]


def test_every_op_writing_an_argument_it_does_not_return_is_listed():
    assert len(UNRETURNED) > 100, f"only {len(UNRETURNED)} such ops found: is the scan broken?"
    missing = unlisted(written_args.HANDLED)
    assert not missing, ("ops that write arguments they do not return, with no path listed in "
                         f"globaltensor/ops/schema/written_args.py (a newer torch?): {missing}")


@pytest.mark.parametrize("name", ["aten._fused_adamw_.default", "aten._amp_foreach_non_finite_check_and_unscale_."
                                  "default", "aten._cummax_helper.default"])
def test_the_scan_fails_when_a_listed_op_is_taken_out(name):
    handled = {k: v for k, v in written_args.HANDLED.items() if k != name}
    if not any(str(op) == name for op in UNRETURNED):
        pytest.skip(f"{name} does not exist in torch {torch.__version__}")
    assert unlisted(handled) == [name]


def _path(op) -> str:
    """The path the dispatcher takes for ``op`` with no rule of its own."""
    if find_rule(op) is not None:
        return "rule"
    if list_kind(op) is not None:
        return "list"
    if op in decomposition_table or torch._C._dispatch_has_kernel_for_dispatch_key(op.name(),
                                                                                    "CompositeImplicitAutograd"):
        return "decomposition"
    return "fallback"


@pytest.mark.parametrize("op", UNRETURNED, ids=str)
def test_each_listed_op_takes_the_listed_path(op):
    listed = written_args.handling(op)
    if listed == "autograd":
        return          # handled above __torch_dispatch__: no path of ours is taken
    got = _path(op)
    # a decomposition some releases have for an op the fallback handles on others keeps its writes too
    assert got == listed or {got, listed} == {"decomposition", "fallback"}, f"{op}: listed {listed}, takes {got}"


# -- the fallback writes every written argument back ---------------------------------------------
def test_fallback_writes_arguments_it_does_not_return(p1):
    """``_cummax_helper(self, values(a!), indices(b!), dim) -> ()`` has no rule: gathered, run on the
    replicas, and its two written outputs boxed back into their split layouts."""
    x = torch.randn(8, 5, dtype=torch.float64)
    values, indices = torch.empty_like(x), torch.empty(8, 5, dtype=torch.long)
    torch.ops.aten._cummax_helper(x, values, indices, 1)
    gx = gt.distribute(x, p1, S(0))
    gv = gt.distribute(torch.zeros_like(x), p1, S(0))
    gi = gt.distribute(torch.zeros(8, 5, dtype=torch.long), p1, S(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.ops.aten._cummax_helper(gx, gv, gi, 1) is None
    assert gv.sbp == (S(0),) and gi.sbp == (S(1),)
    torch.testing.assert_close(gv.full_tensor(), values, **EXACT)
    torch.testing.assert_close(gi.full_tensor(), indices, **EXACT)


def test_fallback_writes_list_outputs(p1):
    """``split_copy.Tensor_out(self, size, dim, *, Tensor(a!)[] out) -> ()``: each out tensor in its layout."""
    x = torch.randn(9, 4, dtype=torch.float64)
    outs = [gt.distribute(torch.zeros(3, 4, dtype=torch.float64), p1, sbp) for sbp in (S(0), B, S(1))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ops.aten.split_copy.Tensor_out(gt.distribute(x, p1, S(0)), 3, 0, out=outs)
    for o, want, sbp in zip(outs, x.split(3), (S(0), B, S(1))):
        assert o.sbp == (sbp,)
        torch.testing.assert_close(o.full_tensor(), want, **EXACT)


def test_fallback_writes_plain_written_tensors(p1):
    """``_amp_update_scale_`` on global state with a plain ``growth_tracker``: the plain tensor gets the
    value every replica computed."""
    scale, tracker = torch.tensor([1024.0]), torch.tensor([3], dtype=torch.int32)
    found = torch.tensor([0.0])
    torch.ops.aten._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 4)
    g_scale, g_tracker = gt.distribute(torch.tensor([1024.0]), p1, B), torch.tensor([3], dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ops.aten._amp_update_scale_(g_scale, g_tracker, gt.distribute(found, p1, B), 2.0, 0.5, 4)
    torch.testing.assert_close(g_scale.full_tensor(), scale, **EXACT)
    torch.testing.assert_close(g_tracker, tracker, **EXACT)


_LIBS = []


def _accumulating_op():
    """A user's op that adds its input's column sums into ``total`` besides returning them, with a
    rule keeping ``total`` broadcast only."""
    if not _LIBS:
        lib = torch.library.Library("gt_written_args", "FRAGMENT")
        lib.define("accumulate(Tensor x, Tensor(a!) total) -> Tensor")

        def accumulate(x, total):
            total.add_(x.sum(0))
            return x.sum(0)
        lib.impl("accumulate", accumulate, "CPU")
        lib.impl("accumulate", lambda x, total: x.sum(0), "Meta")
        _LIBS.append(lib)
        gt.register_rule(torch.ops.gt_written_args.accumulate.default, ["S(0), B -> P"])
    return torch.ops.gt_written_args.accumulate.default


def test_a_rule_that_cannot_keep_a_written_layout_falls_back_and_keeps_the_write(p1):
    """A partial ``total`` has no candidate of the op's rule: the op runs through the fallback, which
    writes ``total`` back as a partial sum (the value on the first rank, zeros elsewhere)."""
    op = _accumulating_op()
    x, total = torch.randn(8, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    want_total = total + x.sum(0)
    g_total = gt.distribute(total, p1, B).to_global(sbp=P) * 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = op(gt.distribute(x, p1, S(0)), g_total)
    assert g_total.sbp == (P,)
    torch.testing.assert_close(g_total.full_tensor(), want_total, **EXACT)
    torch.testing.assert_close(out.full_tensor(), x.sum(0), **EXACT)


def test_an_unlisted_aten_op_with_unreturned_writes_raises_naming_its_arguments(p1):
    from globaltensor.ops import dispatch
    listed = written_args.HANDLED.pop("aten._fused_sgd_.default")
    dispatch.CACHE.clear()
    try:
        w = gt.distribute(torch.zeros(8, 4), p1, S(0))
        g, buf = torch.ones_like(w), torch.zeros_like(w)
        with pytest.raises(NotImplementedError, match=r"_fused_sgd_.default writes arguments it does not "
                                                      r"return \(self, grads, momentum_buffer_list\)"):
            torch.ops.aten._fused_sgd_.default([w], [g], [buf], weight_decay=0.0, momentum=0.9, lr=0.1,
                                               dampening=0.0, nesterov=False, maximize=False, is_first_step=True)
    finally:
        written_args.HANDLED["aten._fused_sgd_.default"] = listed
        dispatch.CACHE.clear()
