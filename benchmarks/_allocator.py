"""The CPU allocator's peak during each of a benchmark's steps, every thread's memory counted.

torch.profiler's memory records carry the allocator's running total; the peaks here are read from
it. The profiler alone keeps that total only on the threads it profiles, so a tensor made on the
step's thread and freed on one of gloo's stays counted; :func:`allocator_peaks` has the allocator
keep it on every thread while it measures.
"""
from __future__ import annotations

import contextlib
from pathlib import Path


@contextlib.contextmanager
def _every_thread_counted():
    """Within, the CPU allocator's running total counts every thread's allocations and frees.

    The profiler counts an allocation or a free only on a thread it profiles: a tensor made on the
    step's thread and freed on one of gloo's (a send buffer its finished work lets go) stays in the
    total for good, and the peaks climb step after step (ZeRO's by 0.4 MiB a step while the
    process's resident memory stays flat). c10's flag ``caffe2_report_cpu_memory_usage`` makes the
    allocator keep its total on every thread; it has no Python binding, so it is set where libc10
    exports it."""
    import ctypes
    import torch
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
    was, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = was


def allocator_peaks(step, steps: int) -> list:
    """The most bytes the CPU allocator held, beyond what it held before the first, during each of
    ``steps`` calls of ``step()``: the highest running total (``total_allocated``) its memory
    records carry within the call, less the total before the first record. Summing the records'
    sizes instead (``self_cpu_memory_usage``) would lose every free made outside an op -- gloo's
    threads letting its collectives' buffers go -- and count those buffers as held to the end."""
    import warnings
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _every_thread_counted(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            for i in range(steps):
                with record_function(f"measured step {i}"):
                    step()
    records, nodes, starts = [], list(prof.profiler.kineto_results.experimental_event_tree()), []
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation:
            records.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
        elif node.name.startswith("measured step "):
            starts.append(node.start_time_ns)
        nodes.extend(node.children)
    records.sort()
    starts = sorted(starts)[1:] + [float("inf")]
    before = records[0][2] - records[0][1]
    peaks, i = [0] * steps, 0
    for t, _, total in records:
        while t >= starts[i]:
            i += 1
        peaks[i] = max(peaks[i], total - before)
    return peaks
