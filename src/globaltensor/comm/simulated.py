"""SimulatedWorld: n ranks in this process; a collective is a few local tensor ops."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from .errors import CollectiveError, calling_hint
from .world import Started, World, tile_places

_comm_thread = None
_comm_thread_lock = threading.Lock()


def _thread() -> ThreadPoolExecutor:
    """The communication thread the simulated ranks' started collectives run on (made on first use)."""
    global _comm_thread
    with _comm_thread_lock:
        if _comm_thread is None:
            _comm_thread = ThreadPoolExecutor(1, thread_name_prefix="globaltensor-comm")
        return _comm_thread


class SimulatedWorld(World):
    simulated = True

    def __init__(self, size: int, cuda_device: int = 0):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"simulate(n): expected a positive number of ranks, got {size!r}")
        self.size = size
        self.local_ranks = tuple(range(size))
        self._local_set = frozenset(self.local_ranks)
        self._cuda_device = cuda_device

    def device(self, device_type: str, rank: int) -> torch.device:
        return torch.device("cpu") if device_type == "cpu" else torch.device("cuda", self._cuda_device)

    def _all_gather(self, group, pieces, dim, sizes):
        _all_arrived("all_gather", group, pieces)
        full = torch.cat([pieces[r] for r in group], dim=dim)
        return {r: full if i == 0 else full.clone() for i, r in enumerate(group)}

    def _reduce_scatter(self, group, pieces, dim, sizes):
        _all_arrived("reduce_scatter", group, pieces)
        total = _sum([pieces[r] for r in group])
        parts = torch.split(total, list(sizes), dim=dim)
        return {r: parts[i].contiguous() for i, r in enumerate(group)}

    def _all_reduce(self, group, pieces):
        _all_arrived("all_reduce", group, pieces)
        total = _sum([pieces[r] for r in group])
        return {r: total if i == 0 else total.clone() for i, r in enumerate(group)}

    def _all_reduce_in_place(self, group, pieces):
        """The sum written into every member's piece, as a process world's backend does: what was
        made from those pieces sees the sums alike on simulated ranks and in processes."""
        _all_arrived("all_reduce", group, pieces)
        total = _sum([pieces[r] for r in group])
        for r in group:
            pieces[r].copy_(total)
        return {r: pieces[r] for r in group}

    def _all_reduce_async(self, group, pieces):
        return Started(_thread().submit(self._all_reduce_in_place, group, pieces).result)

    def _reduce_scatter_async(self, group, pieces, sizes):
        return Started(_thread().submit(self._reduce_scatter, group, pieces, 0, sizes).result)

    def _all_to_all(self, group, chunks, shapes, dtype, tiles):
        _all_arrived("all_to_all", group, chunks)
        out = {}
        for i, r in enumerate(group):
            out[r], places = tile_places(tiles[r], dtype, chunks[r][i].device)
            for j, s in enumerate(group):
                if places[j] is not None and chunks[s][i].numel():
                    places[j].copy_(chunks[s][i])
        return out

    def _broadcast(self, group, src, pieces, shape, dtype, device_type):
        _all_arrived("broadcast", (src,), pieces)
        t = pieces[src]
        return {r: t.to(self.device(device_type, r), copy=True) for r in group}

    def _send_recv(self, transfers, payload, dtype, device_type):
        return {i: payload[i].to(self.device(device_type, t.dst)) for i, t in enumerate(transfers)}


def _all_arrived(op: str, group, pieces) -> None:
    """Every member brought its piece: one process drives every simulated rank, so a missing piece is
    a collective that only some ranks called -- which, in a process world, would hang."""
    if not all(r in pieces for r in group):
        missing = [r for r in group if r not in pieces]
        raise CollectiveError(f"globaltensor: collective {op} over ranks {list(group)}: ranks {missing} did not "
                              f"arrive: no piece was given for them (a tensor made before gt.simulate changed the "
                              f"world?){calling_hint()}")


def _sum(ts):
    out = ts[0].clone()
    for t in ts[1:]:
        out.add_(t)
    return out
