"""The CPU allocator over a step, read from torch.profiler's memory records (every allocation and
free of the process's tensors, whatever code made them -- a peer library's kernels and buffers too):
for launched programs that measure another library's memory as it runs."""
from __future__ import annotations

from torch.profiler import ProfilerActivity, profile


def allocator(step) -> tuple:
    """``step()`` run; the allocator's highest total during it and its total at the end, in bytes,
    both from where it started."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    now = top = 0
    for _, change in events:
        now += change
        top = max(top, now)
    return top, now
