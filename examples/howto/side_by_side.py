"""What every how-to shares: the command line, the world, the small GPT, and a training loop that
steps the distributed model beside the same model on one device, printing progress as it goes.

A how-to builds its distributed model and its ``step(idx, targets) -> loss`` (forward, backward,
optimizer step) and hands them to :func:`train`, which feeds both models the same batches, prints
one line per step (the two losses, the bytes the step sent, its collectives and time) and at the
end the largest parameter difference. ``--float64`` runs both in float64, where the difference is
rounding only and must stay under examples/demo.py's TOLERANCE (its comment derives the bound for
this model, optimizer and learning rate); the tests run every how-to that way, at ``--tiny`` size.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

EXAMPLES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import globaltensor as gt  # noqa: E402
from demo import EPS, LR, TOLERANCE, default_dtype, error  # noqa: E402, F401  (LR, EPS: for the how-tos)
from gpt import GPT, GPTConfig, make_batch  # noqa: E402

RANKS = 4
#: ``--tiny``: the smallest model every how-to runs on (2 layers, for the pipeline's two stages;
#: 4 heads, for 4-way tensor parallelism), a few steps; the tests use it.
TINY = dict(cfg=GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16), batch=8, seq=8, steps=3)
FULL = dict(cfg=GPTConfig(), batch=16, seq=16, steps=20)


def parse_args(doc: str, argv=None, more: Optional[Callable] = None) -> argparse.Namespace:
    """``--tiny``, ``--steps``, ``--float64`` (and what ``more(parser)`` adds); the description is the
    first line of the how-to's docstring."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if more is not None:
        more(parser)
    parser.add_argument("--tiny", action="store_true", help="the tiny model and a few steps (what the tests run)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: 20, or 3 with --tiny)")
    parser.add_argument("--float64", action="store_true",
                        help=f"train in float64, where the runs must agree to {TOLERANCE:g}")
    args = parser.parse_args(argv)
    size = TINY if args.tiny else FULL
    args.cfg, args.batch, args.seq = size["cfg"], size["batch"], size["seq"]
    args.steps = size["steps"] if args.steps is None else args.steps
    args.dtype = torch.float64 if args.float64 else torch.float32
    return args


def setup_world(ranks: int = RANKS) -> None:
    """``ranks`` simulated ranks in this process, unless a launcher made this process one rank of a world
    (or the caller already simulates ``ranks``)."""
    if "WORLD_SIZE" not in os.environ and gt.world_size() != ranks:
        gt.simulate(ranks)
    if gt.world_size() != ranks:
        raise SystemExit(f"needs a world of {ranks} ranks, got {gt.world_size()}")


def log(*args) -> None:
    """Print on rank 0 only (every rank runs the whole program)."""
    if gt.rank() == 0:
        print(*args, flush=True)


def models(args) -> tuple:
    """Two copies of the GPT from one initialisation (the same on every rank): the one to distribute
    and the single-device reference."""
    torch.manual_seed(0)
    reference = GPT(args.cfg).to(args.dtype)
    return copy.deepcopy(reference), reference


def adamw(params) -> torch.optim.AdamW:
    """The optimizer of every how-to and of the reference (examples/demo.py's settings)."""
    return torch.optim.AdamW(params, lr=LR, eps=EPS)


def describe(model: torch.nn.Module, names: List[str]) -> None:
    """Print the layout of the parameters ``names``."""
    params = dict(model.named_parameters())
    for name in names:
        p = params[name]
        log(f"  {name:28s} shape {str(tuple(p.shape)):10s} sbp {p.sbp} on {p.placement.ranks.tolist()}")


def adamw_step(model: torch.nn.Module) -> Callable:
    """``step(idx, targets) -> loss`` with plain AdamW over ``model``: forward, backward, update -- the
    reference's step, and that of the how-tos whose distributed model needs nothing more."""
    opt = adamw(model.parameters())

    def step(idx, targets):
        loss = model.loss(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def profile_one_step(model: torch.nn.Module, to_global: Callable, args) -> gt.CommProfile:
    """One forward and backward of a first batch, under ``gt.comm_profile(model)``; the gradients
    dropped after. What the how-tos print their layout's traffic from."""
    idx, targets = to_global(*make_batch(args.cfg, args.batch, args.seq, torch.Generator().manual_seed(0)))
    with gt.comm_profile(model) as prof:
        model.loss(idx, targets).backward()
    model.zero_grad()
    return prof


@dataclass
class Result:
    losses: List[float] = field(default_factory=list)
    reference_losses: List[float] = field(default_factory=list)
    bytes_sent: List[int] = field(default_factory=list)
    collectives: List[int] = field(default_factory=list)
    loss_error: float = 0.0
    parameter_error: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the runs agree to TOLERANCE (the bound for float64 runs)."""
        return self.loss_error <= TOLERANCE and self.parameter_error <= TOLERANCE


def train(model: torch.nn.Module, reference: torch.nn.Module, step: Callable, to_global: Callable, args,
          reference_step: Optional[Callable] = None, float32_differs_by: str = "the order of sums") -> Result:
    """``args.steps`` steps of ``step(*to_global(idx, targets))`` beside the reference's single-device
    step on the same batches (``reference_step(idx, targets) -> loss``; by default AdamW's), in
    ``args.dtype``; prints a line per step and the differences measured, saying what they come from
    in float32 (``float32_differs_by``)."""
    if reference_step is None:
        reference_step = adamw_step(reference)
    data = torch.Generator().manual_seed(1234)                 # the same batches on every rank
    result = Result()
    log(f"\n{'step':>9} {'loss':>9} {'1 device':>9} {'bytes sent':>11} {'collectives':>11} {'time':>8}")
    with default_dtype(args.dtype):
        for i in range(args.steps):
            idx, targets = make_batch(args.cfg, args.batch, args.seq, data)
            start = time.perf_counter()
            with gt.comm_stats() as stats:
                loss = step(*to_global(idx, targets))
            elapsed = time.perf_counter() - start
            ref_loss = reference_step(idx, targets)
            result.losses.append(loss.item())                  # a collective: every rank calls it
            result.reference_losses.append(ref_loss.item())
            result.bytes_sent.append(stats.bytes_sent)
            result.collectives.append(stats.count)
            log(f"{i + 1:>4}/{args.steps:<4} {result.losses[-1]:>9.5f} {result.reference_losses[-1]:>9.5f} "
                f"{stats.bytes_sent:>11,} {stats.count:>11} {elapsed * 1e3:>6.0f}ms")
    with torch.no_grad():                                      # full_tensor: a collective, every rank
        result.parameter_error = max(error(p.full_tensor().to(q.dtype), q)
                                     for p, q in zip(model.parameters(), reference.parameters()))
    result.loss_error = error(torch.tensor(result.losses, dtype=torch.float64),
                              torch.tensor(result.reference_losses, dtype=torch.float64))
    log(f"max |a - b| / (1 + |b|) against one device: losses {result.loss_error:.1e}, "
        f"parameters {result.parameter_error:.1e}"
        + (f" ({'OK' if result.ok else 'MISMATCH'}: float64 bound {TOLERANCE:g})" if args.float64 else
           f" (float32: the runs differ by {float32_differs_by}; --float64 checks them against the bound)"))
    return result
