"""Save a checkpoint on one world and load it on another with other layouts (torch.distributed.checkpoint).

``save DIR`` runs on 2 ranks, ``load DIR`` on 4; tests/checkpoint runs the same functions on
simulated worlds of those sizes and tests/multiprocess/test_checkpoint.py launches them as gloo
processes. Each prints ``RESULT {json}`` on rank 0: the logical values it ended with (every
rank takes part in ``full_tensor``) and the training losses.

Saved on 2 ranks: tensors of uneven shapes as S(0), B, P (pieces that sum to the value), a 0-dim
B and an empty tensor; a float64 model with AdamW sharded by ``gt.nn.ZeroOptimizer`` after 3 data-
parallel steps (its losses, and the 3 steps after the save: the uninterrupted run). Loaded on 4
ranks: the tensors into S(1), 2x2 (S(1), B), B, P and 2x2 (B, S(0)) targets; the model on a 2x2
data x Megatron-tensor placement, trained 3 more steps from the loaded state.
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import globaltensor as gt
from launched_values import logical
import globaltensor.nn as gnn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from nn_models import MEGATRON_2D, TOL, net  # noqa: E402

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
SHAPES = {"a": (7, 5), "b": (6, 3), "c": (5, 3), "e": (), "z": (0, 4)}
STEPS = 3


def value_of(name):
    """The value of tensor ``name``: float64, the same on every rank and in the test process."""
    return logical(SHAPES[name], name, torch.float64)


def batches():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(8, 6, generator=gen, dtype=torch.float64) for _ in range(2 * STEPS)]


def train(model, opt, placement, batch_sbp, xs):
    losses = []
    for x in xs:
        loss = model(gt.distribute(x, placement, batch_sbp)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def model_and_optimizer(placement, plan):
    model = net().double()
    gnn.distribute_module(model, placement, plan)
    return model, gnn.ZeroOptimizer(model.parameters(), torch.optim.AdamW, axis=0, lr=0.01)


def save(path) -> dict:
    p = gt.placement("cpu", [0, 1])
    n = len(p.rank_list())
    tensors = {
        "a": gt.distribute(value_of("a"), p, S(0)),
        "b": gt.distribute(value_of("b"), p, B),
        "c": gt.to_global(value_of("c") / n, p, P),          # each rank's piece; halving is exact
        "e": gt.distribute(value_of("e"), p, B),
        "z": gt.distribute(value_of("z"), p, S(0)),
    }
    model, opt = model_and_optimizer(p, {})
    xs = batches()
    losses = train(model, opt, p, S(0), xs[:STEPS])
    dcp.save({"tensors": tensors, "model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    uninterrupted = losses + train(model, opt, p, S(0), xs[STEPS:])
    return {"uninterrupted": uninterrupted}


def load(path) -> dict:
    p1 = gt.placement("cpu", [0, 1, 2, 3])
    p2 = gt.placement("cpu", [[0, 1], [2, 3]])
    targets = {
        "a": [(p1, S(1)), (p2, (S(1), B)), (p1, P)],
        "b": [(p1, S(1)), (p2, (B, S(0)))],
        "c": [(p1, B), (p2, (S(0), S(1)))],
        "e": [(p1, P)],
        "z": [(p2, (S(0), B))],
    }
    out = {"tensors": {}}
    for name, layouts in targets.items():
        for i, (placement, sbp) in enumerate(layouts):
            t = gt.full(SHAPES[name], 7.0, dtype=torch.float64, placement=placement, sbp=sbp)
            dcp.load({"tensors": {name: t}}, checkpoint_id=path)
            out["tensors"][f"{name}/{i}"] = t.full_tensor().tolist()
    model, opt = model_and_optimizer(p2, MEGATRON_2D)
    gnn.init_optimizer_state(opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    out["resumed"] = train(model, opt, p2, (S(0), B), batches()[STEPS:])
    return out


def check(saved: dict, loaded: dict) -> None:
    """Every loaded tensor equals its saved logical value exactly (data movement only, float64); the
    resumed losses equal the uninterrupted run's to nn_models.TOL (the 2x2 run sums in another order)."""
    for key, value in loaded["tensors"].items():
        want = value_of(key.split("/")[0])
        got = torch.tensor(value, dtype=torch.float64).reshape(want.shape)
        assert torch.equal(got, want), f"{key}: loaded {got} != saved {want}"
    assert len(loaded["tensors"]) == 9
    uninterrupted = torch.tensor(saved["uninterrupted"], dtype=torch.float64)
    torch.testing.assert_close(torch.tensor(loaded["resumed"], dtype=torch.float64), uninterrupted[STEPS:], **TOL)

if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    result = {"save": save, "load": load}[mode](path)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)
