"""Run by tests/multiprocess/test_schedules_launched.py on N gloo processes, one pipeline stage each:
a chain of linear + tanh chunks (chunk c on rank c mod N), trained with AdamW and clip_grad_norm_
over every stage by ``gt.compile(micro_batches=2N, schedule=...)`` for each schedule named on the
command line, beside the same chain on plain tensors in this process. Every rank prints one
``GT {json}`` record per schedule: the largest difference of the loss and of its own weights."""
import json
import sys

import torch

import globaltensor as gt

B = gt.sbp.broadcast
WIDTH, ROWS, STEPS = 8, 16, 3


def run(schedule: str) -> dict:
    n = gt.world_size()
    chunks = 2 * n if schedule == "interleaved_1f1b" else n
    stages = [gt.placement("cpu", [r]) for r in range(n)]
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(WIDTH, WIDTH, generator=gen, dtype=torch.float64) / WIDTH ** 0.5 for _ in range(chunks)]
    ws = [gt.distribute(w, stages[c % n], B).requires_grad_() for c, w in enumerate(init)]
    ref = [w.clone().requires_grad_() for w in init]
    opts = torch.optim.AdamW(ws, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)

    def step(x, y, weights=ws, opt=opts[0], move=lambda t, c: t.to_global(placement=stages[c % n])):
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
        loss = g(gt.distribute(x, stages[0], B), gt.distribute(y, stages[(chunks - 1) % n], B)).full_tensor()
        loss_error = max(loss_error, (loss - step(x, y, ref, opts[1], lambda t, c: t)).abs().item())
    weight_error = max([(w.to_local() - r.detach()).abs().max().item() for w, r in zip(ws, ref)
                        if w.placement == stages[gt.rank()]] or [0.0])
    return {"schedule": schedule, "loss_error": loss_error, "weight_error": weight_error,
            "plan": g.plan.pipeline}


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print("GT " + json.dumps(run(name)), flush=True)
