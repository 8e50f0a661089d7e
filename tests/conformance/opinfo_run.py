"""Running PyTorch's OpInfo samples on global tensors and classifying the outcome.

For one OpInfo op (``op_db`` of ``torch.testing._internal.common_methods_invocations``), one of
its sample inputs and one layout recipe, :func:`run_case` lays every tensor argument out on 4
simulated ranks, runs the op (forward, and backward where the OpInfo supports autograd) and
compares with the same call on one device. The outcome is one of :data:`CLASSES`:

- ``clean``: equal to one device, no op went through the gather fallback;
- ``fallback``: equal, but some aten op ran through the gather-to-broadcast fallback
  (``globaltensor.ops.fallback.taken`` counts it);
- ``raises``: the global run raised;
- ``wrong``: it gave another value, shape or dtype, or left another value in an input (one the
  op writes, as ``native_batch_norm``'s running statistics, or one it must leave alone) --
  never acceptable.

Layout recipes (every tensor argument of the sample, each its own random choice):

- ``split``: 1-D placement of 4 ranks, each tensor split along a random dim (OpInfo shapes
  are mostly 5 or 10 long: uneven pieces, often an empty one);
- ``broadcast``: every tensor broadcast;
- ``partial``: 1-D, every floating tensor partial -- its pieces sum *exactly* to the value
  (the value rounded to bfloat16, the remainder, and zeros, in a random order of ranks), so
  any op must equal one device whether or not its rule keeps the partial sum;
- ``nd``: 2x2 placement, a random nd-SBP per tensor from split (any dim), broadcast and
  (floating tensors) partial.

A sample is skipped, for that sample only, when the single-device reference is not a
function of the input values: when running it on a copy of its inputs changes the result
(``as_strided`` of a view reads storage outside the view), or when it raises. An op whose
result depends on the random seed (``bernoulli``, ``nn.functional.dropout``) is compared by
shape and dtype only: the library's random numbers are sharding-invariant, not torch's stream;
so is one returning uninitialised memory (``new_empty``, ``empty_permuted``).

Tolerance: float32 results of sums regrouped over up to 4 pieces differ from one device by
a few ulps of the partial sums, i.e. about n * 2**-23 relative for n terms; OpInfo samples
have up to a few thousand terms, hence rtol 1e-4 and an absolute floor of 1e-4 times the
largest reference magnitude (tiny results of cancelling terms). Wrong answers of the kind
this suite hunts for (a dropped conjugation, a constant added on every rank) are O(1).
"""
from __future__ import annotations

import itertools
import os
import traceback
import random
import warnings
import zlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

import globaltensor as gt
from globaltensor.ops import dispatch, fallback
from globaltensor.sbp import broadcast, partial_sum, split
from globaltensor.tensor import GlobalTensor

CLASSES = ("clean", "fallback", "raises", "wrong")
RECIPES = ("split", "broadcast", "partial", "nd")
RTOL = 1e-4


def load_ops() -> list:
    """Every OpInfo op (its variants included) supporting float32 on CPU, in op_db order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def op_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def seed_of(*parts) -> int:
    """A seed from names: the same on every machine and Python run (unlike ``hash``)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


