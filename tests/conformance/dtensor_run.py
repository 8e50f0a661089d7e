"""The conformance cases through DTensor, for the coverage table's comparison (tools/op_coverage.py).

The same ops, samples and recipes as opinfo_run.plan, on 4 ranks in one process: a fake
process group and ``LocalTensorMode`` (each DTensor holds every rank's local tensor). Layouts
map to DTensor placements: split -> ``Shard(d)`` (DTensor's pieces follow ``torch.chunk``),
broadcast -> ``Replicate()``, partial -> ``Partial()`` with the value on the first rank of the
axis and zeros elsewhere (exact). Classes: clean, raises (mostly: no sharding strategy for
the op), wrong. Forward and, where the OpInfo supports autograd, backward. A case still
running after ``TIME_LIMIT_S`` counts as raising: DTensor's strategy search through some
decompositions (``batch_norm_backward``) runs for many minutes.
"""
from __future__ import annotations

import json
import random
import signal
import traceback

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

import opinfo_run as run

_WORLD = 4
TRACE = False   # print the traceback of each raising case (debugging)
TIME_LIMIT_S = 30


class _TimeLimit(Exception):
    pass


def _alarm(signum, frame):
    raise _TimeLimit(f"still running after {TIME_LIMIT_S} s")


def _init():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=_WORLD, store=FakeStore())


def _placements(t, recipe, ndim, rng):
    from torch.distributed.tensor import Partial, Replicate, Shard
    nd = run._choose_sbp(t, recipe, ndim, rng)
    return [Shard(v.dim) if v.is_split else Partial() if v.is_partial else Replicate() for v in nd]


def _to_dtensor(t, mesh, placements):
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
    plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
    x = distribute_tensor(t.detach(), mesh, plain)
    if any(isinstance(p, Partial) for p in placements):
        coords = {r: mesh.mesh.flatten().tolist().index(r) for r in range(_WORLD)}
        shape = tuple(mesh.mesh.shape)
        local = x.to_local()
        local = local._local_tensors if isinstance(local, LocalTensor) else {r: local for r in range(_WORLD)}
        pieces = {}
        for r, v in local.items():
            c = list(torch.unravel_index(torch.tensor(coords[r]), shape)) if len(shape) > 1 else [coords[r]]
            zero = any(isinstance(p, Partial) and int(c[a]) != 0 for a, p in enumerate(placements))
            pieces[r] = torch.zeros_like(v) if zero else v.clone()
        x = DTensor.from_local(LocalTensor(pieces), mesh, placements, run_check=False, shape=x.shape,
                               stride=x.stride())
    return x.requires_grad_(t.requires_grad) if t.requires_grad else x


def _plain(v):
    """A DTensor's whole value, or a LocalTensor's rank-0 value, as a plain tensor."""
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor
    if isinstance(v, DTensor):
        v = v.full_tensor()
    if isinstance(v, LocalTensor):
        v = v._local_tensors[0]
    return v


def run_case(op, sample, recipe, seed) -> str:
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import DeviceMesh, DTensor, distribute_tensor
    want, _, random_op, skip = run._reference(op, sample)
    if skip is not None:
        return "skip"
    rng = random.Random(seed)
    args, kwargs = run._args(sample)
    flat, spec = tree_flatten((args, kwargs))
    plain = [run._clone(v) for v in flat]
    inputs = [v for v in plain if isinstance(v, torch.Tensor) and v.requires_grad]
    want_grads = weights_plain = None
    if op.supports_autograd and not random_op:
        try:
            ref = run._call(op, *tree_unflatten(plain, spec))
            # made here, outside LocalTensorMode, where a factory would draw per rank
            weights_plain = run._grad_outputs(run._differentiable(ref), seed)
            want_grads = run._grads(ref, inputs, weights_plain)
        except Exception:                       # noqa: BLE001 -- no reference backward: forward only
            want_grads = None
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIME_LIMIT_S)
    try:
        with LocalTensorMode(frozenset(range(_WORLD))):
            mesh = DeviceMesh("cpu", torch.arange(_WORLD).reshape(2, 2) if recipe == "nd" else torch.arange(_WORLD))
            ndim = 2 if recipe == "nd" else 1
            dargs = [_to_dtensor(run._clone(v), mesh, _placements(v, recipe, ndim, rng))
                     if isinstance(v, torch.Tensor) and v.layout == torch.strided else v for v in flat]
            torch.manual_seed(0)
            got = run._call(op, *tree_unflatten(dargs, spec))
            got_plain = tree_map(_plain, got)
            grads = None
            if want_grads is not None:
                outs = run._differentiable(got)
                d_inputs = [d for d, v in zip(dargs, flat) if isinstance(v, torch.Tensor) and v.requires_grad]
                weights = [distribute_tensor(w, o.device_mesh, [p if not p.is_partial() else _replicate()
                                                                 for p in o.placements])
                           if isinstance(o, DTensor) else w for w, o in zip(weights_plain, outs)]
                grads = tree_map(_plain, torch.autograd.grad(outs, d_inputs, weights, allow_unused=True)) \
                    if outs else None
    except Exception:                           # noqa: BLE001 -- classified
        if TRACE:
            traceback.print_exc()
        return "raises"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if run._mismatch(got_plain, want, "output", random_op):
        return "wrong"
    if want_grads is not None and run._mismatch(grads, want_grads, "gradient", False):
        return "wrong"
    return "clean"


def _replicate():
    from torch.distributed.tensor import Replicate
    return Replicate()


def classify_all(ops, path=None) -> dict:
    """``{op id: class}``: each op's worst case (skipped cases do not count); written to ``path``
    (JSON) as it goes; the ops already there are not run again (delete the file to rerun all)."""
    _init()
    out = json.loads(path.read_text()) if path is not None and path.exists() else {}
    for op in ops:
        if run.op_id(op) in out:
            continue
        if path is not None and out:
            path.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")
        have = run.samples(op, run.SAMPLES_LOOKED_AT)
        classes = [run_case(op, have[i], recipe, seed) for i, recipe, seed in run.plan(op, have)]
        ranked = [run.CLASSES.index(c) for c in classes if c in run.CLASSES]
        out[run.op_id(op)] = run.CLASSES[max(ranked)] if ranked else "clean"
    if path is not None:
        path.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")
    return out
