"""GLOBALTENSOR_LOG / gt.set_log_level: each boxing logged at info, each signature choice at debug."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import globaltensor as gt
from globaltensor.observe import context as profile_context, log as profile_log

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


@pytest.fixture
def log_level():
    """Sets the level for the test; back to warning after it."""
    yield gt.set_log_level
    gt.set_log_level("warning")


def _messages(caplog, name):
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_info_logs_each_boxing(p1, log_level, caplog):
    caplog.set_level(logging.INFO, logger="globaltensor")
    log_level("info")
    assert profile_context.on
    x = gt.randn(8, 6, placement=p1, sbp=S(1))
    w = gt.randn(6, 4, placement=p1, sbp=S(1))
    gather_plan = gt.boxing_plan(x, sbp=B)          # the cheapest: gathering x keeps the output split
    y = x @ w
    y.to_global(sbp=B)
    out_plan = gt.boxing_plan(y, sbp=B)
    assert _messages(caplog, "globaltensor.boxing") == [
        f"aten.mm: 8x6 float32 S(1) -> B on cpu[0,1,2,3]: all_gather [0,1,2,3] {gather_plan.bytes} B; "
        f"{gather_plan.bytes} B in all (the most any one rank sends)",
        f"to_global: 8x4 float32 S(1) -> B on cpu[0,1,2,3]: all_gather [0,1,2,3] {out_plan.bytes} B; "
        f"{out_plan.bytes} B in all (the most any one rank sends)"]
    assert _messages(caplog, "globaltensor.signature") == []     # debug only
    log_level("warning")
    assert not profile_context.on
    caplog.clear()
    y.to_global(sbp=B)
    assert caplog.records == []


def test_debug_logs_each_signature_choice(p1, log_level, caplog):
    caplog.set_level(logging.DEBUG, logger="globaltensor")
    log_level("debug")
    x = gt.randn(9, 7, placement=p1, sbp=S(1))       # shapes no other test uses: the choice is made here
    w = gt.randn(7, 5, placement=p1, sbp=S(1))
    x @ w
    x @ w                                           # the second call reuses the decision: not logged again
    choices = [m for m in _messages(caplog, "globaltensor.signature") if m.startswith("aten.mm(")]
    assert len(choices) == 1
    plan = gt.boxing_plan(x, sbp=B)                 # gathering x: no partial output left to reduce
    assert choices[0].startswith(f"aten.mm(9x7 float32 S(1), 7x5 float32 S(1)) on cpu[0,1,2,3]: chose "
                                 f"(B, S(1)) -> S(1), cost {plan.bytes} B (1 boxing step); others: ")
    others = choices[0].split("; others: ")[1].split(", (")
    costs = [int(o.rsplit(" ", 2)[-2]) for o in others]
    assert costs == sorted(costs) and min(costs) >= plan.bytes and len(others) == 5
    assert len(_messages(caplog, "globaltensor.boxing")) == 2     # each run of the boxing: debug includes info


def test_bad_levels(log_level):
    with pytest.raises(ValueError, match=r"set_log_level\(level\): expected one of \['debug', 'error', 'info', "
                                         r"'warning'\], got 'loud'"):
        log_level("loud")
    with pytest.raises(TypeError, match=r"set_log_level\(level\): expected one of .* got 2.5"):
        log_level(2.5)


def test_environment_variable_read_at_import():
    program = ("import globaltensor as gt\ngt.simulate(2)\n"
               "x = gt.randn(4, 3, placement=gt.placement('cpu', [0, 1]), sbp=gt.sbp.split(0))\n"
               "x.to_global(sbp=gt.sbp.broadcast)\n")
    run = subprocess.run([sys.executable, "-c", program], env={**os.environ, "GLOBALTENSOR_LOG": "INFO"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert [line for line in run.stderr.splitlines() if line.startswith("globaltensor")] == [
        "globaltensor.boxing INFO: to_global: 4x3 float32 S(0) -> B on cpu[0,1]: all_gather [0,1] 24 B; 24 B in all "
        "(the most any one rank sends)"]


def test_bad_environment_variable(monkeypatch, log_level):
    monkeypatch.setenv("GLOBALTENSOR_LOG", "sometimes")
    with pytest.raises(ValueError, match=r"GLOBALTENSOR_LOG: expected one of \['debug', 'error', 'info', 'warning'\], "
                                         r"got 'sometimes'"):
        profile_log.configure_from_environment()
