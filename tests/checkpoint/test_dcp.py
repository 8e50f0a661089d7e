"""torch.distributed.checkpoint with global tensors on simulated worlds (DCP without a process group:
this one process holds every rank's pieces and writes them with their offsets).

The launched counterpart, save on 2 gloo processes and load on 4, is tests/multiprocess/test_checkpoint.py;
both run tests/multiprocess/_checkpoint_program.py.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import example, given, settings, strategies as st
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import globaltensor as gt
import globaltensor.nn as gnn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multiprocess"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
import _checkpoint_program as program  # noqa: E402
from nn_models import MEGATRON_1D, net  # noqa: E402

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum

# DCP warns on every call that no process group is initialised ("assuming the intent is to save in
# a single process"): that is the case under test.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def chunks(path, name) -> list:
    """``(offsets, sizes)`` of every chunk saved for ``name``, sorted."""
    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata[name]
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)


def test_save_on_2_ranks_load_on_4_in_other_layouts_and_resume(tmp_path):
    with gt.simulate(2):
        saved = program.save(tmp_path)
    with gt.simulate(4):
        loaded = program.load(tmp_path)
    program.check(saved, loaded)


def test_pieces_are_written_with_offsets_once_each(tmp_path, p2):
    x = torch.arange(35.0).reshape(7, 5)
    state = {"split": gt.distribute(x, p2, (S(0), S(1))), "bcast": gt.distribute(x, p2, (B, S(0))),
             "partial": gt.to_global(x / 4, p2, (P, P)), "scalar": gt.distribute(torch.tensor(3.0), p2, (P, B))}
    dcp.save(state, checkpoint_id=tmp_path)
    assert chunks(tmp_path, "split") == [((0, 0), (4, 3)), ((0, 3), (4, 2)), ((4, 0), (3, 3)), ((4, 3), (3, 2))]
    assert chunks(tmp_path, "bcast") == [((0, 0), (4, 5)), ((4, 0), (3, 5))], "the broadcast axis writes one copy"
    # partial axes are reduce-scattered to splits of the largest dim before writing
    assert chunks(tmp_path, "partial") == [((0, 0), (2, 5)), ((2, 0), (2, 5)), ((4, 0), (2, 5)), ((6, 0), (1, 5))]
    assert chunks(tmp_path, "scalar") == [((), ())]
    for f in tmp_path.iterdir():
        assert b"globaltensor" not in f.read_bytes(), f"{f.name} pickles a globaltensor object"
    out = {k: torch.zeros_like(v.full_tensor()) for k, v in state.items()}
    dcp.load(out, checkpoint_id=tmp_path)     # plain tensors, read with weights_only=True
    assert torch.equal(out["split"], x) and torch.equal(out["bcast"], x) and torch.equal(out["partial"], x)
    assert out["scalar"].item() == 3.0


LAYOUTS_1D = st.sampled_from([S(0), S(1), B, P])
LAYOUTS_2D = st.tuples(LAYOUTS_1D, LAYOUTS_1D)


@settings(max_examples=20, deadline=None)
@given(shape=st.tuples(st.integers(0, 7), st.integers(1, 6)), saved=st.one_of(LAYOUTS_1D, LAYOUTS_2D),
       loaded=st.one_of(LAYOUTS_1D, LAYOUTS_2D), sub=st.booleans())
@example(shape=(2, 3), saved=(S(0), S(0)), loaded=S(0), sub=False)   # rank 1's empty piece starts at rank 2's row
def test_any_saved_layout_loads_into_any_other(tmp_path_factory, shape, saved, loaded, sub):
    """Shapes uneven and empty; 1-D, 2x2 and a 2-rank subset placement on either side; exact (float64)."""
    path = tmp_path_factory.mktemp("ckpt")
    x = torch.randn(shape, dtype=torch.float64)
    with gt.simulate(4):
        def placement(nd):
            return gt.placement("cpu", [[0, 1], [2, 3]] if isinstance(nd, tuple) else ([1, 3] if sub else [0, 1, 2, 3]))
        src = gt.distribute(x, placement(saved), saved)
        dcp.save({"x": src}, checkpoint_id=path)
        dst = gt.full(shape, 9.0, dtype=torch.float64, placement=placement(loaded), sbp=loaded)
        dcp.load({"x": dst}, checkpoint_id=path)
        assert torch.equal(dst.full_tensor(), x), (saved, loaded)


def test_module_and_zero_optimizer_resume_exactly(tmp_path, p1):
    """Saved after 2 steps and loaded into a fresh model and optimizer of the same layout, 2 more steps
    give the uninterrupted run's losses bit for bit (the same sums in the same order)."""
    def make():
        model = net().double()
        gnn.distribute_module(model, p1, MEGATRON_1D)
        return model, gnn.ZeroOptimizer(model.parameters(), torch.optim.Adam, axis=0, lr=0.02)

    xs = program.batches()[:4]
    model, opt = make()
    program.train(model, opt, p1, B, xs[:2])
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=tmp_path)
    uninterrupted = program.train(model, opt, p1, B, xs[2:])
    model, opt = make()
    gnn.init_optimizer_state(opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    assert program.train(model, opt, p1, B, xs[2:]) == uninterrupted


def test_dcp_to_torch_save_gives_plain_tensors_a_single_device_model_loads(tmp_path, p2):
    model = net().double()
    gnn.distribute_module(model, p2, gnn.megatron_plan(column=["*.up"], row=["*.down"], axis=1, ndim=2))
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "dcp")
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    assert all(type(v) is torch.Tensor for v in full.values())
    single = net(seed=1).double()
    single.load_state_dict(full)
    x = torch.randn(8, 6, dtype=torch.float64)
    out = model(gt.distribute(x, p2, (S(0), B))).full_tensor()
    torch.testing.assert_close(single(x), out, rtol=1e-12, atol=1e-12)   # float64, sums in another order


