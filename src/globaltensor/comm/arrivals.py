"""Who arrived at a collective: each rank publishes where it is, so that a timed-out peer can tell.

Every process keeps, per group of ranks (a sorted tuple), how many collectives it has entered
on that group and which ones it is inside now. A daemon thread publishes that state to the
job's store (``globaltensor/arrivals/RANK``) whenever it changed, at most every
:data:`PERIOD_S` seconds; a collective pays a counter and two dictionary writes, never a store
round trip. When a collective fails, the failing rank reads its peers' states: a peer that
has entered fewer collectives on the group did not arrive, and its state says where it is
instead, as last seen (waiting in another collective, in no collective at all, or failed -- a
rank reports its own failure at once, see :meth:`ArrivalBoard.report_failure`). A rank killed
outright is last seen up to :data:`PERIOD_S` before it died.
"""
from __future__ import annotations

import json
import threading
from typing import Dict, List, Optional, Tuple

# a publish is a store write (its CPU here and in the store's server on rank 0); a stuck collective
# is diagnosed seconds after it stopped, so 100 ms of staleness costs nothing there
PERIOD_S = 0.1
PREFIX = "globaltensor/arrivals/"
# how long stop() waits for a publish in progress (a store round trip; a dead store fails at once)
STOP_WAIT_S = 5.0


def _ranks(key) -> str:
    return str(list(key))


class ArrivalBoard:
    def __init__(self, store, rank: int):
        self.store, self.rank = store, rank
        self.entered: Dict[tuple, Tuple[str, int]] = {}   # group -> (op, seq) of the last collective entered
        self.inside: Dict[tuple, Tuple[str, int]] = {}    # group -> (op, seq) while inside it
        self.failure: Optional[str] = None
        self._version = 0
        self._counting = threading.Lock()
        self._published = -1
        self._stop = threading.Event()
        self._publish()
        self._thread = threading.Thread(target=self._serve, name="gt-arrivals", daemon=True)
        self._thread.start()

    # -- the hot path: no store access -------------------------------------------------------
    def enter(self, op: str, key: tuple) -> int:
        # locked: two threads of a process may run collectives of one group (a compiled graph's inline sends)
        with self._counting:
            seq = self.entered[key][1] + 1 if key in self.entered else 1
            self.entered[key] = self.inside[key] = (op, seq)
            self._version += 1
        return seq

    def leave(self, key: tuple) -> None:
        with self._counting:
            self.inside.pop(key, None)
            self._version += 1

    # -- publishing ---------------------------------------------------------------------------
    def _state(self) -> str:
        return json.dumps({"entered": [[list(k), op, s] for k, (op, s) in dict(self.entered).items()],
                           "inside": [[list(k), op, s] for k, (op, s) in dict(self.inside).items()],
                           "failure": self.failure})

    def _publish(self) -> None:
        version = self._version
        self.store.set(PREFIX + str(self.rank), self._state())
        self._published = version

    def _serve(self) -> None:
        while not self._stop.wait(PERIOD_S):
            if self._version != self._published:
                try:
                    self._publish()
                except Exception:      # the store is gone (the job is ending): nothing to tell anyone
                    return

    def stop(self) -> None:
        """Stop publishing, and wait until the publisher has left any store call: a daemon thread
        still inside one when the interpreter finalizes is ended by the unwinding of its C++ frames,
        which aborts the process ("terminate called without an active exception", SIGABRT)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(STOP_WAIT_S)

    def report_failure(self, text: str) -> None:
        """Tell the peers, now, that this rank failed (they may be waiting for it in a collective)."""
        if self.failure is None:
            self.failure = text
        try:
            self._publish()
        except Exception:
            pass

    # -- reading, when a collective failed -----------------------------------------------------
    def _peer(self, rank: int) -> Optional[dict]:
        key = PREFIX + str(rank)
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def missing(self, key: tuple, seq: int) -> List[Tuple[int, str]]:
        """``(rank, where it is)`` for each member of group ``key`` that has not entered collective
        ``seq`` on it. Raises when the store cannot be read."""
        out = []
        for r in key:
            if r == self.rank:
                continue
            state = self._peer(r)
            if state is None:
                out.append((r, "it has not started its process world"))
                continue
            entered = {tuple(k): (op, s) for k, op, s in state["entered"]}
            if entered.get(key, ("", 0))[1] >= seq:
                continue
            out.append((r, _where(state, key, entered.get(key))))
        return out


def _where(state: dict, key: tuple, last) -> str:
    parts = []
    if state["failure"]:
        parts.append(f"it failed: {state['failure']}")
    inside = [f"{op} #{s} over ranks {list(k)}" for k, op, s in state["inside"]]
    parts.append("last seen waiting in " + ", ".join(inside) if inside else "last seen in no collective")
    parts.append(f"its last collective over ranks {_ranks(key)} then was {last[0]} #{last[1]}" if last else
                 f"it had entered no collective over ranks {_ranks(key)}")
    return "; ".join(parts)


def describe_missing(board: Optional[ArrivalBoard], key: tuple, seq: int, op: str) -> str:
    """The part of a failed collective's message that says who did not arrive."""
    head = f"this was {op} #{seq} over these ranks"
    if board is None:
        return head
    try:
        missing = board.missing(key, seq)
    except Exception as e:
        return f"{head}; the ranks' arrivals could not be read ({type(e).__name__}: {e}; the rank holding the store may have ended)"
    if not missing:
        return f"{head}; every rank arrived"
    return (f"{head}; ranks {[r for r, _ in missing]} did not arrive (" +
            "; ".join(f"rank {r}: {where}" for r, where in missing) + ")")
