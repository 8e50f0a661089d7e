"""One object per distinct layout, so the dispatcher's hot path compares layouts by identity.

A decision caches the ids of its inputs' layouts; every layout a decision hands to a tensor (a
target it boxes an input to, an output's layout) and every input's layout before its key is stored
is the interned object, so the same layouts give the same key call after call; a gradient read
through ``.grad`` and an optimizer's states take their parameter's interned layout too (tensor.py,
nn/optim_pieces.py), so their checks are identities. Interned layouts live as long as the process.
"""
from __future__ import annotations

from .layout import Layout

_LAYOUTS: dict = {}


def intern(layout: Layout) -> Layout:
    return _LAYOUTS.setdefault(layout, layout)
