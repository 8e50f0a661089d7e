"""Running an OpInfo case under ``gt.compile`` beside the same case eager (test_capture_sweep.py).

The case's tensors are laid out as opinfo_run.run_case lays them out (same recipe, same seed);
the function compiled takes them as arguments, calls the op and -- where the OpInfo supports
autograd and the op is not random -- takes the gradients of its outputs with the same weights.
Its first call runs eagerly (the warm-up), its second captures and runs the graph, its third runs
the graph again; each is compared with an eager call of the same function on the same inputs.
The graph runs the pieces' ops the eager call runs, in the same order, so the values are equal
exactly (random ops: their shapes and dtypes). ``kernels`` names the ops with a rule kernel the
eager call ran: the sweep covers every kernel.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

import globaltensor as gt
from globaltensor.ops.registry import find_rule
from globaltensor.sbp import broadcast
from globaltensor.tensor import GlobalTensor
import opinfo_run as run
from cuda_attention_standin import cuda_attention_on_cpu


@dataclass
class Compared:
    problem: str = ""                          # "" when every compiled call equals eager
    kernels: set = field(default_factory=set)  # ops with a rule kernel the case ran
    skipped: str = ""


class _Kernels(TorchDispatchMode):
    """Notes the global ops whose rule has a kernel."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, GlobalTensor) for t in types):
            rule = find_rule(func)
            if rule is not None and rule.kernel is not None:
                self.seen.add(str(func))
            with self:
                return GlobalTensor.__torch_dispatch__(func, types, args, kwargs or {})
        return func(*args, **(kwargs or {}))


def _exactly(got, want, what: str, structure_only: bool) -> str:
    gl, wl = tree_flatten(got)[0], tree_flatten(want)[0]
    if len(gl) != len(wl):
        return f"{what}: {len(gl)} leaves, eager {len(wl)}"
    for i, (g, w) in enumerate(zip(gl, wl)):
        if isinstance(w, torch.Tensor):
            g, w = (v.full_tensor() if isinstance(v, GlobalTensor) else v for v in (g, w))
            if g.shape != w.shape or g.dtype != w.dtype:
                return f"{what} {i}: {g.dtype}{tuple(g.shape)}, eager {w.dtype}{tuple(w.shape)}"
            if not structure_only and not torch.equal(g, w):
                return f"{what} {i}: values differ from eager by {(g - w).abs().max().item():.3g}"
        elif g != w:
            return f"{what} {i}: {g!r}, eager {w!r}"
    return ""


def compare_compiled(op, sample, recipe: str, seed: int, compiled: bool = True) -> Compared:
    """The case compiled beside eager; ``compiled=False``: eager only, for the kernels it reaches."""
    _, _, random_op, skip = run._reference(op, sample)
    if skip is not None:
        return Compared(skipped=skip.detail)
    rng = random.Random(seed)
    args, kwargs = run._args(sample)
    flat, spec = tree_flatten((args, kwargs))
    grads = op.supports_autograd and not random_op
    with gt.simulate(4):
        placement = run._placement(recipe)
        leaves, where = [], []
        for i, v in enumerate(flat):
            if isinstance(v, torch.Tensor) and v.layout == torch.strided:
                leaves.append(run.lay_out(run._clone(v), placement, run._choose_sbp(v, recipe, placement.ndim, rng),
                                          rng))
                where.append(i)

        def op_call(*tensors):
            values = list(flat)
            for i, t in zip(where, tensors):
                values[i] = t
            return run._call(op, *tree_unflatten(values, spec))

        # the gradients' weights are made outside the function compiled: arguments, as the tensors are
        weights = []
        if grads:
            try:
                outs = run._differentiable(op_call(*leaves))
            except Exception:                   # noqa: BLE001 -- eager raises: no comparison below
                outs = []
            weights = [gt.distribute(w, o.placement, tuple(broadcast if s.is_partial else s for s in o.sbp))
                       for w, o in zip(run._grad_outputs(outs, seed), outs)]

        n_leaves = len(leaves)

        def fn(*tensors):
            tensors, ws = tensors[:n_leaves], tensors[n_leaves:]
            out = op_call(*tensors)
            inputs = [t for t in tensors if t.requires_grad]
            outs = run._differentiable(out)
            if not ws or not outs or not inputs:
                return out
            return out, torch.autograd.grad(outs, inputs, list(ws), allow_unused=True)
        leaves = leaves + weights

        kernels = _Kernels()
        try:
            with kernels:
                want = fn(*leaves)
        except Exception as e:                  # noqa: BLE001 -- the conformance suite classifies these
            return Compared(skipped=f"eager raises {type(e).__name__}")
        if not compiled:
            return Compared("", kernels.seen)
        step = gt.compile(fn)
        for n in range(3):
            got = step(*leaves)
            problem = _exactly(got, fn(*leaves), f"call {n}", random_op)
            if problem:
                return Compared(problem, kernels.seen)
        if step.captures != 1:
            return Compared(f"captured {step.captures} times in 3 calls", kernels.seen)
    return Compared("", kernels.seen)


def _t(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape) * 7 + shape[-1]))


def _grad_of(out_fn):
    """``f(*tensors)``: ``out_fn``'s outputs and its inputs' gradients (weights of ones)."""
    def f(*tensors):
        out = out_fn(*tensors)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        return out, torch.autograd.grad(outs, [t for t in tensors if t.requires_grad], allow_unused=True,
                                        grad_outputs=[torch.ones_like(o) for o in outs])
    return f


