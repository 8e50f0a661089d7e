"""Ring attention on CUDA's sdpa kernels (flash, memory-efficient, cuDNN), on CPU: the ops run as
stand-ins (cuda_attention_standin.py) that compute with the CPU flash op and return what each CUDA
op returns, shapes and dtypes. What the stand-ins cannot show -- the real kernels' arithmetic and
conventions -- tests/cuda checks on a GPU.

Tolerance: the CUDA ops return their log-sum-exp in float32 (their meta kernels say so, and the
stand-ins keep to it), so each block's merge weight ``exp(lse_j - lse)`` carries a relative
rounding of about ``|lse| 2**-24`` (|lse| < 8 here: 5e-7), and a key's gradient sums such terms
over up to 64 query rows: 1e-5 bounds both, against one device's float64 stand-in call."""
import pytest
import torch

import globaltensor as gt
from cuda_attention_standin import cuda_attention_on_cpu
from harness import check_candidates
from globaltensor.ops.explicit import ImplicitBoxingError

aten = torch.ops.aten
S = gt.sbp.split
TOL = dict(rtol=0, atol=1e-5)
KERNELS = ["flash", "efficient", "cudnn"]


@pytest.fixture(autouse=True)
def standins():
    with cuda_attention_on_cpu():
        yield


def attention(kernel, q, k, v, causal, bias=None):
    """The CUDA op's output, as F.scaled_dot_product_attention reaches it on a GPU."""
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[0]
    if kernel == "efficient":
        return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal)[0]
    return aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, causal)[0]


def _run_ring(kernel, tensors, order, causal, bias=None, bias_sbp=None):
    """``(ops, [(got, want)] for the output and the three gradients)``: the ring on 4 ranks under
    gt.explicit against one device."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    want = attention(kernel, *leaves, causal, bias)
    probe = torch.randn_like(want)
    (want * probe).sum().backward()
    seq = S(2, order=order)
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        split = [gt.distribute(t, p, seq).requires_grad_() for t in tensors]
        gbias = None if bias is None else gt.distribute(bias, p, bias_sbp)
        with gt.explicit(), gt.comm_stats() as stats:
            got = attention(kernel, *split, causal, gbias)
            (got * gt.distribute(probe, p, seq)).sum().backward()
        assert got.sbp == (seq,)
        pairs = [(got.full_tensor(), want.detach())] + [(a.grad.full_tensor(), b.grad) for a, b in zip(split, leaves)]
    return set(stats.ops()), pairs


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("order", ["plain", "head_tail"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_attention_on_each_cuda_kernel(kernel, order, causal, float64):
    """q, k and v split on the sequence stay split: only key/value blocks move, forward and backward,
    and the output and gradients equal one device."""
    g = torch.Generator().manual_seed(3)
    ops, pairs = _run_ring(kernel, [torch.randn(2, 2, 64, 8, generator=g) for _ in range(3)], order, causal)
    assert ops == {"send_recv"}
    for got, want in pairs:
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kernel", ["efficient", "cudnn"])
def test_ring_attention_cuts_a_bias_per_block(kernel, float64):
    """An additive bias split on its query rows: each block takes its key columns; rows it hides
    wholly from a block (-inf) take nothing from it."""
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(2, 2, 32, 8, generator=g) for _ in range(3)]
    bias = torch.randn(2, 1, 32, 32, generator=g)
    bias[:, :, :8, 8:] = -float("inf")                      # the first rank's rows see only its own keys
    ops, pairs = _run_ring(kernel, tensors, "plain", False, bias, S(2))
    assert ops == {"send_recv"}
    for got, want in pairs:
        torch.testing.assert_close(got, want, **TOL)


def test_flash_ring_attention_with_grouped_query_heads(float64):
    """Fewer key/value heads than query heads: the blocks carry the kernel's grouped heads as they are."""
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 4, 32, 8, generator=g), torch.randn(1, 2, 32, 8, generator=g), \
        torch.randn(1, 2, 32, 8, generator=g)
    ops, pairs = _run_ring("flash", [q, k, v], "plain", True)
    assert ops == {"send_recv"}
    for got, want in pairs:
        torch.testing.assert_close(got, want, **TOL)


def test_the_efficient_kernels_ring_needs_query_rows_a_multiple_of_32(float64):
    """Its log-sum-exp is padded to a multiple of 32 rows: with 48 queries the padded one would split
    unlike them, so there is no ring signature -- under gt.explicit, a conversion to write."""
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        q, k, v = (gt.distribute(torch.randn(2, 2, 48, 8), p, S(2)) for _ in range(3))
        with gt.explicit(), pytest.raises(ImplicitBoxingError, match="_scaled_dot_product_efficient_attention"):
            attention("efficient", q, k, v, True)
        assert attention("flash", q, k, v, True).sbp == (S(2),)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_candidate_of_the_cuda_attention_rules(causal, float64):
    """Each candidate of the six ops' rules (batch, heads, the ring, a partial grad_out), forced on
    random layouts, equals one device -- the ring's also in head-tail order."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, 32, 8, generator=g) for _ in range(3))
    go = torch.randn(2, 4, 32, 8, generator=g)
    forward_calls = {
        aten._scaled_dot_product_flash_attention.default: (q, k, v, 0.0, causal),
        aten._scaled_dot_product_efficient_attention.default: (q, k, v, None, True, 0.0, causal),
        aten._scaled_dot_product_cudnn_attention.default: (q, k, v, None, True, 0.0, causal),
    }
    for op, args in forward_calls.items():
        assert check_candidates(op, *args, **TOL) >= 3
        assert check_candidates(op, *args, head_tail=True, **TOL) >= 1
    flash = aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, causal)
    efficient = aten._scaled_dot_product_efficient_attention.default(q, k, v, None, True, 0.0, causal)
    cudnn = aten._scaled_dot_product_cudnn_attention.default(q, k, v, None, True, 0.0, causal)
    backward_calls = {
        aten._scaled_dot_product_flash_attention_backward.default:
            (go, q, k, v, flash[0], flash[1], None, None, 32, 32, 0.0, causal, flash[6], flash[7]),
        aten._scaled_dot_product_efficient_attention_backward.default:
            (go, q, k, v, None, efficient[0], efficient[1], efficient[2], efficient[3], 0.0,
             [True, True, True, False], causal),
        aten._scaled_dot_product_cudnn_attention_backward.default:
            (go, q, k, v, cudnn[0], cudnn[1], cudnn[6], cudnn[7], None, None, None, 32, 32, 0.0, causal),
    }
    for op, args in backward_calls.items():
        assert check_candidates(op, *args, **TOL) >= 4
        assert check_candidates(op, *args, head_tail=True, **TOL) >= 1


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("heads, chosen", [(8, "all_to_all"), (2, "send_recv")], ids=["ulysses", "ring"])
def test_the_cost_model_chooses_ring_or_ulysses_for_the_cuda_kernels(kernel, heads, chosen, float64):
    """As for the CPU op (test_attention.py): heads to spare, the all-to-all to a head split sends the
    least; fewer heads than ranks (and a batch of 2 on 4 ranks), the ring."""
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        q, k, v = (gt.distribute(torch.randn(2, heads, 64, 16), p, S(2)).requires_grad_() for _ in range(3))
        with gt.comm_stats() as stats:
            attention(kernel, q, k, v, True).sum().backward()
        assert chosen in stats.ops() and "all_gather" not in stats.ops(), stats.ops()
