"""A stand-in for CUDA graphs on CPU, to test ``gt.compile(cuda_graphs=True)``'s plumbing without a GPU.

Capturing runs the segment's body on fake tensors under a recording mode: every aten call is kept
with its arguments, nothing runs (a CUDA capture records kernels and runs none). The static outputs
alias as a graph's do: outputs on one storage are views of one static buffer (a gradient bucket and
its views), an output on the storage of a tensor the calls read (a parameter, a static input) is a
view of that tensor, and an in-place op's result on such a tensor (the binding returns its real
argument) is that tensor itself. Replaying runs the recorded calls again on the real tensors -- the
static inputs and the constants the calls read, as a graph reads fixed addresses -- and copies each
result storage into its static buffer. A capture may be told to fail (as one with a host read
inside would on a GPU).
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


class _Recording(TorchDispatchMode):
    """Keeps every call with its arguments and runs it on fakes: a real tensor (a static input, a
    parameter) is handed on as its fake -- fake mode alone would run an op whose arguments are all
    real on the real tensors, and an in-place one would write them."""

    def __init__(self, fake: FakeTensorMode):
        super().__init__()
        self.fake, self.calls, self.real = fake, [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}

        def as_fake(x):
            if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor):
                self.real[id(x)] = x
                return self.fake.from_tensor(x)
            return x
        out = func(*tree_map(as_fake, args), **tree_map(as_fake, kwargs))
        self.calls.append((func, args, kwargs, out))
        return out


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _on(storage, like: torch.Tensor) -> torch.Tensor:
    """A tensor on ``storage`` with ``like``'s dtype, offset, shape and strides."""
    return torch.empty(0, dtype=like.dtype).set_(storage, like.storage_offset(), like.shape, like.stride())


class RecordedGraph:
    def __init__(self, calls, outs, static_outs, buffers):
        self.calls, self.outs, self.static_outs = calls, outs, static_outs
        self.buffers = buffers          # [(an output's index, its static storage)] per storage a replay fills


class StandInGraphs:
    """The backend interface of actor_rt/cuda_graphs.py ``CudaGraphs``, on CPU tensors."""
    device_type = "cpu"

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.captures = self.replays = 0
        self.pools: list = []
        self.captured_in: list = []          # the pool of each capture

    def check(self) -> None:
        return None

    def pool(self):
        self.pools.append(object())
        return self.pools[-1]

    def capture(self, body, inputs, pool):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing (stand-in)")
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, _Recording(mode) as rec:
            outs = body(inputs)
        with mode:
            read = {_key(mode.from_tensor(t)): t.untyped_storage() for t in rec.real.values()}
        storages, buffers, static = {}, [], []
        for i, o in enumerate(outs):
            if not isinstance(o, FakeTensor):       # an in-place op's result is its real argument itself
                static.append(o)
                continue
            key = _key(o)
            if key not in storages:
                storages[key] = read.get(key)
                if storages[key] is None:
                    storages[key] = torch.empty(o.untyped_storage().nbytes(), dtype=torch.uint8).untyped_storage()
                    buffers.append((i, storages[key]))
            static.append(_on(storages[key], o))
        self.captures += 1
        self.captured_in.append(pool)
        return RecordedGraph(rec.calls, list(outs), static, buffers), static

    def replay(self, graph: RecordedGraph) -> None:
        self.replays += 1
        real: dict = {}
        def swap(x):
            if isinstance(x, FakeTensor):
                return real[id(x)]           # made by an earlier call of the replay
            return x
        for func, args, kwargs, out in graph.calls:
            got = func(*tree_map(swap, args), **tree_map(swap, kwargs))
            for fake, value in zip(tree_flatten(out)[0], tree_flatten(got)[0]):
                if isinstance(fake, torch.Tensor):
                    real[id(fake)] = value
        for i, storage in graph.buffers:
            made = swap(graph.outs[i]).untyped_storage()
            torch.empty(0, dtype=torch.uint8).set_(storage).copy_(torch.empty(0, dtype=torch.uint8).set_(made))
