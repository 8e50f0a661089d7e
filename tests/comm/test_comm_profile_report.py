"""The profile's table, module tree and JSON."""
from __future__ import annotations

import json
import re

import pytest
import torch

import globaltensor as gt

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


class ToSbp(torch.nn.Module):
    def __init__(self, sbp):
        super().__init__()
        self.sbp = sbp

    def forward(self, x):
        return x.to_global(sbp=self.sbp)


class Net(torch.nn.Module):
    """The batch split (its backward all-gathers the input's gradient), fc1 column parallel, its
    output gathered (a forward all-gather), fc2 replicated."""

    def __init__(self):
        super().__init__()
        self.split = ToSbp(S(0))
        self.fc1 = torch.nn.Linear(6, 8)
        self.gather = ToSbp(B)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.gather(self.fc1(self.split(x))))


@pytest.fixture
def profile(p1):
    torch.manual_seed(0)
    net = Net()
    gt.nn.distribute_module(net, p1, {"fc1.*": S(0)})
    x = gt.randn(5, 6, placement=p1, sbp=B, requires_grad=True)
    with gt.comm_profile(net) as prof:
        net(x).sum().backward()
    return prof


def test_table_is_aligned_and_totals_add_up(profile):
    text = profile.table()
    lines = text.splitlines()
    head, columns, rule, *body = lines
    busiest = min(r for r, b in profile.per_rank.items() if b == profile.bytes_sent)
    assert head == (f"Communication profile: {profile.count} collectives; the busiest rank, {busiest}, sent "
                    f"{profile.bytes_sent:,} bytes")
    assert columns.split() == ["op", "module", "phase", "collective", "group", "conversion", "tensor", "calls",
                               "bytes", "%", "of", "rank", str(busiest)]
    rows, total = body[:-2], body[-1]
    assert set(rule) == {"-"} and body[-2] == rule and len(rows) == len(profile.rows())
    ends = {len(line) for line in [columns] + rows + [total]}
    assert len(ends) == 1                                  # right-aligned numbers end in one column
    starts = {line.index(c) for line, c in zip([columns] + rows, ["op"] + [r["op"] for r in profile.rows()])}
    assert starts == {0}
    for name in ("phase", "collective", "conversion"):      # left-aligned text columns start together
        at = columns.index(name)
        assert all(line[at - 2:at] == "  " and line[at] != " " for line in rows), name
    calls, nbytes, share = re.split(r"\s+", total)[-3:]
    assert int(calls) == profile.count and int(nbytes.replace(",", "")) == profile.bytes_sent and share == "100.0"
    shares = [float(line.split()[-1]) for line in rows]
    assert sum(shares) == pytest.approx(100, abs=0.05 * len(shares))   # each share rounded to 0.1


def test_table_by_op(profile):
    lines = profile.table(by="op").splitlines()
    assert lines[1].split()[:3] == ["op", "calls", "bytes"]
    busiest = int(lines[1].split()[-1])
    assert [line.split() for line in lines[3:-2]] == [
        [r["op"], str(r["calls"]), f"{r['bytes']:,}", f"{100 * r['bytes_per_rank'][busiest] / profile.bytes_sent:.1f}"]
        for r in profile.rows("op")]
    assert [r["op"] for r in profile.rows("op")] == ["to_global", "aten.addmm"]


def test_tree_nests_modules_with_their_totals(profile):
    lines = profile.tree().splitlines()
    assert lines[0].split()[:2] == ["module", "/"]
    assert lines[1].split() == ["Global", str(profile.count), f"{profile.bytes_sent:,}"]
    indent = lambda line: len(line) - len(line.lstrip())
    at = {line.split()[0]: i for i, line in enumerate(lines)}
    assert lines[at["Net"]].split()[1:] == ["(Net)", "3", f"{profile.bytes_sent:,}"]
    assert at["Net"] < at["Net.split"] < at["Net.fc1"] < at["Net.gather"]       # in the model's order
    for name, phase, op, collective in [("Net.split", "backward", "to_global", "all_reduce"),
                                        ("Net.fc1", "forward", "aten.addmm", "all_gather"),
                                        ("Net.gather", "forward", "to_global", "all_gather")]:
        i = at[name]
        assert indent(lines[i]) == indent(lines[at["Net"]]) + 2 == 4
        assert lines[i + 1].strip() == phase
        assert lines[i + 2].split()[:3] == [op, collective, "[0,1,2,3]"]
        event = next(e for e in profile.events if e.module == name)
        assert lines[i].split()[-2:] == ["1", f"{event.bytes:,}"]


def test_json_round_trips(profile, tmp_path):
    path = tmp_path / "comm.json"
    text = profile.to_json(str(path))
    assert path.read_text() == text
    data = json.loads(text)
    assert data["collectives"] == profile.count and data["bytes_sent"] == profile.bytes_sent
    assert data["bytes_per_rank"] == {str(r): b for r, b in profile.per_rank.items()}
    assert len(data["events"]) == profile.count and data["captured"] == []
    first, event = data["events"][0], profile.events[0]
    assert first["op"] == event.op and first["module"] == event.module and first["group"] == list(event.group)
    assert first["conversion"]["from"]["sbp"] == [repr(v) for v in event.conversion.src_sbp]
    assert first["conversion"]["shape"] == list(event.conversion.shape) and first["conversion"]["dtype"] == "float32"
    assert data["modules"]["Net.gather"] == "ToSbp"
    assert [r["calls"] for r in data["rows"]] == [r["calls"] for r in profile.rows()]
