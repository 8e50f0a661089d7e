"""The CUDA hand-over (actor_rt/cuda_handover.py), its logic on CPU with stand-in events and streams:
one event per task and register slot, made once and recorded again; a consumer waits on its
producer's event of the same iteration, a producer refilling a slot on its consumers' events of the
slot's last use; no tensor reaches ``record_stream``. tools/gpu_check.sh runs it on a GPU (the
CUDA lane's two-stream graphs)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from globaltensor.actor_rt import cuda_handover


class _Event:
    made = 0

    def __init__(self):
        _Event.made += 1
        self.name, self.records = f"e{_Event.made}", 0

    def record(self):
        self.records += 1


class _Stream:
    def __init__(self):
        self.waited = []

    def wait_event(self, ev):
        self.waited.append(ev.name)


def _task(k, waits=(), consumers=()):
    return SimpleNamespace(k=k, events=[None] * k, cuda_waits=list(waits), cuda_consumers=list(consumers))


def test_events_are_made_once_per_slot_and_the_waits_follow_the_registers(monkeypatch):
    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    producer, consumer = _task(2), _task(3)
    producer.cuda_consumers, consumer.cuda_waits = [consumer], [producer]
    for it in range(6):
        stream.waited.clear()
        cuda_handover.wait(producer, it)
        # before filling slot it % 2 again, the consumer's use of iteration it - 2 must be done
        assert stream.waited == ([] if it < 2 else [consumer.events[(it - 2) % 3].name])
        cuda_handover.publish(producer, it)
        stream.waited.clear()
        cuda_handover.wait(consumer, it)
        assert stream.waited == [producer.events[it % 2].name]        # the input of this iteration is made
        cuda_handover.publish(consumer, it)
    assert _Event.made == 2 + 3                                         # one per task and slot
    assert [e.records for e in producer.events] == [3, 3] and [e.records for e in consumer.events] == [2, 2, 2]
