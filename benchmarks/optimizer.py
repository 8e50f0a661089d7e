"""The optimizer step over a GPT's parameters: globaltensor beside plain torch and DTensor, foreach and fused.

    .venv/bin/python benchmarks/optimizer.py [--quick] [--embd 256] [--nproc 2]

Each of ``nproc`` gloo processes holds the GPT of actor_runtime.py (n_embd 256, 4 layers) and steps
AdamW over it five ways, rounds interleaved: plain torch over local tensors; globaltensor over global
parameters, its update on the pieces (nn/optim_pieces.py: torch's own update on plain tensors); the same
through the dispatcher, as before that path existed (each foreach or fused op one local call per group
of parameters); DTensor over DTensor parameters -- broadcast / ``Replicate`` (every rank updates the
whole model, as in data parallelism: the same work on each side) -- and subclass_floor.py's *thin*
wrapper subclass (it only unwraps, calls and rewraps: what torch charges any Python subclass to carry a
list op into ``__torch_dispatch__``, the floor of a step through a subclass), with ``foreach=True`` and
with ``fused=True``. ``--embd 32`` makes the tensors small enough that the step is its per-op costs, as
a GPU's launch-bound step is. The gradients are set once; the steps only update. The script counts the
global ops one globaltensor step dispatches (0: the update runs on the pieces) and checks that each
side's parameters match plain torch's after the same steps. Then, in one process, the foreach and fused
steps on 1 and 4 simulated ranks beside plain torch's over as many copies of the parameters (``_worker_sim``).
Goal (#47): globaltensor's step <= 1.1x plain torch's.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import _harness as H
from actor_runtime import GPT_EMBD, GPT_HEADS, GPT_LAYERS, GPT_VOCAB
from subclass_floor import thin_training_class

#: seconds a round of each side's steps lasts: a round of a few 0.3 ms steps right after a barrier times
#: the processes waking from it (on two shared cores) more than the step
ROUND_S = 0.02


def _params(embd: int):
    import torch
    sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "examples"))
    from gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=GPT_VOCAB, block_size=64, n_layer=GPT_LAYERS, n_head=GPT_HEADS, n_embd=embd))
    return [p.detach() for p in model.parameters()]


def _dispatched(step) -> int:
    """How many global ops one ``step()`` dispatches."""
    import globaltensor as gt
    before = gt.dispatch_cache_info()
    step()
    after = gt.dispatch_cache_info()
    return after.hits + after.misses - before.hits - before.misses


def _through_dispatcher(step):
    """``step`` with AdamW's update on global tensors op by op through the dispatcher (its path before
    the update on pieces): its lists global (none kept as pieces) and its update the original."""
    import torch
    import torch.optim.adam as adam_module
    from globaltensor.nn import optim_groups

    def run():
        on_pieces = adam_module.adam
        adam_module.adam = on_pieces.on_globals
        optim_groups.ON_PIECES.discard(torch.optim.AdamW)
        try:
            step()
        finally:
            adam_module.adam = on_pieces
            optim_groups.ON_PIECES.add(torch.optim.AdamW)
    return run


def _worker(rank: int, world: int, quick: bool, embd: int = GPT_EMBD):
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh
    import globaltensor as gt

    Thin = thin_training_class()
    values = _params(embd)
    placement = gt.placement("cpu", list(range(world)))
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(v.shape, generator=g) for v in values]
    sides = {
        "plain": [v.clone().requires_grad_() for v in values],
        "gt": [gt.distribute(v.clone(), placement, gt.sbp.broadcast).requires_grad_() for v in values],
        "gt dispatcher": [gt.distribute(v.clone(), placement, gt.sbp.broadcast).requires_grad_() for v in values],
        "dt": [distribute_tensor(v.clone(), mesh, [Replicate()]).requires_grad_() for v in values],
        "thin": [Thin(v.clone(), requires_grad=True) for v in values],
    }
    for name, ps in sides.items():
        for p, gr in zip(ps, grads):
            p.grad = gt.distribute(gr, placement, gt.sbp.broadcast) if name.startswith("gt") else \
                distribute_tensor(gr, mesh, [Replicate()]) if name == "dt" else Thin(gr.clone()) if name == "thin" \
                else gr.clone()
    result = {"params": len(values), "numel": sum(v.numel() for v in values), "times": {}, "calls": {}}
    for mode in ("foreach", "fused"):
        kw = {mode: True}
        opts = {name: torch.optim.AdamW(ps, lr=1e-4, **kw) for name, ps in sides.items()}
        steps = {name: _through_dispatcher(o.step) if name == "gt dispatcher" else o.step for name, o in opts.items()}
        fns = {f"{name} {mode}": step for name, step in steps.items()}
        times = H.timed_many(fns, warmup=3, repeats=5 if quick else 15,
                             inner=2 if quick else H.inner_for(fns, ROUND_S))
        result["times"].update(times)
        result["calls"][mode] = _dispatched(steps["gt"])        # one more step: the others take it too
        for name in ("plain", "dt", "thin", "gt dispatcher"):
            steps[name]()
    want = sides["plain"]
    whole = {"gt": lambda p: p.full_tensor(), "gt dispatcher": lambda p: p.full_tensor(),
             "dt": lambda p: p.full_tensor(), "thin": lambda p: p._piece}
    with torch.no_grad():
        for name, read in whole.items():
            result[f"max diff {name}"] = max(float((read(p) - w).abs().max()) for p, w in zip(sides[name], want))
    return result


def _worker_sim(rank: int, world: int, quick: bool, embd: int = GPT_EMBD, ranks=(1, 4)):
    """One process, ``gt.simulate(n)`` for each ``n`` of ``ranks``: AdamW (foreach, then fused) over the
    GPT's parameters broadcast on the n simulated ranks, beside plain torch's AdamW over n copies of the
    parameters -- the same tensors to update (each simulated rank holds a replica)."""
    import torch
    import globaltensor as gt

    values = _params(embd)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(v.shape, generator=g) for v in values]
    out = {}
    for n, mode in itertools.product(ranks, ("foreach", "fused")):
        with gt.simulate(n):
            placement = gt.placement("cpu", list(range(n)))
            plain = [v.clone().requires_grad_() for _ in range(n) for v in values]
            for p, gr in zip(plain, grads * n):
                p.grad = gr.clone()
            ours = [gt.distribute(v.clone(), placement, gt.sbp.broadcast).requires_grad_() for v in values]
            for p, gr in zip(ours, grads):
                p.grad = gt.distribute(gr, placement, gt.sbp.broadcast)
            opts = {"plain": torch.optim.AdamW(plain, lr=1e-4, **{mode: True}),
                    "gt": torch.optim.AdamW(ours, lr=1e-4, **{mode: True})}
            fns = {k: o.step for k, o in opts.items()}
            times = H.timed_many(fns, warmup=3, repeats=5 if quick else 15,
                                 inner=2 if quick else H.inner_for(fns, ROUND_S), sync=False)
            with torch.no_grad():
                diff = max(float((p.full_tensor() - w).abs().max()) for p, w in zip(ours, plain[:len(values)]))
            out[n, mode] = dict(times=times, diff=diff)
    return out


def report_sim(res) -> None:
    rows = [[f"AdamW {mode}, {n} simulated rank{'s' if n > 1 else ''}", H.fmt(r["times"]["plain"]),
             H.fmt(r["times"]["gt"]), f"{H.paired_ratio(r['times']['gt'], r['times']['plain']):.3f}x",
             f"{r['diff']:.1e}"] for (n, mode), r in res.items()]
    print(H.table(["step", "plain ms", "gt ms", "gt / plain", "largest difference"], rows,
                  "## AdamW step in a simulated world (plain torch over as many parameter copies as ranks)"))


def report(res) -> None:
    t = res["times"]
    rows = []
    for mode in ("foreach", "fused"):
        plain, gt_, via, dt, thin = (t[f"{k} {mode}"] for k in ("plain", "gt", "gt dispatcher", "dt", "thin"))
        rows.append([f"AdamW {mode}", H.fmt(plain), H.fmt(thin), H.fmt(gt_), H.fmt(via), H.fmt(dt),
                     f"{H.paired_ratio(thin, plain):.3f}x", f"{H.paired_ratio(gt_, plain):.3f}x",
                     f"{H.paired_ratio(via, plain):.3f}x", f"{H.paired_ratio(gt_, dt):.3f}x"])
    print(H.table(["step", "plain ms", "thin ms", "gt ms", "gt via dispatcher ms", "DTensor ms",
                   "thin / plain (floor)", "gt / plain", "via dispatcher / plain", "gt / DTensor"], rows,
                  f"## AdamW step over {res['params']} parameters ({res['numel']:,} elements), broadcast"))
    print("global ops one gt step dispatches: " + ", ".join(f"{mode} {n}" for mode, n in res["calls"].items()))
    print(f"largest difference from plain torch after the same steps: gt {res['max diff gt']:.2e}, "
          f"via dispatcher {res['max diff gt dispatcher']:.2e}, DTensor {res['max diff dt']:.2e}, "
          f"thin {res['max diff thin']:.2e}")
    worst = max(H.paired_ratio(t[f"gt {m}"], t[f"plain {m}"]) for m in ("foreach", "fused"))
    print(f"goal: gt <= 1.1x plain torch -> {'MET' if worst <= 1.1 else 'MISSED'} (worst {worst:.3f}x)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--embd", type=int, default=GPT_EMBD)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args(argv)
    print(H.header("optimizer"))
    report(H.spawn(_worker, args.nproc, args.quick, args.embd))
    report_sim(H.spawn(_worker_sim, 0, args.quick, args.embd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
