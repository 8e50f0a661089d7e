"""ProcessWorld: one rank per process over torch.distributed (gloo on cpu, NCCL on cuda).

Initialised from MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK / LOCAL_RANK on first use,
or taken over from an already-initialised default group. Sub-groups are created on every
rank, members or not, in the same order (see :meth:`ProcessWorld.prepare_groups`), and
cached. A failing or timed-out collective raises :class:`CollectiveError` naming the rank, the
op, the group and the ranks that did not arrive (arrivals.py), and the collective method a user
called, if any (errors.py). The timeout is ``gt.set_timeout`` (timeouts.py).
"""
from __future__ import annotations

import atexit
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ..sbp.shape import numel
from .arrivals import ArrivalBoard, describe_missing
from .buffers import own_block_out, pack, scratch
from . import functional
from .errors import CollectiveError, calling_hint
from .timeouts import collective_timeout
from .world import Started, World, done, tile_places


# torch 2.13 deprecates all_gather_into_tensor (a warning on every run) for all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def exit_barrier_timeout() -> timedelta:
    """``GT_EXIT_BARRIER_TIMEOUT`` seconds (default 10): how long a rank at exit waits for the others."""
    return timedelta(seconds=float(os.environ.get("GT_EXIT_BARRIER_TIMEOUT", "10")))


def _exit_barrier(size: int) -> None:
    """Wait, for a bounded time, until every rank has reached its exit (through the store).

    Bounded because a rank leaving through ``sys.exit(1)`` looks like a clean exit here (no
    hook sees a SystemExit's code) while its peers may be blocked in a collective waiting for
    it: an unbounded barrier would hold the failure back for a whole collective timeout, and
    the launcher would learn of it only then. (gloo's ``monitored_barrier`` bounds only rank
    0's wait, so it does not help here.)
    """
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        dist.barrier()
        return
    store = get_store()
    if store.add("globaltensor/exit/arrived", 1) == size:
        store.set("globaltensor/exit/all", "1")
    store.wait(["globaltensor/exit/all"], exit_barrier_timeout())