# CUDA's sdpa ops on q, k, v split on the sequence (ring attention), run by CPU stand-ins
CUDA_ATTENTION = {
    "flash": lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0],
    "efficient": lambda q, k, v: torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                                                        True)[0],
    "cudnn": lambda q, k, v: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)[0],
}

# kernels the OpInfo samples do not reach: (function, its inputs as (tensor, nd-SBP on the 2x2
# placement, requires grad), values compared -- False for random ops)
F = torch.nn.functional
aten = torch.ops.aten
EXTRA = {
    "batch_norm_no_training": (lambda x, m, v: aten._native_batch_norm_legit_no_training(x, None, None, m, v, 0.1, 1e-5),
                               [(_t(8, 3, 4), ("S0", "B"), False), (_t(3), ("B", "B"), False),
                                (_t(3).abs() + 1, ("B", "B"), False)], True),
    "batch_norm_no_stats": (_grad_of(lambda x: aten._native_batch_norm_legit.no_stats(x, None, None, True, 0.1, 1e-5)),
                            [(_t(8, 3, 4), ("S0", "S2"), True)], True),
    "sdpa_flash_cpu": (_grad_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                       [(_t(4, 2, 8, 16), ("S0", "S1"), True), (_t(4, 2, 8, 16), ("S0", "S1"), True),
                        (_t(4, 2, 8, 16), ("S0", "S1"), True)], True),
    **{f"sdpa_{name}_cuda_ring": (_grad_of(call), [(_t(2, 2, 32, 8), ("S0", "S2"), True)] * 3, True)
       for name, call in CUDA_ATTENTION.items()},
    "upsample_nearest3d": (_grad_of(lambda x: F.interpolate(x, scale_factor=2, mode="nearest")),
                           [(_t(4, 2, 3, 4, 5), ("S0", "S1"), True)], True),
    "upsample_nearest_exact3d": (_grad_of(lambda x: F.interpolate(x, scale_factor=2, mode="nearest-exact")),
                                 [(_t(4, 2, 3, 4, 5), ("S0", "S1"), True)], True),
    "replication_pad3d": (_grad_of(lambda x: F.pad(x, (1, 1, 1, 1, 1, 1), mode="replicate")),
                          [(_t(4, 2, 3, 4, 5), ("S0", "S1"), True)], True),
    "bernoulli_p_tensor": (lambda x, p: aten.bernoulli.Tensor(x, p), [(_t(8, 4), ("S0", "B"), False),
                                                                     (_t(8, 4).sigmoid(), ("S0", "B"), False)], False),
    "bernoulli_float": (lambda x: torch.ops.aten.bernoulli.p(x, 0.3), [(_t(8, 4), ("S0", "S1"), False)], False),
    "bernoulli__tensor": (lambda x, p: (x * 1).bernoulli_(p), [(_t(8, 4), ("S0", "B"), False),
                                                               (_t(8, 4).sigmoid(), ("S0", "B"), False)], False),
    "dropout": (lambda x: F.dropout(x, 0.5, training=True), [(_t(8, 4), ("S0", "S1"), False)], False),
    "native_dropout": (lambda x: aten.native_dropout(x, 0.5, True), [(_t(8, 4), ("S0", "S1"), False)], False),
    "rand_like": (lambda x: torch.rand_like(x) + x, [(_t(8, 4), ("S0", "S1"), False)], False),
    "embedding_vocab_split": (_grad_of(lambda w, ids: F.embedding(ids, w, padding_idx=5, scale_grad_by_freq=True)),
                              [(_t(12, 4), ("S0", "S0"), True),
                               (torch.tensor([[0, 5, 11], [7, 5, 3]]), ("B", "B"), False)], True),
    "embedding_max_norm": (lambda w, ids: F.embedding(ids, w, max_norm=1.0),
                           [(_t(12, 4) * 3, ("S0", "B"), False), (torch.tensor([[0, 5, 11], [7, 5, 3]]), ("B", "B"), False)],
                           True),
}


def compare_extra(name: str, compiled: bool = True) -> Compared:
    """An EXTRA case on the 2x2 placement, compiled beside eager (or eager only); CUDA's attention ops
    run as their CPU stand-ins (tests/cuda_attention_standin.py)."""
    fn, inputs, values = EXTRA[name]
    with gt.simulate(4), cuda_attention_on_cpu():
        p = gt.placement("cpu", [[0, 1], [2, 3]])
        nd = {"B": broadcast, **{f"S{d}": gt.sbp.split(d) for d in range(5)}}
        leaves = [gt.distribute(t, p, tuple(nd[s] for s in sbp)).requires_grad_(grad) for t, sbp, grad in inputs]
        kernels = _Kernels()
        with kernels:
            want = fn(*leaves)
        if not compiled:
            return Compared("", kernels.seen)
        step = gt.compile(fn)
        for n in range(3):
            gt.manual_seed(n)
            got = step(*leaves)
            gt.manual_seed(n)
            problem = _exactly(got, fn(*leaves), f"call {n}", not values)
            if problem:
                return Compared(problem, kernels.seen)
        if step.captures != 1:
            return Compared(f"captured {step.captures} times in 3 calls", kernels.seen)
    return Compared("", kernels.seen if want is not None else set())
