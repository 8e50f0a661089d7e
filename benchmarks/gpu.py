"""The GPT training step on one GPU: plain torch, DTensor, globaltensor eager, compiled, and compiled
with CUDA graphs, and plain and global under torch.compile (needs CUDA).

    .venv/bin/python benchmarks/gpu.py [--quick]

One process, one GPU, a 1-rank placement (no communication: what each library adds to the same
step). Two sizes -- n_embd 256, 4 layers, batch 8 x 128, and n_embd 1024, 8 layers, batch 8 x 512 --
each a whole step with AdamW (torch's default on CUDA: foreach), then split into forward + backward
and the optimizer's step. Beside them, the same eager step on subclass_floor.py's *thin* wrapper
subclass (unwrap, call, rewrap; AdamW foreach): what torch charges any Python tensor subclass for
carrying each op into ``__torch_dispatch__``, the floor under globaltensor's and DTensor's eager
rows. Rounds interleaved, medians, CUDA synchronised around every call; the device's name heads the
table. Without CUDA it says so and measures nothing.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import _harness as H
from subclass_floor import thin_parameters, thin_training_class

SIZES = {"n_embd 256, 4 layers, batch 8x128": (256, 4, 8, 128), "n_embd 1024, 8 layers, batch 8x512": (1024, 8, 8, 512)}
SMALL, LARGE = "n_embd 256, 4 layers, batch 8x128", "n_embd 1024, 8 layers, batch 8x512"


def _worker(rank: int, world: int, quick: bool):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor, init_device_mesh
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from gpt import GPT, GPTConfig
    import globaltensor as gt

    if not torch.cuda.is_available():
        return {"device": None}
    Thin = thin_training_class()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{H.free_port()}", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    placement = gt.placement("cuda", [0])
    mesh = init_device_mesh("cuda", (1,))
    results = {"device": torch.cuda.get_device_name(0), "rows": {}}
    for label, (embd, layers, batch, seq) in SIZES.items():
        cfg = GPTConfig(vocab_size=512, block_size=seq, n_layer=layers, n_head=max(embd // 64, 1), n_embd=embd)
        torch.manual_seed(0)
        base = GPT(cfg).to(device)
        idx = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
        # tc_plain / tc_gt: the loss compiled with torch.compile (Inductor), the optimizer eager
        models = {k: GPT(cfg).to(device) for k in ("dt", "gt", "gtc", "gtg", "tc_plain", "tc_gt")}
        models = {"plain": base, **models}
        for m in list(models.values())[1:]:
            m.load_state_dict(base.state_dict())
        models["thin"] = thin_parameters(copy.deepcopy(base), Thin)
        distribute_module(models["dt"], mesh)                     # every parameter Replicate()
        for name in ("gt", "gtc", "gtg", "tc_gt"):
            gt.nn.distribute_module(models[name], placement)
        # foreach named for the thin side: torch's default takes it only for its listed tensor types
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, **({"foreach": True} if k == "thin" else {}))
                for k, m in models.items()}
        dt_idx = distribute_tensor(idx, mesh, [Replicate()])
        gt_idx = gt.distribute(idx, placement, gt.sbp.broadcast)
        inputs = {"plain": idx, "dt": dt_idx, "gt": gt_idx, "gtc": gt_idx, "gtg": gt_idx, "tc_plain": idx,
                  "tc_gt": gt_idx, "thin": Thin(idx)}
        losses = {k: torch.compile(m.loss) if k.startswith("tc_") else m.loss for k, m in models.items()}

        def fwd_bwd(k):
            losses[k](inputs[k], inputs[k]).backward()

        def step_fn(k):
            def step(i, t):
                loss = losses[k](i, t)
                loss.backward()
                opts[k].step()
                opts[k].zero_grad()
                return loss.detach()
            return step
        steps = {k: step_fn(k) for k in models}
        steps["gtc"] = gt.compile(steps["gtc"])
        steps["gtg"] = gt.compile(steps["gtg"], cuda_graphs=True)      # gtg: compiled, CUDA graphs replayed

        def synced(fn):
            def run():
                fn()
                torch.cuda.synchronize()
            return run
        reps = dict(warmup=3, repeats=3 if quick else 10, inner=2 if quick else 5, sync=False)
        whole = H.timed_many({k: synced(lambda k=k: steps[k](inputs[k], inputs[k])) for k in models}, **reps)
        parts = {f"{k} fwd+bwd": synced(lambda k=k: fwd_bwd(k)) for k in ("plain", "gt", "thin", "tc_plain", "tc_gt")}
        parts.update({f"{k} step": synced(opts[k].step) for k in ("plain", "gt", "thin")})
        split = H.timed_many(parts, **reps)
        results["rows"][label] = {**whole, **split}
    dist.destroy_process_group()
    return results


def report(res) -> None:
    if res["device"] is None:
        print("no CUDA device: the GPU rows are not measured")
        return
    rows, parts = [], []
    for label, t in res["rows"].items():
        rows.append([label, H.fmt(t["plain"]), H.fmt(t["thin"]), H.fmt(t["dt"]), H.fmt(t["gt"]), H.fmt(t["gtc"]),
                     H.fmt(t["gtg"]), H.ratio(t["thin"], t["plain"]), H.ratio(t["gt"], t["dt"]),
                     H.ratio(t["gtc"], t["plain"]), H.ratio(t["gtg"], t["plain"])])
        parts.append([label, H.fmt(t["plain fwd+bwd"]), H.fmt(t["thin fwd+bwd"]), H.fmt(t["gt fwd+bwd"]),
                      H.fmt(t["plain step"]), H.fmt(t["thin step"]), H.fmt(t["gt step"]),
                      H.ratio(t["thin step"], t["plain step"]), H.ratio(t["gt step"], t["plain step"])])
    print(H.table(["GPT", "plain ms", "thin ms", "DTensor ms", "gt eager ms", "gt compiled ms", "gt CUDA graphs ms",
                   "thin / plain (floor)", "gt eager / DTensor", "compiled / plain", "CUDA graphs / plain"], rows,
                  f"## GPT step with AdamW on {res['device']}, a 1-rank placement"))
    print(H.table(["GPT", "plain fwd+bwd", "thin fwd+bwd", "gt fwd+bwd", "plain AdamW step", "thin AdamW step",
                   "gt AdamW step", "thin / plain step (floor)", "gt / plain step"],
                  parts, "## forward + backward and the optimizer's step"))
    compiled = [[label, H.fmt(t["tc_plain"]), H.fmt(t["tc_gt"]), H.ratio(t["tc_gt"], t["tc_plain"]),
                 H.fmt(t["tc_plain fwd+bwd"]), H.fmt(t["tc_gt fwd+bwd"]), H.ratio(t["tc_gt fwd+bwd"], t["tc_plain fwd+bwd"])]
                for label, t in res["rows"].items()]
    print(H.table(["GPT", "plain step", "global step", "global / plain (goal <= 1.05x)", "plain fwd+bwd",
                   "global fwd+bwd", "global / plain"], compiled,
                  "## torch.compile (Inductor) of the loss, the optimizer eager: plain and global"))


# goal -> (what is measured, its peer, the sizes it is judged at, the most the ratio may be)
GOALS = {
    "gt eager step <= DTensor's": ("gt", "dt", tuple(SIZES), 1.0),
    "gt AdamW step <= 1.2x plain torch's": ("gt step", "plain step", tuple(SIZES), 1.2),
    "gt compiled step <= 1.05x plain torch at n_embd 1024": ("gtc", "plain", (LARGE,), 1.05),
    "gt compiled with CUDA graphs <= 0.7x plain torch eager at n_embd 256": ("gtg", "plain", (SMALL,), 0.7),
    "torch.compile global step <= 1.05x torch.compile plain": ("tc_gt", "tc_plain", tuple(SIZES), 1.05),
}


# a measured row's name in run_all.py's table
LABELS = {"plain": "plain", "dt": "DTensor", "tc_plain": "torch.compile plain", "plain step": "plain AdamW step",
          "thin": "thin subclass", "thin step": "thin subclass AdamW step"}

# goal -> the thin subclass's row over the same peer: the floor of any Python subclass under the goal
FLOORS = {"gt eager step <= DTensor's": "thin", "gt AdamW step <= 1.2x plain torch's": "thin step"}


def verdicts(res) -> list:
    """One line per goal: ``VERDICT met|short <goal> (<ratio at each size>)``, and where an eager
    subclass's floor bounds the goal, the thin subclass's ratio over the same peer."""
    if res["device"] is None:
        return [f"VERDICT not measured {goal} (no CUDA device)" for goal in GOALS]

    def ratios(key, peer, sizes) -> dict:
        return {size: res["rows"][size][key] / res["rows"][size][peer] for size in sizes}

    def shown(r: dict) -> str:
        return ", ".join(f"{size.split(',')[0]}: {v:.2f}x" for size, v in r.items())
    out = []
    for goal, (ours, peer, sizes, most) in GOALS.items():
        r = ratios(ours, peer, sizes)
        floor = f"; a thin subclass: {shown(ratios(FLOORS[goal], peer, sizes))}" if goal in FLOORS else ""
        out.append(f"VERDICT {'met' if all(v <= most for v in r.values()) else 'short'} {goal} ({shown(r)}{floor})")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH", help="also write the measured times (seconds) to PATH")
    args = ap.parse_args(argv)
    print(H.header("gpu"))
    res = H.spawn(_worker, 0, args.quick)
    report(res)
    print("\n".join(verdicts(res)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
