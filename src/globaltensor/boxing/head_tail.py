"""Planning boxings from and to head-tail splits (``split(d, order="head_tail")``, sbp/shape.py).

A head-tail piece is two chunks of each block, so the axis steps (which cut boxes) do not reach it.
It is reached in one of three ways, the cheapest by the planner's cost:

- a *reorder*: one ``send_recv`` on the placement between the head-tail layout and the same layout
  in plain order (``split(d, blocks=f)``): each rank sends the chunks it holds to the ranks that hold
  them in the other order, keeping what it holds in both (at most its piece, as an all-to-all would);
- a *local cut* from the layout with the head-tail axis broadcast (each rank takes its chunks);
- where source and target split the same dims head-tail on the same axes and the chunks are even
  (so a head-tail piece has the shape of its plain-order piece), the boxing of the other axes runs
  on the pieces as they are: it moves whole pieces along other axes and never looks inside dim ``d``.
"""
from __future__ import annotations

from .layout import Layout, axis_groups, intersect
from .plan import Plan, Step
from ..comm.world import Transfer
from ..sbp.shape import head_tail_axes, head_tail_problem, numel
from ..sbp.values import broadcast, split


def plain_order(layout: Layout) -> Layout:
    """``layout`` with its head-tail splits in plain order (same dims and block counts)."""
    return layout.with_sbp(tuple(split(v.dim, v.blocks) if v.is_split and v.head_tail else v
                                 for v in layout.nd_sbp))


def head_tail_steps(src: Layout, dst: Layout, plan_boxing) -> list:
    """The steps of the cheapest of the routes above; ``plan_boxing`` plans the rest."""
    for lay in (src, dst):
        problem = head_tail_problem(lay.shape, lay.nd_sbp)
        if problem:
            raise ValueError(f"boxing: {lay.nd_sbp!r} is not a layout of shape {tuple(lay.shape)}: {problem}")
    if src.placement == dst.placement and _same_chunks(src, dst):
        steps = _beside(src, dst, plan_boxing)
        if steps is not None:
            return steps
    head = [reorder(src, plain_order(src))] if src.head_tail else []
    start = plain_order(src) if src.head_tail else src
    if not dst.head_tail:
        return head + list(plan_boxing(start, dst).steps)
    plain = plain_order(dst)
    routes = [head + list(plan_boxing(start, plain).steps) + [reorder(plain, dst)]]
    spread = dst.with_sbp(tuple(broadcast if v.is_split and v.head_tail else v for v in dst.nd_sbp))
    routes.append(head + list(plan_boxing(start, spread).steps) + [Step("slice", spread, dst, (), ())])
    return min(routes, key=lambda steps: Plan(src, dst, tuple(steps)).cost)


def _same_chunks(src: Layout, dst: Layout) -> bool:
    """Both split the same dims head-tail on the same axes, in even chunks."""
    axes = head_tail_axes(src.nd_sbp)
    if axes != head_tail_axes(dst.nd_sbp):
        return False
    hierarchy = src.placement.hierarchy
    return all(src.nd_sbp[a] == dst.nd_sbp[a] and (src.shape[d] // src.nd_sbp[a].blocks) % (2 * hierarchy[a]) == 0
               for d, a in axes.items())


def _beside(src: Layout, dst: Layout, plan_boxing):
    """The boxing of the other axes, planned in plain order and run on the head-tail pieces (their
    shapes agree; the steps keep the plain-order layouts they were planned on); None when that plan
    would move data along a head-tail axis."""
    axes = set(head_tail_axes(src.nd_sbp).values())
    plan = plan_boxing(plain_order(src), plain_order(dst))
    if any(set(s.axes) & axes or not s.axes and s.op != "refactor" for s in plan.steps):
        return None
    return list(plan.steps)


def reorder(src: Layout, dst: Layout) -> Step:
    """One ``send_recv`` from ``src`` to ``dst`` (same placement, one of them head-tail, the other its
    plain order): along each head-tail axis' groups, every box a rank holds in ``src`` goes to the
    rank holding it in ``dst``. ``regions`` names each transfer's box of the tensor."""
    axes = tuple(sorted(set(head_tail_axes(src.nd_sbp).values()) | set(head_tail_axes(dst.nd_sbp).values())))
    transfers, regions, sent = [], [], {}
    for group in axis_groups(src.placement, axes):
        for t in group:
            for s in group:
                for sbox, _ in src.cells(s):
                    for tbox, _ in dst.cells(t):
                        inter = intersect(sbox, tbox)
                        if inter is None:
                            continue
                        transfers.append(Transfer(s, t, tuple(l for _, l in inter)))
                        regions.append(inter)
                        if s != t:
                            sent[s] = sent.get(s, 0) + numel(transfers[-1].shape) * src.itemsize
    parties = tuple(src.placement.rank_list())
    return Step("send_recv", src, dst, axes, (parties,), tuple(sorted(sent.items())), tuple(transfers),
                regions=tuple(regions))
