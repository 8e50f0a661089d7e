"""Checking ops on global tensors against the same computation on one device.

``check_candidates(op, *args)``: for each candidate signature of ``op``'s rule, on a 1-D
placement of 4 ranks and a 2x2 placement (there with the all-broadcast one in the product),
lay the inputs out as the candidate asks (partial inputs as random splits of the value),
run the op with exactly that signature, and compare every output -- value and layout --
with the op on the plain tensors.
``check_layouts(fn, *args)``: the same for any function, with every input on random
layouts; ``grad=True`` also compares the inputs' gradients and checks their SBP.
``no_fallback()``: a block in which an op running through the gather-to-broadcast fallback fails.
"""
from __future__ import annotations

import random

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

import globaltensor as gt
from globaltensor.ops import decide as stages
from globaltensor.ops.decide import in_kinds
from globaltensor.ops.executor import runner
from globaltensor.ops.registry import find_rule
from globaltensor.sbp import all_broadcast, as_signature, blocks_problem, broadcast, nd_candidates, partial_sum, split
from fallback_guard import no_fallback  # noqa: F401  (re-exported for the tests)

PLACEMENTS = {"1d": lambda: gt.placement("cpu", [0, 1, 2, 3]), "2x2": lambda: gt.placement("cpu", [[0, 1], [2, 3]])}


def make_global(t: torch.Tensor, placement, nd_sbp, rng: random.Random, requires_grad=False):
    """``t`` laid out as ``nd_sbp``; partial axes hold random pieces that sum to the value."""
    plain = tuple(broadcast if v.is_partial else v for v in nd_sbp)
    x = gt.distribute(t.detach(), placement, plain)
    if plain != tuple(nd_sbp):
        x = _random_partial(x, placement, tuple(nd_sbp), rng)
    if requires_grad:
        x = x.detach().requires_grad_(True)
    return x


def lay(t: torch.Tensor, sbp, placement="1d", seed: int = 0):
    """``t`` laid out as ``sbp`` (one SBP or an nd tuple) on a placement of :data:`PLACEMENTS` (by name)
    or a given one; partial axes as random pieces (:func:`make_global`, seeded by ``seed``)."""
    p = PLACEMENTS[placement]() if isinstance(placement, str) else placement
    return make_global(t, p, sbp if isinstance(sbp, tuple) else (sbp,), random.Random(seed))


def _random_partial(x, placement, nd_sbp, rng):
    """Pieces of a partial layout: along each partial axis the first rank adds noise that the
    others take off. The noise varies with every coordinate except this axis's and broadcast
    axes' (replicas must stay equal)."""
    from globaltensor.tensor import GlobalTensor
    layout = x.layout_meta.with_sbp(nd_sbp)
    if not x.dtype.is_floating_point:
        return gt.distribute(x.full_tensor(), placement, nd_sbp)
    pieces = {r: t.clone() for r, t in x.local_tensors().items()}
    base = rng.randrange(1 << 20)
    for a, v in enumerate(nd_sbp):
        k = placement.hierarchy[a]
        if not v.is_partial or k == 1:
            continue
        for r in pieces:
            c = placement.coord(r)
            key = (base, a) + tuple(c[b] for b in range(placement.ndim) if b != a and not nd_sbp[b].is_broadcast)
            gen = torch.Generator().manual_seed(hash(key) & 0xFFFFFFFF)
            noise = torch.randn(pieces[r].shape, generator=gen, dtype=pieces[r].dtype)
            pieces[r] = pieces[r] + noise if c[a] == 0 else -noise / (k - 1)
    return GlobalTensor(layout, pieces)


