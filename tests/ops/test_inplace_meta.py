"""In-place ops that change metadata (ops/writes/metadata_ops.py): ``transpose_``, ``t_``, ``swapdims_``,
``squeeze_``, ``unsqueeze_``, ``as_strided_`` change the tensor itself -- its wrapper's sizes
and strides, its layout by the out-of-place op's rule, its pieces -- and autograd, copy-views
and the RNN modules (which call ``transpose_``) work through them."""
import contextlib
import itertools
import random

import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import broadcast as B, partial_sum as P, split as S
from harness import PLACEMENTS, check_layouts, make_global, no_fallback

torch.manual_seed(0)

X4 = torch.randn(5, 1, 3, 6)
X2 = torch.randn(5, 6)
X1 = torch.randn(7)

# (name, input, the op in place, old dim -> new dim; None: the dim is removed)
CASES = [
    ("transpose_(0,2)", X4, lambda x: x.transpose_(0, 2), {0: 2, 1: 1, 2: 0, 3: 3}),
    ("transpose_(-1,1)", X4, lambda x: x.transpose_(-1, 1), {0: 0, 1: 3, 2: 2, 3: 1}),
    ("swapdims_(0,3)", X4, lambda x: x.swapdims_(0, 3), {0: 3, 1: 1, 2: 2, 3: 0}),
    ("swapaxes_(1,2)", X4, lambda x: x.swapaxes_(1, 2), {0: 0, 1: 2, 2: 1, 3: 3}),
    ("t_ 2-D", X2, lambda x: x.t_(), {0: 1, 1: 0}),
    ("t_ 1-D", X1, lambda x: x.t_(), {0: 0}),
    ("squeeze_()", X4, lambda x: x.squeeze_(), {0: 0, 1: None, 2: 1, 3: 2}),
    ("squeeze_(1)", X4, lambda x: x.squeeze_(1), {0: 0, 1: None, 2: 1, 3: 2}),
    ("squeeze_(2) keeps", X4, lambda x: x.squeeze_(2), {0: 0, 1: 1, 2: 2, 3: 3}),
    ("squeeze_((1,3))", X4, lambda x: x.squeeze_((1, 3)), {0: 0, 1: None, 2: 1, 3: 2}),
    ("unsqueeze_(0)", X4, lambda x: x.unsqueeze_(0), {0: 1, 1: 2, 2: 3, 3: 4}),
    ("unsqueeze_(-1)", X4, lambda x: x.unsqueeze_(-1), {0: 0, 1: 1, 2: 2, 3: 3}),
    ("unsqueeze_(2)", X4, lambda x: x.unsqueeze_(2), {0: 0, 1: 1, 2: 3, 3: 4}),
]
IDS = [c[0] for c in CASES]


def _layouts(dims: dict, placement):
    """Every nd-SBP whose splits the op keeps (all of them on 1-D, a sample on 2x2)."""
    per_axis = [B, P] + [S(d) for d, new in dims.items() if new is not None]
    combos = list(itertools.product(per_axis, repeat=placement.ndim))
    return combos if placement.ndim == 1 else random.Random(0).sample(combos, min(10, len(combos)))


def _expected(nd: tuple, dims: dict) -> tuple:
    return tuple(S(dims[v.dim]) if v.is_split else v for v in nd)


@pytest.mark.parametrize("name,t,op,dims", CASES, ids=IDS)
def test_values_on_random_layouts(name, t, op, dims):
    check_layouts(lambda x: op(x.clone()), t, trials=5)


@pytest.mark.parametrize("name,t,op,dims", CASES, ids=IDS)
def test_autograd(name, t, op, dims):
    check_layouts(lambda x: op(x * 1), t, trials=4, grad=True)


