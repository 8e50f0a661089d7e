"""torch.distributed.checkpoint across process worlds: saved by 2 launched gloo processes with one set
of layouts, loaded by 4 with others (resharding), training resumed; pieces on broadcast axes are
written once across processes; the same files load on simulated ranks, and DCP's converter makes a
plain torch.save file of them.

Both jobs run tests/multiprocess/_checkpoint_program.py (its docstring lists the layouts).
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import globaltensor as gt

sys.path.insert(0, str(Path(__file__).parent))
import _checkpoint_program as program  # noqa: E402

PROGRAM = Path(__file__).with_name("_checkpoint_program.py")


def result(job) -> dict:
    line = next(l for l in job.lines(0) if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_save_on_2_processes_load_on_4_in_other_layouts(launch, tmp_path):
    path = tmp_path / "ckpt"
    saved = result(launch(PROGRAM, 2, args=["save", str(path)]))
    files = sorted(f.name for f in path.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], "each process writes its own pieces"
    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert sorted(tuple(c.offsets) for c in md["tensors.a"].chunks) == [(0, 0), (4, 0)]
    assert len(md["tensors.b"].chunks) == 1, "a broadcast tensor is written by one process"
    assert sorted(tuple(c.offsets) for c in md["tensors.c"].chunks) == [(0, 0), (3, 0)], "partial: reduce-scattered"

    loaded = result(launch(PROGRAM, 4, args=["load", str(path)]))
    program.check(saved, loaded)
    with gt.simulate(4), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")   # no process group here: intended
        program.check(saved, program.load(path))                            # the same files on simulated ranks

    dcp_to_torch_save(path, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    for name in program.SHAPES:
        assert torch.equal(full["tensors"][name], program.value_of(name)), name
    single = program.net().double()
    single.load_state_dict(full["model"])
