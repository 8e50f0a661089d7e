"""``AutoPlan.explain()``: the chosen layouts per module, what each module's collectives cost forward and
backward, memory per rank, and the best alternatives -- data parallel, Megatron, ZeRO -- beside it,
each with its predicted step and that step's compute, communication and host dispatch."""
from __future__ import annotations

from collections import defaultdict

from ...sbp import sbp_text


def _module_of(name: str) -> str:
    return name.rpartition(".")[0] or "(model)"


def _by_module(events) -> dict:
    """``{module: {phase: [bytes, collectives]}}`` of the chosen option's collectives: the bytes the
    busiest rank sends in them, the collectives it takes part in (groups of other axes run beside)."""
    sent: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    count: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    for e in events:
        module = e.module.partition(".")[2] or "(model)" if e.module != "Global" else "(outside modules)"
        phase = e.phase if e.phase in ("forward", "backward") else "optimizer"
        for r in e.group:
            sent[module][phase][r] += e.bytes_per_rank.get(r, 0)
            count[module][phase][r] += 1
    return {m: {ph: [max(per_rank.values()), max(count[m][ph].values())] for ph, per_rank in phases.items()}
            for m, phases in sent.items()}


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def explain(plan) -> str:
    chosen = plan.chosen
    lines = [f"Chosen: {chosen.candidate.name} on {plan.placement}", ""]
    costs = _by_module(chosen.cost.events)
    modules = sorted({_module_of(n) for n in chosen.params} | set(costs))
    lines.append(_row(["module", "parameters", "forward bytes (collectives)", "backward bytes (collectives)",
                       "optimizer step bytes (collectives)"]))
    lines.append(_row(["---"] * 5))
    for m in modules:
        params = ", ".join(f"{n.rpartition('.')[2]} {sbp_text(nd)}" for n, nd in chosen.params.items()
                           if _module_of(n) == m)
        c = costs.get(m, {})
        lines.append(_row([m, params or "-"] + [f"{c.get(ph, [0, 0])[0]:,} ({c.get(ph, [0, 0])[1]})"
                                                 for ph in ("forward", "backward", "optimizer")]))
    lines.append("")
    lines.append("inputs: " + ", ".join(sbp_text(nd) for nd in chosen.inputs)
                 + (f"; optimizer state split over axis {plan.zero_axis} (ZeroOptimizer)"
                    if plan.zero_axis is not None else ""))
    parts = ", ".join(f"{k} {v:,}" for k, v in chosen.cost.memory_parts.items())
    limit = f" (limit {plan.memory_limit:,})" if plan.memory_limit is not None else ""
    lines.append(f"memory per rank: {chosen.cost.memory:,} bytes{limit}: {parts}")
    lines.append("")
    lines.append(_row(["layout", "bytes a step", "collectives", "predicted ms", "compute / communication / host ms",
                       "memory per rank", ""]))
    lines.append(_row(["---"] * 7))
    shown = _alternatives(plan)
    for o in shown:
        fits = plan.memory_limit is None or o.cost.memory <= plan.memory_limit
        mark = "chosen" if o is chosen else ("" if fits else "over the memory limit")
        lines.append(_row([o.candidate.name, f"{o.cost.bytes:,}", str(o.cost.collectives),
                           f"{o.cost.seconds * 1e3:.3f}", _parts_ms(plan, o), f"{o.cost.memory:,}", mark]))
    return "\n".join(lines)


def _parts_ms(plan, option) -> str:
    """The option's predicted compute, communication shown and host dispatch, on the plan's device;
    "-" for a plan loaded from a dict (it keeps no tallies)."""
    if option.cost.tally is None:
        return "-"
    p = plan.predict(option=option)
    return f"{p.compute * 1e3:.3f} / {p.communication * 1e3:.3f} / {p.host * 1e3:.3f}"


def _alternatives(plan) -> list:
    """The chosen option, the classic hand plans -- pure data parallel, Megatron (on a 2-D placement:
    data parallel on the first axes, Megatron on the last), ZeRO -- and the next best."""
    n = plan.placement.ndim

    def named(roles, zero=False):
        return next((o for o in plan.options if o.candidate.roles == roles and o.candidate.zero == zero
                     and not o.candidate.vocab and not o.candidate.blocked and not o.candidate.balanced), None)
    classic = [named(("data",) * n), named(("data",) * (n - 1) + ("tensor",)), named(("data",) * n, zero=True)]
    ranked = sorted(plan.options, key=lambda o: o.cost.seconds)
    shown = []
    for o in [plan.chosen] + [o for o in classic if o is not None] + ranked[:3]:
        if not any(o is s for s in shown):
            shown.append(o)
    return shown
