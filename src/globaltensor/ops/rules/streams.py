"""``record_stream``: a CUDA stream uses the tensor's memory, so the caching allocator must not hand
it out again before that stream is done. It reads and writes no values: every rank's piece records
the stream, whatever the layout (the schema marks the tensor written, so the layout stays as it
is -- no gather into a copy whose recording would protect nothing)."""
from __future__ import annotations

from ..registry import aten, register_rule
from .common import P, S, sig


def _any_layout(x, stream):
    return [sig([S(d)], []) for d in range(x.dim())] + [sig([P], [])]


register_rule(aten.record_stream.default, _any_layout)
