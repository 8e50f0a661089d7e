"""Capture: run a function once through the eager dispatch path and record what it does to the pieces.

The function runs as it would eagerly -- the same rules, signature choices, boxing plans and
kernels -- under a TorchDispatchMode that sees every op twice: first as the global op the user
wrote (``aten.mm`` on global tensors), which it hands to the global tensors' own dispatch, and
then as each plain op that dispatch issues on a rank's piece, which it records. Collectives are
recorded where the World runs them (comm's observer), random calls where their key tensor is made
(ops/rng.py's maker), and every GlobalTensor made is noted, to learn which survive the call.

The capture run is a dry run: everything it writes that existed before (parameters, optimizer
state, arguments, the random counter) is put back afterwards, so the compiled graph's own first
run makes the call's effects, once. Python control flow is frozen; a host read (``.item()``,
``.tolist()``, printing a value) or an op whose output shape depends on data raises here.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..comm import get_world
from ..comm import stats
from ..comm.world import observe_collectives
from ..observe.text import signature_text
from ..observe.where import user_frame
from ..ops import rng
from ..ops.dispatch import decision_for
from ..ops.schema.op_record import record
from ..from_local import reading_meta
from ..nn.mapped_call import record_tasks_with, running_rank
from ..tensor import GlobalTensor, observe_creation
from ..compat.torch_ops import aten
from .graph import Captured, Node, Output, Ref, StorageRef, Value

_HOST_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default, aten.item.default}
_raw_grad = torch._C.TensorBase.grad
_IN_PLACE = {"all_reduce_in_place"}      # collectives that may write their inputs (comm.world)
#: ops with no result that a graph must still run on every step: they raise when their input says so
EFFECTS = {aten._assert_async.msg, aten._assert_async.default}


class CaptureError(RuntimeError):
    """What ``gt.compile`` cannot capture: a host read, an op with a data-dependent output shape."""


def _host_read_error(what: str) -> CaptureError:
    return CaptureError(f"gt.compile: {what} reads a tensor's value on the host inside the captured function, at "
                        f"{user_frame()}; the value would be frozen into the graph. Return the tensor instead "
                        f"and read it outside.")


class _HostReadGuard:
    """``Tensor.tolist`` / ``numpy`` / ``__array__`` read memory without an aten op the mode could see:
    while a capture runs they raise (the library's own shape exchanges and suspended work pass)."""

    METHODS = ("tolist", "numpy", "__array__")

    def __init__(self, tracer: "Tracer"):
        self.tracer = tracer
        self.saved = {}

    def __enter__(self):
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            self.saved[name] = original
            setattr(torch.Tensor, name, self._guarded(name, original))

    def _guarded(self, name, original):
        tracer = self.tracer

        def method(t, *args, **kwargs):
            if not tracer.suspended and not reading_meta() and not isinstance(t, GlobalTensor):
                raise _host_read_error(f"Tensor.{name}()")
            return original(t, *args, **kwargs)
        return method

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


def _data_dependent(func, args, kwargs) -> bool:
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func is aten.index.Tensor:       # only boolean-mask indexing depends on data
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return True


def storage_key(t: torch.Tensor) -> Optional[tuple]:
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if s.nbytes() == 0:
        return None
    return (t.device.type, t.device.index, s.data_ptr())


class Tracer(TorchDispatchMode):
    def __init__(self, leaves: list, on_leaf=None, optimizer_tasks: bool = True):
        super().__init__()
        self.on_leaf = on_leaf          # called with every pre-existing global leaf that requires grad
        # an elementwise optimizer's update recorded as one task reading its settings at each run
        # (nn/optim_pieces.py); False: recorded op by op in its capturable form (inside CUDA graphs)
        self.optimizer_tasks = optimizer_tasks
        self.nodes: list = []
        self.values: dict = {}
        self.vid_of: dict = {}          # id(tensor) -> vid (its latest value)
        self.keep: list = []            # every tensor seen, alive until the capture ends (ids stay unique)
        self.rank_hint: dict = {}       # id(piece) -> rank, for pieces of global tensors not yet seen by an op
        self.storage_vid: dict = {}             # storage -> the latest value living in it
        self.external_storages: set = set()     # storages of arguments and state
        self.state_storages: set = set()
        self.saved: list = []           # (tensor, copy) of what existed before and was written
        self.saved_ids: set = set()
        self.created: list = []         # weakrefs to GlobalTensors made during the capture
        self.seen: dict = {}            # id(wrapper) -> (weakref, pieces when first seen), those made before
        self.labels: list = []
        self.settings: list = []        # (group, key, index) read by tasks at each run (nn/optim_pieces.py)
        self.suspended = False
        self.segment, self.backward = 0, False
        self.world = get_world()
        self.rng_base = rng.current_offset()
        self.arg_of: dict = {}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, GlobalTensor):
                for r, piece in leaf._pieces.items():
                    self.arg_of.setdefault(id(piece), (i, r))
                    self.keep.append(piece)
                self.see(leaf)
            elif isinstance(leaf, torch.Tensor):
                self.arg_of.setdefault(id(leaf), (i, None))

    # -- values ---------------------------------------------------------------------------
    def _new_value(self, t: torch.Tensor, **kw) -> int:
        vid = len(self.values)
        v = Value(vid, **kw)
        v.storage = storage_key(t)
        v.meta = (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype) if t.layout == torch.strided else None
        self.values[vid] = v
        self.vid_of[id(t)] = vid
        if v.storage is not None:
            self.storage_vid[v.storage] = vid
        self.keep.append(t)
        return vid

    def _vid(self, t: torch.Tensor) -> int:
        vid = self.vid_of.get(id(t))
        if vid is not None:
            return vid
        arg = self.arg_of.get(id(t))
        if arg is not None:
            vid = self._new_value(t, kind="arg", arg=arg, rank=arg[1])
        else:
            vid = self._new_value(t, kind="state", tensor=t, rank=self.rank_hint.get(id(t)))
        if self.values[vid].storage is not None:
            self.external_storages.add(self.values[vid].storage)
            if arg is None:
                self.state_storages.add(self.values[vid].storage)
        return vid

    def _label_rank(self, piece, rank: int) -> None:
        vid = self.vid_of.get(id(piece))
        if vid is None:
            self.rank_hint[id(piece)] = rank
            self.keep.append(piece)
            return
        v = self.values[vid]
        if v.rank is None:
            v.rank = rank
            if v.kind == "node" and self.nodes[v.node].kind == "op" and self.nodes[v.node].rank is None:
                self.nodes[v.node].rank = rank

    def see(self, t: GlobalTensor) -> None:
        """Note a global tensor's pieces' ranks; remember a pre-existing one's pieces as they are."""
        for r, piece in t._pieces.items():
            self._label_rank(piece, r)
        if id(t) not in self.seen:
            self.seen[id(t)] = (weakref.ref(t), dict(t._pieces))
            if self.on_leaf is not None and t.requires_grad and t.grad_fn is None:
                self.on_leaf(t)

    def _see_all(self, tree) -> None:
        for leaf in tree_flatten(tree)[0]:
            if isinstance(leaf, GlobalTensor):
                self.see(leaf)

    def created_tensor(self, t: GlobalTensor) -> None:
        self.created.append(weakref.ref(t))
        self.seen[id(t)] = (None, None)          # made here: not a pre-existing tensor
        for r, piece in t._pieces.items():
            self._label_rank(piece, r)

    # -- recording ------------------------------------------------------------------------
    def _phase(self) -> None:
        backward = torch._C._current_graph_task_id() != -1
        if backward != self.backward:
            self.backward = backward
            self.segment += 1

    def _label(self, fallback: str) -> str:
        if not self.labels:
            return fallback
        name = str(self.labels[0].func).replace("aten.", "")
        return name + " (backward)" if self.backward else name

    def _signature(self) -> str:
        """The signature the outermost global op being recorded chose (its Decision's), or ""."""
        chosen = self.labels[0].signature if self.labels else None
        return signature_text(chosen) if chosen is not None else ""

    def _save_before_write(self, tensors) -> None:
        for t in tensors:
            key = storage_key(t)
            if key in self.external_storages and id(t) not in self.saved_ids:
                self.saved_ids.add(id(t))
                self.saved.append((t, t.detach().clone()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        if func in _HOST_READS and not reading_meta():
            raise _host_read_error(str(func))
        if _data_dependent(func, args, kwargs):
            raise CaptureError(f"gt.compile: {func} has an output shape that depends on the data, at "
                               f"{user_frame()}; a captured graph needs shapes fixed at capture")
        if any(issubclass(t, GlobalTensor) for t in types):
            return self._global_op(func, types, args, kwargs)
        return self._plain_op(func, args, kwargs)

    def _global_op(self, func, types, args, kwargs):
        self._see_all((args, kwargs))
        self.labels.append(decision_for(func, args, kwargs))
        try:
            with self:
                out = GlobalTensor.__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.labels.pop()
        self._see_all(out)
        return out

    def _plain_op(self, func, args, kwargs):
        flat = tree_flatten((args, kwargs))[0]
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        if any(t.is_meta for t in tensors) or str(kwargs.get("device")) == "meta":
            return func(*args, **kwargs)
        written = record(func).written_tensors(args, kwargs)
        inputs = [self._vid(t) for t in tensors]
        storages = {}
        for x in flat:
            if isinstance(x, torch.UntypedStorage) and x.nbytes():
                vid = self.storage_vid.get((x.device.type, x.device.index, x.data_ptr()))
                if vid is not None:
                    storages[id(x)] = vid
                    inputs.append(vid)
        self._save_before_write(written)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            outs, slots = [out], None
        elif isinstance(out, (tuple, list)):
            slots = [j for j, o in enumerate(out) if isinstance(o, torch.Tensor)]
            outs = [out[j] for j in slots]
        else:
            outs, slots = [], []
        if any(o.is_meta for o in outs) or (not outs and not written and func not in EFFECTS):
            return out
        self._phase()
        rank = next((self.values[v].rank for v in inputs if self.values[v].rank is not None), running_rank())
        node = self._op_node(func, _template((args, kwargs), self._ref, storages), inputs, outs, slots, rank,
                             tuple({storage_key(t) for t in written} - {None}))
        node.device = outs[0].device if outs else (written or tensors)[0].device
        if any(o.device != t.device for o in outs for t in tensors) or \
                (func is aten.copy_.default and args[0].device != args[1].device):
            node.stream = "copy"
        return out

    def task(self, target, tensors: tuple, writes: tuple = (), settings: tuple = ()) -> tuple:
        """Run ``target`` (a mapped function's task, nn/mapped_call.py; an optimizer's update on pieces,
        nn/optim_pieces.py) on ``tensors`` unrecorded inside, and record it as one task of its rank; its
        tensor results. ``writes``: the tensors among them it writes in place (put back after the dry
        run, and ordered against their other readers and writers); ``settings``: the optimizer settings
        ``(group, key, index)`` it reads at each run (no new capture when they change)."""
        inputs = [self._vid(t) for t in tensors]
        self._save_before_write(writes)
        self.settings.extend(settings)
        self.suspended = True
        try:
            outs = target(*tensors)
        finally:
            self.suspended = False
        self._phase()
        node = self._op_node(target, (tuple(Ref(v) for v in inputs), {}), inputs, list(outs), list(range(len(outs))),
                             target.rank, tuple({storage_key(t) for t in writes} - {None}))
        node.device = outs[0].device if outs else tensors[0].device if tensors else None
        return outs

    def _op_node(self, func, template, inputs: list, outs: list, slots, rank, writes: tuple) -> Node:
        """A node of kind "op" running ``func``, its outputs ``outs`` made values of the graph."""
        node = Node(len(self.nodes), "op", func, template, [], slots,
                    self._label(str(func).replace("aten.", "")), rank=rank, signature=self._signature(),
                    segment=self.segment, backward=self.backward, inputs=tuple(inputs),
                    reads=tuple({self.values[v].storage for v in inputs} - {None}), writes=writes)
        node.metas = {v: self.values[v].meta for v in inputs}
        self.nodes.append(node)
        for j, o in enumerate(outs):
            vid = self._new_value(o, kind="node", node=node.index, out=j, rank=rank)
            if self.values[vid].storage not in self.state_storages:
                self.values[vid].nbytes = o.untyped_storage().nbytes()
            node.outs.append(vid)
        return node

    def _ref(self, t: torch.Tensor) -> Ref:
        return Ref(self.vid_of[id(t)])

    def collective(self, name, world, args, run):
        if self.suspended:
            return run()
        leaves, spec = tree_flatten(args)
        inputs = [self._vid(x) for x in leaves if isinstance(x, torch.Tensor)]
        self.suspended = True
        try:
            out = run()
        finally:
            self.suspended = False
        self._phase()
        out_leaves, out_spec = tree_flatten(out)
        if out is None:                       # "count": a collective of ranks elsewhere, counted here
            ranks_out = {}
        elif name == "send_recv":
            transfers = args[0]
            ranks_out = {i: transfers[i].dst for i in out}
        else:
            ranks_out = {r: r for r in out}
        ranks = sorted({self.values[v].rank for v in inputs if self.values[v].rank is not None}
                       | set(ranks_out.values()))
        node = Node(len(self.nodes), "collective", name,
                    ([Ref(self.vid_of[id(x)]) if isinstance(x, torch.Tensor) else x for x in leaves], spec),
                    [], out_spec, self._label(name), rank=ranks[0] if ranks else None, signature=self._signature(),
                    ranks=tuple(ranks), segment=self.segment, backward=self.backward, inputs=tuple(inputs),
                    reads=tuple({self.values[v].storage for v in inputs} - {None}), stream="collective",
                    writes=tuple({self.values[v].storage for v in inputs} - {None}) if name in _IN_PLACE else ())
        node.device = next((o.device for o in out_leaves if isinstance(o, torch.Tensor)), None)
        self.nodes.append(node)
        owner = [ranks_out[k] for k, v in (out or {}).items() for _ in (v if isinstance(v, (list, tuple)) else [v])]
        for j, (o, r) in enumerate(zip(out_leaves, owner)):
            if not isinstance(o, torch.Tensor):
                continue
            vid = self._new_value(o, kind="node", node=node.index, out=j, rank=r)
            self.values[vid].nbytes = o.untyped_storage().nbytes() if self.values[vid].storage else 0
            node.outs.append(vid)
        return out

    def number(self, fed, dtype: torch.dtype, device) -> torch.Tensor:
        """A float argument of the call as a 0-dim tensor the graph is fed at every call
        (nn/fed_numbers.py: a clipping threshold)."""
        self.suspended = True
        try:
            t = torch.tensor(fed.value, dtype=dtype, device=device)
        finally:
            self.suspended = False
        self._new_value(t, kind="number", number=(fed.index, dtype, device))
        return t

    def keys(self, offset: int, stream: int, device) -> torch.Tensor:
        self.suspended = True
        try:
            t = torch.tensor(rng.key_values(offset, stream), dtype=torch.int64, device=device)
        finally:
            self.suspended = False
        self._new_value(t, kind="keys", keys=(offset - self.rng_base, stream, device))
        return t

    # -- after the call -------------------------------------------------------------------
    def restore(self) -> None:
        """Put back what the dry run wrote into tensors that existed before it."""
        self.suspended = True
        with torch.no_grad():
            for t, copy in reversed(self.saved):
                t.copy_(copy)
        rng.set_offset(self.rng_base)

    def output(self, leaf) -> Output:
        if isinstance(leaf, GlobalTensor):
            return Output("global", leaf._layout, {r: self._vid(p) for r, p in leaf._pieces.items()})
        if isinstance(leaf, torch.Tensor):
            return Output("plain", refs={None: self._vid(leaf)})
        return Output("const", value=leaf)

    def rebinds(self, returned: set) -> list:
        """(wrapper, rank, vid) for every global tensor alive after the call whose piece the call made:
        made during it (gradients, new optimizer state) or given a new piece by it."""
        out = []
        for wref, before in self.seen.values():
            if wref is None:
                continue
            t = wref()
            if t is None:
                continue
            for r, piece in t._pieces.items():
                if before.get(r) is not piece and id(piece) in self.vid_of:
                    out.append((wref, r, self.vid_of[id(piece)]))
        for wref in self.created:
            t = wref()
            if t is None or id(t) in returned:
                continue
            for r, piece in t._pieces.items():
                vid = self.vid_of.get(id(piece))
                if vid is not None and self.values[vid].kind in ("node", "keys", "arg"):
                    out.append((wref, r, vid))
        return out


def _template(tree, ref, storages: dict):
    """``tree`` with every tensor replaced by its Ref and every storage of a value by a StorageRef
    (lists and tuples kept, one level deep as aten's)."""
    args, kwargs = tree

    def one(v):
        if isinstance(v, torch.Tensor):
            return ref(v)
        if id(v) in storages:
            return StorageRef(storages[id(v)])
        if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            return type(v)(ref(x) if isinstance(x, torch.Tensor) else x for x in v)
        return v
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def capture(fn, args: tuple, kwargs: dict, on_leaf=None, optimizer_tasks: bool = True) -> Captured:
    """Run ``fn(*args, **kwargs)`` once as a dry run and return what it did as a Captured graph;
    ``on_leaf(t)`` is told of each parameter-like tensor (a global leaf requiring grad) it meets;
    ``optimizer_tasks``: see :class:`Tracer`."""
    leaves = tree_flatten((args, kwargs))[0]
    tracer = Tracer(leaves, on_leaf, optimizer_tasks)
    previous_observer = observe_collectives(tracer.collective)
    previous_creation = observe_creation(tracer.created_tensor)
    previous_keys = rng.make_keys_with(tracer.keys)
    previous_tasks = record_tasks_with(tracer)
    try:
        with stats.paused(), _HostReadGuard(tracer), tracer:
            result = fn(*args, **kwargs)
            out_leaves, out_spec = tree_flatten(result)
            outputs = [tracer.output(leaf) for leaf in out_leaves]
            consumed = rng.current_offset() - tracer.rng_base
    finally:
        observe_collectives(previous_observer)
        observe_creation(previous_creation)
        rng.make_keys_with(previous_keys)
        record_tasks_with(previous_tasks)
        tracer.restore()
    returned = {id(leaf) for leaf in out_leaves}
    grad_rebinds = []
    created = {id(w()) for w in tracer.created if w() is not None}
    for i, leaf in enumerate(leaves):
        g = _raw_grad.__get__(leaf) if isinstance(leaf, GlobalTensor) else None
        if isinstance(g, GlobalTensor) and id(g) in created:
            grad_rebinds.append((i, g._layout, {r: tracer._vid(p) for r, p in g._pieces.items()}))
            returned.add(id(g))
    del result, out_leaves
    return Captured(tracer.nodes, tracer.values, outputs, out_spec, tracer.rebinds(returned), grad_rebinds,
                    consumed, tuple(tracer.world.local_ranks), tuple(tracer.settings))
