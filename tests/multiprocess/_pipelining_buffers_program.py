"""torch.distributed.pipelining's buffers on each rank's CPU allocator
(tests/multiprocess/test_pipelining_buffers.py): a chain of Linear chunks, ``M`` micro-batches of
``ROWS x D`` float32, under GPipe, 1F1B and interleaved 1F1B. Each rank prints ``GT {json}``: per
schedule, what a step leaves allocated (the buffers) and the highest total of the next step, in
micro-batch messages."""
import json
import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
import globaltensor as gt
from allocator_peaks import allocator
from globaltensor.nn.auto.scale_model import ScaleLayout, stage_chunks

ROWS, D, M = 4096, 64, 4     # M: test_pipelining_buffers.py's too

world, rank = gt.world_size(), gt.rank()
message = ROWS * D * 4
out = {"rank": rank}
for name, schedule, virtual in (("gpipe", ScheduleGPipe, 1), ("1f1b", Schedule1F1B, 1),
                                ("interleaved", ScheduleInterleaved1F1B, 2)):
    torch.manual_seed(0)
    chunks = stage_chunks(ScaleLayout(dp=1, pp=world, virtual=virtual), rank)[0]
    stages = [PipelineStage(nn.Linear(D, D, bias=False), c, world * virtual, torch.device("cpu")) for c in chunks]
    run = schedule(stages if virtual > 1 else stages[0], n_microbatches=M,
                   loss_fn=lambda y, target: ((y - target) ** 2).mean())
    x, y = torch.randn(ROWS * M, D), torch.randn(ROWS * M, D)

    def step():
        if rank == 0:
            run.step(x)
        else:
            run.step(target=y)
    _, kept = allocator(step)              # the first step makes the buffers
    top, _ = allocator(step)
    out[name] = {"kept": kept / message, "peak": (kept + top) / message}
print("GT " + json.dumps(out))
