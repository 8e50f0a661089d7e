"""torchtitan's loss (bfloat16 logits cast to float, cross entropy, the logits let go, backward) on
2 gloo processes, each rank's peak read from the CPU allocator (torch.profiler's memory events): torch
over the whole vocabulary and this library's vocabulary-split loss hold ``LOSS_LOGITS_COPIES`` float32
logits a rank, DTensor's ``loss_parallel()`` ``DTENSOR_LOSS_LOGITS_COPIES`` -- the counts
``plan_at_scale``'s memory model takes for a loss (benchmarks/published_runs.py: DTensor's for
torchtitan's tensor-parallel runs)."""
from __future__ import annotations

from globaltensor.nn.auto.scale_model import DTENSOR_LOSS_LOGITS_COPIES, LOSS_LOGITS_COPIES

PROGRAM = r'''
import json
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import ProfilerActivity, profile
import globaltensor as gt

TOKENS, HIDDEN, VOCAB = 512, 16, 1024


def allocator_peak(step):
    """The most bytes the CPU allocator held at once beyond what it held before ``step()``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    now = top = 0
    for _, change in events:
        now += change
        top = max(top, now)
    return top


def titan_loss(x, w, labels):
    logits = x @ w.t()
    loss = F.cross_entropy(logits.float(), labels)
    del logits
    loss.backward()


def dtensor_loss(x, w, labels):
    with loss_parallel():
        titan_loss(x, w, labels)


world = gt.world_size()
mesh = init_device_mesh("cpu", (world,))
ranks = gt.placement("cpu", list(range(world)))
gen = torch.Generator().manual_seed(0)
h = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, generator=gen)
w = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16, generator=gen)
labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
logits_bytes = {"torch": TOKENS * VOCAB * 4, "globaltensor": TOKENS * VOCAB // world * 4,
                "dtensor": TOKENS * VOCAB // world * 4}
sides = {
    "torch": (titan_loss, h.clone().requires_grad_(), w.clone().requires_grad_(), labels),
    "globaltensor": (titan_loss, gt.distribute(h, ranks, gt.sbp.broadcast).requires_grad_(),
                     gt.distribute(w, ranks, gt.sbp.split(0)).requires_grad_(),
                     gt.distribute(labels, ranks, gt.sbp.broadcast)),
    "dtensor": (dtensor_loss, distribute_tensor(h, mesh, [Replicate()]).requires_grad_(),
                distribute_tensor(w, mesh, [Shard(0)]).requires_grad_(), labels),
}
out = {"rank": gt.rank()}
for name, (loss, x, w_, y) in sides.items():
    out[name] = allocator_peak(lambda: loss(x, w_, y)) / logits_bytes[name]
print("GT " + json.dumps(out))
'''


def test_dtensor_loss_parallel_holds_one_more_float32_logits_than_torch_and_this_library(launch):
    """Beside the logits-sized tensors only per-row ones are alive (row maxima and sums, targets,
    masks: a few bytes a row against a rank's 2,048 bytes of a row's float32 logits), hence 0.25."""
    for rec in launch(PROGRAM, 2).one_record_each((0, 1)):
        for name, copies in (("torch", LOSS_LOGITS_COPIES), ("globaltensor", LOSS_LOGITS_COPIES),
                             ("dtensor", DTENSOR_LOSS_LOGITS_COPIES)):
            assert copies <= rec[name] < copies + 0.25, (name, rec)
