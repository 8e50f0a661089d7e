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

    def add_paused(self, record: CollectiveRecord) -> None:
        """A collective run while recording is paused (a capture run): not counted."""

    def __repr__(self) -> str:
        return f"CommStats(collectives={self.count}, bytes_sent={self.bytes_sent})"


_active: List[CommStats] = []
_paused: List[CommStats] = []   # the recorders a paused region hides; they see its collectives by add_paused
_lock = threading.Lock()


class comm_stats:
    """Context manager recording every collective run inside it."""

    def __enter__(self) -> CommStats:
        self.stats = CommStats()
        start_recording(self.stats)
        return self.stats

    def __exit__(self, *exc) -> None:
        stop_recording(self.stats)


def start_recording(recorder: CommStats) -> None:
    """``recorder.add(record)`` from now on, for every collective run."""
    _active.append(recorder)


def stop_recording(recorder: CommStats) -> None:
    """No more records for ``recorder``."""
    # by identity: two recorders with equal contents (say, both empty) compare equal
    for i in range(len(_active) - 1, -1, -1):
        if _active[i] is recorder:
            del _active[i]
            break


class paused:
    """Within, collectives are not recorded (the traced mode's capture run, whose collectives the
    compiled run performs and counts again); the hidden recorders see them through ``add_paused``
    (a profile notes what the capture saw)."""

    def __enter__(self) -> None:
        self.saved = _active[:]
        self.hidden = len(_paused)
        _paused.extend(self.saved)
        _active.clear()

    def __exit__(self, *exc) -> None:
        del _paused[self.hidden:]
        _active[:] = self.saved + _active


def record(op: str, group: tuple, bytes_per_rank: Dict[int, int]) -> None:
    if _active or _paused:
        rec = CollectiveRecord(op, tuple(group), dict(bytes_per_rank))
        with _lock:                 # a compiled graph's collective streams record from their threads
            for s in _active:
                s.add(rec)
            for s in _paused:
                s.add_paused(rec)


def recording() -> bool:
    return bool(_active)


def ring_bytes(group: tuple, chunk_bytes: list) -> Dict[int, int]:
    """Ring all-gather / reduce-scatter: rank i passes on every chunk but the one of rank i+1."""
    total = sum(chunk_bytes)
    p = len(group)
    return {r: total - chunk_bytes[(i + 1) % p] for i, r in enumerate(group)} if p > 1 else {group[0]: 0}
