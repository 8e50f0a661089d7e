"""Per-rank peak memory and attention work of a long-context step: the sequence split over 4 processes.

    .venv/bin/python benchmarks/long_context.py [--quick]

A causal 2-layer GPT (examples/gpt.py: 2 heads, n_embd 64) on one sequence of T = 4096 tokens
(``--quick``: 1024), forward and backward. On one device; then in 4 gloo processes with the tokens
split on the sequence and the model replicated, where attention runs as ring attention (2 heads on
4 ranks): split plainly (``S(1)``) and balanced (``S(1, order="head_tail")``: rank r holds chunks r
and 7 - r of 8). Each process measures the peak of the bytes it allocated during the step
(the allocator's running total in ``torch.profiler``'s memory records, every thread's counted:
_allocator.py; the parameters exist before and are not counted, the gradients are, on both
sides), after one warm-up step. Goals (#31): the busiest rank's peak at most 0.35x one device's;
per-rank causal attention work (query-key scores, counted from the ring's blocks as its kernel
runs them: ``attention_work``) within 5% of each other under the balanced split.

The peers: DTensor's ``context_parallel`` rotates k and v for the CUDA sdpa kernels only (flash,
efficient, cudnn), so it has no CPU row here; a hand-written ring over raw torch.distributed is
what our ring attention is.
"""
from __future__ import annotations

import argparse
import sys

import _harness as H
from _allocator import allocator_peaks

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


def _one_device(rank: int, world: int, seq: int) -> int:
    model, idx, targets = _model(seq)

    def step():
        model.loss(idx, targets).backward()
        model.zero_grad(set_to_none=True)
    step()
    return allocator_peaks(step, 1)[0]


def _split(rank: int, world: int, seq: int, order: str) -> dict:
    import torch.distributed as dist
    import globaltensor as gt
    from globaltensor.sbp import split as S
    model, idx, targets = _model(seq)
    placement = gt.placement("cpu", list(range(world)))
    gt.nn.distribute_module(model, placement)
    sbp = S(1, order=order)
    gidx, gtargets = gt.distribute(idx, placement, sbp), gt.distribute(targets, placement, sbp)

    def step():
        model.loss(gidx, gtargets).backward()
        model.zero_grad(set_to_none=True)
    step()
    with gt.comm_stats() as stats:
        peak = allocator_peaks(step, 1)[0]
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    return dict(peaks=peaks, ops=sorted(set(stats.ops())))


def attention_work(seq: int, order: str, world: int = 4) -> list:
    """Per rank, the causal ring's query-key scores per (batch, head) for q, k, v ``[1, 2, seq, 32]``."""
    import torch
    import globaltensor as gt
    from globaltensor.boxing import Layout
    from globaltensor.ops.rules.ring_attention import attention_work as work
    from globaltensor.sbp import split as S
    with gt.simulate(world):
        layout = Layout((1, 2, seq, 32), torch.float32, gt.placement("cpu", list(range(world))),
                        (S(2, order=order),))
        counted = work(layout, layout, causal=True)
    return [counted[r] for r in range(world)]


ORDERS = {"plain": "S(1)", "head_tail": "S(1, order='head_tail')"}


def measure(quick: bool = False) -> dict:
    seq = 1024 if quick else 4096
    return dict(seq=seq, one=H.spawn(_one_device, 0, seq),
                split={order: H.spawn(_split, 4, seq, order) for order in ORDERS},
                work={order: attention_work(seq, order) for order in ORDERS})


def report(res: dict) -> None:
    one = res["one"]
    print(f"causal 2-layer GPT, 2 heads, n_embd 64, one sequence of {res['seq']} tokens; peak bytes allocated "
          f"during a forward and backward, and the causal attention's query-key scores per (batch, head)")
    rows = [["one device", f"{one:,}", "1.00", "", ""]]
    for order, name in ORDERS.items():
        peaks, work = res["split"][order]["peaks"], res["work"][order]
        mean = sum(work) / len(work)
        rows += [[f"rank {r} of 4 ({name})", f"{p:,}", f"{p / one:.2f}", f"{w:,}", f"{w / mean:.2f}"]
                 for r, (p, w) in enumerate(zip(peaks, work))]
    print(H.table(["", "peak bytes", "x one device", "attention scores", "x mean"], rows))
    for order, name in ORDERS.items():
        peaks, work = res["split"][order]["peaks"], res["work"][order]
        ratio, spread = max(peaks) / one, max(work) / min(work) - 1
        print(f"{name}: collectives {', '.join(res['split'][order]['ops'])}; goal: the busiest rank at most "
              f"{GOAL}x one device's -- {ratio:.3f}x: {'met' if ratio <= GOAL else 'NOT met'}; attention work "
              f"spread {spread:.1%} (goal for the balanced split: within 5%"
              f"{': met' if spread <= 0.05 else ': NOT met' if order == 'head_tail' else ''})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    report(measure(ap.parse_args().quick))