def _assert_close(got, want, what, rtol, atol):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
        g = got.full_tensor() if getattr(got, "is_global", False) else got
        assert tuple(g.shape) == tuple(want.shape), f"{what}: shape {tuple(g.shape)} != {tuple(want.shape)}"
        if want.dtype.is_floating_point or want.dtype.is_complex:
            torch.testing.assert_close(g.to(want.dtype), want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
        else:
            assert torch.equal(g.to(want.dtype), want), f"{what}: values differ"
    else:
        assert got == want, f"{what}: {got!r} != {want!r}"


def _compare(got, want, what, rtol, atol):
    gl, _ = tree_flatten(got)
    wl, _ = tree_flatten(want)
    assert len(gl) == len(wl), f"{what}: {len(gl)} outputs, expected {len(wl)}"
    for i, (g, w) in enumerate(zip(gl, wl)):
        _assert_close(g, w, f"{what} output {i}", rtol, atol)


def _meta_args(args, kwargs) -> tuple:
    return tree_map(lambda v: torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor)
                    else v, (args, kwargs))


def candidate_signatures(op, *args, **kwargs) -> list:
    """The rule's 1-D candidates for these arguments (meta tensors of the same shapes)."""
    rule = find_rule(op)
    assert rule is not None, f"{op} has no rule"
    meta = _meta_args(args, kwargs)
    return [as_signature(c) for c in rule.candidates(*meta[0], **meta[1])]


def check_candidates(op, *args, rtol=1e-4, atol=1e-5, placements=("1d", "2x2"), max_2d=12, seed=0, blocks=1,
                     head_tail=False, **kwargs):
    """Each candidate of ``op``'s rule, forced on its own with the inputs in its layouts, gives the
    single-device result and outputs in its layouts; returns how many ran. ``blocks=f`` checks
    instead the candidates that hold in any order (``Rule.order_free``) with every split blocked
    ``f`` ways, skipping those whose blocks do not fit the shapes. ``head_tail=True`` checks them in
    head-tail order (with ``blocks``: also blocked ``f`` ways), those the dispatcher admits."""
    want = op(*args, **kwargs)
    sigs = candidate_signatures(op, *args, **kwargs)
    kinds = sorted({(1, "head_tail"), (blocks, "head_tail")}) if head_tail else [(blocks, "plain")] if blocks > 1 else []
    if kinds:
        sigs = in_kinds(find_rule(op), sigs, kinds, *_meta_args(args, kwargs))
    assert sigs, f"{op}: the rule gave no candidates for these arguments"
    replicated = all_broadcast(len(sigs[0].inputs), len(sigs[0].outputs))
    shape_checked = find_rule(op).check_shapes
    rng = random.Random(seed)
    ran = 0
    with gt.simulate(4):
        for name in placements:
            p = PLACEMENTS[name]()
            combos = nd_candidates([sigs if p.ndim == 1 else sigs + [replicated]] * p.ndim)
            if len(combos) > max_2d:
                combos = rng.sample(combos, max_2d)
            for c in combos:
                flat, spec = tree_flatten((args, kwargs))
                tensors = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
                shapes = [tuple(flat[i].shape) for i in tensors] + [tuple(o.shape) for o in tree_flatten(want)[0]
                                                                    if isinstance(o, torch.Tensor)]
                if any(blocks_problem(shape, p.hierarchy, nd) for shape, nd in zip(shapes, c.inputs + c.outputs)):
                    continue        # the dispatcher never offers it
                if head_tail and not any(v.is_split and v.head_tail for nd in c.inputs for v in nd):
                    continue        # checked in plain order
                if blocks > 1 and not head_tail and not any(v.is_split and v.blocks > 1 for nd in c.inputs for v in nd):
                    continue        # the plain candidate, checked without blocks
                for k, i in enumerate(tensors):
                    flat[i] = make_global(flat[i], p, c.inputs[k], rng)
                a, kw = tree_unflatten(flat, spec)
                what = f"{op} on {name} with candidate {c.inputs} -> {c.outputs}"
                run = forced_run(op, a, kw, c)
                if run is None:
                    assert shape_checked or head_tail, f"{what}: the dispatcher did not admit it"
                    continue  # its pieces do not line up on this shape: rightly not used
                got = run(a, kw)
                _compare(got, want, what, rtol, atol)
                outs = [o.sbp for o in tree_flatten(got)[0] if isinstance(o, torch.Tensor)]
                assert outs == list(c.outputs), f"{what}: outputs came as {outs}"
                ran += 1
    return ran


