"""ProcessWorld's scratch buffers for collective temporaries (comm/buffers.py ``Scratch``)."""
import threading

import torch

from globaltensor.comm.buffers import Scratch

CPU = torch.device("cpu")


def test_a_buffer_given_back_is_taken_again_and_grows_when_too_small():
    s = Scratch()
    a = s.take(100, torch.float32, CPU)
    assert a.numel() >= 100 and a.dtype == torch.float32
    s.give(a)
    assert s.take(50, torch.float32, CPU) is a          # big enough: reused
    s.give(a)
    b = s.take(1000, torch.float32, CPU)                # too small: a new one
    assert b is not a and b.numel() >= 1000
    assert s.take(10, torch.float64, CPU).dtype == torch.float64   # kept per dtype


def test_buffers_taken_together_are_distinct():
    s = Scratch()
    a = s.take(10, torch.float32, CPU)
    s.give(a)
    b, c = s.take(10, torch.float32, CPU), s.take(10, torch.float32, CPU)
    assert b is not c


def test_how_much_is_kept_is_bounded():
    s = Scratch()
    bufs = [s.take(10, torch.float32, CPU) for _ in range(s.KEEP + 2)]
    for b in bufs:
        s.give(b)
    again = [s.take(10, torch.float32, CPU) for _ in range(s.KEEP + 2)]
    assert sum(any(x is y for y in bufs) for x in again) == s.KEEP
    big = torch.empty(s.MAX_BYTES // 4 + 1, dtype=torch.float32)
    s2 = Scratch()
    s2.give(big)
    assert s2.take(1, torch.float32, CPU) is not big


def test_threads_never_hold_one_buffer_at_once():
    """Each thread fills the buffer it took with its own number and reads it back before giving it."""
    s = Scratch()
    clashes = []

    def work(mark):
        for _ in range(300):
            b = s.take(4096, torch.float32, CPU)
            b.fill_(mark)
            if not bool((b == mark).all()):
                clashes.append(mark)
            s.give(b)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not clashes
