"""Shared helpers of the benchmarks: spawn gloo processes, time side by side, print tables.

Every benchmark script spawns its own processes (``spawn``): each sets one OMP/torch
thread, joins a gloo group on 127.0.0.1 at a free port and runs ``worker(rank, world,
*args)``; rank 0's return value comes back to the parent. Timing (``timed``) is warm-up
calls, then ``repeats`` rounds of ``inner`` back-to-back calls; a round's time is the
slowest rank's, the figure is the median round. Nothing is downloaded.
"""
from __future__ import annotations

import gc
import math
import os
import socket
import statistics
import sys
import time
import traceback
from typing import Callable, List, Optional, Sequence

# One thread per process, set before torch is imported here and inherited by children.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("GT_COLLECTIVE_TIMEOUT", "120")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# Make `import globaltensor` work from a checkout without installing (src layout).
_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
if os.path.isdir(_SRC) and _SRC not in sys.path:
    sys.path.insert(0, _SRC)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, worker: Callable, args: tuple, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import warnings
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*")
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*")
    import torch.distributed as dist
    try:
        if world > 0:
            from datetime import timedelta
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=180))
        result = worker(rank, world, *args)
        if rank == 0:
            q.put(("ok", result))
        if world > 0:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        q.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def spawn(worker: Callable, nproc: int, *args, timeout: float = 600.0):
    """Run ``worker(rank, nproc, *args)`` in ``nproc`` gloo processes; rank 0's return value.

    ``nproc=0`` runs one process with no process group (for single-process measurements
    that must not share this interpreter's state).
    """
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, nproc, port, worker, args, q), daemon=False)
             for r in range(max(nproc, 1))]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    result = None
    try:
        while True:
            if not q.empty():
                status, result = q.get()
                if status == "error":
                    raise RuntimeError(f"benchmark worker failed: {result}")
                break
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(0.5)
                if not q.empty():
                    continue
                raise RuntimeError(f"benchmark worker exited with codes {[p.exitcode for p in procs]}")
            if all(p.exitcode == 0 for p in procs):
                raise RuntimeError("benchmark workers exited without a result")
            if time.monotonic() > deadline:
                raise TimeoutError(f"benchmark did not finish in {timeout:.0f} s")
            time.sleep(0.05)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    return result


class Timing(float):
    """A median time in seconds that also carries the fastest round (``.min``) and every round
    (``.rounds``): on a loaded machine the minimum shows the undisturbed cost, the median the
    typical one, and the rounds give :func:`paired_ratio`."""

    def __new__(cls, median: float, fastest: float, rounds=()):
        t = super().__new__(cls, median)
        t.min = fastest
        t.rounds = tuple(rounds)
        return t

    def __reduce__(self):
        return (Timing, (float(self), self.min, self.rounds))


def paired_ratio(a: "Timing", b: "Timing") -> float:
    """The median over rounds of ``a``'s round time over ``b``'s in the same round. Rounds of
    :func:`timed_many` are interleaved, so a slow spell of the machine hits both sides of a
    pair: steadier than the ratio of the medians when the machine's speed drifts."""
    return statistics.median(x / y for x, y in zip(a.rounds, b.rounds))


def timed(fn: Callable, *, warmup: int = 3, repeats: int = 7, inner: int = 3, sync: bool = True) -> float:
    """Median over ``repeats`` rounds of the per-call seconds of ``fn`` (slowest rank per round),
    as a :class:`Timing` (its ``.min`` is the fastest round)."""
    return timed_many({"fn": fn}, warmup=warmup, repeats=repeats, inner=inner, sync=sync)["fn"]


def timed_many(fns: dict, *, warmup: int = 3, repeats: int = 7, inner: int = 3, sync: bool = True) -> dict:
    """Like :func:`timed` for several functions, their rounds interleaved (a, b, c, a, b, c, ...)
    so that drift in the machine's load hits each alike. ``None`` entries are skipped.
    ``sync=False``: no barrier before a round and no reduction over ranks (one process)."""
    import torch.distributed as dist
    on = sync and dist.is_available() and dist.is_initialized()
    names = [k for k, f in fns.items() if f is not None]
    for k in names:
        for _ in range(warmup):
            fns[k]()
    gc.collect()
    rounds = {k: [] for k in names}
    for _ in range(repeats):
        for k in names:
            fn = fns[k]
            if on:
                dist.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            rounds[k].append((time.perf_counter() - t0) / inner)
    if on and names:
        t = torch.tensor([rounds[k] for k in names], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rounds = dict(zip(names, t.tolist()))
    out = {k: Timing(statistics.median(rounds[k]), min(rounds[k]), rounds[k]) for k in names}
    out.update({k: None for k, f in fns.items() if f is None})
    return out


def inner_for(fns: dict, round_s: float) -> int:
    """Calls per round so that a round of the slowest of ``fns`` lasts about ``round_s``, the same
    on every rank (the functions may be collectives). A round of a few calls of a fast conversion
    right after a barrier times the ranks waking up from it more than the conversion."""
    import torch.distributed as dist
    slowest = 0.0
    for fn in fns.values():
        if fn is not None:
            fn()
            t0 = time.perf_counter()
            fn()
            slowest = max(slowest, time.perf_counter() - t0)
    inner = torch.tensor([max(1, math.ceil(round_s / max(slowest, 1e-9)))])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(inner, op=dist.ReduceOp.MAX)
    return int(inner)


def sgd_step(model, opt, *batch):
    """One training step of a model with a ``loss(*batch)`` method (examples/gpt.py): forward,
    ``zero_grad``, backward, the optimizer's step; the loss."""
    return _update(opt, model.loss(*batch))


def logits_step(model, opt, idx, targets):
    """One training step of a plain module returning logits (DDP, the hand-written shards):
    cross entropy over the flattened tokens, ``zero_grad``, backward, the optimizer's step."""
    import torch.nn.functional as F
    logits = model(idx)
    return _update(opt, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))


def _update(opt, loss):
    """``zero_grad``, ``loss``'s backward, the optimizer's step; ``loss``."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def slowest(seconds: float) -> float:
    """The largest value of ``seconds`` over the ranks (for one-shot timings)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def ratio(a: Optional[float], b: Optional[float]) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def fmt(v, unit_scale: float = 1e3, digits: int = 2) -> str:
    """A time in seconds as milliseconds (``unit_scale=1e6`` for microseconds); text passes through."""
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return f"{v * unit_scale:.{digits}f}"


def table(headers: Sequence[str], rows: List[Sequence], title: str = "") -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    out = ([title] if title else []) + [line, sep]
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join(out)


def header(name: str) -> str:
    import platform
    try:
        load = open("/proc/loadavg").read().split()[0]
    except OSError:
        load = "?"
    return (f"# {name}: torch {torch.__version__}, gloo, {os.cpu_count()} cores (load average {load}), "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, python {platform.python_version()}, "
            f"{time.strftime('%Y-%m-%d %H:%M')}")


def load_average() -> str:
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "?"


def megatron_f_g(group=None):
    """Megatron's two conjugate functions over ``group`` (None: the world), for hand-written
    tensor parallelism: ``f`` is the identity forward and an all-reduce backward (before a
    column-parallel layer), ``g`` an all-reduce forward and the identity backward (after a
    row-parallel one)."""
    import torch.distributed as dist

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
            return grad

    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            t = t.contiguous()
            dist.all_reduce(t, group=group)
            return t

        @staticmethod
        def backward(ctx, grad):
            return grad

    return F.apply, G.apply
