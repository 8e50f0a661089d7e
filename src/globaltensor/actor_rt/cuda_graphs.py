"""CUDA graphs for ``gt.compile(fn, cuda_graphs=True)``: each capturable segment (segments.py) of each
compute stream replayed from a graph instead of launched op by op.

A segment runs as one call in its stream's generated code (stream_code.py). Per register slot
(iteration ``it`` uses slot ``it % k``, ``k`` the most registers of the segment's tasks) the call
goes through three states:

- first use: the tasks run eagerly, as without graphs -- libraries (cuBLAS handles, workspaces)
  initialise on the stream's thread outside any capture -- and the inputs the segment writes are
  noted (their version counters move: a gradient bucket zeroed for the next accumulation);
- second use: the inputs are copied into the slot's static buffers and the segment is captured
  into a graph on the stream, from the slot's memory pool (one per stream); capturing records and
  runs nothing, so the graph is replayed at once for this iteration;
- later uses: the inputs are copied into the static buffers and the graph replays.

A static input keeps its input's storage whole -- the same bytes, offset, shape and strides -- and a
replay copies the input's storage into it, and an input the segment writes gets its static copy's
storage back after the replay: the graph's view ops address storage offsets (fused into
one ``as_strided`` by fuse_views.py), which may reach past the input's own view (a gradient's slice
of its bucket). An input that comes with another storage layout leaves the segment eager, with
one warning. Its outputs are the graph's static outputs of that slot: the registers protocol already keeps a
slot's values until every consumer is through with them, and the slot's graph writes them again
only ``k`` iterations later. An input is read in place -- no copy -- where it is a static output
of another captured segment with the same ``k`` (a fixed tensor per slot) or a constant (parameters
and optimizer state: the graph reads and updates them where they are). Random draws take their
keys as fed inputs (ops/rng.py), so a replay draws what the eager step would.

A capture that fails (a host read inside the segment, say) leaves that segment eager, with one
warning naming it. The backend -- how a graph is made, captured and replayed -- is
:class:`CudaGraphs`; the tests put a stand-in in its place that records a segment's calls and
replays them on CPU (tests/actor_rt/graph_standin.py).
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, List

import torch

from .program import Program
from .segments import Segment, plan_segments


class CudaGraphs:
    """Graphs made, captured and replayed with ``torch.cuda.CUDAGraph``."""
    device_type = "cuda"

    def check(self) -> None:
        """RuntimeError unless this torch can capture CUDA graphs on a GPU here."""
        if not torch.cuda.is_available():
            raise RuntimeError("gt.compile(cuda_graphs=True): CUDA graphs need a GPU, and this torch sees none "
                               f"(torch {torch.__version__}, torch.cuda.is_available() is False); compile "
                               f"without cuda_graphs on CPU")
        if not hasattr(torch.cuda, "CUDAGraph") or not hasattr(torch.cuda, "graph_pool_handle"):
            raise RuntimeError(f"gt.compile(cuda_graphs=True): this torch build ({torch.__version__}) has no CUDA "
                               f"graph support (torch.cuda.CUDAGraph)")

    def pool(self):
        return torch.cuda.graph_pool_handle()

    def capture(self, body: Callable, inputs: list, pool):
        """``(graph, outputs)``: ``body(inputs)`` captured on the current stream, not run."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.current_stream(),
                              capture_error_mode="thread_local"):     # other streams' threads keep running
            outs = body(inputs)
        return graph, outs

    def replay(self, graph) -> None:
        graph.replay()


def graph_backend():
    """The backend ``cuda_graphs=True`` uses (the tests replace this function)."""
    return CudaGraphs()


class GraphPlan:
    """A runtime's captured segments: ``segments`` (stream -> its capturable segments), ``slots``
    (task id -> the register slots its segment's graphs rotate over: the most registers of the
    segment's tasks), one memory pool per stream. Empty without a backend."""

    def __init__(self, program: Program, backend=None, cut_every: int = 0):
        self.backend = backend
        self.segments: Dict[str, List[Segment]] = {}
        self.slots: Dict[int, int] = {}
        self.pools: dict = {}
        if backend is None:
            return
        for seg in plan_segments(program, backend.device_type, cut_every):
            if seg.capturable:
                self.segments.setdefault(seg.stream, []).append(seg)
                k = max(program.tasks[t].registers for t in seg.tasks)
                self.slots.update(dict.fromkeys(seg.tasks, k))

    def pool(self, stream: str):
        if stream not in self.pools:
            self.pools[stream] = self.backend.pool()
        return self.pools[stream]


class SegmentGraph:
    """One segment's graphs, per register slot: eager first, then captured, then replayed."""

    def __init__(self, name: str, body: Callable, slots: int, in_place: List[bool], backend, pool):
        self.name, self.body, self.k, self.in_place = name, body, slots, in_place
        self.backend, self.pool = backend, pool
        self.slots: list = [None] * slots        # per slot: None, "warm", or (graph, static inputs, outputs)
        self.written = [False] * len(in_place)   # per input: whether the segment writes it (seen eagerly)
        self.failed = None

    def __call__(self, it: int, inputs: list):
        state = self.slots[it % self.k]
        if self.failed is not None:
            return self.body(inputs)
        if state is None:
            self.slots[it % self.k] = "warm"
            versions = [x._version for x in inputs]
            outs = self.body(inputs)
            self.written = [w or x._version != v for w, x, v in zip(self.written, inputs, versions)]
            return outs
        if state == "warm":
            return self._capture(it % self.k, inputs)
        graph, static, outs = state
        for x, buf in zip(inputs, static):
            if x is not buf:
                if _geometry(x) != _geometry(buf):
                    return self._give_up(inputs, f"an input came as {_geometry(x)}, captured as {_geometry(buf)}")
                _storage_bytes(buf).copy_(_storage_bytes(x))
        self._replay(graph, inputs, static)
        return outs

    def _replay(self, graph, inputs: list, static: list) -> None:
        self.backend.replay(graph)
        for x, buf, written in zip(inputs, static, self.written):
            if written and x is not buf:
                _storage_bytes(x).copy_(_storage_bytes(buf))

    def _capture(self, slot: int, inputs: list):
        static = [x if keep else _static_copy(x) for x, keep in zip(inputs, self.in_place)]
        try:
            graph, outs = self.backend.capture(self.body, static, self.pool)
        except Exception as e:  # noqa: BLE001 -- the segment runs eagerly instead, and says why
            return self._give_up(inputs, f"{type(e).__name__}: {e}")
        self.slots[slot] = (graph, static, tuple(outs))
        self._replay(graph, inputs, static)
        return tuple(outs)

    def _give_up(self, inputs: list, why: str):
        """Run this segment eagerly from now on, after one warning saying why."""
        self.failed = why
        warnings.warn(f"gt.compile(cuda_graphs=True): segment {self.name} could not be captured ({why}); it runs "
                      f"without a graph", stacklevel=3)
        return self.body(inputs)


def _geometry(t: torch.Tensor) -> tuple:
    """(storage bytes, offset, shape, strides, dtype): what a captured view of ``t`` relies on."""
    return (t.untyped_storage().nbytes(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t``, as bytes."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _static_copy(t: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``t``'s geometry on a copy of its whole storage."""
    storage = _storage_bytes(t).clone().untyped_storage()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())
