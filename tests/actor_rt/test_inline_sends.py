"""Which point-to-point sends a process world's lowering puts on the compute stream.

A ``send_recv`` in which this rank only sends runs on its compute stream (no hand-off to the
collective thread per message), unless an exchange of the same rank (it sends and receives, so
it stays on the collective stream) also sends to one of its peers: messages to a peer match in
the order they are issued, so all sends to one peer stay on one stream. Receives, CUDA sends
and a rank taking part with nothing to send stay where they were. The launched process-world
runs (tests/multiprocess/test_compiled.py: pipeline parallelism, failures) check the values.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from globaltensor.actor_rt.graph import Node, Ref
from globaltensor.actor_rt.lower import _inline_sends
from globaltensor.actor_rt.program import TaskSpec
from globaltensor.comm.world import Transfer

ME = 0


def _send_recv(tid: int, transfers: list, device_type: str = "cpu") -> TaskSpec:
    payload = {i: Ref(100 + i) for i, t in enumerate(transfers) if t.src == ME and t.dst != ME}
    leaves, spec = tree_flatten((transfers, payload, torch.float32, device_type))
    node = Node(tid, "collective", "send_recv", (leaves, spec), [], None, "to_global", rank=ME)
    return TaskSpec(tid, f"{tid}:send_recv@r{ME}", node, None, ME, f"r{ME}:collective", [])


def _op(tid: int) -> TaskSpec:
    node = Node(tid, "op", torch.ops.aten.relu.default, ((Ref(1),), {}), [tid], None, "relu", rank=ME)
    return TaskSpec(tid, f"{tid}:relu@r{ME}", node, None, ME, f"r{ME}:compute", [])


def test_a_rank_that_only_sends_sends_from_its_compute_stream():
    tasks = [_op(0), _send_recv(1, [Transfer(ME, 1, (4, 4))]), _send_recv(2, [Transfer(ME, 2, (4,)),
                                                                            Transfer(ME, 3, (4,))])]
    assert _inline_sends(tasks, ME) == [1, 2]


def test_receives_cuda_sends_and_empty_parts_stay_on_the_collective_stream():
    tasks = [_send_recv(0, [Transfer(1, ME, (4, 4))]),                     # receives only
             _send_recv(1, [Transfer(ME, 1, (4, 4))], device_type="cuda"),  # NCCL
             _send_recv(2, [Transfer(2, 3, (4, 4))]),                      # a peer with no part of its own
             _send_recv(3, [Transfer(ME, ME, (4, 4))])]                    # a copy to itself
    assert _inline_sends(tasks, ME) == []


def test_sends_to_a_peer_an_exchange_also_sends_to_stay_with_the_exchange():
    exchange = _send_recv(0, [Transfer(ME, 1, (4,)), Transfer(1, ME, (4,))])
    tasks = [exchange, _send_recv(1, [Transfer(ME, 1, (4,))]), _send_recv(2, [Transfer(ME, 2, (4,))]),
             _send_recv(3, [Transfer(ME, 1, (4,)), Transfer(ME, 3, (4,))])]
    assert _inline_sends(tasks, ME) == [2], "only the send to rank 2, which no exchange also sends to"
