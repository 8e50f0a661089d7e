"""A profile's events grouped into rows, an aligned text table, and a module tree."""
from __future__ import annotations

from typing import Dict, List, Sequence

from .text import group_text

KEYS = ("op", "module", "phase", "collective", "group", "conversion")
GLOBAL = "Global"               # the module of collectives outside any module of the profiled model
PHASES = ("forward", "backward")


def _check_keys(by: Sequence[str]) -> tuple:
    if isinstance(by, str):
        by = (by,)
    if not isinstance(by, (list, tuple)):
        raise TypeError(f"by: expected a field name or a list of them, from {list(KEYS)}, got {by!r}")
    by = tuple(by)
    bad = [k for k in by if k not in KEYS]
    if bad or not by:
        raise ValueError(f"by: expected one or more of {list(KEYS)}, got {list(by)!r}")
    return by


def rows(events: list, by: Sequence[str] = KEYS) -> List[dict]:
    """Events grouped by the fields ``by``; each row has them, ``calls``, ``bytes_per_rank`` (summed)
    and ``bytes`` (its busiest rank's); dearest first, then most calls, then first seen."""
    by = _check_keys(by)
    grouped: Dict[tuple, dict] = {}
    for e in events:
        key = tuple(getattr(e, k) for k in by)
        row = grouped.get(key)
        if row is None:
            row = grouped[key] = _row_fields(e, by)
            row["calls"], row["bytes_per_rank"] = 0, {}
        row["calls"] += 1
        per_rank = row["bytes_per_rank"]
        for r, b in e.bytes_per_rank.items():
            per_rank[r] = per_rank.get(r, 0) + b
    out = list(grouped.values())
    for row in out:
        row["bytes_per_rank"] = dict(sorted(row["bytes_per_rank"].items()))
        row["bytes"] = max(row["bytes_per_rank"].values(), default=0)
    order = {id(r): i for i, r in enumerate(out)}
    return sorted(out, key=lambda r: (-r["bytes"], -r["calls"], order[id(r)]))


def _row_fields(event, by: tuple) -> dict:
    row = {}
    for k in by:
        if k == "group":
            row["group"] = list(event.group)
        elif k == "conversion":
            c = event.conversion
            row["conversion"] = "-" if c is None else str(c)
            row["tensor"] = "-" if c is None else c.tensor
        else:
            row[k] = getattr(event, k)
    return row


def _totals(events: list) -> Dict[int, int]:
    per_rank: Dict[int, int] = {}
    for e in events:
        for r, b in e.bytes_per_rank.items():
            per_rank[r] = per_rank.get(r, 0) + b
    return per_rank


def _busiest(per_rank: Dict[int, int]):
    """The rank that sent the most (the lowest of equals), or None."""
    return min(per_rank, key=lambda r: (-per_rank[r], r)) if per_rank else None


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _cell(row: dict, column: str) -> str:
    v = row[column]
    if column == "group":
        return group_text(v)
    if column in ("calls", "bytes"):
        return f"{v:,}"
    return str(v)


def _aligned(lines: List[List[str]], right: set) -> List[str]:
    """Cells padded to their column's width (columns in ``right`` to the right), two spaces apart."""
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(max(map(len, lines)))]
    out = []
    for line in lines:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(line)]
        out.append("  ".join(cells).rstrip())
    return out


def table(title: str, events: list, by: Sequence[str] = KEYS) -> str:
    by = _check_keys(by)
    per_rank = _totals(events)
    busiest = _busiest(per_rank)
    total = per_rank.get(busiest, 0)
    head = (f"{title}: {_count(len(events), 'collective')}; the busiest rank, {busiest}, sent "
            f"{_count(total, 'byte')}" if events else f"{title}: no collectives")
    if not events:
        return head
    columns = [c for k in by for c in ((k, "tensor") if k == "conversion" else (k,))] + ["calls", "bytes"]
    share = f"% of rank {busiest}"
    lines = [columns + [share]]
    for row in rows(events, by):
        part = row["bytes_per_rank"].get(busiest, 0)
        lines.append([_cell(row, c) for c in columns] + [f"{100 * part / total:.1f}" if total else "-"])
    lines.append(["total"] + [""] * (len(columns) - 3) + [f"{len(events):,}", f"{total:,}", "100.0" if total else "-"])
    right = {len(columns) - 2, len(columns) - 1, len(columns)}
    body = _aligned(lines, right)
    rule = "-" * max(map(len, body))
    return "\n".join([head, body[0], rule, *body[1:-1], rule, body[-1]])


def tree(events: list, module_types: Dict[str, str]) -> str:
    """Each module with its subtree's totals, its own collectives by phase, then its submodules."""
    if not events:
        return "no collectives"
    own: Dict[str, list] = {}
    for e in events:
        own.setdefault(e.module, []).append(e)
    names = [GLOBAL] + [n for n in module_types if n != GLOBAL]
    names += [n for n in own if n not in names]
    children: Dict[str, list] = {n: [] for n in names}
    for n in names[1:]:
        children[_parent(n, children)].append(n)
    subtree: Dict[str, list] = {}

    def collect(n):
        subtree[n] = list(own.get(n, []))
        for c in children[n]:
            subtree[n] += collect(c)
        return subtree[n]
    collect(GLOBAL)

    lines: List[List[str]] = []

    def emit(n, depth):
        evs = subtree[n]
        if not evs:
            return
        pad = "  " * depth
        kind = f" ({module_types[n]})" if n in module_types else ""
        per_rank = _totals(evs)
        lines.append([f"{pad}{n}{kind}", "", "", "", "", f"{len(evs):,}", f"{per_rank[_busiest(per_rank)]:,}"])
        mine_all = own.get(n, [])
        for phase in PHASES + tuple(sorted({e.phase for e in mine_all} - set(PHASES))):
            mine = [e for e in mine_all if e.phase == phase]
            if not mine:
                continue
            lines.append([f"{pad}  {phase}"])
            for row in rows(mine, ("op", "collective", "group", "conversion")):
                lines.append([f"{pad}    {row['op']}", row["collective"], group_text(row["group"]),
                              row["conversion"], row["tensor"], f"{row['calls']:,}", f"{row['bytes']:,}"])
        for c in children[n]:
            emit(c, depth + 1)
    emit(GLOBAL, 0)
    header = ["module / phase / op", "collective", "group", "conversion", "tensor", "calls", "bytes"]
    return "\n".join(_aligned([header] + lines, {5, 6}))


def _parent(name: str, known: Dict[str, list]) -> str:
    """The nearest enclosing module among ``known`` (by qualified name), else Global."""
    parts = name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:k])
        if candidate in known:
            return candidate
    return GLOBAL
