"""torchtitan's loss on each rank's CPU allocator, three ways (tests/multiprocess/test_dtensor_loss_peak.py):
torch over the whole vocabulary, this library's vocabulary-split loss, DTensor's ``loss_parallel()``.
Each rank prints ``GT {json}``: each side's peak in float32 logits of its own."""
import json
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel
import globaltensor as gt
from allocator_peaks import allocator

TOKENS, HIDDEN, VOCAB = 512, 16, 1024


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
    out[name] = allocator(lambda: loss(x, w_, y))[0] / logits_bytes[name]
print("GT " + json.dumps(out))