def test_initialising_optimizer_state_leaves_parameters_alone(p1):
    model = net().double()
    gnn.distribute_module(model, p1)
    before = {k: v.full_tensor() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    assert gnn.init_optimizer_state(opt) is opt
    assert set(opt.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.param_groups[0]["lr"] == 0.1
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v.full_tensor(), before[k]) for k, v in model.state_dict().items())
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer"):
        gnn.init_optimizer_state(model)


def test_a_piece_this_process_does_not_hold_is_named(p1):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    x = gt.zeros(8, 2, placement=p1, sbp=S(0))
    with pytest.raises(ValueError, match=r"w: this process holds no piece .* at offsets \(1, 0\)"):
        x.__get_tensor_shard__(MetadataIndex("w", torch.Size([1, 0])))


@pytest.mark.parametrize("saved,loaded", [
    ((S(0), S(1, blocks=3)), S(1)), (S(0), (B, S(1, blocks=3))), (S(1, blocks=3), (S(1, blocks=3), P))])
def test_blocked_splits_save_a_chunk_per_block_and_load_in_place(tmp_path, saved, loaded):
    """A blocked piece is its part of each block: one chunk per block, at that block's offsets."""
    x = torch.randn(6, 12, dtype=torch.float64)
    with gt.simulate(4):
        def placement(nd):
            return gt.placement("cpu", [[0, 1], [2, 3]] if isinstance(nd, tuple) else [0, 1, 2, 3])
        dcp.save({"x": gt.distribute(x, placement(saved), saved)}, checkpoint_id=tmp_path)
        dst = gt.full((6, 12), 9.0, dtype=torch.float64, placement=placement(loaded), sbp=loaded)
        dcp.load({"x": dst}, checkpoint_id=tmp_path)
        assert torch.equal(dst.full_tensor(), x)
    if saved == S(1, blocks=3):
        assert chunks(tmp_path, "x") == [((0, c), (6, 1)) for c in range(12)]