@pytest.mark.parametrize("name,t,op,dims", CASES, ids=IDS)
def test_same_object_new_meta_no_communication(name, t, op, dims):
    """The wrapper itself changes as a plain tensor would; its pieces are views of the old ones."""
    want = op(t.clone())
    with gt.simulate(4), no_fallback():
        for pname in PLACEMENTS:
            p = PLACEMENTS[pname]()
            for nd in _layouts(dims, p):
                x = make_global(t, p, nd, random.Random(1))
                old = {r: piece.untyped_storage().data_ptr() for r, piece in x.local_tensors().items()}
                with gt.comm_stats() as stats:
                    out = op(x)
                what = f"{name} of {nd} on {pname}"
                assert out is x, what
                assert (x.shape, x.stride()) == (want.shape, want.stride()), what
                assert x.sbp == _expected(nd, dims), f"{what}: sbp {x.sbp}"
                assert stats.bytes_sent == 0, what
                for r, piece in x.local_tensors().items():
                    assert tuple(piece.shape) == x.layout_meta.piece_shape(r), what
                    assert piece.numel() == 0 or piece.untyped_storage().data_ptr() == old[r], what
                torch.testing.assert_close(x.full_tensor(), want)


def test_chain_matches_plain_strides():
    t = X4.clone()
    steps = [lambda x: x.transpose_(0, 3), lambda x: x.unsqueeze_(1), lambda x: x.squeeze_(),
             lambda x: x.t_() if x.dim() == 2 else x.swapdims_(0, 2), lambda x: x.unsqueeze_(-1)]
    with gt.simulate(4), no_fallback():
        x = make_global(t, PLACEMENTS["2x2"](), (S(0), S(3)), random.Random(0))
        for step in steps:
            step(t)
            step(x)
            assert (x.shape, x.stride()) == (t.shape, t.stride())
        torch.testing.assert_close(x.full_tensor(), t)
        torch.testing.assert_close((x + 1).full_tensor(), t + 1)
        torch.testing.assert_close(x.contiguous().full_tensor(), t.contiguous())


def test_split_of_a_squeezed_dim_is_boxed():
    """A split of a dim of global size 1 has no place after squeeze_: the tensor is boxed first."""
    t = torch.randn(1, 6)
    with gt.simulate(4):
        for nd in ((S(0),), (S(1),)):
            x = make_global(t, PLACEMENTS["1d"](), nd, random.Random(0))
            assert x.squeeze_(0) is x and x.shape == (6,)
            torch.testing.assert_close(x.full_tensor(), t.squeeze(0))
        x = make_global(t, PLACEMENTS["1d"](), (S(1),), random.Random(0))
        with gt.comm_stats() as stats:
            x.squeeze_()        # the piece [1, 1] of a split dim 1 keeps its dim 1
        assert x.sbp == (S(0),) and stats.bytes_sent == 0


def test_pieces_shared_with_another_tensor_keep_their_shape():
    with gt.simulate(4):
        x = make_global(X2, PLACEMENTS["1d"](), (S(0),), random.Random(0))
        y = x.to_global(sbp=x.sbp)          # the same layout: the same piece objects
        x.transpose_(0, 1)
        assert y.shape == X2.shape and all(tuple(v.shape) == y.layout_meta.piece_shape(r)
                                           for r, v in y.local_tensors().items())
        torch.testing.assert_close(y.full_tensor(), X2)


def test_kept_kept_boxed_copy_is_dropped():
    xr = X2.clone().requires_grad_()
    (xr * 1).transpose_(0, 1).cumsum(0).mul(torch.arange(30.).reshape(6, 5)).sum().backward()
    with gt.simulate(4):
        x = make_global(X2, PLACEMENTS["1d"](), (S(1),), random.Random(0), requires_grad=True)
        x2 = x * 1
        x2.cumsum(1)                        # boxes x2 off S(1) and keeps the copy on it
        assert x2._boxed is not None
        x2.transpose_(0, 1)
        assert x2._boxed is None
        w = gt.distribute(torch.arange(30.).reshape(6, 5), x.placement, B)
        x2.cumsum(0).mul(w).sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), xr.grad)


