"""The setups the documentation's Python blocks start from.

A page that says its blocks start from [`setups.NAME()`](setups.py) means: each block runs as if
after ``globals().update(setups.NAME())`` -- a 4-rank simulated world, the names below, nothing
else. tests/docs/test_doc_blocks.py runs every block that way (a page without a named setup runs
its blocks in order, its first block being the setup).

Run from the repository's root (examples/gpt.py is the model of the pages).
"""
from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

import globaltensor as gt

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import demo  # noqa: E402
from gpt import GPT, MLP, TENSOR_PARALLEL, GPTConfig, make_batch  # noqa: E402


def _world_names() -> dict:
    torch.manual_seed(0)
    S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
    p = gt.placement("cpu", ranks=[0, 1, 2, 3])
    return dict(torch=torch, F=F, nn=nn, gt=gt, S=S, B=B, P=P, p=p, placement=p,
                p2=gt.placement("cpu", ranks=[[0, 1], [2, 3]]),
                x=gt.randn(16, 32, placement=p, sbp=S(0)), w=gt.randn(32, 8, placement=p, sbp=B))


def simulated() -> dict:
    """4 simulated ranks; ``torch``, ``F``, ``nn``, ``gt``; ``S``, ``B``, ``P`` (split, broadcast,
    partial sum); ``p`` and ``placement`` (ranks ``[0, 1, 2, 3]``), ``p2`` (``[[0, 1], [2, 3]]``);
    ``x``, a global 16 x 32 float32 tensor split on its rows, and ``w``, a global 32 x 8 one,
    broadcast."""
    gt.simulate(4)
    return _world_names()


def processes() -> dict:
    """The names of :func:`simulated`, in a world of 4 processes, this one of them (launched by
    ``python -m globaltensor.launch --nproc-per-node 4`` or torchrun)."""
    if gt.world_size() != 4:
        raise RuntimeError(f"setups.processes(): expected a launched world of 4 processes, got {gt.world_size()} rank(s)")
    return _world_names()


def gpt() -> dict:
    """:func:`simulated`, and examples/gpt.py's GPT at its default size, on one device: ``model``
    (``cfg``: ``GPTConfig()``; ``vocab``, its vocabulary; ``half``, half its layers), a batch of 16
    sequences of 16 token ids ``idx`` and their next tokens ``targets`` (plain tensors), and
    ``GPT``, ``GPTConfig``, ``MLP``, ``TENSOR_PARALLEL``, ``make_batch``."""
    names = simulated()
    cfg = GPTConfig()
    idx, targets = make_batch(cfg, 16, 16, torch.Generator().manual_seed(0))
    names.update(GPT=GPT, GPTConfig=GPTConfig, MLP=MLP, TENSOR_PARALLEL=TENSOR_PARALLEL, make_batch=make_batch,
                 cfg=cfg, model=GPT(cfg), vocab=cfg.vocab_size, half=cfg.n_layer // 2, idx=idx, targets=targets)
    return names


def data_parallel() -> dict:
    """:func:`gpt`, the model distributed data parallel (``plan``: the empty plan, every parameter
    broadcast) with ``opt`` its AdamW, after one training step (``train_step(x, y)``: demo.py's step,
    forward, backward, AdamW; returns the loss); the batch split on its rows (``idx`` and
    ``targets``, also ``x`` and ``y``) and ``micro_batches`` (4 such batches of 4 sequences),
    ``params`` (the model's parameters), ``build()`` (a fresh GPT like ``model``), ``single`` (one,
    on one device), ``path`` (an empty folder), ``dcp`` (``torch.distributed.checkpoint``) and
    ``contextlib``."""
    names = gpt()
    model, p, S = names["model"], names["p"], names["S"]
    plan: dict = {}
    gt.nn.distribute_module(model, p, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, targets = (gt.distribute(t, p, S(0)) for t in (names["idx"], names["targets"]))
    train_step = demo.train_step(model, opt)
    train_step(idx, targets)
    micro = [make_batch(names["cfg"], 4, 16, torch.Generator().manual_seed(i)) for i in range(4)]
    names.update(plan=plan, opt=opt, idx=idx, targets=targets, x=idx, y=targets, train_step=train_step,
                 micro_batches=[tuple(gt.distribute(t, p, S(0)) for t in batch) for batch in micro],
                 params=list(model.parameters()), build=lambda: GPT(names["cfg"]), single=GPT(names["cfg"]),
                 path=tempfile.mkdtemp(prefix="globaltensor-docs-"), dcp=dcp, contextlib=contextlib)
    return names
