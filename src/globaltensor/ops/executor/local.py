"""Running a ``local`` decision: box the inputs to their targets, call the op (or the rule's kernel) on
each held rank's pieces, wrap the results.

This is the hot path of every op after its first call; everything that can be worked out once
(where the tensors sit, the ranks this process holds, the output's kind) is worked out when the
runner is made. :meth:`PieceRun.each_rank` is the one per-rank call loop. The runner that
:meth:`PieceRun.fast` makes skips the boxing step when every input is a global tensor in its target
layout already, the common case; with one held rank it calls the op once, its check and the
pieces' substitution in one pass.
"""
from __future__ import annotations

from typing import Callable

from ...comm import current as _current
from ...comm import get_world
from ...tensor import GlobalTensor, box, replicate, wrap_fresh, wrap_result
from ..kept_boxed_copy import box_input
from ..decide.decision import Decision
from ..explicit import explicit, refuse_implicit
from ..schema.args import Substitution, get
from ..schema.op_record import record


class PieceRun:
    def __init__(self, d: Decision):
        self.func, self.call = d.func, d.func._op
        self.positions = d.positions
        self.substitute = Substitution(d.positions)
        self.flat = self.substitute.flat_indices
        self.targets, self.out_kind, self.out_layouts = d.targets, d.out_kind, d.out_layouts
        self.local, self.kernel = d.local, d.kernel
        # a tuple / list result: which of its entries are tensors (the others are None, e.g. the
        # grads a backward op's output_mask leaves out, or numbers); out_layouts has one per tensor entry
        self.out_slots = d.out_slots
        self.returns_input = d.returned
        self.placement = d.placement
        self.all_broadcast = [all(v.is_broadcast for v in t.nd_sbp) for t in d.targets]
        # an op whose result may alias an input (``to``, ``contiguous``, views) can hand back the
        # input tensor itself; then so does this run, as torch does (``x.to(x.dtype) is x``)
        self.may_return_self = d.out_kind == "tensor" and record(d.func).returns_alias
        self._world = None

    def fast(self) -> Callable:
        """This run, or -- where the tensors sit in flat positional arguments and no kernel runs -- a
        closure that checks every input is a global tensor already in its target layout and then
        goes straight to :meth:`each_rank` (else it takes this run). Where this process holds one
        rank of the placement (a process world: the hot path), the check puts each piece in place
        as it goes and the op is called once, with no loop. An op making one fresh result (``add``,
        ``mm``, ``relu``) wraps it without looking for a returned input."""
        flat = self.flat
        if self.kernel is not None or flat is None:
            return self
        pairs, slow, each, wrap = list(zip(flat, self.targets)), self.__call__, self.each_rank, self.wrap
        call, local, targets, out_layouts = self.call, self.local, self.targets, self.out_layouts
        current = _current
        fresh = self.out_kind == "tensor" and not self.returns_input and not self.may_return_self
        out_layout = self.out_layouts[0] if fresh else None

        def run(args, kwargs):
            if current._world is not self._world:
                self._held()
            r = self.single
            if r is None:
                for i, target in pairs:
                    v = args[i]
                    if type(v) is not GlobalTensor or v._layout is not target:
                        return slow(args, kwargs)
                results, out = each(args, kwargs, None)
                if not results:                 # no rank of the placement lives here
                    return slow(args, kwargs)
            else:
                a = list(args)
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
                results = {r: out}
            if fresh:
                return wrap_fresh(out_layout, results, self.device, out)
            return wrap(results, [args[i] for i in flat])
        return run

    def each_rank(self, args, kwargs, values) -> tuple:
        """The one per-rank call loop: each held rank's call gets its pieces at the tensor positions
        (``values``, the tensor inputs in their targets: global tensors, or plain tensors moved to
        the rank's device; None: the arguments themselves, global tensors at flat positions) and the
        rule's ``local`` rewrite, then runs -- or, with a kernel, the calls are handed to it, which
        runs them all (once, even when no rank is held here). Returns ``({rank: result}, the last
        result)``."""
        flat, local, call, kernel = self.flat, self.local, self.call, self.kernel
        calls = {} if kernel is not None else None
        results, out = {}, None
        a = list(args) if flat is not None else None
        for r in self.ranks:
            if values is None:
                for i in flat:
                    a[i] = args[i]._pieces[r]
                ra, rkw = a, kwargs
            else:
                pieces = [v._pieces[r] if type(v) is GlobalTensor else v.to(self.devices[r]) for v in values]
                ra, rkw = self.substitute(args, kwargs, pieces)
            if local is not None:
                ra, rkw = local(r, self.targets, self.out_layouts, *ra, **rkw)
            if calls is not None:
                calls[r] = (list(ra), rkw)
            else:
                out = results[r] = call(*ra, **rkw)
        if calls is not None:
            results = kernel(self.func, args, kwargs, self.targets, self.out_layouts, calls)
            out = next(iter(results.values()), None)
        return results, out

    def __call__(self, args, kwargs):
        self._held()
        values = self._inputs(args, kwargs)
        results, _ = self.each_rank(args, kwargs, values)
        return self.wrap(results, values)

    def _inputs(self, args, kwargs) -> list:
        """Each tensor input in its target layout: a global tensor, or a plain tensor used as is."""
        flat = self.flat
        values = [args[i] for i in flat] if flat is not None else [get(args, kwargs, p) for p in self.positions]
        if explicit.depth:
            refuse_implicit(self.func, [v._layout if type(v) is GlobalTensor else None for v in values], self.targets)
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

    def wrap(self, results: dict, inputs: list):
        """The op's result as global tensors: an input the op writes and returns (``add_``) is that
        input; a result whose pieces are an input's, in its layout, is that input; others are new."""
        kind = self.out_kind
        if kind == "tensor":
            k = self.returns_input.get(0)
            if k is not None:
                return inputs[k]
            same = self._same_input(results, inputs) if self.may_return_self else None
            return same if same is not None else self._new(self.out_layouts[0], results)
        if kind == "none":
            return None
        ranks = list(results)
        slots = self.out_slots if self.out_slots is not None else [True] * len(self.out_layouts)
        outs, n = [], 0
        for j, is_tensor in enumerate(slots):
            if not is_tensor:                   # None, or a number every rank computes alike (max_q)
                outs.append(results[ranks[0]][j] if ranks else None)
                continue
            k = self.returns_input.get(j)
            outs.append(inputs[k] if k is not None else
                        self._new(self.out_layouts[n], {r: results[r][j] for r in ranks}))
            n += 1
        return tuple(outs) if kind == "tuple" else outs

    def _new(self, layout, pieces: dict) -> GlobalTensor:
        piece = next(iter(pieces.values()), None)
        if piece is None:
            return GlobalTensor(layout, pieces, device=self.device)
        return wrap_result(layout, pieces, self.device, piece)

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