def test_write_into_copy_view_after_metadata_op():
    """``v = x[:, 1:4]`` of a split x holds a copy; after ``v.t_()`` writes into v still land in x."""
    src = torch.arange(21.).reshape(3, 7)
    want = torch.arange(42.).reshape(7, 6)
    with gt.simulate(4):
        x = make_global(want, PLACEMENTS["1d"](), (S(1),), random.Random(0))
        v = x[:, 1:4]
        assert getattr(v, "_view_of", None) is not None
        v.t_()
        v.copy_(src)
        plain = want[:, 1:4]
        plain.t_()
        plain.copy_(src)
        torch.testing.assert_close(x.full_tensor(), want)


def _torch_error(fn):
    """The exception torch raises for ``fn`` on a plain tensor (its type and message vary by release)."""
    try:
        fn(X2.clone())
    except Exception as e:          # noqa: BLE001 -- whatever torch raises is the reference
        return type(e), str(e)
    raise AssertionError("torch accepted the call")


def test_bad_dim_raises_and_changes_nothing():
    with gt.simulate(4), no_fallback():
        x = make_global(X2, PLACEMENTS["1d"](), (S(0),), random.Random(0))
        for bad in (lambda t: t.transpose_(0, 5), lambda t: t.unsqueeze_(4)):
            kind, message = _torch_error(bad)
            with pytest.raises(kind) as got:
                bad(x)
            assert str(got.value) == message
        assert x.shape == X2.shape and x.sbp == (S(0),)
        torch.testing.assert_close(x.full_tensor(), X2)


@pytest.mark.filterwarnings("ignore:globaltensor")
def test_as_strided_gathers():
    t = torch.arange(12.)
    with gt.simulate(4):
        for nd in ((B,), (S(0),)):
            x = make_global(t, PLACEMENTS["1d"](), nd, random.Random(0))
            assert x.as_strided_((3, 4), (4, 1)) is x
            assert (x.shape, x.stride(), x.sbp) == ((3, 4), (4, 1), (B,))
            torch.testing.assert_close(x.full_tensor(), t.reshape(3, 4))


# -- the RNN modules call transpose_ ------------------------------------------------------------

RNNS = [(cls, bf) for cls in (torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN) for bf in (True, False)]


@pytest.mark.filterwarnings("ignore:globaltensor")
@pytest.mark.parametrize("cls,batch_first", RNNS, ids=[f"{c.__name__}-bf{b}" for c, b in RNNS])
def test_rnn_modules(cls, batch_first):
    """Input split on the batch dim, parameters broadcast. The LSTM's ``mkldnn_rnn_layer`` (and
    its backward) have no rule and run through the fallback; GRU and RNN need none."""
    torch.manual_seed(1)
    module = cls(5, 7, num_layers=2, batch_first=batch_first, bidirectional=cls is torch.nn.GRU)
    x = torch.randn(6, 3, 5) if batch_first else torch.randn(3, 6, 5)
    xr = x.clone().requires_grad_()
    want = module(xr)
    _loss(*want).backward()
    grads = {n: p.grad for n, p in module.named_parameters()}
    with gt.simulate(4), contextlib.nullcontext() if cls is torch.nn.LSTM else no_fallback():
        p = PLACEMENTS["1d"]()
        for name, param in list(module.named_parameters()):
            setattr(module, name, torch.nn.Parameter(gt.distribute(param.detach(), p, B)))
        gx = gt.distribute(x, p, S(0 if batch_first else 1)).requires_grad_()
        out, h = module(gx)
        torch.testing.assert_close(out.full_tensor(), want[0], rtol=1e-4, atol=1e-5)
        for got, w in zip(h if isinstance(h, tuple) else (h,), want[1] if isinstance(h, tuple) else (want[1],)):
            torch.testing.assert_close(got.full_tensor(), w, rtol=1e-4, atol=1e-5)
        _loss(out, h).backward()
        torch.testing.assert_close(gx.grad.full_tensor(), xr.grad, rtol=1e-4, atol=1e-5)
        for n, param in module.named_parameters():
            torch.testing.assert_close(param.grad.full_tensor(), grads[n], rtol=1e-4, atol=1e-5)


def _loss(out, h):
    h = h[0] if isinstance(h, tuple) else h
    return (out * out).sum() + (h * h).sum()
