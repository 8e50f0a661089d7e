"""The expert-parallel forward of a stacked experts module: tokens move to their experts' ranks.

On each group of ranks along the expert axis (the experts' weights split on their expert dim
over it, each rank holding a balanced run of experts), with the tokens split over it too:

1. each rank sorts its (token, slot) pairs by expert and counts them per expert;
2. the counts are exchanged (every rank learns how many rows it gets from whom);
3. an all-to-all sends each row to the rank holding its expert, in the sizes the routing gave;
4. each rank runs its experts on the rows they got, one expert after another;
5. the reverse all-to-all brings the results home;
6. each rank weights them by the routing weights and sums a token's slots, as the module does.

Everything between the global tensors in and out is plain torch on pieces with autograd, and the
two all-to-alls are differentiable (token_exchange.py): the backward moves the rows' gradients
along the same routes. No expert weight moves; the weights' gradients stay on their ranks.
"""
from __future__ import annotations

import math
from typing import Dict, List

import torch

from ...boxing.layout import axis_groups
from ...comm import get_world
from ...comm.world import observed
from ..local_map import assemble, pieces_of
from ...sbp import broadcast, partial_sum, split
from ...sbp.shape import balanced_sizes
from ...tensor import GlobalTensor
from .experts import with_bystanders
from .padded import padded_forward
from .token_exchange import exchange_counts, exchange_rows, transposed


def expert_parallel_forward(module, kind, placement, axis: int, tensor_axes: tuple, name: str,
                            capacity_factor, hidden_states, top_k_index, top_k_weights):
    """The module's forward with its tokens sent to the ranks of their experts (see the module doc);
    with ``capacity_factor``, in the padded sizes of padded.py. Over ``tensor_axes`` every expert is
    split Megatron's way: the tokens are broadcast there and the result is partial, summed later."""
    if not all(isinstance(t, GlobalTensor) for t in (hidden_states, top_k_index, top_k_weights)):
        raise TypeError(f"expert_parallel: {name} got plain tensors; its inputs must be global tensors on the "
                        f"placement its weights live on (give the model global inputs)")
    if capacity_factor is None and observed():
        raise RuntimeError(f"expert_parallel: {name}: its all-to-all's sizes follow the routing, which a captured "
                           f"graph cannot; give gt.nn.expert_parallel(..., capacity_factor=) to pad them to a size "
                           f"fixed at capture")
    nd = tuple(split(0) if a == axis else (broadcast if v.is_partial or a in tensor_axes else v)
               for a, v in enumerate(hidden_states.sbp))
    x, idx, w = (t.to_global(placement=placement, sbp=nd) for t in (hidden_states, top_k_index, top_k_weights))
    if tensor_axes and w.dtype != x.dtype:
        # each tensor rank's share of a routing weight's gradient is summed in the tokens' precision and
        # only then rounded to the weights' (HF routers give float32 weights), as on one device
        w = w.to(x.dtype).to_global(sbp=nd, grad_sbp=nd)
    world = get_world()
    ranks = tuple(r for r in placement.rank_list() if world.holds(r))
    xs, idxs, ws = (dict(zip(ranks, pieces_of(t, ranks))) for t in (x, idx, w))
    weights = kind.local_weights(module, placement, axis, ranks)
    k = idx.shape[1]
    out = {}
    for group in axis_groups(placement, (axis,)):
        held = [r for r in group if world.holds(r)]
        if not held:
            continue
        rows = {m: x._layout.piece_shape(m)[0] * k for m in group}
        if capacity_factor is None:
            out.update(_group_forward(module, kind, group, held, xs, idxs, ws, weights, k, rows))
        else:
            capacity = max(math.ceil(capacity_factor * n / kind.num_experts) for n in rows.values())
            out.update(padded_forward(module, kind, name, group, held, (xs, idxs, ws), weights, capacity))
    layout = x._layout.with_sbp(tuple(partial_sum if a in tensor_axes else v for a, v in enumerate(nd)))
    return with_bystanders(assemble(layout, ranks, [out[r] for r in ranks]),
                           kind.unheld(module, placement, axis, ranks))


def routed_forward(module, kind, placement, axis: int, tensor_axes: tuple, name: str, capacity_factor, x, scores,
                   expert_ids, tokens_per_expert=None):
    """torchtitan's ``RoutedExperts`` interface (experts.py) through :func:`expert_parallel_forward`: the
    ``[batch, seq, ...]`` tokens and routing flattened to rows; the tokens per expert, which its
    dispatcher reads, are counted again from the routing where the rows land."""
    b, l, d = x.shape
    k = expert_ids.shape[-1]
    out = expert_parallel_forward(module, kind, placement, axis, tensor_axes, name, capacity_factor,
                                  x.reshape(b * l, d), expert_ids.reshape(b * l, k), scores.reshape(b * l, k))
    return out.reshape(b, l, d)


def _group_forward(module, kind, group: tuple, held: List[int], xs, idxs, ws, weights, k: int,
                   rows: Dict[int, int]) -> Dict:
    n_experts = kind.num_experts
    own = balanced_sizes(n_experts, len(group))                 # experts per member
    first = [sum(own[:j]) for j in range(len(group))]
    order, sends, counts = {}, {}, {}
    for r in held:
        flat = idxs[r].reshape(-1)
        order[r] = torch.argsort(flat, stable=True)
        sends[r] = xs[r][order[r] // k]
        counts[r] = torch.zeros(n_experts, dtype=torch.int64, device="meta") if flat.is_meta else \
            torch.bincount(flat, minlength=n_experts)
    # member -> its rows per expert; on meta pieces (a plan's costing) the routing is modelled as even
    modelled = {m: balanced_sizes(rows[m], n_experts) for m in group} if xs[held[0]].is_meta else None
    per_expert = exchange_counts(group, counts, modelled)
    sizes = [[sum(per_expert[src][first[j]:first[j] + own[j]]) for j in range(len(group))] for src in group]
    received = exchange_rows(group, sizes, sends)
    results = {}
    for r in held:
        j = group.index(r)
        results[r] = _run_local_experts(module, kind, received[r], weights[r], [
            per_expert[src][first[j]:first[j] + own[j]] for src in group])
    back = exchange_rows(group, transposed(sizes), results)
    out = {}
    for r in held:
        slots = back[r][torch.argsort(order[r])]
        out[r] = kind.combine(slots, ws[r], xs[r].dtype)
    return out


def _run_local_experts(module, kind, rows: torch.Tensor, mine, counts: List[List[int]]) -> torch.Tensor:
    """``rows`` come grouped by sender, then by expert (``counts[sender][e]`` each): run every local
    expert once on all of its rows, and give the results back in the rows' order."""
    n_local = len(counts[0]) if counts else 0
    expert_of = torch.tensor([e for per_sender in counts for e, c in enumerate(per_sender) for _ in range(c)],
                             dtype=torch.int64, device=rows.device)
    perm = torch.argsort(expert_of, stable=True)
    by_expert = rows[perm].split([sum(per_sender[e] for per_sender in counts) for e in range(n_local)])
    outs = [kind.run(module, mine, e, part) for e, part in enumerate(by_expert)]
    return torch.cat(outs)[torch.argsort(perm)]
