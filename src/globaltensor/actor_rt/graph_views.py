"""Looking at a compiled graph: its plan, Graphviz text, and a Chrome-trace timeline of a run."""
from __future__ import annotations

import json
from collections import Counter

from .program import Program
from .segments import plan_segments
from .stream_code import PART

_COLOURS = {"compute": "lightblue", "collective": "orange", "copy": "palegreen"}


class PlanView:
    """``g.plan``: the tasks (name, rank, stream, registers, bytes), streams and the memory bound."""

    def __init__(self, program: Program, device_type: str = "cuda"):
        self.program = program
        self.tasks = program.tasks
        self.streams = {name: [program.tasks[i].name for i in ids] for name, ids in program.order.items()}
        self.registers = {t.name: t.registers for t in program.tasks}
        self.memory_bound = program.memory_bound
        self.micro_batches = program.micro_batches
        #: the pipeline schedule, and (other than gpipe) its stages and bounds
        self.schedule = program.schedule
        self.pipeline = program.pipeline
        #: each compute stream's runs of tasks a CUDA graph could replay, and why the others cannot
        self.segments = plan_segments(program, device_type, PART)

    def __repr__(self) -> str:
        kinds = Counter(t.stream.rsplit(":", 1)[-1] for t in self.tasks)
        lines = [f"Plan: {len(self.tasks)} tasks on {len(self.streams)} streams "
                 f"({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), micro_batches={self.micro_batches}, "
                 f"registers' memory bound {self.memory_bound} bytes"]
        if self.pipeline:
            lines.append(f"  schedule: {self.pipeline}")
        elif self.micro_batches > 1:
            lines.append(f"  schedule: {self.schedule}")
        for name, tasks in self.streams.items():
            shown = ", ".join(tasks[:6]) + (f", ... ({len(tasks)} in all)" if len(tasks) > 6 else "")
            lines.append(f"  {name}: {shown}")
        graphs = [seg for seg in self.segments if seg.capturable]
        reasons = Counter(seg.reason.split(" (")[0] for seg in self.segments if not seg.capturable)
        lines.append(f"  compute segments: {len(self.segments)}, {len(graphs)} capturable as CUDA graphs"
                     + "".join(f"; {n} not: {why}" for why, n in reasons.items()))
        return "\n".join(lines)


def dot(program: Program) -> str:
    lines = ["digraph plan {", "  rankdir=TB;", "  node [shape=box, style=filled, fontsize=10];"]
    by_rank: dict = {}
    for t in program.tasks:
        by_rank.setdefault(t.rank, []).append(t)
    for rank, tasks in sorted(by_rank.items()):
        lines.append(f"  subgraph cluster_r{rank} {{")
        lines.append(f'    label="rank {rank}";')
        for t in tasks:
            colour = _COLOURS.get(t.stream.rsplit(":", 1)[-1], "white")
            signature = f"\\n{t.node.signature}" if t.node is not None and t.node.signature else ""
            label = t.name.replace('"', "'") + signature + f"\\n{t.stream} x{t.registers}"
            lines.append(f'    t{t.id} [label="{label}", fillcolor={colour}];')
        lines.append("  }")
    for t in program.tasks:
        for src in t.inputs:
            if src[0] == "task":
                lines.append(f"  t{src[1]} -> t{t.id};")
        for pid, delay in t.deps:
            style = "dashed" if delay == 0 else "dotted"
            lines.append(f"  t{pid} -> t{t.id} [style={style}, color=gray];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def chrome_trace(timeline: list, path: str, rank_of: dict, waits: list = ()) -> str:
    """Write ``(stream, task, iteration, start, end)`` firings as Chrome-trace JSON, one process row
    per rank (``rank_of``: task name -> rank) and one thread row per stream; returns ``path``.

    Firings are events of category ``task`` named after the task. ``waits`` --
    ``(stream, task, iteration, start, end, "input" | "credit", other)``: a stream asleep before
    ``task`` until ``other`` made its input or freed a register -- are events of category
    ``wait`` on the same row, named ``"input <- other"`` or ``"credit <- other"``. What is left
    of a row between its events is the stream's own overhead, or time it could have run but
    did not get a core (or the GIL)."""
    events, threads = [], {}
    start = min([e[3] for e in timeline] + [w[3] for w in waits], default=0.0)
    for stream, task, it, t0, t1 in timeline:
        tid = threads.setdefault(stream, len(threads))
        events.append({"name": task, "cat": "task", "ph": "X", "pid": rank_of[task], "tid": tid,
                       "ts": (t0 - start) * 1e6, "dur": max((t1 - t0) * 1e6, 0.01), "args": {"iteration": it}})
    for stream, task, it, t0, t1, why, other in waits:
        tid = threads.setdefault(stream, len(threads))
        events.append({"name": f"{why} <- {other}", "cat": "wait", "ph": "X", "pid": rank_of[task], "tid": tid,
                       "ts": (t0 - start) * 1e6, "dur": max((t1 - t0) * 1e6, 0.01),
                       "args": {"iteration": it, "task": task}})
    names = {tid: stream for stream, tid in threads.items()}
    for rank in sorted({e["pid"] for e in events}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
    for rank, tid in sorted({(e["pid"], e["tid"]) for e in events if e["ph"] == "X"}):
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": names[tid]}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path
