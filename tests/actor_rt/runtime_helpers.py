"""Helpers of the actor-runtime tests (flow control, deadlock freedom, graph errors).

- ``run_bounded(fn, timeout_s, what)``: run ``fn`` on a daemon thread and fail the test, with
  the stacks of the runtime's threads, when it does not finish in ``timeout_s`` (a deadlock
  fails instead of hanging the suite).
- Timeline analysis: ``firings`` (task name -> iteration -> (start, end)), ``data_edges`` (from
  the plan's task inputs), ``credit_violations`` (a producer started iteration ``i`` before its
  consumer finished ``i - registers``) and ``max_lead`` (how far a producer did run ahead).
- Two custom ops with an SBP rule, registered once per process: ``slow_op`` (sleeps, then
  halves: an expensive consumer whose cost does not depend on the machine's speed) and
  ``maybe_fail_op`` (doubles, or raises ``InjectedFailure`` on pieces of ``FAIL["rows"]`` rows
  while ``FAIL["rows"]`` is set, after ``FAIL["after"]`` more successful calls on such pieces).
- ``assert_same``: a compiled output equals the eager one (layout, pieces, values).
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Callable, Dict, List, Tuple

import pytest
import torch

import globaltensor as gt
from globaltensor.tensor import GlobalTensor

REL = 1e-10


# -- hang detection ------------------------------------------------------------------------------
def _actor_stacks() -> str:
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        if t.name.startswith(("gt-actor", "gt-test-caller")):
            f = frames.get(t.ident)
            if f is not None:
                out.append(f"--- {t.name}\n" + "".join(traceback.format_stack(f)[-6:]))
    return "\n".join(out)


def run_bounded(fn: Callable, timeout_s: float, what: str):
    """``fn()``'s result, or its exception re-raised; the test fails when it takes past ``timeout_s``."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the test's thread
            box["error"] = e
    th = threading.Thread(target=target, name="gt-test-caller", daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        pytest.fail(f"{what} did not finish within {timeout_s:.0f} s (a deadlock?); the runtime's threads:\n"
                    f"{_actor_stacks()}", pytrace=False)
    if "error" in box:
        raise box["error"]
    return box["result"]


# -- timelines -----------------------------------------------------------------------------------
def timeline_of(g) -> list:
    return list(g._graph().runtime.timeline)


def firings(timeline: list) -> Dict[str, Dict[int, Tuple[float, float]]]:
    """task name -> iteration -> (start, end); every (task, iteration) fires once."""
    out: Dict[str, Dict[int, Tuple[float, float]]] = {}
    for stream, name, it, t0, t1 in timeline:
        per = out.setdefault(name, {})
        assert it not in per, f"task {name} fired iteration {it} twice"
        assert t1 >= t0, f"task {name} iteration {it} ends before it starts"
        per[it] = (t0, t1)
    return out


def data_edges(plan) -> list:
    """(producer, consumer) TaskSpecs of every data edge of the plan, once each."""
    edges, seen = [], set()
    for t in plan.tasks:
        for src in t.inputs:
            if src[0] == "task" and (src[1], t.id) not in seen:
                seen.add((src[1], t.id))
                edges.append((plan.tasks[src[1]], t))
    return edges


def credit_violations(plan, timeline: list) -> List[str]:
    """Every firing that broke the credits: producer P started iteration i before its consumer C
    had finished iteration i - P.registers (P would have overwritten a register C still reads)."""
    fire = firings(timeline)
    bad = []
    for p, c in data_edges(plan):
        pf, cf = fire.get(p.name, {}), fire.get(c.name, {})
        for i, (start, _) in sorted(pf.items()):
            j = i - p.registers
            if j < min(pf):            # an iteration of an earlier run: its register is empty again
                continue
            if j not in cf:
                bad.append(f"{p.name} [{p.stream}, {p.registers} registers] started iteration {i}, but its "
                           f"consumer {c.name} [{c.stream}] never ran iteration {j}")
            elif cf[j][1] > start:
                bad.append(f"{p.name} [{p.stream}, {p.registers} registers] started iteration {i} "
                           f"{(cf[j][1] - start) * 1e3:.3f} ms before its consumer {c.name} [{c.stream}] "
                           f"finished iteration {j}")
    return bad


def max_lead(timeline: list, producer: str, consumer: str) -> int:
    """The most iterations ``producer`` had started beyond those ``consumer`` had finished, over the
    run (k registers allow k: the producer starts i once the consumer has finished i - k)."""
    fire = firings(timeline)
    pf, cf = fire[producer], fire[consumer]
    base = min(pf)
    lead = 0
    for i, (start, _) in pf.items():
        finished = sum(1 for _, end in cf.values() if end <= start)
        lead = max(lead, (i - base + 1) - finished)
    return lead


# -- custom ops ------------------------------------------------------------------------------------
SLOW_S = {"seconds": 0.02}
FAIL = {"rows": None, "after": 0, "calls": 0}


class InjectedFailure(RuntimeError):
    """What maybe_fail_op raises."""


@torch.library.custom_op("gt_rt_helpers::slow", mutates_args=())
def slow_op(x: torch.Tensor) -> torch.Tensor:
    time.sleep(SLOW_S["seconds"])
    return x * 0.5


@slow_op.register_fake
def _slow_fake(x):
    return torch.empty_like(x)


@torch.library.custom_op("gt_rt_helpers::maybe_fail", mutates_args=())
def maybe_fail_op(x: torch.Tensor) -> torch.Tensor:
    if FAIL["rows"] is not None and x.shape[0] == FAIL["rows"]:
        FAIL["calls"] += 1
        if FAIL["calls"] > FAIL["after"]:
            raise InjectedFailure(f"injected failure on a piece of {x.shape[0]} rows")
    return x * 2.0


@maybe_fail_op.register_fake
def _maybe_fail_fake(x):
    return torch.empty_like(x)


slow_op.register_autograd(lambda ctx, grad: grad * 0.5)
maybe_fail_op.register_autograd(lambda ctx, grad: grad * 2.0)


_ELEMENTWISE = ["S(0) -> S(0)", "S(1) -> S(1)", "B -> B"]
gt.register_rule(torch.ops.gt_rt_helpers.slow.default, _ELEMENTWISE)
gt.register_rule(torch.ops.gt_rt_helpers.maybe_fail.default, _ELEMENTWISE)


def set_failure(rows=None, after: int = 0) -> None:
    """maybe_fail_op raises on pieces of ``rows`` rows after ``after`` more calls on them; None: never."""
    FAIL.update(rows=rows, after=after, calls=0)


# -- values ------------------------------------------------------------------------------------------
def assert_same(out, ref, what: str, rel: float = REL) -> None:
    """``out`` (compiled) equals ``ref`` (eager): layout, each rank's piece, to float64 rounding."""
    assert isinstance(out, GlobalTensor), f"{what}: expected a GlobalTensor, got {type(out).__name__}"
    assert out.placement == ref.placement and out.sbp == ref.sbp, \
        f"{what}: {out.placement} {out.sbp} != eager {ref.placement} {ref.sbp}"
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != eager {tuple(ref.shape)}"
    mine, theirs = out.local_tensors(), ref.local_tensors()
    assert set(mine) == set(theirs), f"{what}: pieces on ranks {sorted(mine)} != eager {sorted(theirs)}"
    for r in sorted(theirs):
        a, b = mine[r].detach(), theirs[r].detach()
        assert a.shape == b.shape, f"{what}: rank {r}'s piece {tuple(a.shape)} != eager {tuple(b.shape)}"
        if not b.numel():
            continue
        err = (a - b).abs().max().item()
        scale = max(b.abs().max().item(), 1.0)
        assert err <= rel * scale, f"{what}: rank {r}'s piece: max |compiled - eager| = {err:.3e} (scale {scale:.3e})"
