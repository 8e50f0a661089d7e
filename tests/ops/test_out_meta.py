"""Output meta (ops/schema/out_meta.py): the pointwise shortcut gives the shape and dtype the op's
CPU kernel gives at the arguments' shapes (or, where it has no CPU kernel for the dtypes, torch's
meta path), for every functional pointwise op of one or two tensors, across dtypes (type
promotion, 0-dim operands) and broadcast shapes."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from globaltensor.ops.schema.out_meta import _takes_shortcut, output_meta
from globaltensor.sbp import broadcast_shape

aten = torch.ops.aten
DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool, torch.complex64]


def _tensor_args(op) -> int:
    """How many leading Tensor arguments the op takes, when all the others have defaults."""
    args = op._schema.arguments
    n = 0
    while n < len(args) and str(args[n].type) == "Tensor" and not args[n].kwarg_only:
        n += 1
    return n if all(a.has_default_value() for a in args[n:]) else 0


def _pointwise_ops():
    ops = []
    for name in dir(aten):
        packet = getattr(aten, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if _takes_shortcut(op) and _tensor_args(op) in (1, 2):
                ops.append(op)
    return sorted(ops, key=str)


OPS = _pointwise_ops()


def test_many_pointwise_ops_take_the_shortcut():
    names = {str(op) for op in OPS}
    assert len(OPS) > 150
    assert {"aten.add.Tensor", "aten.mul.Tensor", "aten.gelu.default", "aten.eq.Tensor"} <= names
    assert not _takes_shortcut(aten.add_.Tensor) and not _takes_shortcut(aten.add.out)
    assert not _takes_shortcut(aten.mm.default)


shapes = st.lists(st.sampled_from([1, 3]), min_size=0, max_size=3).map(tuple)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")   # complex64 meeting float16
@settings(max_examples=300, deadline=None)
@given(op=st.sampled_from(OPS), dtypes=st.tuples(st.sampled_from(DTYPES), st.sampled_from(DTYPES)),
       shapes=st.tuples(shapes, shapes))
def test_shortcut_matches_the_kernel(op, dtypes, shapes):
    """The kernel is the truth: the pieces are its results. Torch's meta path can disagree with it
    (``ldexp`` of an integer base and a 0-dim float16 exponent: meta says float32, the CPU kernel
    gives float16)."""
    n = _tensor_args(op)
    args = [torch.empty(s, dtype=d, device="meta") for s, d in zip(shapes, dtypes)][:n]
    try:
        want = op(*[torch.ones(s, dtype=d) for s, d in zip(shapes, dtypes)][:n])
    except Exception:  # noqa: BLE001 - no CPU kernel for these dtypes: the shortcut's fallback, the meta path
        try:
            want = op(*args)
        except Exception:  # noqa: BLE001 - the op does not take these dtypes / shapes: nothing to compare
            return
    got = output_meta(op, tuple(args), {})
    assert (tuple(got.shape), got.dtype, got.device.type) == (tuple(want.shape), want.dtype, "meta"), op


def test_a_scalar_operand_joins_the_type_promotion():
    x = torch.empty(2, 3, dtype=torch.int64, device="meta")
    assert output_meta(aten.add.Tensor, (x, 1.5), {}).dtype == torch.float32
    assert output_meta(aten.div.Tensor, (x, 2), {}).dtype == torch.float32
    assert output_meta(aten.div.Tensor_mode, (x, 2), {"rounding_mode": "floor"}).dtype == torch.int64


def test_shapes_that_do_not_broadcast_raise():
    x, y = torch.empty(2, 3, device="meta"), torch.empty(4, 3, device="meta")
    with pytest.raises(ValueError, match="do not broadcast"):
        output_meta(aten.add.Tensor, (x, y), {})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0, 1, 2, 5]), max_size=4).map(tuple), min_size=1, max_size=3))
def test_broadcast_shape_agrees_with_torch(shapes):
    try:
        want = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        with pytest.raises(ValueError):
            broadcast_shape(*shapes)
        return
    assert broadcast_shape(*shapes) == want
