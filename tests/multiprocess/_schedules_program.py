"""Run by tests/multiprocess/test_schedules_launched.py on N gloo processes: a chain of linear + tanh
chunks (chunk c on stage c mod the stages; for zbv 2 per stage, down the stages and back up), trained with AdamW and clip_grad_norm_ over every stage
by ``gt.compile(micro_batches=..., schedule=...)`` for each schedule named on the command line,
beside the same chain on plain tensors in this process. ``--data-parallel``: stages of 2 ranks, the
batch split over them; else one rank per stage. ``--hf``: transformers' Llama (GQA, sdpa; its rotary
tables sent to every layer's stage) cut by ``gt.nn.pipeline_stages``, one rank per stage, its loss
beside the model's own on plain tensors. Every rank prints one ``GT {json}`` record per schedule:
the largest difference of the loss and of its own weights' pieces."""
import json
import sys

import torch

import globaltensor as gt

B, S = gt.sbp.broadcast, gt.sbp.split
WIDTH, ROWS, STEPS = 8, 16, 3


def run(schedule: str, data_parallel: bool) -> dict:
    per_stage = 2 if data_parallel else 1
    n = gt.world_size() // per_stage
    chunks = 2 * n if schedule in ("interleaved_1f1b", "zbv") else n
    stages = [gt.placement("cpu", list(range(s * per_stage, (s + 1) * per_stage))) for s in range(n)]
    at = [stages[min(c, chunks - 1 - c) if schedule == "zbv" else c % n] for c in range(chunks)]
    batch = S(0) if data_parallel else B
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(WIDTH, WIDTH, generator=gen, dtype=torch.float64) / WIDTH ** 0.5 for _ in range(chunks)]
    ws = [gt.distribute(w, at[c], B).requires_grad_() for c, w in enumerate(init)]
    ref = [w.clone().requires_grad_() for w in init]
    opts = torch.optim.AdamW(ws, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)

    def step(x, y, weights=ws, opt=opts[0], move=lambda t, c: t.to_global(placement=at[c], sbp=batch)):
        for c, w in enumerate(weights):
            x = torch.tanh(move(x, c) @ w)
        loss = ((x - move(y, chunks - 1)) ** 2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(weights, 0.5)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    g = gt.compile(step, micro_batches=2 * n, schedule=schedule)
    loss_error = 0.0
    for _ in range(STEPS):
        x, y = (torch.randn(ROWS, WIDTH, generator=gen, dtype=torch.float64) for _ in range(2))
        loss = g(gt.distribute(x, stages[0], batch), gt.distribute(y, at[-1], batch)).full_tensor()
        loss_error = max(loss_error, (loss - step(x, y, ref, opts[1], lambda t, c: t)).abs().item())
    mine = stages[gt.rank() // per_stage]
    weight_error = max([(w.to_local() - r.detach()).abs().max().item() for w, r in zip(ws, ref)
                        if w.placement == mine] or [0.0])
    return {"schedule": schedule, "loss_error": loss_error, "weight_error": weight_error,
            "plan": g.plan.pipeline}


def run_hf(schedule: str) -> dict:
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).double()
    reference = copy.deepcopy(model)
    stages = [gt.placement("cpu", [r]) for r in range(gt.world_size())]
    gt.nn.pipeline_stages(model, stages, chunks_per_stage=2 if schedule in ("interleaved_1f1b", "zbv") else 1,
                          v_shape=schedule == "zbv")
    opts = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(reference.parameters(), lr=1e-3)

    def step(ids, labels, m=model, opt=opts[0]):
        logits = m(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    g = gt.compile(step, micro_batches=4, schedule=schedule)
    gen = torch.Generator().manual_seed(0)
    loss_error = 0.0
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (8, 9), generator=gen)
        x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        head = model.lm_head.weight.placement                 # the last chunk's stage: the first under zbv
        loss = g(gt.distribute(x, stages[0], S(0)), gt.distribute(y, head, S(0))).full_tensor()
        loss_error = max(loss_error, (loss - step(x, y, reference, opts[1])).abs().item())
    return {"schedule": schedule, "loss_error": loss_error, "weight_error": 0.0, "plan": g.plan.pipeline}


if __name__ == "__main__":
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    for name in names:
        record = run_hf(name) if "--hf" in sys.argv else run(name, "--data-parallel" in sys.argv)
        print("GT " + json.dumps(record), flush=True)
