"""The dispatch cache: each call key's decision (ops/call_key.py), bounded, least recently used out first.

A training step meets a few hundred distinct keys (the GPT of examples/ on a 2x2 placement: ~150),
repeated at every step; an evaluation, a new sequence length, a planner's candidates add more.
:data:`MAXSIZE` entries hold many such programs at once. Past that, what goes is what was used least
recently, kept in two generations so that a hit costs one dictionary look-up and nothing more (an
ordered dict's move-to-end on every hit is ~1.5 % of an eager op's whole overhead): new decisions
enter the recent generation; when it holds ``MAXSIZE / 2``, it becomes the older one and the older
one is dropped; a hit in the older generation moves the entry back into the recent one. So a
decision used at least once per ``MAXSIZE / 2`` new decisions is never dropped, and one unused for
``MAXSIZE`` new decisions always is. ``gt.dispatch_cache_info()`` reports hits, misses and the size;
a steady training loop shows a flat size and no new misses.
"""
from __future__ import annotations

from typing import NamedTuple

#: the most decisions kept, both generations together (a decision is a few small objects: ~2 KB)
MAXSIZE = 4096


class CacheInfo(NamedTuple):
    """``hits``: calls that found their decision; ``misses``: decisions made (a call the key cannot
    hold counts as a miss each time); ``size`` / ``maxsize``: entries now / at most."""
    hits: int
    misses: int
    size: int
    maxsize: int


class DecisionCache:
    """Two generations of decisions. The dispatcher's hot path reads :attr:`recent` directly (the same
    dict object for the cache's life) and counts its own hits; every other look-up is :meth:`get`."""

    def __init__(self, maxsize: int = MAXSIZE):
        self.recent: dict = {}
        self.older: dict = {}
        self.maxsize = maxsize
        self.hits = 0
        self.misses = 0

    def get(self, key):
        """The decision stored under ``key`` (a hit, counted; from the older generation, moved back to
        the recent one), or None."""
        decision = self.recent.get(key)
        if decision is None:
            decision = self.older.pop(key, None)
            if decision is None:
                return None
            self.store(key, decision)
        self.hits += 1
        return decision

    def store(self, key, decision) -> None:
        recent = self.recent
        if len(recent) >= max(1, self.maxsize // 2):
            self.older = dict(recent)          # the recent generation ages; the older one goes
            recent.clear()
        recent[key] = decision

    def resize(self, maxsize: int) -> None:
        """Keep at most ``maxsize`` decisions from now on; past it now, the oldest go (the older
        generation's first)."""
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 2:
            raise ValueError(f"gt.set_dispatch_cache_size: expected an int >= 2 (two generations), got {maxsize!r}")
        self.maxsize = maxsize
        while len(self) > maxsize:
            generation = self.older or self.recent
            del generation[next(iter(generation))]

    def clear(self) -> None:
        """Drop every decision and zero the counts."""
        self.recent.clear()
        self.older = {}
        self.hits = self.misses = 0

    def drop_all(self) -> None:
        """Drop every decision, keeping the counts (the rules changed)."""
        self.recent.clear()
        self.older = {}

    def info(self, hot_hits: int = 0) -> CacheInfo:
        """The counts; ``hot_hits``: the hits the dispatcher's hot path counted itself."""
        return CacheInfo(self.hits + hot_hits, self.misses, len(self), self.maxsize)

    def __len__(self) -> int:
        return len(self.recent) + len(self.older)
