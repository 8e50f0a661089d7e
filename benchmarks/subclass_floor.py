"""The floor under any eager Python tensor subclass, on the data-parallel GPT step of actor_runtime.py.

    .venv/bin/python benchmarks/subclass_floor.py [--quick]

One process, one data-parallel rank's compute (half the batch, no communication): the same
training step (forward, backward, SGD) on plain torch tensors, on a *thin* ``__torch_dispatch__``
wrapper subclass that only unwraps, calls and rewraps (one level of lists, tuple results and
autograd: the least a subclass needs to train), and on globaltensor (every parameter broadcast
over one rank, the batch split over it). Every op of the step crosses from C++ into Python for
the two subclasses; DDP runs none of that. The ratio thin / plain is what any Python subclass
pays on this step, before distributing anything: a data-parallel step against DDP cannot go below
it. Rounds interleaved, ratios paired per round (see _harness.py).

``--hybrid``: the same for one rank of hybrid_gpt.py's 2x2 step -- its hand-written Megatron shards
(tensor rank 0 of 2) on half the batch, Megatron's f / g as identities (no communication) -- plain
against thin: the floor under the hybrid step's goal.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import _harness as H
from actor_runtime import GPT_BATCH, GPT_EMBD, GPT_HEADS, GPT_LAYERS, GPT_LR, GPT_SEQ, GPT_VOCAB


def thin_training_class():
    """A wrapper subclass that unwraps its pieces (and one level of lists), calls the op and
    rewraps every tensor result, keeping ``requires_grad``: the floor of a trainable subclass."""
    import torch

    class Thin(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        @staticmethod
        def __new__(cls, piece, requires_grad=False):
            t = torch.Tensor._make_wrapper_subclass(cls, piece.shape, strides=piece.stride(), dtype=piece.dtype,
                                                    device=piece.device, requires_grad=requires_grad)
            t._piece = piece
            return t

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            def unwrap(a):
                if type(a) is Thin:
                    return a._piece
                if type(a) in (list, tuple):
                    return type(a)(x._piece if type(x) is Thin else x for x in a)
                return a
            out = func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})
            if isinstance(out, torch.Tensor):
                return Thin(out)
            if type(out) in (list, tuple):
                return type(out)(Thin(o) if isinstance(o, torch.Tensor) else o for o in out)
            return out
    return Thin


def thin_parameters(model, Thin):
    """``model`` with every parameter a ``Thin`` one."""
    import torch

    for name, p in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(Thin(p.detach().clone(), requires_grad=True)))
    return model


def _gpt_and_half_batch(embd: int) -> tuple:
    """actor_runtime.py's GPT at width ``embd`` (seeded), and one data-parallel rank's batch."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from gpt import GPT, GPTConfig, make_batch

    cfg = GPTConfig(vocab_size=GPT_VOCAB, block_size=GPT_SEQ, n_layer=GPT_LAYERS, n_head=GPT_HEADS, n_embd=embd)
    torch.manual_seed(0)
    base = GPT(cfg)
    idx, tgt = make_batch(cfg, GPT_BATCH // 2, GPT_SEQ, torch.Generator().manual_seed(1))
    return base, idx, tgt


def _settings(quick: bool) -> dict:
    return dict(warmup=1, repeats=3, inner=1) if quick else dict(warmup=2, repeats=11, inner=1)


def _worker_hybrid(rank: int, world: int, quick: bool, embd: int = GPT_EMBD) -> dict:
    """One rank's compute of the 2x2 hybrid step (see the module docstring): plain / thin."""
    import torch

    from hybrid_gpt import megatron_shards

    Thin = thin_training_class()
    base, idx, tgt = _gpt_and_half_batch(embd)

    def identity(x):
        return x

    plain = megatron_shards(base, 0, 2, identity, identity)
    thin = thin_parameters(megatron_shards(base, 0, 2, identity, identity), Thin)

    def stepper(model, i, t):
        opt = torch.optim.SGD(model.parameters(), lr=GPT_LR)
        return lambda: H.logits_step(model, opt, i, t)

    steps = {"plain": stepper(plain, idx, tgt), "thin": stepper(thin, Thin(idx), Thin(tgt))}
    losses = [float(steps["plain"]().detach()), float(steps["thin"]().detach()._piece)]
    if abs(losses[0] - losses[1]) > 1e-4 * abs(losses[0]):
        raise AssertionError(f"subclass floor (hybrid): plain and thin disagree: {losses}")
    return dict(times=H.timed_many(steps, sync=False, **_settings(quick)))


def _worker(rank: int, world: int, quick: bool, embd: int = GPT_EMBD) -> dict:
    import copy

    import torch

    import globaltensor as gt

    Thin = thin_training_class()
    base, idx, tgt = _gpt_and_half_batch(embd)

    def stepper(model, i, t):
        opt = torch.optim.SGD(model.parameters(), lr=GPT_LR)
        return lambda: H.sgd_step(model, opt, i, t)

    plain, thin, glob = copy.deepcopy(base), thin_parameters(copy.deepcopy(base), Thin), copy.deepcopy(base)
    p1 = gt.placement("cpu", [0])
    gt.nn.distribute_module(glob, p1)
    S = gt.sbp.split
    steps = {"plain": stepper(plain, idx, tgt), "thin": stepper(thin, Thin(idx), Thin(tgt)),
             "gt": stepper(glob, gt.distribute(idx, p1, S(0)), gt.distribute(tgt, p1, S(0)))}
    read = {"plain": float, "thin": lambda v: float(v._piece), "gt": lambda v: float(v.full_tensor())}
    losses = {k: read[k](s().detach()) for k, s in steps.items()}
    if max(losses.values()) - min(losses.values()) > 1e-4 * abs(losses["plain"]):
        raise AssertionError(f"subclass floor: the three steps disagree: {losses}")
    return dict(times=H.timed_many(steps, sync=False, **_settings(quick)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--embd", type=int, default=GPT_EMBD, help="the GPT's width (default %(default)s)")
    ap.add_argument("--hybrid", action="store_true", help="one rank of the 2x2 hybrid step instead (plain / thin)")
    args = ap.parse_args(argv)
    print(H.header("subclass_floor"))
    print(f"n_embd {args.embd}" + (", one rank of the 2x2 hybrid step" if args.hybrid else ""))
    t0 = time.time()
    t = H.spawn(_worker_hybrid if args.hybrid else _worker, 1, args.quick, args.embd)["times"]
    print(H.table(["step", "ms", "min ms", "/ plain (paired)"],
                  [[k, H.fmt(t[k]), H.fmt(t[k].min), f"{H.paired_ratio(t[k], t['plain']):.3f}x"] for k in t]))
    if "gt" in t:
        print(f"gt / thin (paired): {H.paired_ratio(t['gt'], t['thin']):.3f}x")
    print(f"\n(total {time.time() - t0:.0f} s; load average at the end {H.load_average()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
