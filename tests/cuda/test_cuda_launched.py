"""The CUDA lane's launched job (skipped without a GPU): one process with NCCL runs a compiled training
step on a cuda placement and exits 0 -- no stream thread left inside CUDA or NCCL at exit."""
from __future__ import annotations

PROGRAM = r'''
import torch
import globaltensor as gt

p = gt.placement("cuda", [0])
torch.manual_seed(0)
w = gt.distribute(torch.randn(16, 8, device="cuda"), p, gt.sbp.broadcast).requires_grad_()
opt = torch.optim.AdamW([w], lr=0.1)

def step(x):
    loss = (x @ w).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()

compiled = gt.compile(step)
for i in range(4):
    loss = compiled(gt.distribute(torch.randn(4, 16, device="cuda"), p, gt.sbp.broadcast))
print("GT done", loss.item())
'''


def test_a_compiled_cuda_process_exits_cleanly(launch):
    # check=True: a non-zero exit (SIGABRT at exit) fails here; a fresh interpreter ("spawn"), whose
    # exit runs the interpreter's finalization, where a forked rank ends by os._exit
    result = launch(PROGRAM, 1, start_method="spawn")
    assert any(line.startswith("GT done") for line in result.lines(0)), result.describe()
    assert "terminate called" not in result.output, result.describe()