def samples(op, limit: int) -> list:
    """Up to ``limit`` of the op's first sample inputs (requiring grad where it supports autograd)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed_of(op_id(op)))
        return list(itertools.islice(op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd),
                                     limit))


@dataclass
class Outcome:
    cls: str                      # one of CLASSES, or "skip"
    detail: str = ""              # the exception, the mismatch or the skip reason
    fell_back: tuple = ()         # the aten ops that went through the fallback
    decomposed: tuple = ()        # the aten ops that ran as their decomposition
    layouts: list = field(default_factory=list)
    trace: str = ""                # the traceback of a raising case
    library_error: bool = False    # raised by globaltensor's code (not by torch above its dispatch)


def _args(sample) -> tuple:
    return (sample.input, *sample.args), dict(sample.kwargs)


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone().requires_grad_(v.requires_grad)
    return v


def _call(op, args, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return op.op(*args, **kwargs)


def _reference(op, sample):
    """The single-device result on a copy of the inputs, the tensor inputs' values after the call
    (``{flat index: value}``: changed where the op writes them, ``native_batch_norm``'s running
    statistics), and whether its values are not a function of the inputs (random,
    uninitialised); or a skip Outcome."""
    args, kwargs = _args(sample)
    try:
        copies = tree_map(_same_view, (args, kwargs))     # made outside the mode, which notes empty()
        torch.manual_seed(0)
        with _SeededOps() as seeded:
            in_storage = _call(op, *copies)
    except Exception as e:                      # noqa: BLE001 -- any error of the reference
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return None, {}, False, Outcome("skip", f"the single-device reference raises {type(e).__name__}: {first}")
    try:
        torch.manual_seed(0)
        cloned = tree_map(_clone, (args, kwargs))
        on_copy = _call(op, *cloned)
        unchanged = seeded.seen or _same(on_copy, in_storage)
    except Exception:                           # noqa: BLE001 -- it reads beyond a compact copy
        unchanged = False
    if not unchanged:
        return None, {}, False, Outcome("skip", "the single-device reference changes when run on a copy of its "
                                                "inputs (it reads storage outside the tensor)")
    inputs_after = {i: v for i, v in enumerate(tree_flatten(cloned)[0]) if isinstance(v, torch.Tensor)}
    return on_copy, inputs_after, seeded.seen, None


class _SeededOps(TorchDispatchMode):
    """Notes whether an aten op run inside gives values that are not a function of its inputs:
    random numbers (tagged ``nondeterministic_seeded``) or uninitialised memory (``empty*``)."""
    seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else ""
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) or name.startswith(("empty", "new_empty")):
            self.seen = True
        return func(*args, **(kwargs or {}))


def _same_view(v):
    """A copy of the input that keeps what it sees: the same strides into a copy of its storage."""
    if not isinstance(v, torch.Tensor) or v.layout != torch.strided:
        return _clone(v)
    copy = torch.empty(0, dtype=v.dtype).set_(v.untyped_storage().clone(), v.storage_offset(), v.shape, v.stride())
    return copy.requires_grad_(v.requires_grad)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """Strided, in a dtype ``torch.equal`` takes on CPU."""
    t = t.detach() if t.layout == torch.strided else t.detach().to_dense()
    return t.to(torch.complex64) if t.dtype == torch.complex32 else t


def _same(a, b) -> bool:
    fa, sa = tree_flatten(a)
    fb, sb = tree_flatten(b)
    if sa != sb or len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            x, y = _dense(x), _dense(y)
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.detach(), y.detach()) and \
                    not torch.allclose(x.detach(), y.detach(), equal_nan=True):
                return False
        elif x != y and not (x != x and y != y):
            return False
    return True


# -- layouts ---------------------------------------------------------------------------------

def _placement(recipe: str):
    return gt.placement("cpu", [[0, 1], [2, 3]] if recipe == "nd" else [0, 1, 2, 3])


def _choose_sbp(t: torch.Tensor, recipe: str, ndim: int, rng: random.Random) -> tuple:
    floating = t.dtype.is_floating_point or t.dtype.is_complex
    splits = [split(d) for d in range(t.dim())]
    if recipe == "broadcast":
        return (broadcast,) * ndim
    if recipe == "split":
        return (rng.choice(splits),) if splits else (broadcast,)
    if recipe == "partial":
        return (partial_sum,) if floating else (rng.choice(splits),) if splits else (broadcast,)
    choices = splits + [broadcast] + ([partial_sum] if floating else [])
    return tuple(rng.choice(choices) for _ in range(ndim))


def _exact_parts(t: torch.Tensor, k: int, rng: random.Random) -> list:
    """``k`` tensors summing exactly to ``t``: its bfloat16 rounding, the remainder, zeros (each
    its own tensor: an op writing its input writes each rank's piece)."""
    if t.dtype not in (torch.float32, torch.float64) or k == 1:
        return [t] + [torch.zeros_like(t) for _ in range(k - 1)]
    head = t.to(torch.bfloat16).to(t.dtype)
    head = torch.where(torch.isfinite(t), head, t)
    rest = torch.where(torch.isfinite(t), t - head, torch.zeros_like(t))
    parts = [head, rest] + [torch.zeros_like(t) for _ in range(k - 2)]
    rng.shuffle(parts)
    return parts


def lay_out(t: torch.Tensor, placement, nd_sbp: tuple, rng: random.Random) -> GlobalTensor:
    """``t`` as a global tensor of layout ``nd_sbp``; partial pieces sum exactly to the value."""
    plain = tuple(broadcast if v.is_partial else v for v in nd_sbp)
    x = gt.distribute(t.detach(), placement, plain)
    partial_axes = [a for a, v in enumerate(nd_sbp) if v.is_partial]
    if partial_axes:
        layout = x.layout_meta.with_sbp(nd_sbp)
        pieces = dict(x.local_tensors())
        for a in partial_axes:
            k = placement.hierarchy[a]
            # one order of the parts per coordinate off this axis: replicas along B axes stay equal
            groups = {}
            for r in pieces:
                c = placement.coord(r)
                key = tuple(c[b] for b in range(placement.ndim) if b != a and not nd_sbp[b].is_broadcast)
                if key not in groups:
                    groups[key] = _exact_parts(pieces[r], k, random.Random(rng.random()))
                pieces[r] = groups[key][c[a]].clone()     # each rank its own tensor, as in a process world
        x = GlobalTensor(layout, pieces)
    return x.requires_grad_(t.requires_grad) if t.requires_grad else x


# -- one case --------------------------------------------------------------------------------

def _full(v):
    return v.full_tensor() if isinstance(v, GlobalTensor) else v


def _tolerance(want: torch.Tensor) -> float:
    finite = want[torch.isfinite(want)] if want.numel() else want
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    return RTOL * max(scale, 1.0)


def _mismatch(got, want, what: str, structure_only: bool) -> str:
    """'' where ``got`` (possibly global) equals ``want``; else what differs."""
    gf, gs = tree_flatten(got)
    wf, ws = tree_flatten(want)
    if len(gf) != len(wf):
        return f"{what}: {len(gf)} outputs, expected {len(wf)}"
    for i, (g, w) in enumerate(zip(gf, wf)):
        if not isinstance(w, torch.Tensor):
            if isinstance(g, torch.Tensor) or (g != w and not (g != g and w != w)):
                return f"{what} {i}: {g!r} != {w!r}"
            continue
        if not isinstance(g, torch.Tensor):
            return f"{what} {i}: expected a tensor, got {type(g).__name__}"
        g = _full(g).detach()
        w = w.detach()
        if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
            return f"{what} {i}: shape/dtype {tuple(g.shape)}/{g.dtype} != {tuple(w.shape)}/{w.dtype}"
        if g.is_conj() != w.is_conj() or g.is_neg() != w.is_neg():
            g, w = g.resolve_conj().resolve_neg(), w.resolve_conj().resolve_neg()
        if structure_only:
            continue
        if w.is_floating_point() or w.is_complex():
            if not torch.allclose(g, w, rtol=RTOL, atol=_tolerance(w), equal_nan=True):
                worst = float((g - w).abs().nan_to_num(float("inf")).max()) if w.numel() else 0.0
                return f"{what} {i}: values differ (largest difference {worst:.3g})"
        elif not torch.equal(g, w):
            return f"{what} {i}: values differ"
    return ""


def _grad_outputs(outs: list, rng_seed: int) -> list:
    gen = torch.Generator().manual_seed(rng_seed)
    return [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs]


def _differentiable(out) -> list:
    return [o for o in tree_flatten(out)[0]
            if isinstance(o, torch.Tensor) and o.requires_grad and (o.is_floating_point() or o.is_complex())]


def _grads(out, inputs: list, weights: list):
    outs = _differentiable(out)
    if not outs or not inputs:
        return None
    return torch.autograd.grad(outs, inputs, weights, allow_unused=True)


def run_case(op, sample, recipe: str, seed: int) -> Outcome:
    """The outcome of ``op`` on ``sample`` with every tensor argument laid out by ``recipe``."""
    want, inputs_after, random_op, skip = _reference(op, sample)
    if skip is not None:
        return skip
    rng = random.Random(seed)
    args, kwargs = _args(sample)
    flat, spec = tree_flatten((args, kwargs))
    plain = [_clone(v) for v in flat]
    grad_wanted = op.supports_autograd and not random_op
    inputs = [v for v in plain if isinstance(v, torch.Tensor) and v.requires_grad]
    want_grads = None
    if grad_wanted:
        p_args, p_kwargs = tree_unflatten(plain, spec)
        try:
            ref_out = _call(op, p_args, p_kwargs)
            weights = _grad_outputs(_differentiable(ref_out), seed)
            want_grads = _grads(ref_out, inputs, weights)
        except Exception:                       # noqa: BLE001 -- no reference backward: forward only
            want_grads = None
    with gt.simulate(4):
        placement = _placement(recipe)
        layouts, globals_ = [], []
        for v in flat:
            if isinstance(v, torch.Tensor) and v.layout == torch.strided:
                nd = _choose_sbp(v, recipe, placement.ndim, rng)
                layouts.append(nd)
                g = lay_out(_clone(v), placement, nd, rng)
                globals_.append(g)
            else:
                globals_.append(v)
        g_args, g_kwargs = tree_unflatten(globals_, spec)
        fell = dict(fallback.taken)
        dec = dict(dispatch.decomposed_calls)
        outcome = Outcome("clean", layouts=layouts)
        try:
            torch.manual_seed(0)
            got = _call(op, g_args, g_kwargs)
            problem = _mismatch(got, want, "output", random_op) or \
                _mismatch([globals_[i] for i in inputs_after], list(inputs_after.values()), "input after the call",
                          random_op)
            if not problem and want_grads is not None:
                g_inputs = [g for g, v in zip(globals_, flat) if isinstance(v, torch.Tensor) and v.requires_grad]
                outs = _differentiable(got)
                g_weights = [gt.distribute(w, o.placement, tuple(broadcast if s.is_partial else s for s in o.sbp))
                             if isinstance(o, GlobalTensor) else w
                             for w, o in zip(_grad_outputs(outs, seed), outs)]
                got_grads = torch.autograd.grad(outs, g_inputs, g_weights, allow_unused=True) if outs else None
                problem = _mismatch(got_grads, want_grads, "gradient", False)
        except Exception as e:                  # noqa: BLE001 -- classified, not hidden
            outcome.trace = traceback.format_exc()
            outcome.library_error = _raised_in_library(e)
            outcome.cls, outcome.detail = "raises", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            problem = ""
        if problem:
            outcome.cls, outcome.detail = "wrong", problem
        outcome.fell_back = tuple(sorted(str(f) for f, n in fallback.taken.items() if n > fell.get(f, 0)))
        outcome.decomposed = tuple(sorted(str(f) for f, n in dispatch.decomposed_calls.items() if n > dec.get(f, 0)))
        if outcome.cls == "clean" and outcome.fell_back:
            outcome.cls = "fallback"
            outcome.detail = "via the gather fallback: " + ", ".join(outcome.fell_back)
    return outcome


CLEAR_ERRORS = (ValueError, TypeError, NotImplementedError)


def _raised_in_library(e: BaseException) -> bool:
    """Whether the innermost globaltensor frame is where the exception was raised."""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and f"{os.sep}globaltensor{os.sep}" in frames[-1].filename


def unclear_errors(outcomes) -> list:
    """The raising cases where globaltensor raised something other than a clear error (a
    ValueError / TypeError / NotImplementedError naming the op): a bug of the library."""
    return [(i, recipe, o) for i, recipe, o in outcomes
            if o.cls == "raises" and o.library_error and not o.detail.startswith(tuple(c.__name__ + ":" for c in CLEAR_ERRORS))]


# -- the plan: which samples and recipes run for each op --------------------------------------

SAMPLES_PER_OP = 3
FIRST_RECIPES = ("split", "nd")
SAMPLES_LOOKED_AT = 8
FLAG_SAMPLES_LOOKED_AT = 32


def _richness(sample) -> int:
    """How much layout a sample offers: the dims of its tensor arguments, added up."""
    return sum(v.dim() for v in tree_flatten(_args(sample))[0] if isinstance(v, torch.Tensor))


def _flags(sample) -> tuple:
    """The sample's boolean arguments: its mode (``training``, ``keepdim``, ``is_causal``, ...)."""
    return tuple(v for v in tree_flatten((list(sample.args), sample.kwargs))[0] if isinstance(v, bool))


def plan(op, have: list, samples_per_op: int = SAMPLES_PER_OP, first_recipes: tuple = FIRST_RECIPES) -> list:
    """``(sample index, recipe, seed)`` for the op: a fixed, seeded subset (``samples_per_op`` of
    the first ``SAMPLES_LOOKED_AT``, the flag combinations beside them).

    Of the op's first ``SAMPLES_LOOKED_AT`` samples, the one with the most tensor dims (OpInfo
    lists 0-dim samples first) and up to two more picked at random; the first runs on
    ``first_recipes`` (``split`` and ``nd``), the others each on one recipe picked at random. Then,
    of its first ``FLAG_SAMPLES_LOOKED_AT``, the first sample of every combination of boolean
    arguments the chosen ones leave out (batch norm in eval as well as in training, ``keepdim`` both
    ways), on a recipe picked at random. All choices are seeded by the op's name, so every run makes
    the same ones."""
    name = op_id(op)
    rng = random.Random(seed_of(name))
    first = have[:SAMPLES_LOOKED_AT]
    order = sorted(range(len(first)), key=lambda i: (-_richness(first[i]), i))
    chosen = order[:1] + rng.sample(order[1:], min(samples_per_op - 1, len(order) - 1)) if order else []
    cases = []
    for k, i in enumerate(chosen):
        for recipe in (first_recipes if k == 0 else (rng.choice(RECIPES),)):
            cases.append((i, recipe, seed_of(name, i, recipe)))
    covered = {_flags(have[i]) for i in chosen}
    for i, sample in enumerate(have):
        if _flags(sample) not in covered:
            covered.add(_flags(sample))
            recipe = rng.choice(RECIPES)
            cases.append((i, recipe, seed_of(name, i, recipe)))
    return cases


def classify_op(op, cases=None, samples_per_op: int = SAMPLES_PER_OP, first_recipes: tuple = FIRST_RECIPES) -> list:
    """``[(sample index, recipe, Outcome)]`` for the op's plan (or the given cases)."""
    have = samples(op, FLAG_SAMPLES_LOOKED_AT)
    cases = plan(op, have, samples_per_op, first_recipes) if cases is None else cases
    return [(i, recipe, run_case(op, have[i], recipe, seed)) for i, recipe, seed in cases if i < len(have)]


def worst(outcomes) -> str:
    """The op's class: its worst case's (skipped cases do not count; all skipped: clean)."""
    ranks = [CLASSES.index(o.cls) for _, _, o in outcomes if o.cls in CLASSES]
    return CLASSES[max(ranks)] if ranks else "clean"
