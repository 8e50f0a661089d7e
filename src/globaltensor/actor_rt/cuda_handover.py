"""The CUDA hand-over between stream threads: one event per task and register slot, made once.

A task whose value another CUDA stream reads (a producer), and a task that reads one (a consumer),
record their slot's event after their op each iteration (``publish``): the same ``torch.cuda.Event``
for the slot, recorded again. Before its op (``wait``), a consumer's stream waits on each producer's
event of this iteration -- its input is made -- and a producer's stream waits on each consumer's
event of the iteration that last used the register slot it is about to fill: that consumer's
kernels have read the old value before the producer's stream writes, or reuses the memory of, the
new one. So a buffer stays alive by the registers protocol alone -- the host's credit says the
consumer has queued its reads, the device event that they ran -- and no tensor is handed to the
caching allocator's ``record_stream``. An event not recorded yet (the first iterations) is not
waited on.
"""
from __future__ import annotations

import torch


def wait(t, it: int) -> None:
    """On the current (the task's) stream: wait for the producers' events of iteration ``it``, and
    for the consumers' events of iteration ``it - k`` (the last user of the register slot)."""
    current = torch.cuda.current_stream()
    for p in t.cuda_waits:
        ev = p.events[it % p.k] if p.events is not None else None
        if ev is not None:
            current.wait_event(ev)
    if it >= t.k:
        for c in t.cuda_consumers:
            ev = c.events[(it - t.k) % c.k]
            if ev is not None:
                current.wait_event(ev)


def publish(t, it: int) -> None:
    """Record the task's event of this register slot on the current stream (made on first use)."""
    slot = it % t.k
    ev = t.events[slot]
    if ev is None:
        ev = t.events[slot] = torch.cuda.Event()
    ev.record()
