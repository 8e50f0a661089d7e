"""What each rank computes in a meta run: its kernels' flops and bytes, by kind, phase and module.

Every piece of a global tensor made in the run is tagged with its rank (``_gt_rank``); a piece op
(seen by cost.MemoizedMeta) belongs to the rank of its tagged inputs and tags its outputs alike, so
the temporaries of a kernel (ring attention's blocks) keep their rank. An op no tagged tensor
reaches is not a rank's: the dispatcher's own shape inference on fresh meta tensors (a factory with
no tensor input, ``zeros``, is missed too: one fill). The tensor ops a simulated collective runs
(the cat of an all-gather, the sum of an all-reduce) are communication, not compute:
:class:`TallyingWorld` runs them untallied and tags what each rank receives.

A kernel is a *matmul* (mm, addmm, bmm, baddbmm, convolutions, grouped mm: its flops from torch's
formulas), an *attention* kernel (scaled dot-product, forward or backward; causal ones do half the
blocks) or a *memory* kernel (everything else that writes: its bytes read and written). Views and
ops that make no kernel (``empty``) cost nothing on the device. The host's dispatch is counted as
global ops per rank: each rank's process dispatches the ops of its placements.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Tuple

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ...comm import World
from ...comm.world import Started
from ...comm.simulated import SimulatedWorld
from ...ops.schema.op_record import record
from ...tensor import GlobalTensor

aten = torch.ops.aten

RANK = "_gt_rank"

ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default: "forward",
             aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "backward",
             aten._scaled_dot_product_flash_attention.default: "forward",
             aten._scaled_dot_product_flash_attention_backward.default: "backward",
             aten._scaled_dot_product_efficient_attention.default: "forward",
             aten._scaled_dot_product_efficient_attention_backward.default: "backward",
             aten._scaled_dot_product_cudnn_attention.default: "forward",
             aten._scaled_dot_product_cudnn_attention_backward.default: "backward"}

NO_KERNEL = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                       aten.new_empty.default, aten.new_empty_strided.default, aten.detach.default,
                       aten.lift_fresh.default, aten._to_copy.default})


def kernel_work(func, args, kwargs, out) -> Tuple[str, int, int, bool]:
    """``(kind, flops, bytes, causal)`` of one piece op: kind ``"matmul"``, ``"attention"``,
    ``"memory"``, or ``""`` for an op that runs no kernel."""
    if func in ATTENTION:
        q, k, v = (args[1:4] if ATTENTION[func] == "backward" else args[:3])
        causal = bool(kwargs.get("is_causal", _causal_arg(func, args)))
        return "attention", attention_flops(q.shape, k.shape, v.shape, ATTENTION[func] == "backward"), 0, causal
    if func is aten._grouped_mm.default:
        a = args[0]
        return "matmul", 2 * out.numel() * a.shape[-1], 0, False
    formula = flop_registry.get(func._overloadpacket)
    if formula is not None:
        return "matmul", int(formula(*args, **kwargs, out_val=out)), 0, False
    if func in NO_KERNEL or not record(func).aliases_nothing and not record(func).written:
        return "", 0, 0, False
    tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
    moved = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
    return "memory", 0, moved, False


def attention_flops(q: tuple, k: tuple, v: tuple, backward: bool) -> int:
    """A scaled dot-product attention kernel's flops, whole (causal masks not halved), with torch's
    counting (its flop_counter): forward, the scores and their product with the values; backward,
    the scores again and the four gradient products. ``[batch, heads, positions, head dim]``, every
    query head counted (grouped-query attention shares a key/value head among several; torch's
    formulas of releases before 2.13 refuse that)."""
    b, heads, s_q, d_q = q
    s_k, d_v = k[2], v[3]
    scores = 2 * b * heads * s_q * s_k
    return scores * (3 * d_q + 2 * d_v) if backward else scores * (d_q + d_v)


def _causal_arg(func, args) -> bool:
    """The positional ``is_causal`` of the attention kernels that take it there."""
    names = [a.name for a in func._schema.arguments]
    if "is_causal" not in names:
        return False
    i = names.index("is_causal")
    return len(args) > i and bool(args[i])


@dataclass
class Work:
    """Kernels of one kind, summed: their count, flops (attention: of causal kernels, those done) and bytes."""
    kernels: int = 0
    flops: int = 0
    bytes: int = 0

    def add(self, flops: int, nbytes: int) -> None:
        self.kernels += 1
        self.flops += flops
        self.bytes += nbytes


Key = Tuple[str, torch.dtype, str, str]          # (kind, dtype, phase, module)


@dataclass
class ComputeTally:
    """Per rank, the kernels it runs by (kind, dtype, phase, module), the global ops it dispatches and the
    gradients its gradient buckets take."""
    kernels: Dict[int, Dict[Key, Work]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(Work)))
    host_ops: Dict[int, int] = field(default_factory=lambda: defaultdict(int))
    bucketed: Dict[int, int] = field(default_factory=lambda: defaultdict(int))    # gradients the buckets take
    model_flops: int = 0                           # every rank's matmul and attention flops, causal ones whole
    work: Dict[tuple, tuple] = field(default_factory=dict, repr=False)     # an op's work by its metadata

    def piece_op(self, func, args, kwargs, out, phase: str, module: str, key=None) -> None:
        """Count one piece op on the rank of its inputs, and tag its outputs with that rank; ``key``:
        the op and its arguments' metadata (cost.MemoizedMeta's), under which its work is kept."""
        flat_in = list(tensors_in((args, kwargs.values())))
        rank = next((t.__dict__[RANK] for t in flat_in if RANK in t.__dict__), None)
        if rank is None:
            return
        for t in tensors_in(out):
            t.__dict__[RANK] = rank
        work = self.work.get(key) if key is not None else None
        if work is None:
            kind, flops, nbytes, causal = kernel_work(func, args, kwargs, out)
            dtype = next((t.dtype for t in flat_in if t.is_floating_point()), torch.float32)
            work = (kind, flops, nbytes, causal, dtype)
            if key is not None:
                self.work[key] = work
        kind, flops, nbytes, causal, dtype = work
        if not kind:
            return
        self.model_flops += flops
        self.kernels[rank][(kind, dtype, phase, module)].add(flops // 2 if causal else flops, nbytes)

    def global_op(self, args, kwargs) -> None:
        """One global op dispatched by the process of each rank of its global tensors' placements."""
        ranks = set()
        for t in tensors_in((args, kwargs.values())):
            if type(t) is GlobalTensor:
                ranks.update(t._layout.placement.rank_list())
        for r in ranks:
            self.host_ops[r] += 1

    def bucketed_gradient(self, grad) -> None:
        """One gradient taken by the gradient buckets, whose hooks run in the process of each of its ranks."""
        for r in grad._layout.placement.rank_list():
            self.bucketed[r] += 1

    def on_rank(self, rank: int) -> Dict[Key, Work]:
        """The kernels ``rank`` runs."""
        return self.kernels.get(rank, {})


