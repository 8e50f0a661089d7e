"""Conjugate and negative views (ops/rules/mathbits.py, tensor.py): the wrapper carries its pieces'
bits, so later ops see ``z.conj()`` and not ``z``; the ops keep every split and partial sums."""
import random

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import globaltensor as gt
from globaltensor.sbp import broadcast as B, partial_sum as P, split as S
from harness import PLACEMENTS, check_all, make_global, no_fallback

aten = torch.ops.aten
FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# each function of a complex tensor, applied to a global and a plain one, must agree
FUNCS = {
    "conj_mul": lambda z: torch.conj(z) * 1,
    "conj_add": lambda z: torch.conj(z) + z,
    "conj_sum": lambda z: torch.conj(z).sum(0),
    "conj_resolve": lambda z: torch.conj(z).resolve_conj(),
    "conj_imag": lambda z: torch.conj(z).imag,
    "conj_mm": lambda z: torch.conj(z).transpose(0, 1) @ z,
    "neg_view": lambda z: torch._neg_view(z) * 2,
    "conj_neg": lambda z: torch._neg_view(torch.conj(z)).resolve_neg().resolve_conj(),
    "conj_physical": lambda z: torch.conj_physical(z),
    "hfftn": lambda z: torch.fft.hfftn(z),
    "hfft2": lambda z: torch.fft.hfft2(z),
    "view_as_complex": lambda z: torch.view_as_complex(torch.view_as_real(z) * 2),
    "conj_cat": lambda z: torch.cat([torch.conj(z), z], 0),
    "ihfft": lambda z: torch.fft.ihfft(z.real),
}


def _layout(draw_dims, draw_kind, ndim, placement):
    out = []
    for a in range(placement.ndim):
        kind = draw_kind[a]
        out.append(S(draw_dims[a] % ndim) if kind == "S" else P if kind == "P" else B)
    return tuple(out)


@FAST
@given(name=st.sampled_from(sorted(FUNCS)), rows=st.integers(1, 7), cols=st.integers(2, 5),
       two_d=st.booleans(), kinds=st.lists(st.sampled_from("SBP"), min_size=2, max_size=2),
       dims=st.lists(st.integers(0, 1), min_size=2, max_size=2), seed=st.integers(0, 3))
def test_conjugate_and_negative_views_match_one_device(name, rows, cols, two_d, kinds, dims, seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, cols, dtype=torch.complex128, generator=gen)
    want = FUNCS[name](z)
    with gt.simulate(4):
        p = PLACEMENTS["2x2" if two_d else "1d"]()
        nd = _layout(dims, kinds, z.dim(), p)
        g = make_global(z, p, nd, random.Random(seed))
        got = FUNCS[name](g)
        assert got.is_conj() == want.is_conj() and got.is_neg() == want.is_neg(), (name, nd)
        torch.testing.assert_close(got.full_tensor(), want, msg=lambda m: f"{name} on {nd}: {m}")


def test_conjugate_bit_is_on_the_wrapper_and_its_pieces():
    z = torch.randn(8, 3, dtype=torch.complex64)
    with gt.simulate(4):
        g = gt.distribute(z, gt.placement("cpu", [0, 1, 2, 3]), S(0))
        c = torch.conj(g)
        assert c.is_conj() and all(t.is_conj() for t in c.local_tensors().values())
        torch.testing.assert_close((c * 1).full_tensor(), z.conj())


def test_math_bit_ops_keep_every_split_and_partial_without_fallback():
    z = torch.randn(6, 5, dtype=torch.complex128)
    with no_fallback():
        for op in (aten._conj.default, aten._neg_view.default, aten._conj_physical.default):
            assert check_all(op, z) >= 3
        assert check_all(aten.view_as_complex.default, torch.randn(6, 5, 2, dtype=torch.float64)) >= 3


def test_boxing_a_conjugate_view_keeps_the_conjugation():
    z = torch.randn(6, 3, dtype=torch.complex128)
    with gt.simulate(4):
        c = torch.conj(gt.distribute(z, gt.placement("cpu", [0, 1, 2, 3]), S(0)))
        torch.testing.assert_close(c.to_global(sbp=B).to_local(), z.conj())
        torch.testing.assert_close(torch._neg_view(c).to_global(sbp=S(1)).full_tensor(), -z.conj())


def test_ihfft_gradient_on_split_input():
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 3, dtype=torch.complex128)
    want, = torch.autograd.grad(torch.fft.ihfft(x), x, w)
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        g = gt.distribute(x.detach(), p, S(0)).requires_grad_()
        got, = torch.autograd.grad(torch.fft.ihfft(g), g, gt.distribute(w, p, S(0)))
        torch.testing.assert_close(got.full_tensor(), want)


def test_hfftn_keeps_gradient_on_split_input():
    z = torch.randn(6, 4, dtype=torch.complex128, requires_grad=True)
    torch.fft.hfftn(z).pow(2).sum().backward()
    with gt.simulate(4):
        g = gt.distribute(z.detach(), gt.placement("cpu", [0, 1, 2, 3]), S(1)).requires_grad_()
        torch.fft.hfftn(g).pow(2).sum().backward()
        torch.testing.assert_close(g.grad.full_tensor(), z.grad)
