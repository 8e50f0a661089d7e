"""Arrival tracking (comm/arrivals.py) over an in-memory store: who did not arrive, and where they were."""
from __future__ import annotations

import time

import pytest

from globaltensor.comm.arrivals import PERIOD_S, ArrivalBoard, describe_missing

# The board publishes a change within one PERIOD_S; waiting 100 of them is hang detection only, not
# a bound on a quiet machine's speed.
HANG_PERIODS = 100


class DictStore:
    """The three store calls the board makes, over a dict shared by the boards of one test."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


class DeadStore:
    def set(self, key, value):
        pass

    def check(self, keys):
        raise ConnectionError("connection refused")


@pytest.fixture
def boards():
    store = DictStore()
    made = {r: ArrivalBoard(store, r) for r in range(3)}
    yield made
    for b in made.values():
        b.stop()


def published(board: ArrivalBoard) -> None:
    """Wait until the board's thread has published its latest state."""
    deadline = time.monotonic() + HANG_PERIODS * PERIOD_S
    while board._published != board._version:
        assert time.monotonic() < deadline, "the board never published its state"
        time.sleep(0.005)


def test_a_rank_behind_on_the_group_did_not_arrive(boards):
    group = (0, 1, 2)
    for b in boards.values():                        # collective #1: everyone, in and out
        b.enter("all_gather", group)
        b.leave(group)
    seq = boards[0].enter("all_reduce", group)           # ranks 0 and 1 enter collective #2, rank 2 does not
    boards[1].enter("all_reduce", group)
    boards[2].enter("broadcast", (1, 2))                 # rank 2 waits elsewhere
    for b in boards.values():
        published(b)
    assert [r for r, _ in boards[0].missing(group, seq)] == [2]
    text = describe_missing(boards[0], group, seq, "all_reduce")
    assert text == ("this was all_reduce #2 over these ranks; ranks [2] did not arrive (rank 2: last seen waiting in "
                    "broadcast #1 over ranks [1, 2]; its last collective over ranks [0, 1, 2] then was all_gather #1)"), text


def test_a_failed_rank_says_why(boards):
    group = (0, 1)
    seq = boards[0].enter("all_gather", group)
    boards[1].report_failure("GraphError: task 3 (op mylib.op, rank 1) raised")
    published(boards[0])
    text = describe_missing(boards[0], group, seq, "all_gather")
    assert "ranks [1] did not arrive (rank 1: it failed: GraphError: task 3 (op mylib.op, rank 1) raised; " \
           "last seen in no collective; it had entered no collective over ranks [0, 1])" in text, text


def test_every_rank_arrived(boards):
    group = (0, 1)
    seq = boards[0].enter("all_gather", group)
    boards[1].enter("all_gather", group)
    published(boards[1])
    assert describe_missing(boards[0], group, seq, "all_gather").endswith("every rank arrived")


def test_a_rank_without_a_board_has_not_started():
    store = DictStore()
    board = ArrivalBoard(store, 0)
    try:
        seq = board.enter("all_gather", (0, 1))
        assert board.missing((0, 1), seq) == [(1, "it has not started its process world")]
    finally:
        board.stop()


def test_an_unreadable_store_is_said_not_raised():
    board = ArrivalBoard(DeadStore(), 0)
    try:
        seq = board.enter("all_gather", (0, 1))
        text = describe_missing(board, (0, 1), seq, "all_gather")
        assert "the ranks' arrivals could not be read (ConnectionError: connection refused" in text, text
    finally:
        board.stop()


class SlowStore(DictStore):
    """A store whose writes take a while, as a round trip to a loaded peer's store does."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.inside = seconds, 0

    def set(self, key, value):
        self.inside += 1
        time.sleep(self.seconds)
        super().set(key, value)
        self.inside -= 1


def test_stop_returns_once_the_publisher_is_out_of_its_store_call():
    """A daemon thread still inside a store call (C++ in a real job) when the interpreter finalizes
    aborts the process; stop() at exit waits for the call to end and the thread to leave."""
    store = SlowStore(0.3)
    board = ArrivalBoard(store, 0)
    board.enter("all_reduce", (0, 1))                     # a change: the publisher writes it
    deadline = time.monotonic() + HANG_PERIODS * PERIOD_S
    while store.inside == 0:
        assert time.monotonic() < deadline, "the publisher never wrote"
        time.sleep(0.005)
    board.stop()
    assert store.inside == 0 and not board._thread.is_alive()
