"""Running a decided op: box the inputs, call the aten op on each held rank's pieces, wrap.

This is the hot path of every op after its first call; everything that can be worked out
once (positions of the tensors, target layouts, output layouts and kinds, the ranks this
process holds) is worked out when the decision is made.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..comm import current as _current
from ..comm import get_world
from ..tensor import GlobalTensor, box, replicate, wrap_fresh, wrap_result
from .args import Substitution, get
from .boxed_copy import box_input
from .op_record import record


class LocalRun:
    def __init__(self, func, positions, targets, out_kind, out_layouts, local, returns_input, kernel=None,
                 out_slots=None, kept=()):
        self.func = func
        self.kept = kept            # positions among the tensor inputs of the tensors the op writes
        self.kernel = kernel
        # a tuple / list result: which of its entries are tensors (the others are None, e.g. the
        # grads a backward op's output_mask leaves out, or numbers); out_layouts has one per tensor entry
        self.out_slots = out_slots
        self.call = func._op
        self.positions = positions
        self.substitute = Substitution(positions)
        self.targets = targets
        self.out_kind = out_kind
        self.out_layouts = out_layouts
        self.local = local
        self.returns_input = returns_input
        self.placement = (targets or out_layouts)[0].placement
        self.all_broadcast = [all(v.is_broadcast for v in t.nd_sbp) for t in targets]
        # an op whose result may alias an input (``to``, ``contiguous``, views) can hand back the
        # input tensor itself; then so does this run, as torch does (``x.to(x.dtype) is x``)
        self.may_return_self = out_kind == "tensor" and record(func).returns_alias
        self._world = None

    def fast(self):
        """This run, or for the common case -- the aten op on each piece (after the rule's
        ``local`` rewrite of its arguments, a view's piece shape say), tensors only in flat
        positional arguments, fresh tensors out or an input written in place -- a closure
        doing only that when every input is a global tensor already in its target layout (else
        it takes this run)."""
        flat = self.substitute.flat_indices
        several = self.out_kind in ("tuple", "list") and not self.returns_input
        if (self.kernel is not None or flat is None
                or not (several or self.out_kind == "tensor" and not set(self.returns_input) - {0})):
            return self
        call, local, targets, slow = self.call, self.local, self.targets, self.__call__
        out_layouts = self.out_layouts
        out_layout = out_layouts[0] if out_layouts else None
        returned = self.returns_input.get(0)        # an in-place op returns its input
        returned = None if returned is None else flat[returned]
        may_return_self, wrap = self.may_return_self, wrap_result
        pairs = list(zip(flat, targets))
        current = _current
        if not several and returned is None and not may_return_self:
            return self._fresh(pairs, out_layout)

        def run(args, kwargs):
            if current._world is not self._world:
                self._held()
            a = list(args)
            for i, target in pairs:
                v = a[i]
                if type(v) is not GlobalTensor or v._layout is not target:
                    return slow(args, kwargs)
            if self.single is not None:
                r = self.single
                for i, _ in pairs:
                    a[i] = args[i]._pieces[r]
                if local is None:
                    out = call(*a, **kwargs)
                else:
                    la, lkw = local(r, targets, out_layouts, *a, **kwargs)
                    out = call(*la, **lkw)
                results = {r: out}
            else:
                results, out = self._each_rank(a, args, kwargs, pairs)
                if not results:                 # no rank of the placement lives here
                    return slow(args, kwargs)
            if returned is not None:
                return args[returned]
            if several:
                return self._wrap_several(results, out)
            if may_return_self and (self.single is None or any(out is a[i] for i, _ in pairs)):
                same = self._same_input(results, [args[i] for i in flat])
                if same is not None:
                    return same
            return wrap(out_layout, results, self.device, out)
        return run

    def _fresh(self, pairs: list, out_layout) -> Callable:
        """The closure of :meth:`fast` for one result that aliases no input, the commonest op
        (``add``, ``mm``, ``relu``): on one held rank it unwraps, calls and wraps in one pass."""
        call, local, targets, out_layouts, slow = self.call, self.local, self.targets, self.out_layouts, self.__call__
        current = _current

        def run(args, kwargs):
            if current._world is not self._world:
                self._held()
            r = self.single
            a = list(args)
            if r is None:
                for i, target in pairs:
                    v = a[i]
                    if type(v) is not GlobalTensor or v._layout is not target:
                        return slow(args, kwargs)
                results, out = self._each_rank(a, args, kwargs, pairs)
                return wrap_fresh(out_layout, results, self.device, out) if results else slow(args, kwargs)
            for i, target in pairs:
                v = a[i]
                if type(v) is not GlobalTensor or v._layout is not target:
                    return slow(args, kwargs)
                a[i] = v._pieces[r]
            if local is None:
                out = call(*a, **kwargs)
            else:
                la, lkw = local(r, targets, out_layouts, *a, **kwargs)
                out = call(*la, **lkw)
            return wrap_fresh(out_layout, {r: out}, self.device, out)
        return run

    def _each_rank(self, a: list, args, kwargs, pairs: list) -> tuple:
        """The op on each held rank's pieces (simulated worlds hold several), inputs already
        checked: {rank: result}, and the last result."""
        results, out = {}, None
        for r in self.ranks:
            for i, _ in pairs:
                a[i] = args[i]._pieces[r]
            if self.local is None:
                out = results[r] = self.call(*a, **kwargs)
            else:
                la, lkw = self.local(r, self.targets, self.out_layouts, *a, **kwargs)
                out = results[r] = self.call(*la, **lkw)
        return results, out

    def _wrap_several(self, results: dict, out) -> tuple:
        """A tuple / list result of fresh tensors (None where the op left an entry out, a number where
        it returns one)."""
        outs, n = [], 0
        for j, piece in enumerate(out):
            if not isinstance(piece, torch.Tensor):
                outs.append(piece)
                continue
            outs.append(wrap_result(self.out_layouts[n], {r: results[r][j] for r in results}, self.device, piece))
            n += 1
        return tuple(outs) if self.out_kind == "tuple" else outs

    def _same_input(self, results: dict, inputs: list):
        """The input whose pieces the local op returned as they are, in the output's layout."""
        for v in inputs:
            if (type(v) is GlobalTensor and results and all(results[r] is v._pieces.get(r) for r in results)
                    and v._layout == self.out_layouts[0]):
                return v
        return None

    def _held(self):
        world = get_world()
        if world is not self._world:
            self._world = world
            self.ranks = [r for r in self.placement.rank_list() if world.holds(r)]
            self.devices = {r: world.device(self.placement.type, r) for r in self.ranks}
            self.device = self.devices[self.ranks[0]] if self.ranks else None
            self.single = self.ranks[0] if len(self.ranks) == 1 else None
        return self.ranks

    def _inputs(self, args, kwargs) -> list:
        """Each tensor input in its target layout: a global tensor, or a plain tensor used as is."""
        flat = self.substitute.flat_indices
        values = [args[i] for i in flat] if flat is not None else [get(args, kwargs, p) for p in self.positions]
        for n, (v, target) in enumerate(zip(values, self.targets)):
            if type(v) is not GlobalTensor:
                if not self.all_broadcast[n]:
                    values[n] = box(replicate(v, self.placement), target)
            elif v._layout is not target:
                if v._layout == target:
                    v._layout = target  # the interned equal object: next time an identity check
                else:
                    values[n] = box_input(v, target)
        return values

    def __call__(self, args, kwargs):
        ranks = self._held()
        inputs = self._inputs(args, kwargs)
        call, local, substitute = self.call, self.local, self.substitute
        if self.kernel is not None:
            return self._wrap(self._run_kernel(args, kwargs, ranks, inputs), ranks, inputs)
        results = {}
        for r in ranks:
            values = [v._pieces[r] if type(v) is GlobalTensor else v.to(self.devices[r]) for v in inputs]
            a, kw = substitute(args, kwargs, values)
            if local is not None:
                a, kw = local(r, self.targets, self.out_layouts, *a, **kw)
            results[r] = call(*a, **kw)
        return self._wrap(results, ranks, inputs)

    def _run_kernel(self, args, kwargs, ranks, inputs) -> dict:
        """The rule's kernel runs the whole call (once, even when no rank is held here)."""
        calls = {}
        for r in ranks:
            values = [v._pieces[r] if type(v) is GlobalTensor else v.to(self.devices[r]) for v in inputs]
            a, kw = self.substitute(args, kwargs, values)
            if self.local is not None:
                a, kw = self.local(r, self.targets, self.out_layouts, *a, **kw)
            calls[r] = (a, kw)
        return self.kernel(self.func, args, kwargs, self.targets, self.out_layouts, calls)

    def _wrap(self, results, ranks, inputs):
        kind = self.out_kind
        if kind == "tensor":
            k = self.returns_input.get(0)
            if k is not None:
                return inputs[k]
            same = self._same_input(results, inputs) if self.may_return_self else None
            return same if same is not None else GlobalTensor(self.out_layouts[0], results, device=self.device)
        if kind == "none":
            return None
        slots = self.out_slots if self.out_slots is not None else [True] * len(self.out_layouts)
        outs, n = [], 0
        for j, is_tensor in enumerate(slots):
            if not is_tensor:                   # None, or a number every rank computes alike (max_q)
                outs.append(results[ranks[0]][j] if ranks else None)
                continue
            k = self.returns_input.get(j)
            outs.append(inputs[k] if k is not None else
                        GlobalTensor(self.out_layouts[n], {r: results[r][j] for r in ranks}))
            n += 1
        return tuple(outs) if kind == "tuple" else outs
