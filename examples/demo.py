"""Train a small GPT on 4 ranks with 2-D (data x tensor) parallelism, eagerly and compiled, beside a single-device run.

    python examples/demo.py                                          # 4 CPU-simulated ranks, one process
    python -m globaltensor.launch --nproc-per-node 4 examples/demo.py  # 4 processes (gloo)

The model (examples/gpt.py) is plain PyTorch. ``gt.nn.distribute_module`` lays its
parameters out on a 2x2 placement -- axis 0 is the data axis, axis 1 the tensor axis -- with
a Megatron-style plan: attention's qkv and the MLP's fc1 column parallel, attention's proj
and the MLP's fc2 row parallel on the tensor axis, everything replicated on the data axis.
The batch is split over the data axis. Three copies of the model start from one
initialisation and see the same batches: the distributed model stepped eagerly, the same
distributed model stepped by ``gt.compile(train_step)`` (call 0 runs eagerly, call 1 captures
the graph, later calls run it on the actor runtime), and the model on one device. Every step
prints the three losses, the bytes the step communicated (the most any one rank sent), its
collectives and its time.

The table is float32. The verdict is not taken from it: float32 rounding differs from CPU to
CPU (vector width, blocking), and AdamW blows some of it up (see TOLERANCE). The same three
runs are repeated in float64, where two programs that agree in exact arithmetic agree to
TOLERANCE on any machine.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings
from collections import Counter
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import globaltensor as gt  # noqa: E402
import globaltensor.nn as gnn  # noqa: E402
from gpt import TENSOR_PARALLEL, GPT, GPTConfig, make_batch  # noqa: E402

S, B = gt.sbp.split, gt.sbp.broadcast
RANKS = 4
DATA_AXIS, TENSOR_AXIS = 0, 1
LR, EPS = 1e-2, 1e-6

# The float64 runs must agree to TOLERANCE, measured as max |a - b| / (1 + |b|) over every loss
# and every parameter element (losses ~4, parameters ~0.1-1). They differ by rounding only: the
# order of sums (split matmuls, all-reduces, the compiled graph's gradient buckets); the compiled
# run's AdamW update is the eager one (the same update on the same pieces, nn/optim_pieces.py). A gradient entry sums n <= ~128 terms (the tokens of a
# batch, the MLP's hidden features) of size <= ~0.2 (its measured scale), so two runs' values of
# it differ by d <= n * u * 0.2 = 3e-15 at worst (u = 1.1e-16). AdamW divides each gradient by
# sqrt(v) + eps, so where a gradient is below eps (zero in exact arithmetic, like the key bias's:
# softmax ignores a constant added to every score, or merely small) it moves the parameter by up
# to lr * d / eps = 3e-11 per step: 1.5e-10 over 5 steps. Everywhere else the difference stays
# relative, ~n * u. The loss barely sees the first kind (its gradient there is below eps).
# TOLERANCE is ~7x that worst case (measured: ~2e-14). In float32 (u = 6e-8) the same path gives
# ~1e-5: the size of the rounding differences between CPUs, so no float32 tolerance would both
# hold everywhere and catch a real fault (a missing reduction, a wrong shard: ~LR).
TOLERANCE = 1e-9


def log(*args, **kwargs) -> None:
    """Print on rank 0 only (every rank runs the whole program)."""
    if gt.rank() == 0:
        print(*args, **kwargs, flush=True)


def setup_world() -> str:
    """4 simulated ranks in this process, unless a launcher started this process as one rank of a world."""
    if "WORLD_SIZE" not in os.environ:
        gt.simulate(RANKS)
        kind = f"{RANKS} CPU-simulated ranks in one process"
    else:
        kind = f"{gt.world_size()} processes (this is rank {gt.rank()})"
    if gt.world_size() != RANKS:
        raise SystemExit(f"demo: needs a world of {RANKS} ranks, got {gt.world_size()}")
    return kind


def describe_sharding(name: str, w) -> None:
    layout = w.layout_meta
    log(f"{name}: logical shape {tuple(w.shape)}, sbp {w.sbp} on placement {w.placement.ranks.tolist()}")
    for r in w.placement.rank_list():
        log(f"  rank {r} (data {w.placement.coord(r)[DATA_AXIS]}, tensor {w.placement.coord(r)[TENSOR_AXIS]}) "
            f"holds rows/cols {[(s, s + n) for s, n in layout.box(r)]} -> piece {layout.piece_shape(r)}")
    if gt.rank() == 0:
        gt.visualize(w)


@contextmanager
def default_dtype(dtype: torch.dtype):
    """``dtype`` as torch's default within. A float64 program needs it: AdamW's step counter takes the
    default dtype, and its bias corrections come from it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def train_step(model, opt):
    """One training step of ``model``: what the eager runs call and what ``gt.compile`` captures."""
    def step(idx, targets):
        loss = model.loss(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def timed(step, *args):
    """``step(*args)``, its collectives and its time."""
    start = time.perf_counter()
    with gt.comm_stats() as stats:
        loss = step(*args)
    return loss, stats, time.perf_counter() - start


def error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / (1 + |b|): relative where |b| > 1, absolute below."""
    return ((a - b).abs() / (1 + b.abs())).max().item()


HEADER = (f"\n{'':4} {' loss ':-^29} {' bytes sent ':-^21} {' collectives ':-^15} {' time per step ':-^17}\n"
          f"{'step':>4} {'4 ranks':>9} {'compiled':>9} {'1 device':>9} {'eager':>10} {'compiled':>10} "
          f"{'eager':>6} {'compiled':>8} {'eager':>8} {'compiled':>8}")
MODES = ("(eager warm-up)", "(capture + run)")                      # the compiled calls 0 and 1
COMPARISONS = {"4 ranks vs 1 device": ("eager", "reference"), "compiled vs eager": ("compiled", "eager")}


def train(steps: int = 5, batch: int = 8, seq: int = 16, cfg: GPTConfig = GPTConfig(),
          dtype: torch.dtype = torch.float32, show: bool = True) -> dict:
    """Train the eager distributed model, its compiled copy and the single-device reference side by side
    in ``dtype``, printing the table when ``show`` (else a progress line per step); returns what was measured."""
    placement = gt.placement("cpu", ranks=[[0, 1], [2, 3]])          # axis 0: data, axis 1: tensor
    plan = gnn.megatron_plan(**TENSOR_PARALLEL, axis=TENSOR_AXIS, ndim=2)
    batch_sbp = (S(0), B)                                            # batch split over the data axis
    torch.manual_seed(0)                                             # the same init on every rank
    reference = GPT(cfg).to(dtype)                                   # initialised in float32 either way
    models = {"eager": copy.deepcopy(reference), "compiled": copy.deepcopy(reference), "reference": reference}
    for name in ("eager", "compiled"):
        gnn.distribute_module(models[name], placement, plan)
    steppers = {name: train_step(m, torch.optim.AdamW(m.parameters(), lr=LR, eps=EPS)) for name, m in models.items()}
    # "device": the simulated ranks share this process's CPU streams (one compute, one collective
    # thread) instead of a thread per rank and stream, which the GIL would only make contend
    steppers["compiled"] = gt.compile(steppers["compiled"], streams="device")
    if show:
        log("plan:")
        for pattern, sbp in plan.items():
            log(f"  {pattern:24s} {sbp}")
        describe_sharding("blocks.0.attn.qkv.weight", models["eager"].blocks[0].attn.qkv.weight)
        log(HEADER)

    data = torch.Generator().manual_seed(1234)                       # the same batches on every rank
    losses = {name: [] for name in models}
    comm = {"eager": [], "compiled": []}
    with default_dtype(dtype):
        for step in range(steps):
            idx, targets = make_batch(cfg, batch, seq, data)
            args = (gt.distribute(idx, placement, batch_sbp), gt.distribute(targets, placement, batch_sbp))
            loss_e, stats_e, time_e = timed(steppers["eager"], *args)
            loss_c, stats_c, time_c = timed(steppers["compiled"], *args)
            loss_r = steppers["reference"](idx, targets)
            for name, loss in (("eager", loss_e), ("compiled", loss_c), ("reference", loss_r)):
                losses[name].append(loss.item())                     # a collective: every rank calls it
            comm["eager"].append(stats_e)
            comm["compiled"].append(stats_c)
            if show:
                log(f"{step:>4} {losses['eager'][-1]:>9.6f} {losses['compiled'][-1]:>9.6f} "
                    f"{losses['reference'][-1]:>9.6f} {stats_e.bytes_sent:>10,} {stats_c.bytes_sent:>10,} "
                    f"{stats_e.count:>6} {stats_c.count:>8} {time_e:>7.3f}s {time_c:>7.3f}s "
                    f"{MODES[step] if step < len(MODES) else ''}".rstrip())
            else:
                log(f"  {str(dtype).removeprefix('torch.')} run: step {step + 1}/{steps} done")
    if show:
        for name, stats in comm.items():
            log(f"collectives per step, {name}: "
                + ", ".join(f"{op} x{n}" for op, n in sorted(Counter(stats[-1].ops()).items())))

    with torch.no_grad():                                            # full_tensor: a collective, every rank
        params = {name: [p if name == "reference" else p.full_tensor() for p in m.parameters()]
                  for name, m in models.items()}
    loss = {name: torch.tensor(v, dtype=torch.float64) for name, v in losses.items()}
    errors = {what: (error(loss[a], loss[b]), max(error(x, y) for x, y in zip(params[a], params[b])))
              for what, (a, b) in COMPARISONS.items()}
    return {"losses": losses, "bytes_sent": {name: [st.bytes_sent for st in c] for name, c in comm.items()},
            "collectives": {name: [st.count for st in c] for name, c in comm.items()},
            "errors": errors, "captures": steppers["compiled"].captures}


def verdict(result: dict) -> bool:
    """Whether every comparison of a float64 ``train`` result is within TOLERANCE."""
    return all(e <= TOLERANCE for pair in result["errors"].values() for e in pair)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    kind = setup_world()
    log(f"globaltensor demo: a {GPTConfig().n_layer}-layer GPT on {kind}, placement 2x2 (data x tensor)\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(steps=args.steps)
        log("\nfor the verdict, the same three runs in float64:")
        check = train(steps=args.steps, dtype=torch.float64, show=False)
    missing = sorted({str(w.message).split(" has no SBP rule")[0].removeprefix("globaltensor: ")
                      for w in caught if "has no SBP rule" in str(w.message)})
    if missing:
        log(f"ops that ran through the gather-to-broadcast fallback (no SBP rule yet): {', '.join(missing)}")
    for w in caught:
        if "has no SBP rule" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    log(f"\nthe same three runs in float64, max |a - b| / (1 + |b|) after {args.steps} steps:")
    for what, (loss_err, param_err) in check["errors"].items():
        log(f"  {what:19s} losses {loss_err:.1e}, parameters {param_err:.1e}")
    ok = verdict(check)
    log(f"{'OK' if ok else 'MISMATCH'}: in float64 the 4-rank run {'matches' if ok else 'does not match'} the "
        f"single-device run and the compiled run the eager one, to {TOLERANCE:.0e}; "
        f"total {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