def forced_run(op, args, kwargs, signature):
    """The runner of ``op`` on these arguments with ``signature`` chosen, through the dispatcher's
    public stages (route, candidates, then the decision on pieces); None where the candidates stage
    does not admit it."""
    r = stages.route(op, args, kwargs)
    assert r.kind == "rule", f"{op} takes the {r.kind} route here, not its rule"
    problem = stages.candidates(r, op, args, kwargs, torch.is_grad_enabled())
    if signature not in problem.candidates:
        return None
    return runner(stages.on_pieces(r, problem, signature))


def random_nd_sbp(t: torch.Tensor, placement, rng: random.Random, partial=True) -> tuple:
    choices = [broadcast] + [split(d) for d in range(t.dim())] + ([partial_sum] if partial else [])
    return tuple(rng.choice(choices) for _ in range(placement.ndim))


def check_layouts(fn, *args, trials=6, grad=False, rtol=1e-4, atol=1e-5, placements=("1d", "2x2"),
                  partial=True, seed=0):
    """``fn`` on global inputs in random layouts equals ``fn`` on the plain inputs (and so do gradients)."""
    rng = random.Random(seed)
    plain = [a.detach().clone().requires_grad_(grad) if isinstance(a, torch.Tensor) and grad and
             a.dtype.is_floating_point else a for a in args]
    want = fn(*plain)
    if grad:
        _backward(want)
    with gt.simulate(4):
        for name in placements:
            p = PLACEMENTS[name]()
            for _ in range(trials):
                layouts = [random_nd_sbp(a, p, rng, partial and not grad) if isinstance(a, torch.Tensor) else None
                           for a in args]
                gl = [make_global(a, p, l, rng, grad and a.dtype.is_floating_point) if l is not None else a
                      for a, l in zip(args, layouts)]
                got = fn(*gl)
                _compare(got, want, f"{getattr(fn, '__name__', fn)} on {name} with {layouts}", rtol, atol)
                if grad:
                    _backward(got)
                    for i, (g, w) in enumerate(zip(gl, plain)):
                        if isinstance(w, torch.Tensor) and w.requires_grad:
                            assert g.grad is not None, f"input {i} got no gradient"
                            assert g.grad.sbp == g.sbp, f"input {i}: grad sbp {g.grad.sbp} != {g.sbp}"
                            _assert_close(g.grad, w.grad, f"grad of input {i} with {layouts}", rtol, atol)


def _backward(out):
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    total = None
    for o in outs:
        term = (o * torch.linspace(0.5, 1.5, o.numel()).reshape(o.shape)).sum() if not getattr(o, "is_global", False) \
            else (o * _weights_like(o)).sum()
        total = term if total is None else total + term
    total.backward()


def _weights_like(o):
    w = torch.linspace(0.5, 1.5, o.numel()).reshape(o.shape)
    return gt.distribute(w, o.placement, tuple(broadcast if v.is_partial else v for v in o.sbp))


def check_all(op, *args, placements=("1d", "2x2"), max_2d=12, **kwargs):
    """``check_candidates``, and every candidate of the rule ran (on the 1-D placement at least)."""
    n = len(candidate_signatures(op, *args, **kwargs))
    ran = check_candidates(op, *args, placements=placements, max_2d=max_2d, **kwargs)
    assert ran >= n, f"{op}: {ran} runs for {n} candidates"
    return ran


def sigs(op, *args, **kwargs):
    """The rule's candidates for these arguments, as strings."""
    return {repr(s) for s in candidate_signatures(op, *args, **kwargs)}