def _note_uncaught_errors(world) -> None:
    """Mark ``world`` failed when the program dies of an exception: then its exit skips the final
    barrier, so the launcher sees the failure at once instead of after a barrier timeout; and
    tell the peers, which may be waiting for this rank in a collective."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        world._failed = True
        world.report_failure(f"{kind.__name__}: {value}")
        previous(kind, value, tb)
    sys.excepthook = hook


def _arrival_board(rank: int):
    """The board publishing this rank's arrivals in the default group's store (None without one: then
    a failed collective names its op and group, but not who did not arrive)."""
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return ArrivalBoard(get_store(), rank) if get_store is not None else None
    except Exception:
        return None


_CPU = torch.device("cpu")


class ProcessWorld(World):
    simulated = False

    def __init__(self):
        created = not dist.is_initialized()
        if created:
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if v not in os.environ]
            if missing:
                raise RuntimeError(f"process world: environment variables {missing} are not set")
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=collective_timeout())
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.local_ranks = (self.rank,)
        self._local_set = frozenset(self.local_ranks)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._cuda = None
        self._groups = {}
        self._failed = False
        self._board = _arrival_board(self.rank)
        _note_uncaught_errors(self)
        atexit.register(self._shutdown, created)

    def device(self, device_type: str, rank: int) -> torch.device:
        if device_type == "cpu":
            return _CPU
        if self._cuda is None:
            self._cuda = self._own_gpu()
        return self._cuda

    def _own_gpu(self) -> torch.device:
        """``cuda:<local rank>``: one GPU per local rank, as torchrun lays processes out; checked once,
        before the first CUDA tensor, so a node with more processes than GPUs fails with a clear
        error on the ranks that have none, not with torch's "invalid device ordinal" mid-collective."""
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if self.local_rank >= visible:
            ways = (f"launch at most {visible} process(es) per node (--nproc-per-node {visible}), make every GPU "
                    f"visible to every process, or use a cpu placement" if visible else
                    "use a cpu placement, or run on nodes with GPUs")
            raise RuntimeError(
                f"globaltensor: rank {self.rank} (local rank {self.local_rank}) needs its own GPU for a cuda "
                f"placement, but this node shows {visible} GPU(s) (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); {ways}")
        return torch.device("cuda", self.local_rank)

    def _shutdown(self, destroy: bool) -> None:
        """At exit: drop the cached groups and destroy the process groups this world created.

        A gloo worker thread frees each finished collective's tensors after the caller has
        moved on; if that happens during interpreter shutdown, the process aborts ("terminate
        called without an active exception", SIGABRT -- seen under torchrun). Destroying the
        groups first joins those threads, and it can only do so when no reference held here
        keeps a group alive.
        """
        self._groups.clear()
        if self._board is not None:
            self._board.stop()
        if destroy and dist.is_initialized():
            try:
                if not self._failed:
                    _exit_barrier(self.size)  # a peer may still be receiving what this rank sent last
            except Exception:
                pass
            try:
                dist.destroy_process_group()
            except Exception:
                pass

    def report_failure(self, text: str) -> None:
        if self._board is not None:
            self._board.report_failure(text)

    def gather_check(self, values: list) -> list:
        """Every rank's vector of the consistency check (consistency.py), in rank order: a small
        all-gather over the whole world, outside gt.comm_stats() and the traced mode."""
        mine = torch.tensor(values, dtype=torch.int64)
        out = mine.new_empty(self.size * len(values))
        self._run("consistency check", tuple(range(self.size)),
                  lambda: _all_gather_single(out, mine, group=dist.group.WORLD))
        return torch._C.TensorBase.tolist(out.view(self.size, -1))   # not Tensor.tolist: the traced mode guards that

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        out = [None] * self.size
        self._run("consistency check (details)", tuple(range(self.size)),
                  lambda: dist.all_gather_object(out, obj, group=dist.group.WORLD))
        return out

    def retime(self, seconds: float) -> None:
        """Give this rank's process groups the collective timeout of ``seconds``."""
        groups = {id(g): g for g in self._groups.values() if g is not dist.GroupMember.NON_GROUP_MEMBER}
        groups[id(dist.group.WORLD)] = dist.group.WORLD
        for g in groups.values():
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), g)

    # -- groups ---------------------------------------------------------------------------
    def prepare_groups(self, groups) -> None:
        """Create the process groups of ``groups`` not made yet -- on every rank, members or not.

        torch names a new group after how many groups its process already has, so every
        process must create the same groups in the same order: callers reach this from code
        every rank runs (each boxing step, in plan order), not from inside a collective.
        """
        for group in groups:
            key = tuple(sorted(group))
            if key not in self._groups and len(key) > 1:
                self._groups[key] = dist.group.WORLD if key == tuple(range(self.size)) else \
                    dist.new_group(list(key), timeout=collective_timeout())

    def _pg(self, group: tuple):
        """The process group of ``group`` and, for each member in ``group`` order, its group rank."""
        key = tuple(sorted(group))
        pg = self._groups.get(key)
        if pg is None:
            if key != tuple(range(self.size)):
                raise RuntimeError(f"globaltensor: rank {self.rank}: no process group for ranks {list(key)}; "
                                   f"World.prepare_groups must run on every rank first")
            pg = self._groups[key] = dist.group.WORLD
        return pg, [key.index(r) for r in group]

    def _run(self, op: str, group: tuple, fn):
        key = tuple(sorted(group))
        board = self._board
        seq = board.enter(op, key) if board is not None else 0
        try:
            out = fn()
        except Exception as e:
            if board is not None:
                board.leave(key)
            raise CollectiveError(f"globaltensor: rank {self.rank}: collective {op} over ranks {list(group)} failed: "
                                  f"{describe_missing(board, key, seq, op)}{calling_hint()}; "
                                  f"{type(e).__name__}: {e}") from e
        if board is not None:
            board.leave(key)
        return out

    # -- collectives ----------------------------------------------------------------------
    def _all_gather(self, group, pieces, dim, sizes):
        me = self.rank
        x = pieces[me]
        pg, order = self._pg(group)
        if functional.traced(x):
            return {me: functional.all_gather(x, pg, order, dim, sizes)}
        width = max(sizes)
        if x.shape[dim] < width:
            pad = list(x.shape)
            pad[dim] = width - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad)], dim=dim)
        x = x.contiguous()
        even = all(s == width for s in sizes)
        if dim == 0 and even and order == sorted(order):
            out = x.new_empty((width * len(group),) + tuple(x.shape[1:]))
            self._run("all_gather", group, lambda: _all_gather_single(out, x, group=pg))
            return {me: out}
        bufs = [torch.empty_like(x) for _ in group]
        self._run("all_gather", group, lambda: dist.all_gather(bufs, x, group=pg))
        parts = [bufs[order[i]].narrow(dim, 0, sizes[i]) for i in range(len(group))]
        return {me: torch.cat(parts, dim=dim)}

    def _reduce_scatter(self, group, pieces, dim, sizes):
        me = self.rank
        x = pieces[me]
        pg, order = self._pg(group)
        i_me = group.index(me)
        if functional.traced(x):
            return {me: functional.reduce_scatter(x, pg, order, i_me, dim, sizes)}
        if x.is_cuda:
            parts = list(torch.split(x, list(sizes), dim=dim))
            inputs = [None] * len(group)
            for i, p in enumerate(parts):
                inputs[order[i]] = p.contiguous()
            out = torch.empty_like(inputs[order[i_me]])
            self._run("reduce_scatter", group, lambda: dist.reduce_scatter(out, inputs, group=pg))
            return {me: out}
        # gloo: an all-to-all of the parts and a local sum beats its reduce-scatter. The parts
        # received are summed straight into the result, so they go to a scratch buffer. A rank
        # first or last in the group's rank order (either of 2) leaves its own part out of the
        # exchange and adds it from x, which saves gloo's copy of that part to itself (and the
        # others' parts of a dim-0 split still lie back to back in x); x contiguous, so the sum
        # comes out contiguous all the same.
        parts = list(torch.split(x, list(sizes), dim=dim))
        shape = list(x.shape)
        shape[dim] = sizes[i_me]
        own_here = len(group) > 1 and x.is_contiguous() and order[i_me] in (0, len(group) - 1)
        received = [tuple(shape)] * len(group)
        if own_here:
            parts[i_me] = x.new_empty(0)
            received[i_me] = (0,)
        recv = scratch.take(numel(shape) * (len(group) - int(own_here)), x.dtype, x.device)
        got = self._exchange(group, parts, received, x.dtype, recv)
        if own_here:
            got[i_me] = x.narrow(dim, sum(sizes[:i_me]), sizes[i_me])
        out = torch.add(got[0], got[1]) if len(got) > 1 else got[0].clone()  # one pass, no clone
        for t in got[2:]:
            out.add_(t)
        scratch.give(recv)
        return {me: out}

    def _all_reduce(self, group, pieces):
        me = self.rank
        return self._all_reduce_in_place(group, {me: pieces[me].clone(memory_format=torch.contiguous_format)})

    def _all_reduce_in_place(self, group, pieces):
        me = self.rank
        pg, _ = self._pg(group)
        t = pieces[me].contiguous()
        if functional.traced(t):
            return {me: t.copy_(functional.all_reduce(t, pg))}
        self._run("all_reduce", group, lambda: dist.all_reduce(t, group=pg))
        return {me: t}

    def _all_reduce_async(self, group, pieces):
        me = self.rank
        pg, _ = self._pg(group)
        t = pieces[me].contiguous()
        if functional.traced(t):        # a functional collective's result is waited for where it is read
            return done({me: functional.all_reduce(t, pg)})
        work = self._run("all_reduce", group, lambda: dist.all_reduce(t, group=pg, async_op=True))

        def finish():
            self._run("all_reduce", group, work.wait)
            return {me: t}
        return Started(finish)

    def _reduce_scatter_async(self, group, pieces, sizes):
        """A flat reduce-scatter, started. gloo: an all-to-all of the parts, summed when waited for
        (as ``_reduce_scatter``); NCCL: its reduce-scatter."""
        me = self.rank
        x = pieces[me].contiguous()
        pg, order = self._pg(group)
        i_me = group.index(me)
        if functional.traced(x):
            return done({me: functional.reduce_scatter(x, pg, order, i_me, 0, sizes)})
        parts = list(torch.split(x, list(sizes)))
        if x.is_cuda:
            inputs = [None] * len(group)
            for i, part in enumerate(parts):
                inputs[order[i]] = part
            out = torch.empty_like(parts[i_me])
            work = self._run("reduce_scatter", group,
                             lambda: dist.reduce_scatter(out, inputs, group=pg, async_op=True))

            def finish_nccl():
                self._run("reduce_scatter", group, work.wait)
                return {me: out}
            return Started(finish_nccl)
        by_group_rank = sorted(range(len(group)), key=order.__getitem__)
        send_sizes = [sizes[j] for j in by_group_rank]
        send = x if by_group_rank == list(range(len(group))) else torch.cat([parts[j] for j in by_group_rank])
        recv = torch.empty(sizes[i_me] * len(group), dtype=x.dtype, device=x.device)
        work = self._run("reduce_scatter", group, lambda: dist.all_to_all_single(
            recv, send, [sizes[i_me]] * len(group), send_sizes, group=pg, async_op=True))

        def finish():
            self._run("reduce_scatter", group, work.wait)
            return {me: recv.view(len(group), sizes[i_me]).sum(0)}
        return Started(finish)

    def _all_to_all(self, group, chunks, shapes, dtype, tiles):
        """One ``all_to_all_single``, with the fewest copies around it:

        - the blocks sent go as they lie when they are back to back in one storage (the row blocks
          of a dim-0 piece), else each is copied once into a scratch send buffer;
        - the blocks received land where they belong when their places in the result lie back to
          back (row blocks again), else in a scratch buffer, each then copied once to its place;
        - this rank's own block stays out of the exchange (one copy, straight from the piece to its
          place, instead of gloo's copy to itself) unless that costs more copies: leaving a middle
          block out breaks a run of blocks to send or of places to receive into. That copy runs
          while the exchange is in flight (the collective started asynchronously, then waited for).
        """
        me = self.rank
        i_me = group.index(me)
        mine = chunks[me]
        device = mine[i_me].device
        out, dest = tile_places(tiles[me], dtype, device)
        received = [shapes[j][i_me] for j in range(len(group))]
        if functional.traced(mine[i_me]):
            pg, order = self._pg(group)
            for place, part in zip(dest, functional.exchange(mine, received, pg, order)):
                if place is not None and part.numel():
                    place.copy_(part)
            return {me: out}
        _, order = self._pg(group)
        ranked = sorted(range(len(group)), key=order.__getitem__)
        own_out, direct = own_block_out([mine[j] for j in ranked], [dest[j] for j in ranked],
                                         [numel(received[j]) for j in ranked], ranked.index(i_me))
        send = list(mine)
        if own_out:
            send[i_me], received[i_me] = mine[i_me].new_empty(0), (0,)
        recv = direct if direct is not None else scratch.take(sum(numel(r) for r in received), dtype, device)
        own = (lambda: dest[i_me].copy_(mine[i_me])) if own_out and mine[i_me].numel() else None
        got = self._exchange(group, send, received, dtype, recv, meanwhile=own)
        if direct is None:
            for place, part in zip(dest, got):
                if place is not None and part.numel():
                    place.copy_(part)
            scratch.give(recv)
        return {me: out}

    def _exchange(self, group, mine, received, dtype, recv, meanwhile=None) -> list:
        """Send ``mine[j]`` to member j and receive, into the flat ``recv``, a tensor of
        ``received[j]`` from each member j; returns those, as views of ``recv``, in group order.

        One flat buffer each way, in group-rank order: gloo's list all_to_all needs every
        tensor to have the same shape, its all_to_all_single takes uneven split sizes. Chunks
        that need packing are packed into a scratch send buffer (see buffers.pack). ``meanwhile``
        (local work that touches no buffer of the exchange) runs while the exchange is in flight.
        """
        pg, order = self._pg(group)
        by_group_rank = sorted(range(len(group)), key=order.__getitem__)
        send_sizes = [mine[j].numel() for j in by_group_rank]
        send, packed = pack([mine[j] for j in by_group_rank], sum(send_sizes), dtype, recv.device)
        recv_sizes = [numel(received[j]) for j in by_group_rank]
        flat = recv[:sum(recv_sizes)]

        def exchange():
            work = dist.all_to_all_single(flat, send, recv_sizes, send_sizes, group=pg,
                                          async_op=meanwhile is not None)
            if meanwhile is not None:
                meanwhile()
                work.wait()
        self._run("all_to_all", group, exchange)
        if packed is not None:
            scratch.give(packed)
        parts = dict(zip(by_group_rank, torch.split(flat, recv_sizes)))
        return [parts[j].view(received[j]) for j in range(len(group))]

    def _broadcast(self, group, src, pieces, shape, dtype, device_type):
        me = self.rank
        pg, order = self._pg(group)
        if me == src:
            t = pieces[me].clone(memory_format=torch.contiguous_format)
        else:
            t = torch.empty(shape, dtype=dtype, device=self.device(device_type, me))
        if functional.traced(t):
            return {me: functional.broadcast(t, order[group.index(src)], pg) if len(group) > 1 else t}
        if len(group) > 1:
            self._run("broadcast", group, lambda: dist.broadcast(t, src, group=pg))
        return {me: t}

    def _send_recv(self, transfers, payload, dtype, device_type):
        me = self.rank
        device = self.device(device_type, me)
        peers = tuple(sorted({t.src for t in transfers} | {t.dst for t in transfers}))
        if me in peers and functional.tracing(payload.values()):
            return functional.send_recv(transfers, payload, dtype, device, me, peers, *self._pg(peers))
        ops, out = [], {}
        for i, t in enumerate(transfers):
            if t.src == me and t.dst == me:
                out[i] = payload[i].to(device)
            elif t.src == me and payload[i].numel():
                ops.append(dist.P2POp(dist.isend, payload[i].contiguous(), t.dst, tag=i))
            elif t.dst == me:
                out[i] = torch.empty(t.shape, dtype=dtype, device=device)
                if out[i].numel():
                    ops.append(dist.P2POp(dist.irecv, out[i], t.src, tag=i))
        if me in peers:    # every peer counts the exchange, those with nothing to send or receive too
            self._run("send_recv", peers, lambda: [w.wait() for w in dist.batch_isend_irecv(ops)] if ops else None)
        return out
