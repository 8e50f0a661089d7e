"""Expert dispatch in sizes fixed ahead of the routing: each rank sends each expert ``capacity`` rows.

GShard's and Switch's form, for a captured graph (``gt.compile``), whose collectives have their
sizes fixed at capture: a rank lays the rows it routes to expert e in slot ``e`` of an
``[experts, capacity, hidden]`` buffer, in their order, the rest of the slot zeros; one all-to-all
of fixed sizes sends each rank its experts' slots from every rank; the experts run on whole slots
(padding included); the reverse all-to-all brings the slots home, where each (token, expert) pair
reads its row back. ``capacity`` is ``ceil(capacity_factor x rows / experts)``, rows being a rank's
tokens times top-k (the largest over the ranks). A rank routing more rows than that to one expert
is an error -- the step raises, naming the expert and the capacity; no token is dropped unseen.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ...comm.world import observed
from ...sbp.shape import balanced_sizes
from .token_exchange import exchange_rows, transposed


def padded_forward(module, kind, name: str, group: tuple, held: List[int], tokens: tuple, weights: Dict[int, object],
                   capacity: int) -> Dict[int, torch.Tensor]:
    xs, idxs, ws = tokens
    n_experts, members = kind.num_experts, len(group)
    own = balanced_sizes(n_experts, members)                                # experts per member
    sends, places = {}, {}
    for r in held:
        flat = idxs[r].reshape(-1)
        chosen = torch.zeros(flat.shape[0], n_experts, dtype=torch.int64, device=flat.device)
        chosen.scatter_(1, flat[:, None], 1)
        counts = chosen.sum(0)
        _check_capacity(name, r, counts, capacity)
        slot = chosen.cumsum(0).gather(1, flat[:, None]).squeeze(1) - 1      # each row's place in its expert
        rows = xs[r].repeat_interleave(idxs[r].shape[1], dim=0)
        buffer = rows.new_zeros(n_experts, capacity, rows.shape[-1]).index_put((flat, slot), rows)
        sends[r], places[r] = buffer.reshape(n_experts * capacity, -1), (flat, slot)
    sizes = [[own[j] * capacity for j in range(members)] for _ in range(members)]
    received = exchange_rows(group, sizes, sends)
    results = {}
    for r in held:
        n_local = own[group.index(r)]
        slots = received[r].view(members, n_local, capacity, -1)
        outs = [kind.run(module, weights[r], e, slots[:, e].reshape(members * capacity, -1)) for e in range(n_local)]
        results[r] = torch.stack([o.view(members, capacity, -1) for o in outs], dim=1).reshape(
            members * n_local * capacity, -1) if outs else received[r]
    back = exchange_rows(group, transposed(sizes), results)
    out = {}
    for r in held:
        flat, slot = places[r]
        mine = back[r].view(n_experts, capacity, -1)[flat, slot]
        out[r] = kind.combine(mine, ws[r], xs[r].dtype)
    return out


def _check_capacity(name: str, rank: int, counts: torch.Tensor, capacity: int) -> None:
    """Eagerly: the counts are read and an overflow named with them. Captured: one assertion per
    expert in the graph, run on every step (the counts are data, unknown at capture)."""
    if not observed():
        over = [(e, c) for e, c in enumerate(counts.tolist()) if c > capacity]
        if over:
            e, c = over[0]
            raise RuntimeError(f"expert_parallel: {name}: rank {rank} routes {c} rows to expert {e}, over its capacity "
                               f"of {capacity} (every expert's rows: {counts.tolist()}); raise capacity_factor")
        return
    for e in range(counts.shape[0]):
        torch._assert_async(counts[e] <= capacity,
                            f"expert_parallel: {name}: rank {rank} routes more rows to expert {e} than its capacity "
                            f"of {capacity}; raise capacity_factor")
