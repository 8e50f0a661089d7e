"""Plans: the steps of a boxing, with the bytes each rank sends in each, known before running."""
from __future__ import annotations

from dataclasses import dataclass, field

from .layout import Layout

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send_recv")


@dataclass(frozen=True)
class Step:
    """One boxing step from layout ``src`` to layout ``dst``.

    ``op`` is a collective (see COLLECTIVES) or a local op: ``slice`` (B->S), ``to_partial``
    (S->P, B->P), ``copy`` (rank-local moves between placements), ``refactor`` (each rank
reshapes its piece to or from a blocked split's factored layout). Same-placement steps work
    on the groups along ``axes``; ``groups`` lists the groups of ranks in the order every
    rank issues them. ``bytes_per_rank`` is what each rank sends, as gt.comm_stats counts it.
    Between placements: ``broadcast`` sends ``root``'s tensor to the rest of its group while
    target ranks that hold it keep it; ``all_gather`` (``axes`` empty) gathers the pieces of
    a source replica, flattened, over a group of those ranks and the target ranks, member i
    giving ``sizes[i]`` elements (0 for members that only receive);
    ``send_recv`` runs ``transfers``; where ``regions`` is given (a head-tail reorder, head_tail.py),
    transfer ``i`` carries box ``regions[i]`` of the tensor, else the intersection of its two pieces.
    A ``slice`` to a head-tail layout takes each rank's chunks of its piece.
    """
    op: str
    src: Layout
    dst: Layout
    axes: tuple
    groups: tuple
    bytes_per_rank: tuple = field(default=())
    transfers: tuple = field(default=())
    root: int = -1
    sizes: tuple = field(default=())
    regions: tuple = field(default=())

    @property
    def is_collective(self) -> bool:
        """Whether running the step issues a collective (groups of one rank issue none)."""
        if self.op not in COLLECTIVES:
            return False
        if self.op == "send_recv":
            return any(t.src != t.dst for t in self.transfers)
        return any(len(g) > 1 for g in self.groups)

    @property
    def bytes(self) -> int:
        """The most bytes any one rank sends in this step."""
        return max((b for _, b in self.bytes_per_rank), default=0)

    def __repr__(self) -> str:
        what = f"{self.src.nd_sbp}->{self.dst.nd_sbp}"
        if self.src.placement != self.dst.placement:
            what = f"{self.src.placement} {self.src.nd_sbp} -> {self.dst.placement} {self.dst.nd_sbp}"
        groups = ", ".join(str(list(g)) for g in self.groups)
        return f"{self.op}[{what}] groups={groups} bytes={self.bytes}"


@dataclass(frozen=True)
class Plan:
    """A boxing from layout ``src`` to layout ``dst``: its ``steps`` in the order every rank runs them."""
    src: Layout
    dst: Layout
    steps: tuple

    @property
    def bytes_per_rank(self) -> dict:
        """``{rank: bytes}`` each rank sends over the whole plan."""
        out = {}
        for s in self.steps:
            for r, b in s.bytes_per_rank:
                out[r] = out.get(r, 0) + b
        return out

    @property
    def bytes(self) -> int:
        """The most bytes any one rank sends over the whole plan."""
        return max(self.bytes_per_rank.values(), default=0)

    @property
    def cost(self) -> tuple:
        """What the planner minimises: (bytes the busiest rank sends, collectives, steps)."""
        return (self.bytes, sum(s.is_collective for s in self.steps), len(self.steps))

    @property
    def collectives(self) -> list:
        """The names of the steps that issue a collective, in order."""
        return [s.op for s in self.steps if s.is_collective]

    def __repr__(self) -> str:
        lines = [f"Plan {self.src.nd_sbp} on {self.src.placement} -> {self.dst.nd_sbp} on {self.dst.placement}"
                 f" shape={tuple(self.src.shape)}: {self.bytes} bytes"]
        lines += [f"  {i}. {s!r}" for i, s in enumerate(self.steps)] or ["  (nothing to do)"]
        return "\n".join(lines)
