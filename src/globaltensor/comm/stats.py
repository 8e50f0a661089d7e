"""Byte accounting of collectives: ``with gt.comm_stats() as st: ...; st.bytes_sent``.

Each collective is counted by its bandwidth-optimal algorithm, from global meta only, so a
simulated world and a process world count the same program alike:
ring all-gather / reduce-scatter: the p-1 pieces a rank passes on; all-reduce: twice a
reduce-scatter; all-to-all: the pieces sent to other ranks; broadcast and send: the tensor.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List


@dataclass
class CollectiveRecord:
    op: str
    group: tuple
    bytes_per_rank: Dict[int, int]

    @property
    def bytes(self) -> int:
        return max(self.bytes_per_rank.values(), default=0)


@dataclass
class CommStats:
    records: List[CollectiveRecord] = field(default_factory=list)
    per_rank: Dict[int, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def bytes_sent(self) -> int:
        """The largest number of payload bytes any one rank sent."""
        return max(self.per_rank.values(), default=0)

    @property
    def count(self) -> int:
        return len(self.records)

    def ops(self) -> list:
        return [r.op for r in self.records]

    def add(self, record: CollectiveRecord) -> None:
        self.records.append(record)
        for r, b in record.bytes_per_rank.items():
            self.per_rank[r] += b

    def __repr__(self) -> str:
        return f"CommStats(collectives={self.count}, bytes_sent={self.bytes_sent})"


_active: List[CommStats] = []
_lock = threading.Lock()


class comm_stats:
    """Context manager recording every collective run inside it."""

    def __enter__(self) -> CommStats:
        self.stats = CommStats()
        _active.append(self.stats)
        return self.stats

    def __exit__(self, *exc) -> None:
        # by identity: two recorders with equal contents (say, both empty) compare equal
        for i in range(len(_active) - 1, -1, -1):
            if _active[i] is self.stats:
                del _active[i]
                break


class paused:
    """Within, collectives are not recorded (the traced mode's capture run, whose collectives the
    compiled run performs and counts again)."""

    def __enter__(self) -> None:
        self.saved = _active[:]
        _active.clear()

    def __exit__(self, *exc) -> None:
        _active[:] = self.saved + _active


def record(op: str, group: tuple, bytes_per_rank: Dict[int, int]) -> None:
    if _active:
        rec = CollectiveRecord(op, tuple(group), dict(bytes_per_rank))
        with _lock:                 # a compiled graph's collective streams record from their threads
            for s in _active:
                s.add(rec)


def recording() -> bool:
    return bool(_active)


def ring_bytes(group: tuple, chunk_bytes: list) -> Dict[int, int]:
    """Ring all-gather / reduce-scatter: rank i passes on every chunk but the one of rank i+1."""
    total = sum(chunk_bytes)
    p = len(group)
    return {r: total - chunk_bytes[(i + 1) % p] for i, r in enumerate(group)} if p > 1 else {group[0]: 0}
