"""The most bytes a step's ops hold at once, followed storage by storage, and torchtitan's loss.

:class:`FollowedStorages` gives every plain tensor the ops on pieces within make to an auto_plan
``LiveBytes`` (a :class:`~local_calls.LocalCalls`: global ops' piece ops come back to it); :func:`torchtitan_loss_peak` runs torchtitan's loss under it -- bfloat16 logits
``x @ w.T`` cast to float, cross entropy, the logits let go, backward -- the inputs not counted.
Counting storages is exact and the same on every CPU, unlike an allocator's figures.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

import globaltensor as gt
from globaltensor.nn.auto.cost import LiveBytes
from local_calls import LocalCalls


class FollowedStorages(LocalCalls):
    """Every plain tensor the ops on pieces within make goes to ``live`` (rank 0: one process's total)."""

    def __init__(self, live: LiveBytes):
        super().__init__()
        self.live = live

    def local(self, func, args, kwargs):
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not isinstance(t, gt.GlobalTensor) and not t.is_meta:
                self.live.made(0, t)          # not a global one (no storage) nor a shape's meta tensor
        return out


def torchtitan_loss_peak(x, w, labels, before_backward: bool = False) -> int:
    """The most bytes alive at once in torchtitan's loss on ``x``, ``w``, ``labels`` (plain or
    global), the inputs' own storages not counted; ``before_backward``: the forward only."""
    live = LiveBytes()
    for t in (x, w, labels):
        for piece in (t.local_tensors().values() if isinstance(t, gt.GlobalTensor) else (t,)):
            live.held(0, piece, counted=False)
    with FollowedStorages(live):
        logits = x @ w.t()
        loss = F.cross_entropy(logits.float(), labels)
        del logits
        if not before_backward:
            loss.backward()
    return live.peak[0]
