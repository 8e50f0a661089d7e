"""Predicted against measured: ``plan.predict()``'s step time and peak memory per rank beside the same
step run and timed on gloo processes of this machine, ``gt.calibrate()``d.

    .venv/bin/python benchmarks/predict.py [--quick] [--only gpt-dp-2,llama-tp-2,...]

Each configuration runs in its own processes (one torch thread each). Every rank calibrates the
world (collectives, kernels, the host's seconds per global op), plans the model with
``gt.nn.auto_plan`` (AdamW's state) and takes the option of the configuration's layout -- data
parallel, Megatron, FSDP, ZeRO, sequence split, expert parallel, 2-D -- whatever the planner would
have chosen; it predicts that option's step (``plan.predict(option=)``), then lays the model out as
the option says and trains: forward, loss, backward, AdamW (ZeroOptimizer where the option splits
the state). The pipeline configuration cuts the GPT into one stage a process
(``gt.nn.pipeline_stages``), run eagerly, and predicts it with ``gt.nn.predict_step``.

- **Step time**: the median of rounds of steps, a round's time the slowest rank's.
- **Peak memory** per rank in training: the bytes of the parameters' pieces this rank holds (and of
  a ZeroOptimizer's shards of them, made with it), plus the highest point of the allocator's
  running total, over the total before the first step, in the steps after the first
  (torch.profiler's memory records: every allocation and free of the forwards, backwards and
  optimizer steps, with every thread's counted in the total, gloo's included). The first step
  makes the optimizer's state and the gradient buckets, which stay; each later one holds its
  activations beside them, and reaches the same peak. The most over the ranks.

The ratio columns are predicted / measured. Models: examples/gpt.py's GPT and transformers'
LlamaForCausalLM and MixtralForCausalLM (small configs, their own code; Mixtral's routing is
modelled as even, its real routing is its weights').
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

import _harness as H
from _allocator import allocator_peaks


@dataclass(frozen=True)
class Config:
    name: str
    model: str                    # "gpt", "llama", "mixtral"
    nproc: int
    roles: Tuple[str, ...]        # the option's role per placement axis
    zero: bool = False


CONFIGS = [
    Config("gpt-dp-2", "gpt", 2, ("data",)),
    Config("gpt-tp-2", "gpt", 2, ("tensor",)),
    Config("gpt-fsdp-2", "gpt", 2, ("fsdp",)),
    Config("gpt-zero-2", "gpt", 2, ("data",), zero=True),
    Config("gpt-seq-2", "gpt", 2, ("sequence",)),
    Config("mixtral-ep-2", "mixtral", 2, ("expert",)),
    Config("gpt-dp-4", "gpt", 4, ("data",)),
    Config("gpt-2d-4", "gpt", 4, ("data", "tensor")),
    Config("llama-dp-2", "llama", 2, ("data",)),
    Config("llama-tp-2", "llama", 2, ("tensor",)),
    Config("llama-fsdp-4", "llama", 4, ("fsdp",)),
    Config("gpt-pp-2", "gpt", 2, ("pipeline",)),
]

EMBD, LAYERS, HEADS, VOCAB, BATCH, SEQ = 128, 2, 4, 256, 8, 64
MEMORY_STEPS = 4          # the first makes the optimizer's state and the buckets; the rest are measured


def _model(kind: str):
    import torch
    torch.manual_seed(0)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=EMBD, intermediate_size=4 * EMBD, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
            attn_implementation="sdpa"))
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM
        return MixtralForCausalLM(MixtralConfig(
            vocab_size=VOCAB, hidden_size=EMBD, intermediate_size=2 * EMBD, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=HEADS, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=SEQ, attn_implementation="sdpa"))
    from gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD))


def _loss_step(kind: str):
    import torch.nn.functional as F
    if kind in ("llama", "mixtral"):
        def step(model, ids, targets):
            logits = model(input_ids=ids).logits
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return step
    return lambda model, ids, targets: model.loss(ids, targets)


def _resident(model, optimizer) -> int:
    """Bytes of the storages of this rank's parameter pieces, and of a ZeroOptimizer's shards of
    them (copies it makes when built, before the measured steps)."""
    import globaltensor as gt
    import globaltensor.nn as gnn
    tensors = list(model.parameters())
    if isinstance(optimizer, gnn.ZeroOptimizer):
        tensors += [s for s in map(optimizer.shard_of, model.parameters()) if s is not None]
    seen = {}
    for t in tensors:
        storage = (t.to_local() if isinstance(t, gt.GlobalTensor) else t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _worker(rank: int, world: int, cfg: Config, quick: bool):
    import torch
    import globaltensor as gt
    import globaltensor.nn as gnn

    sys.path.insert(0, "examples")
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets = torch.randint(0, VOCAB, (BATCH, SEQ))
    gt.calibrate(repeats=3 if quick else 5)
    ranks = list(range(world))
    placement = gt.placement("cpu", ranks if len(cfg.roles) == 1 else [ranks[:2], ranks[2:]])
    model = _model(cfg.model)
    loss_of = _loss_step(cfg.model)

    def step(model, ids, targets):
        loss_of(model, ids, targets).backward()
    if cfg.roles == ("pipeline",):     # one stage per rank, run eagerly: gt.nn.predict_step
        stages = [gt.placement("cpu", [r]) for r in ranks]
        gnn.pipeline_stages(model, stages)
        g_ids, g_targets = gt.distribute(ids, stages[0], gt.sbp.broadcast), gt.distribute(targets, stages[-1],
                                                                                         gt.sbp.broadcast)
        predicted = gnn.predict_step(model, (g_ids, g_targets), step=step, optimizer=torch.optim.AdamW)
        layout = f"pipeline stages ({len(stages)}, eager)"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        predicted, layout, opt, g_ids, g_targets = _planned(cfg, model, placement, ids, targets, step)

    def train():
        loss_of(model, g_ids, g_targets).backward()
        opt.step()

    def one_step():
        opt.zero_grad(set_to_none=True)
        train()
    peaks = allocator_peaks(one_step, MEMORY_STEPS)
    resident = _resident(model, opt)
    measured_memory = int(H.slowest(float(resident + max(peaks[1:]))))
    timing = H.timed(one_step, warmup=2, repeats=3 if quick else 7, inner=2 if quick else 4)
    return {"name": cfg.name, "layout": layout, "nproc": world,
            "predicted_s": predicted.seconds, "measured_s": float(timing),
            "predicted_memory": predicted.peak_memory, "measured_memory": measured_memory,
            "compute": predicted.compute, "communication": predicted.communication, "host": predicted.host}


def _planned(cfg: Config, model, placement, ids, targets, step):
    """The option of ``cfg``'s layout from ``auto_plan``, its prediction, and the model laid out by it:
    ``(prediction, layout name, optimizer, ids, targets)``."""
    import torch
    import globaltensor as gt
    import globaltensor.nn as gnn
    from globaltensor.nn.auto.plan import AutoPlan
    if cfg.model == "mixtral":         # HF's "eager" experts call nonzero, which has no meta kernel
        model.config._experts_implementation = "grouped_mm"
    planned = gnn.auto_plan(model, placement, (ids, targets), step=step, optimizer=torch.optim.AdamW)
    if cfg.model == "mixtral":
        model.config._experts_implementation = "eager"
    option = next(o for o in planned.options if o.candidate.roles == cfg.roles and o.candidate.zero == cfg.zero
                  and not o.candidate.vocab and not o.candidate.blocked and not o.candidate.balanced)
    plan = AutoPlan(placement, option, planned.options, None, None, planned.tokens, planned.dtype)
    predicted = plan.predict()
    gnn.distribute_module(model, placement, plan)
    if plan.expert_axis is not None:
        gnn.expert_parallel(model, placement, axis=plan.expert_axis)
    g_ids, g_targets = (gt.distribute(a, placement, nd) for a, nd in zip((ids, targets), plan.inputs))
    return predicted, option.candidate.name, plan.optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3), \
        g_ids, g_targets


def run(quick: bool = False, only: Optional[list] = None) -> list:
    return [H.spawn(_worker, cfg.nproc, cfg, quick) for cfg in CONFIGS if not only or cfg.name in only]


def report(results: list) -> str:
    rows = [[r["name"], r["layout"], r["nproc"], H.fmt(r["predicted_s"]), H.fmt(r["measured_s"]),
             f"{r['predicted_s'] / r['measured_s']:.2f}", f"{r['predicted_memory'] / 2 ** 20:.2f}",
             f"{r['measured_memory'] / 2 ** 20:.2f}", f"{r['predicted_memory'] / r['measured_memory']:.2f}",
             f"{H.fmt(r['compute'])} / {H.fmt(r['communication'])} / {H.fmt(r['host'])}"]
            for r in results]
    return H.table(["config", "layout", "procs", "predicted ms", "measured ms", "time ratio", "predicted MiB",
                    "measured MiB", "memory ratio", "compute / comm / host ms"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated config names")
    a = parser.parse_args()
    print(H.header("predict"))
    print(report(run(a.quick, [n for n in a.only.split(",") if n])))


if __name__ == "__main__":
    main()
