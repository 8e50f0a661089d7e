"""This machine's kernels and dispatch, timed for ``gt.calibrate()``: what a Device says of a GPU.

Each figure is the median of ``repeats`` timings after one untimed call, each timing the mean of
enough calls to last longer than a scheduler's time slice -- a step's typical cost, not its best --
and the ranks start each timing together, so that they share the machine's cores as they do in
training (where ranks outnumber cores, a kernel takes its share of the waits):

- matmuls of two sizes per float dtype: ``α + flops / rate``;
- causal attention's forward and backward (``F.scaled_dot_product_attention``) at two lengths:
  its rate as a fraction of the matmul rate;
- a mix of memory-bound kernels (GELU, add, layer norm, softmax, scale) at two sizes:
  ``α + bytes / bandwidth`` per kernel;
- a small training step's host time per global op over its plain twin's (:func:`host_op_seconds`);
- the host's CPU time per gradient a gradient bucket takes (:func:`host_gradient_seconds`).
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import replace
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from ...comm import get_world
from ...placement import Placement
from ...sbp import broadcast, split
from ...tensor import GlobalTensor
from .devices import THIS_CPU, Device

MATMUL_SIDES = (64, 256)                 # a matmul of side n does 2 n^3 flops
ATTENTION_LENGTHS = (64, 256)            # causal attention of 4 heads of 32 over this many positions
MEMORY_NUMELS = (16 * 1024, 512 * 1024)  # elements per memory-bound kernel
MEMORY_MIX = 5                           # kernels per round of the mix
BLOCK_TOKENS, BLOCK_WIDTH = 256, 64      # the host's step: its kernels about as long as its dispatch
GRADIENT_LAYERS, GRADIENT_WIDTH = 16, 32  # a stack of small linear layers: 16 partial weight gradients
GRADIENT_CALLS = 8                        # backwards a timing of it covers, the same on every rank (it reduces)


#: the shortest stretch one timing covers: longer than a scheduler's time slice, so that where ranks
#: outnumber the cores a kernel's time includes its share of the waits, as in a step
WINDOW_S = 0.02


def calls_to_fill(run: Callable) -> int:
    """How many calls of ``run`` fill :data:`WINDOW_S`, judged by one call (which also warms it up)."""
    start = time.perf_counter()
    run()
    return max(1, int(WINDOW_S / max(time.perf_counter() - start, 1e-7)))


def together() -> None:
    """Wait until every rank of a process world is here: the timing that follows runs on every rank
    at once. Timed apart, the ranks drift, and the last to finish time alone on cores the others
    have left: two calibrations of 2 processes on 2 cores read the matmuls at 91 and 57 GFLOP/s;
    begun together, at 92 and 90."""
    world = get_world()
    if not world.simulated:
        world.all_reduce(tuple(range(world.size)), {world.rank: torch.zeros(1)})


def per_call(run: Callable, calls: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """The mean seconds of ``calls`` calls of ``run`` on ``clock``, begun on every rank at once."""
    together()
    start = clock()
    for _ in range(calls):
        run()
    return (clock() - start) / calls


def typical(run: Callable, repeats: int, calls: Optional[int] = None) -> float:
    """The median seconds of a call of ``run`` over ``repeats`` timings after one untimed call, each
    timing the mean over ``calls`` calls -- by default enough to fill :data:`WINDOW_S`; give it where
    ``run`` is a collective, which every rank must call alike."""
    if calls is None:
        calls = calls_to_fill(run)
    else:
        run()
    return statistics.median(per_call(run, calls) for _ in range(repeats))


def line(x1: float, t1: float, x2: float, t2: float) -> tuple:
    """``(α, rate)`` of ``t = α + x / rate`` through two points (α not below 0)."""
    rate = (x2 - x1) / max(t2 - t1, 1e-9)
    return max(t1 - x1 / rate, 0.0), rate


def kernel_points(repeats: int) -> Dict[str, tuple]:
    """``{name: (work, seconds)}`` of every timed kernel: matmuls (work in flops), attention (flops
    done: half of a causal kernel's), the memory mix (bytes read and written)."""
    out = {}
    for dtype in (torch.float32, torch.float64):
        for n in MATMUL_SIDES:
            a = torch.ones(n, n, dtype=dtype)
            out[f"mm {dtype} {n}"] = (2 * n ** 3, typical(lambda: torch.mm(a, a), repeats))
    for n in ATTENTION_LENGTHS:
        q, k, v = (torch.randn(1, 4, n, 32, requires_grad=True) for _ in range(3))
        grad = torch.ones(1, 4, n, 32)

        def attention():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        flops = sdpa_flop_count(q.shape, k.shape, v.shape) + sdpa_backward_flop_count(grad.shape, q.shape, k.shape,
                                                                                       v.shape)
        out[f"attention {n}"] = (flops // 2, typical(attention, repeats))
    for n in MEMORY_NUMELS:
        x, y = torch.randn(n // 64, 64), torch.randn(n // 64, 64)

        def mix():
            F.gelu(x), x + y, F.layer_norm(x, (64,)), torch.softmax(x, -1), x * 0.5
        out[f"memory {n}"] = (11 * 4 * n, typical(mix, repeats))
    return out


def fitted_device(points: Dict[str, tuple]) -> Device:
    """This machine as a Device fitted to the timed kernels (its links come from the collectives)."""
    rates, latencies = {}, []
    for dtype in (torch.float32, torch.float64):
        (f1, t1), (f2, t2) = (points[f"mm {dtype} {n}"] for n in MATMUL_SIDES)
        latency, rates[dtype] = line(f1, t1, f2, t2)
        latencies.append(latency)
    (a1, s1), (a2, s2) = (points[f"attention {n}"] for n in ATTENTION_LENGTHS)
    _, attention_rate = line(a1, s1, a2, s2)
    (b1, t1), (b2, t2) = (points[f"memory {n}"] for n in MEMORY_NUMELS)
    mix_latency, bandwidth = line(b1, t1, b2, t2)
    return replace(THIS_CPU, name="this CPU (calibrated)", peak=dict(rates), rate=rates,
                   matmul_latency=max(latencies), memory_bandwidth=bandwidth, op_latency=mix_latency / MEMORY_MIX,
                   attention_fraction=min(attention_rate / rates[torch.float32], 1.0))


def host_op_seconds(ranks: list, repeats: int) -> float:
    """The seconds a global op adds to its plain op's in a training step: a pre-norm MLP block (layer
    norm, linear, GELU, linear, residual, cross entropy) replicated on every rank (it sends
    nothing), its forward and backward timed on global tensors and on a plain twin in alternating
    rounds, the median difference divided by the global ops it dispatches (counted in a run of
    their own). Sized so that its kernels last about as long as its dispatch: the dispatch of a
    real step runs between kernels that have used the caches, not in a loop of its own."""
    from ..distribute import distribute_module
    from ...from_local import distribute
    placement = Placement("cpu", ranks)
    torch.manual_seed(0)
    d, n = BLOCK_WIDTH, BLOCK_TOKENS
    block = torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                torch.nn.Linear(4 * d, d))
    x, targets = torch.randn(n, d), torch.randint(0, d, (n,))

    def step(model, x, targets):
        F.cross_entropy(model(x) + x, targets).backward()
    twin = copy.deepcopy(block)
    distribute_module(block, placement, {})
    gx, g_targets = (distribute(t, placement, (broadcast,)) for t in (x, targets))
    step(block, gx, g_targets)
    with GlobalOps() as counted:
        step(block, gx, g_targets)
    plain_run, global_run = (lambda: step(twin, x, targets)), (lambda: step(block, gx, g_targets))
    plain_calls, global_calls = calls_to_fill(plain_run), calls_to_fill(global_run)
    held = sum(1 for r in ranks if get_world().holds(r))
    added = [per_call(global_run, global_calls) - held * per_call(plain_run, plain_calls)
             for _ in range(2 * repeats + 1)]            # paired rounds: a slow spell hits both sides
    return max(statistics.median(added), 0.0) / counted.ops


def host_gradient_seconds(ranks: list, repeats: int) -> float:
    """The CPU seconds a gradient adds to its process's main thread in a backward when a gradient
    bucket takes it: the hooks' Python, its copy into the bucket's flat buffer and out, the
    collective's launch -- not the wait for the collective, which is communication and costs no CPU
    time. A stack of small linear layers replicated on a batch split over the ranks (the weights'
    gradients partial; the biases' come out whole, as the sum's gradient is), its forward and
    backward timed in the thread's CPU time with the gradients bucketed and with the buckets off
    (``bucket_bytes=0``: they stay partial), in alternating rounds; the median difference over the
    gradients the buckets took in one backward."""
    from ..distribute import distribute_module
    from ...from_local import distribute
    placement = Placement("cpu", ranks)
    torch.manual_seed(0)
    d = GRADIENT_WIDTH
    bucketed = torch.nn.Sequential(*(torch.nn.Linear(d, d) for _ in range(GRADIENT_LAYERS)))
    partial = copy.deepcopy(bucketed)
    distribute_module(bucketed, placement, {})
    distribute_module(partial, placement, {}, bucket_bytes=0)
    x = distribute(torch.randn(8 * len(ranks), d), placement, (split(0),))

    def backward(model):
        for p in model.parameters():         # not zero_grad(): it reads .grad, which reduces a partial one
            p.grad = None
        model(x).sum().backward()
    taken = []                               # the warm-up backward counts the gradients the buckets take
    bucketed._gt_grad_buckets.on_bucketed = taken.append
    backward(bucketed)
    bucketed._gt_grad_buckets.on_bucketed = None
    backward(partial)
    added = [per_call(lambda: backward(bucketed), GRADIENT_CALLS, time.thread_time)
             - per_call(lambda: backward(partial), GRADIENT_CALLS, time.thread_time) for _ in range(2 * repeats + 1)]
    return max(statistics.median(added), 0.0) / len(taken)


class GlobalOps(TorchDispatchMode):
    """Counts the global ops dispatched within (their piece ops are the ops' own business)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, GlobalTensor) for t in types):
            self.ops += 1
        return func(*args, **(kwargs or {}))
