"""convolution / convolution_backward: every candidate (plain, no bias, transposed, grouped,
each output_mask), conv2d on random layouts with gradients, and the batch split."""
import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from harness import candidate_signatures, check_candidates, check_layouts

aten = torch.ops.aten
CONV, CONV_BWD = aten.convolution.default, aten.convolution_backward.default
S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


# (stride, padding, dilation, transposed, output_padding, groups)
PLAIN = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
STRIDED = ([2, 1], [0, 1], [1, 2], False, [0, 0], 1)


def _conv_case(n, cin, cout, args, seed=0):
    g = torch.Generator().manual_seed(seed)
    transposed, groups = args[3], args[5]
    w_shape = (cin, cout // groups, 3, 3) if transposed else (cout, cin // groups, 3, 3)
    return torch.randn(n, cin, 8, 8, generator=g), torch.randn(w_shape, generator=g), torch.randn(cout, generator=g)


# (N, Cin, Cout, args): even; uneven with fewer input (3) and output (2) channels than ranks
TOL = dict(rtol=1e-4, atol=1e-4)   # weight gradients sum a few hundred float32 products
CASES = [(4, 4, 8, PLAIN), (5, 3, 2, STRIDED)]


@pytest.mark.parametrize("n,cin,cout,args", CASES)
def test_convolution_candidates(n, cin, cout, args):
    x, w, b = _conv_case(n, cin, cout, args, seed=1)
    assert check_candidates(CONV, x, w, b, *args, max_2d=8) >= 5
    assert check_candidates(CONV, x, w, None, *args, max_2d=8) >= 5


@pytest.mark.parametrize("n,cin,cout,args", CASES)
@pytest.mark.parametrize("mask", [[True, True, True], [True, True, False], [False, True, True]])
def test_convolution_backward_candidates(n, cin, cout, args, mask):
    x, w, b = _conv_case(n, cin, cout, args, seed=2)
    go = torch.randn_like(CONV(x, w, b, *args))
    assert check_candidates(CONV_BWD, go, x, w, [cout], *args, mask, max_2d=8, **TOL) >= 4


def test_transposed_and_grouped():
    transposed = ([2, 2], [1, 1], [1, 1], True, [1, 1], 1)
    x, w, b = _conv_case(5, 3, 2, transposed, seed=3)
    check_candidates(CONV, x, w, b, *transposed, max_2d=6)
    go = torch.randn_like(CONV(x, w, b, *transposed))
    check_candidates(CONV_BWD, go, x, w, [2], *transposed, [True, True, True], max_2d=6, **TOL)
    grouped = ([1, 1], [0, 0], [1, 1], False, [0, 0], 3)
    x, w, b = _conv_case(5, 3, 6, grouped, seed=4)
    sigs = candidate_signatures(CONV, x, w, None, *grouped)
    assert all(c.inputs[0] != S(1) for c in sigs)     # channel splits need groups == 1
    check_candidates(CONV, x, w, None, *grouped, max_2d=6)
    go = torch.randn_like(CONV(x, w, None, *grouped))
    check_candidates(CONV_BWD, go, x, w, None, *grouped, [True, True, False], max_2d=6, **TOL)


def test_conv2d_random_layouts():
    x, w, b = _conv_case(5, 3, 4, PLAIN, seed=5)
    check_layouts(lambda x, w, b: F.conv2d(x, w, b, padding=1), x, w, b, grad=True, trials=4, **TOL)
    check_layouts(lambda x, w: F.conv1d(x, w, stride=2), torch.randn(3, 4, 9), torch.randn(5, 4, 3),
                  grad=True, trials=3, seed=1, **TOL)


def test_conv2d_batch_split():
    """Input S(0), weight and bias B: output S(0) with no traffic; the weight and bias
    gradients are partial sums over the batch, reduced when read."""
    x, w, b = _conv_case(5, 3, 4, PLAIN, seed=6)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    want = F.conv2d(*leaves, padding=1)
    grad = torch.randn_like(want)
    want.backward(grad)
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        gx = gt.distribute(x, p, S(0)).detach().requires_grad_(True)
        gw = gt.distribute(w, p, B).detach().requires_grad_(True)
        gb = gt.distribute(b, p, B).detach().requires_grad_(True)
        with gt.comm_stats() as st:
            got = F.conv2d(gx, gw, gb, padding=1)
            got.backward(gt.distribute(grad, p, S(0)))
        assert st.bytes_sent == 0
        assert got.sbp == (S(0),)
        torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=1e-4, atol=1e-5)
        for t, leaf in zip((gx, gw, gb), leaves):
            assert t.grad.sbp == t.sbp
            torch.testing.assert_close(t.grad.full_tensor(), leaf.grad, **TOL)