def tensors_in(value):
    """The tensors in ``value``: itself, or those in its tuples, lists and dict views, at any depth
    (an op's arguments and results hold no other containers)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list, type({}.values()))):
        for v in value:
            yield from tensors_in(v)


def tag_pieces(t: GlobalTensor) -> None:
    """Tag each piece of a new global tensor with its rank."""
    for r, piece in t._pieces.items():
        piece.__dict__[RANK] = r


class TallyingWorld(SimulatedWorld):
    """A simulated world whose collectives' tensor ops go untallied (``busy``) and whose results are
    tagged with their ranks (and given to ``live``, what each rank holds); started collectives run at
    once (a meta run has nothing to overlap)."""

    def __init__(self, size: int):
        super().__init__(size)
        self.busy = 0
        self.live = None            # cost.LiveBytes, given each tensor a rank receives

    def _untallied(self, run, *args):
        self.busy += 1
        try:
            out = run(self, *args)
        finally:
            self.busy -= 1
        for r, t in out.items():
            if isinstance(t, torch.Tensor):
                self._received(r, t)
        return out

    def _received(self, rank: int, t: torch.Tensor) -> None:
        t.__dict__[RANK] = rank
        if self.live is not None:
            self.live.made(rank, t)

    def _all_gather(self, *args):
        return self._untallied(SimulatedWorld._all_gather, *args)

    def _reduce_scatter(self, *args):
        return self._untallied(SimulatedWorld._reduce_scatter, *args)

    def _all_reduce(self, *args):
        return self._untallied(SimulatedWorld._all_reduce, *args)

    def _all_reduce_in_place(self, *args):
        return self._untallied(SimulatedWorld._all_reduce_in_place, *args)

    def _all_to_all(self, *args):
        return self._untallied(SimulatedWorld._all_to_all, *args)

    def _broadcast(self, *args):
        return self._untallied(SimulatedWorld._broadcast, *args)

    def _send_recv(self, transfers, payload, dtype, device_type):
        self.busy += 1
        try:
            out = SimulatedWorld._send_recv(self, transfers, payload, dtype, device_type)
        finally:
            self.busy -= 1
        for i, t in out.items():
            self._received(transfers[i].dst, t)
        return out

    _all_reduce_async = World._all_reduce_async

    def _reduce_scatter_async(self, group, pieces, sizes):
        """Run at once, its flat inputs -- a ZeRO bucket's gradients, copied out -- counted as
        each rank's and held until the result is waited for, as a process world's started
        collective holds them (to the backward's end)."""
        for r, t in pieces.items():
            self._received(r, t)
        out = self._reduce_scatter(group, pieces, 0, sizes)
        return Started(lambda: (pieces, out)[1])
