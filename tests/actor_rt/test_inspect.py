"""Looking at a compiled function: g.plan (tasks on r<rank>:compute / r<rank>:collective streams,
registers, a memory bound), g.to_dot() (Graphviz text naming every task) and g.trace_to(path)
(Chrome-trace JSON, one thread per stream: the firings, and the streams' waits for inputs and
credits)."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

import globaltensor as gt

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
STREAM = re.compile(r"^r(\d+):(compute|collective)$")


def _training_step(placement):
    torch.manual_seed(0)
    w = torch.randn(8, 4).to_global(placement=placement, sbp=B).clone().requires_grad_()
    opt = torch.optim.SGD([w], lr=0.01)

    def step(x, y):
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def _compiled_step(p1, **kw):
    g = gt.compile(_training_step(p1), **kw)
    x, y = gt.randn(16, 8, placement=p1, sbp=S(0)), gt.randn(16, 4, placement=p1, sbp=S(0))
    for _ in range(3):
        g(x, y)
    return g, (x, y)


def test_plan_before_any_capture_is_an_error(p1):
    g = gt.compile(lambda x: x * 2.0)
    with pytest.raises(RuntimeError, match="captured"):
        g.plan


def test_plan_tasks_streams_registers(p1):
    g, _ = _compiled_step(p1, streams="rank")
    plan = g.plan
    assert len(plan.tasks) > 0
    names = [t.name for t in plan.tasks]
    assert len(set(names)) == len(names), "task names are unique"
    for stream in plan.streams:
        assert STREAM.match(stream), f"stream {stream!r} is not r<rank>:compute / r<rank>:collective"
    ranks = {int(STREAM.match(s).group(1)) for s in plan.streams}
    assert ranks <= {0, 1, 2, 3}
    assert {f"r{r}:compute" for r in range(4)} <= set(plan.streams), "every rank computes its piece"
    assert any(s.endswith(":collective") for s in plan.streams), "the gradient all-reduce is a collective task"
    on_streams = Counter(n for tasks in plan.streams.values() for n in tasks)
    assert on_streams == Counter(names), "every task is on exactly one stream's static order"
    for t in plan.tasks:
        assert t.name in plan.streams[t.stream]
        assert t.stream.startswith(f"r{t.rank}:"), (t.name, t.stream, t.rank)
    assert set(plan.registers) == set(names)
    assert all(k == 2 for k in plan.registers.values()), "registers=2 by default"
    assert plan.memory_bound > 0
    text = repr(plan)
    assert "tasks" in text and "r0:compute" in text


def test_registers_set_the_counts_and_the_memory_bound(p1):
    g2, _ = _compiled_step(p1, registers=2)
    g3, _ = _compiled_step(p1, registers=3)
    assert set(g2.plan.streams) == {"cpu"}, "a simulated CPU world runs its graph on one stream"
    assert all(k == 3 for k in g3.plan.registers.values())
    b2, b3 = g2.plan.memory_bound, g3.plan.memory_bound
    assert 0 < b2 < b3 <= b2 * 3 / 2, f"a third more registers per task: bound {b2} -> {b3}"

    def per_stream(task):
        return 1 if task.stream.endswith(":collective") else 4
    gf, _ = _compiled_step(p1, registers=per_stream, streams="rank")
    plan = gf.plan
    for t in plan.tasks:
        assert plan.registers[t.name] == per_stream(t), t.name


def test_measured_peak_within_the_memory_bound(p1):
    g = gt.compile(lambda x: torch.tanh(x * 2.0).to_global(sbp=B) + 1.0, warmup=0, measure_memory=True)
    xs = [gt.randn(16, 8, placement=p1, sbp=S(0)) for _ in range(6)]
    g.pipeline(xs)
    assert 0 < g.peak_register_bytes <= g.plan.memory_bound, (g.peak_register_bytes, g.plan.memory_bound)


def test_streams_argument_names_the_streams(p1):
    g = gt.compile(lambda x: (x * 2.0).to_global(sbp=B), warmup=0, streams=lambda t: f"r{t.rank}:mine")
    x = gt.randn(8, 3, placement=p1, sbp=S(0))
    out = g(x)
    torch.testing.assert_close(out.full_tensor(), (x * 2.0).full_tensor(), rtol=0, atol=0)
    assert set(g.plan.streams) == {f"r{r}:mine" for r in range(4)}, list(g.plan.streams)


def test_to_dot_mentions_every_task(p1):
    g, _ = _compiled_step(p1)
    dot = g.to_dot()
    assert dot.lstrip().startswith("digraph") and dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    for t in g.plan.tasks:
        assert t.name.replace('"', "'") in dot, f"task {t.name} is missing from the dot text"
    assert "->" in dot
    for r in range(4):
        assert f"rank {r}" in dot


def test_trace_to_writes_chrome_trace_json(p1, tmp_path):
    g, args = _compiled_step(p1, timeline=True)
    g.pipeline([args, args])                      # the last run: two iterations
    path = tmp_path / "trace.json"
    assert g.trace_to(str(path)) == str(path)
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X" and e["cat"] == "task"]
    assert spans, "no actor firings"
    assert all(e["cat"] in ("task", "wait") for e in events if e["ph"] == "X")
    for e in spans:
        assert {"name", "ts", "dur", "pid", "tid"} <= set(e)
        assert e["dur"] >= 0
    plan = g.plan
    names = {t.name for t in plan.tasks}
    fired = Counter(e["name"] for e in spans)
    assert set(fired) == names, "every task fires, and only tasks do"
    assert all(n == 2 for n in fired.values()), "each task fires once per iteration of the last run"
    thread_names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(thread_names.values()) == sorted(plan.streams), "one named thread per stream"
    assert len({e["tid"] for e in spans}) == len(plan.streams), "one tid per stream"
    stream_of = {t.name: t.stream for t in plan.tasks}
    for e in spans:
        assert thread_names[e["tid"]] == stream_of[e["name"]], f"{e['name']} drawn on another stream's thread"


def test_trace_to_without_a_timeline_says_how_to_record_one(p1, tmp_path):
    g, args = _compiled_step(p1)
    with pytest.raises(RuntimeError, match="timeline=True"):
        g.trace_to(str(tmp_path / "trace.json"))


def test_trace_to_draws_a_streams_waits_before_the_firing_they_held_back(p1, tmp_path):
    """The matmuls on one stream, what follows them on another: that stream runs ahead, sleeps
    until each matmul is done, and the trace shows every sleep as a "wait" event on its own row,
    named after the task it waited for (or the call's arguments, which the caller feeds), ending
    before the firing it held back."""
    w = gt.randn(512, 512, placement=p1, sbp=B) / 32.0
    g = gt.compile(lambda x: torch.tanh(x @ w @ w) + 1.0, warmup=0, timeline=True,
                   streams=lambda t: f"r{t.rank}:" + ("mm" if "mm" in t.name else "pointwise"))
    xs = [gt.randn(256, 512, placement=p1, sbp=S(0)) for _ in range(8)]
    outs = g.pipeline(xs)
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out.full_tensor(), (torch.tanh(x @ w @ w) + 1.0).full_tensor())
    with open(g.trace_to(str(tmp_path / "trace.json"))) as f:
        events = json.load(f)["traceEvents"]
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                    if e["ph"] == "M" and e["name"] == "thread_name"}
    fired = {(e["name"], e["args"]["iteration"]): e for e in events if e["ph"] == "X" and e["cat"] == "task"}
    waits = [e for e in events if e["ph"] == "X" and e["cat"] == "wait"]
    plan = g.plan
    stream_of = {t.name: t.stream for t in plan.tasks}
    mm_tasks = {t.name for t in plan.tasks if t.stream.endswith(":mm")}
    assert any(e["name"].startswith("input <- ") and e["name"][len("input <- "):] in mm_tasks and
               stream_of[e["args"]["task"]].endswith(":pointwise") for e in waits), \
        f"no pointwise stream waited for a matmul: {[e['name'] for e in waits]}"
    for e in waits:
        why, other = e["name"].split(" <- ")
        assert why in ("input", "credit") and (other in stream_of or other == "the call's arguments"), e["name"]
        task, it = e["args"]["task"], e["args"]["iteration"]
        assert thread_names[(e["pid"], e["tid"])] == stream_of[task], f"wait of {task} drawn on another row"
        assert stream_of.get(other) != stream_of[task], "a stream never waits for its own tasks"
        assert e["ts"] + e["dur"] <= fired[(task, it)]["ts"] + 1.0, f"the wait of {task} ends after it fired"
