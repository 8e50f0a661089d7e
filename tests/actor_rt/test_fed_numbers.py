"""Float arguments of a compiled function read by the graph at each call (nn/fed_numbers.py): a clipping
threshold that changes from call to call is fed, one capture for them all, each step equal to the eager
step with that threshold (float64, the same ops: exact); a float read anywhere else keys the graph by
its value, as before, so no graph ever holds a stale copy of it."""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt
from globaltensor.nn.fed_numbers import FedNumber

S, B = gt.sbp.split, gt.sbp.broadcast
EXACT = dict(rtol=0, atol=0)
THRESHOLDS = [1.0, 0.5, 0.3, 0.2, 0.1, 0.05]


def _pair(p1, body):
    """Two copies of a tensor-parallel linear layer and their SGD, and ``body(lin, x, number)`` as a step."""
    sides = []
    for _ in range(2):
        torch.manual_seed(0)
        lin = torch.nn.Linear(6, 4).double()
        gt.nn.distribute_module(lin, p1, {"weight": S(0), "bias": S(0)})
        opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)

        def step(x, number, lin=lin, opt=opt):
            loss = body(lin, x, number)
            opt.step()
            opt.zero_grad()
            return loss.detach()
        sides.append((lin, step))
    return sides


def _run(p1, body, numbers):
    """The compiled and the eager steps side by side, one number per call; the compiled function."""
    (m_e, step_e), (m_c, step_c) = _pair(p1, body)
    g = gt.compile(step_c)
    gen = torch.Generator().manual_seed(0)
    for k, number in enumerate(numbers):
        x = gt.distribute(torch.randn(8, 6, dtype=torch.float64, generator=gen), p1, B)
        torch.testing.assert_close(g(x, number).full_tensor(), step_e(x, number).full_tensor(), **EXACT)
        for a, b in zip(m_c.parameters(), m_e.parameters()):
            torch.testing.assert_close(a.full_tensor(), b.full_tensor(), **EXACT, msg=f"call {k}")
    return g


def _clip_norm(lin, x, max_norm):
    loss = lin(x).pow(2).sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(lin.parameters(), max_norm)
    return loss


def _clip_value(lin, x, clip_value):
    loss = lin(x).pow(2).sum()
    loss.backward()
    torch.nn.utils.clip_grad_value_(lin.parameters(), clip_value)
    return loss


@pytest.mark.parametrize("body", [_clip_norm, _clip_value], ids=["clip_grad_norm_", "clip_grad_value_"])
def test_a_changing_clipping_threshold_is_fed(p1, body):
    g = _run(p1, body, THRESHOLDS)
    assert g.captures == 1


def _scaled_loss(lin, x, scale):
    loss = lin(x).pow(2).sum() * scale          # the number is read by an op: frozen in a graph
    loss.backward()
    torch.nn.utils.clip_grad_norm_(lin.parameters(), 1.0)
    return loss


def _threshold_compared(lin, x, max_norm):
    loss = lin(x).pow(2).sum()
    loss.backward()
    if max_norm > 0:                             # Python reads the number: the graph takes this branch
        torch.nn.utils.clip_grad_norm_(lin.parameters(), max_norm)
    return loss


@pytest.mark.parametrize("body", [_scaled_loss, _threshold_compared], ids=["read by an op", "read by Python"])
def test_a_number_read_elsewhere_keys_the_graph_by_its_value(p1, body):
    """Found read (an op refuses the FedNumber, or Python compares it), the number keys the graph by its
    value again: a new value's first call runs eagerly, its second is captured; every step equals
    eager's, so nothing stale was replayed."""
    g = _run(p1, body, [0.5, 0.25, 0.25, 0.125, 0.125, 0.25])
    assert g.captures >= 2                        # 0.25 and 0.125 each have a graph of their own


def test_every_python_read_of_a_fed_number_marks_it():
    for read in (float, int, bool, str, repr, abs, hash, lambda n: -n, lambda n: n + 1, lambda n: 2 * n,
                 lambda n: n / 3, lambda n: 3 / n, lambda n: n ** 2, lambda n: n < 1, lambda n: n == 0.5,
                 lambda n: f"{n:.2f}", round):
        number = FedNumber(0.5, 0)
        read(number)
        assert number.used, read
    untouched = FedNumber(0.5, 0)
    assert untouched.value == 0.5 and not untouched.used       # its value is the library's to read
    with pytest.raises(TypeError):
        torch.ones(2) * FedNumber(0.5, 0)         # torch takes no FedNumber: its capture fails, then keys by value
