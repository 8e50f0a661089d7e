"""Per-rank peak memory of a long-context step: the sequence split over 4 processes, against one device.

    .venv/bin/python benchmarks/long_context.py [--quick]

A causal 2-layer GPT (examples/gpt.py: 2 heads, n_embd 64) on one sequence of T = 4096 tokens
(``--quick``: 1024), forward and backward. On one device; then in 4 gloo processes with the tokens
split on the sequence (``S(1)``) and the model replicated, where attention runs as ring attention
(2 heads on 4 ranks). Each process measures the peak of the bytes it allocated during the step
(``torch.profiler``'s memory events, their running sum; the parameters exist before and are not
counted, the gradients are, on both sides), after one warm-up step. Goal (#31): the busiest rank's
peak at most 0.35x one device's.

The peers: DTensor's ``context_parallel`` rotates k and v for the CUDA sdpa kernels only (flash,
efficient, cudnn), so it has no CPU row here; a hand-written ring over raw torch.distributed is
what our ring attention is.
"""
from __future__ import annotations

import argparse
import sys

import _harness as H

GOAL = 0.35
EXAMPLES = __import__("os").path.join(H._SRC, "..", "examples")


def _model(seq: int):
    import torch
    sys.path.insert(0, EXAMPLES)
    from gpt import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=seq, n_layer=2, n_head=2, n_embd=64)
    g = torch.Generator().manual_seed(1)
    return GPT(cfg), torch.randint(0, 64, (1, seq), generator=g), torch.randint(0, 64, (1, seq), generator=g)


def peak_bytes(fn) -> int:
    """The most bytes ``fn`` had allocated at once (the running sum of the profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


def _one_device(rank: int, world: int, seq: int) -> int:
    model, idx, targets = _model(seq)

    def step():
        model.loss(idx, targets).backward()
        model.zero_grad(set_to_none=True)
    step()
    return peak_bytes(step)


def _split(rank: int, world: int, seq: int) -> dict:
    import torch.distributed as dist
    import globaltensor as gt
    from globaltensor.sbp import split as S
    model, idx, targets = _model(seq)
    placement = gt.placement("cpu", list(range(world)))
    gt.nn.distribute_module(model, placement)
    gidx, gtargets = gt.distribute(idx, placement, S(1)), gt.distribute(targets, placement, S(1))

    def step():
        model.loss(gidx, gtargets).backward()
        model.zero_grad(set_to_none=True)
    step()
    with gt.comm_stats() as stats:
        peak = peak_bytes(step)
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    return dict(peaks=peaks, ops=sorted(set(stats.ops())))


def measure(quick: bool = False) -> dict:
    seq = 1024 if quick else 4096
    return dict(seq=seq, one=H.spawn(_one_device, 0, seq), split=H.spawn(_split, 4, seq))


def report(res: dict) -> None:
    one, peaks = res["one"], res["split"]["peaks"]
    ratio = max(peaks) / one
    print(f"causal 2-layer GPT, 2 heads, n_embd 64, one sequence of {res['seq']} tokens; peak bytes allocated "
          f"during a forward and backward")
    print(H.table(["", "peak bytes", "x one device"],
            [["one device", f"{one:,}", "1.00"]] +
            [[f"rank {r} of 4 (S(1))", f"{p:,}", f"{p / one:.2f}"] for r, p in enumerate(peaks)]))
    print(f"collectives of the split step: {', '.join(res['split']['ops'])}")
    print(f"goal: the busiest rank at most {GOAL}x one device's -- {ratio:.3f}x: "
          f"{'met' if ratio <= GOAL else 'NOT met'}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    report(measure(ap.parse_args().quick))
