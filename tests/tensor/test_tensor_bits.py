"""The tensor bits beside conjugate and negative (tests/ops/test_mathbits.py) that a wrapper must
mirror: ``is_inference()`` -- torch checks it on the wrapper, above the dispatcher, never on the
pieces inside it -- and the zero-tensor bit of ``torch._efficientzerotensor``, whose kernels
move their operands to ``"meta"`` (a clear error) or materialise them (equal to one device)."""
import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import B, S

X = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
W = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))


def _error(fn):
    """The type and first line of what ``fn()`` raises (None: it does not raise)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- compared with one device's, whatever it is
        return type(e).__name__, str(e).splitlines()[0]
    return None


# each use of a tensor made in inference mode, outside inference mode: one device refuses some
USES = {
    "add": lambda t, w: t + 1,
    "add_": lambda t, w: t.add_(1),
    "requires_grad_": lambda t, w: t.requires_grad_(),
    "saved_for_backward": lambda t, w: (t @ w).sum().backward(),
    "clone_add_": lambda t, w: t.clone().add_(1),
    "view_add_": lambda t, w: t.view(-1).add_(1),
    "slice_add_": lambda t, w: t[1:3].add_(1),
}


CASES = [(u, s) for u in sorted(USES) for s in (S(0), B, S(1))]


@pytest.mark.parametrize("use,sbp", CASES)
def test_tensor_made_in_inference_mode_behaves_as_on_one_device(p1, use, sbp):
    """``view(-1)`` of a column split is a blocked split: its pieces are views of the inference
    pieces, so ``add_`` on it raises torch's error as on one device."""
    with torch.inference_mode():
        plain = X + 0
        glob = gt.distribute(X, p1, sbp) + 0
    assert glob.is_inference() and plain.is_inference()
    w_plain, w_glob = W.clone().requires_grad_(), gt.distribute(W, p1, B).requires_grad_()
    assert _error(lambda: USES[use](glob, w_glob)) == _error(lambda: USES[use](plain, w_plain))


def test_views_and_results_of_an_inference_tensor_outside_inference_mode(p1):
    """A view of an inference tensor is one (as torch makes it); a new result is not."""
    with torch.inference_mode():
        g = gt.distribute(X, p1, S(0))
    assert g.view(-1).is_inference() and g[1:3].is_inference() and g.t().is_inference()
    assert not (g + 1).is_inference() and not g.clone().is_inference()
    assert not g.to_global(sbp=B).is_inference()


def test_to_global_of_an_inference_tensor_is_one(p1):
    """``to_global`` takes the tensor as this rank's piece, a view of it: in-place updates and
    autograd refuse it as they refuse the tensor (torch writes, then raises)."""
    with torch.inference_mode():
        piece = X[:2] + 0
    g = piece.to_global(placement=p1, sbp=S(0))
    assert g.is_inference()
    assert _error(lambda: g.add_(1)) == _error(lambda: piece.add_(1)) is not None
    w = gt.distribute(W, p1, B).requires_grad_()
    assert _error(lambda: (g @ w).sum().backward()) == _error(lambda: (piece @ W.requires_grad_()).sum().backward())
    assert not gt.distribute(piece, p1, S(0)).is_inference()      # distribute copies its slices


# -- torch._efficientzerotensor ---------------------------------------------------------------

@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_zero_tensor_in_its_own_kernels_is_a_clear_error(p1, op):
    """ZeroTensor's kernels of add / sub / mul / div move both operands to "meta" to infer the
    result's shape: a global operand raises the error naming them, not a wrong value."""
    g = gt.distribute(X, p1, S(0))
    z = torch._efficientzerotensor(8, 4)
    with pytest.raises(ValueError, match="ZeroTensor kernels"):
        getattr(torch, op)(g, z)
    with pytest.raises(ValueError, match="ZeroTensor kernels"):
        getattr(torch, op)(z, g)


@pytest.mark.parametrize("fn", ["mm", "where", "cat"])
def test_zero_tensor_elsewhere_equals_one_device(p1, fn):
    """Other ops materialise a zero tensor (torch's ZeroTensor fallback) before they reach
    the dispatcher: it is a plain tensor there, taken as broadcast."""
    calls = {"mm": lambda z, x: z.t() @ x,
             "where": lambda z, x: torch.where(x > 0, z, x),
             "cat": lambda z, x: torch.cat([z, x])}
    z = torch._efficientzerotensor(8, 4)
    want = calls[fn](z, X)
    got = calls[fn](z, gt.distribute(X, p1, S(0)))
    assert not got._is_zerotensor()
    assert torch.equal(got.full_tensor(), want)
