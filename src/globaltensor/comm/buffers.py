"""Flat buffers for the process world's collectives: packing the chunks an all-to-all sends with at
most one copy each, sending or receiving straight from a run of views lying back to back, the
choice of keeping a rank's own block out of the exchange, and scratch buffers kept between calls."""
from __future__ import annotations

import torch


def own_block_out(blocks: list, places: list, sizes: list, at: int) -> tuple:
    """Whether this rank's own block (``blocks[at]``, to ``places[at]``; all in group-rank order,
    ``sizes`` the numels received) should stay out of the exchange, and the run of places the
    exchange can then receive straight into (None: through a scratch buffer).

    Counted in elements copied besides the exchange -- packing what is sent, unpacking what is
    received; the own block is copied once either way, by gloo to itself or by this rank to its
    place -- leaving a middle block out can cost more: it breaks a run."""
    sent, total = sum(b.numel() for b in blocks), sum(sizes)
    cost, runs = {}, {}
    for out in (False, True):
        keep = [k for k in range(len(blocks)) if not (out and k == at)]
        send = flat_run([blocks[k] for k in keep])
        runs[out] = flat_run([places[k] for k in keep], [sizes[k] for k in keep])
        own = sizes[at] if out else 0
        cost[out] = (0 if send is not None else sent - own) + (0 if runs[out] is not None else total - own)
    out = len(blocks) > 1 and cost[True] <= cost[False]
    return out, runs[out]


def flat_run(tensors, sizes=None):
    """The non-empty ``tensors`` (``sizes``: their numels) as one flat view, when they are
    contiguous views of one base lying back to back, in order; else None."""
    sizes = [t.numel() for t in tensors] if sizes is None else sizes
    first = base = None
    ptr = total = 0
    for t, n in zip(tensors, sizes):
        if not n:
            continue
        if first is None:
            first, base, ptr = t, t._base, t.data_ptr()
        elif base is None or t._base is not base or t.data_ptr() != ptr:
            return None
        if not t.is_contiguous():
            return None
        ptr += n * t.element_size()
        total += n
    if first is None:
        return None
    return first.as_strided((total,), (1,), first.storage_offset())


def pack(chunks, total: int, dtype, device) -> tuple:
    """The chunks as one flat send buffer, in order, with at most one copy of each; and the
    scratch buffer it lies in, to give back once sent (None when there is none).

    Chunks that are consecutive contiguous views of one storage (the parts of a dim-0 split)
    are sent as they lie, without a copy; others (column blocks) are copied once straight
    into a scratch buffer (``reshape(-1)`` then ``cat`` would copy them twice).
    """
    flat = flat_run(chunks)
    if flat is not None:
        return flat, None
    buf = scratch.take(total, dtype, device)
    send = buf[:total]
    offset = 0
    for c in chunks:
        n = c.numel()
        if n:
            send[offset:offset + n].view(c.shape).copy_(c)
        offset += n
    return send, buf


class Scratch:
    """Flat buffers kept for a collective's temporaries on cpu: the send buffer chunks are packed
    into, the receive buffer of parts summed into the result. Each is done with when its
    collective returns; allocated afresh, a multi-megabyte buffer freed at once makes glibc hand
    its pages back and fault them in again on the next call (measured: a 2 MB all-to-all paid
    ~160 page faults and ~40% of its time for it). cuda tensors come from torch's caching
    allocator, which already reuses memory. Thread-safe: ``list.pop`` and ``append`` are atomic,
    so two threads never hold one buffer (a compiled graph's streams run collectives on theirs).
    At most ``KEEP`` buffers of up to ``MAX_BYTES`` each are kept per dtype.
    """
    KEEP = 2
    MAX_BYTES = 64 << 20

    def __init__(self):
        self._free = {}

    def take(self, n: int, dtype, device) -> torch.Tensor:
        """A flat buffer of at least ``n`` elements (its first ``n`` are the ones to use)."""
        if device.type != "cpu":
            return torch.empty(n, dtype=dtype, device=device)
        try:
            buf = self._free.get(dtype, []).pop()
        except IndexError:
            buf = None
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """``buf`` (from ``take``) is free again."""
        if buf.device.type == "cpu" and buf.numel() * buf.element_size() <= self.MAX_BYTES:
            free = self._free.setdefault(buf.dtype, [])
            if len(free) < self.KEEP:
                free.append(buf)


scratch = Scratch()
