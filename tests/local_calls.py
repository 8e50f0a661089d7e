"""``LocalCalls()``: a dispatch mode that records the aten ops run on plain pieces -- what each rank's
kernels see under the global ops -- so a test can count local calls (one fused call per group, say)."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from globaltensor.tensor import GlobalTensor


class LocalCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, GlobalTensor) for t in types):
            with self:                          # the pieces' ops that the global op issues come back here
                return GlobalTensor.__torch_dispatch__(func, types, args, kwargs or {})
        return self.local(func, args, kwargs or {})

    def local(self, func, args, kwargs):
        """One op on plain pieces: recorded, then run."""
        self.calls.append(func)
        return func(*args, **kwargs)

    def count(self, name: str) -> int:
        """How many local calls of the op packet ``name`` (``"_foreach_add_"``) ran."""
        return sum(f.overloadpacket.__name__ == name for f in self.calls)
