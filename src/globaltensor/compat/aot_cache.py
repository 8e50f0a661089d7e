"""A global tensor's key in torch.compile's AOTAutograd cache (``_stable_hash_for_caching``).

Without it torch keys a traceable wrapper subclass by pickling its flatten context, the layout --
whose pickle holds Python's ``hash()`` of its fields (salted per process by PYTHONHASHSEED) and the
per-rank caches it filled so far -- so a compiled global program never found its cached graph in
another process, and torch warned about it at every first compile. This key is the layout's text
(shape, dtype, placement, nd-SBP: each with a repr that names it exactly), the ranks this process
holds, each piece's geometry, and ``requires_grad``, hashed with blake2b: equal in every process
for equal inputs.
"""
from __future__ import annotations

import hashlib


def stable_cache_hash(t) -> str:
    """The AOTAutograd cache key of global tensor ``t`` (see the module's docstring)."""
    pieces = t._pieces
    ranks = tuple(sorted(pieces))
    geometry = [(tuple(pieces[r].shape), pieces[r].stride(), str(pieces[r].dtype), str(pieces[r].device))
                for r in ranks]
    text = repr((t._layout, ranks, geometry, t.requires_grad))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
