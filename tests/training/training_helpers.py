"""Train examples/gpt.py's GPT on global tensors beside the same model on one device."""
from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

import torch

import globaltensor as gt
import globaltensor.nn as gnn
from globaltensor.tensor import GlobalTensor
from reference_checks import check_gradients, check_parameters

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from gpt import TENSOR_PARALLEL, GPT, GPTConfig, make_batch  # noqa: E402
from demo import default_dtype, train_step  # noqa: E402, F401 -- for test_compiled_gpt: the step demo.py compiles

S, B = gt.sbp.split, gt.sbp.broadcast
CFG = GPTConfig()                      # vocab 64, d 32, 4 heads, 2 layers, block 16
BATCH, SEQ = 8, 16
# Runs are compared in float64 (models initialised in float32, then converted); they differ by the
# order of sums only (split matmuls, all-reduces). A gradient entry sums n <= ~128 terms of size
# <= ~0.2, so it differs by d <= n * u * 0.2 = 3e-15 at worst (u = 1.1e-16). SGD moves parameters
# by lr * d; Adam/AdamW, dividing by sqrt(v) + eps, by up to lr * d / eps = 1e-2 / 1e-6 * d = 3e-11
# where a gradient is below eps (zero in exact arithmetic, like the key bias's): ~1e-10 over the
# steps here. TOL is ~10x that (examples/demo.py's TOLERANCE says more). In float32 (u = 6e-8) the
# same path gives ~1e-5, the size of the rounding differences between CPUs (vector widths), so no
# float32 tolerance both holds on every machine and catches a real fault.
TOL = dict(rtol=1e-9, atol=1e-9)


def megatron(axis: int = 0, ndim: int = 1) -> dict:
    return gnn.megatron_plan(**TENSOR_PARALLEL, axis=axis, ndim=ndim)


@dataclass
class Run:
    model: GPT
    reference: GPT
    optimizer: object
    losses: List[float] = field(default_factory=list)
    ref_losses: List[float] = field(default_factory=list)


def train_gpt_side_by_side(placement, plan, batch_sbp, optimizer: Tuple[type, dict], *, zero_axis: Optional[int] = None,
                       steps: int = 3, cfg: GPTConfig = CFG) -> Run:
    """``steps`` steps of the distributed model and of the single-device reference from the same init
    and data, in float64 (see TOL). Checks each step: the losses agree, every gradient equals the
    reference's and has its parameter's sbp (with ``zero_axis``: every shard's gradient has its
    shard's sbp); at the end every parameter equals the reference's."""
    torch.manual_seed(0)
    model = GPT(cfg).double()
    reference = copy.deepcopy(model)
    gnn.distribute_module(model, placement, plan)
    cls, kwargs = optimizer
    ref_opt = cls(reference.parameters(), **kwargs)
    if zero_axis is None:
        opt = cls(model.parameters(), **kwargs)
    else:
        opt = gnn.ZeroOptimizer(model.parameters(), cls, axis=zero_axis, **kwargs)
    run = Run(model, reference, opt)
    data = torch.Generator().manual_seed(1)
    names = [n for n, _ in model.named_parameters()]
    for step in range(steps):
        idx, targets = make_batch(cfg, BATCH, SEQ, data)
        loss = model.loss(gt.distribute(idx, placement, batch_sbp), gt.distribute(targets, placement, batch_sbp))
        ref_loss = reference.loss(idx, targets)
        assert isinstance(loss, GlobalTensor)
        torch.testing.assert_close(loss.full_tensor(), ref_loss, **TOL, msg=lambda m: f"step {step} loss: {m}")
        loss.backward()
        ref_loss.backward()
        if zero_axis is None:
            check_gradients(step, ((n, p.grad, p.sbp) for n, p in zip(names, model.parameters())),
                            reference.parameters(), TOL)
        opt.step()
        ref_opt.step()
        if zero_axis is not None:
            shards = [opt.shard_of(p) for p in model.parameters()]
            check_gradients(step, ((n, s.grad, s.sbp) for n, s in zip(names, shards)), reference.parameters(), TOL)
            for name, p, s in zip(names, model.parameters(), shards):     # and read as the shards hold them
                assert p.grad.sbp == s.sbp, f"step {step}: {name}.grad has sbp {p.grad.sbp}, shard {s.sbp}"
        opt.zero_grad()
        ref_opt.zero_grad()
        run.losses.append(loss.item())
        run.ref_losses.append(ref_loss.item())
    assert all(p.placement == placement for p in model.parameters())
    check_parameters(names, model.parameters(), reference.parameters(), TOL, f"after {steps} steps")
    assert run.losses[-1] < run.losses[0], f"the model did not train: losses {run.losses}"
    return run


