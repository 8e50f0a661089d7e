"""The errors only a process world raises, on 2 launched ranks (tests/errors/test_process_errors.py).

Each step triggers one error of docs/errors.md and prints ``GT {"id", "type", "message"}`` on
the ranks that raise it; the ranks stay in step, so that the next one starts clean. The last
step leaves rank 1 out of a collective, so it runs under a short timeout.
"""
import json
import time

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

try:                                    # DTensor's shard orders came with torch 2.10
    from torch.distributed.tensor._dtensor_spec import ShardOrderEntry
except ImportError:
    ShardOrderEntry = None

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
me = gt.rank()
p = gt.placement("cpu", [0, 1])


def expect(entry, fn):
    try:
        fn()
    except Exception as e:
        print("GT " + json.dumps({"id": entry, "type": type(e).__name__, "message": str(e)}), flush=True)
    else:
        print("GT " + json.dumps({"id": entry, "type": None, "message": "no error"}), flush=True)


# pieces that do not follow the balanced split: 2 + 4 rows where S(0) gives 3 + 3
expect("to-global-pieces-not-balanced", lambda: torch.ones(2 + 2 * me, 3).to_global(placement=p, sbp=S(0)))

# a mapped function on a placement this rank is not in
outside = gt.placement("cpu", [0])


def f():
    return torch.zeros(1)


if me == 1:
    expect("local-map-outside-placement", lambda: gt.local_map(f, (), S(0), placement=outside)())

# a mapped function whose result's shape changes while its arguments' layouts stay
rows = [2]


def g(a):
    return a[:rows[0]]


g_mapped = gt.local_map(g, (S(0),), S(0))
g_mapped(gt.zeros(4, placement=p, sbp=S(0)))
rows[0] = 1
expect("local-map-result-shape-changed", lambda: g_mapped(gt.zeros(4, placement=p, sbp=S(0))))

# an op without a rule, on a placement this rank is not in
alone = gt.distribute(torch.arange(6.0).reshape(2, 3), gt.placement("cpu", [0]), B)
if me == 1:
    expect("fallback-outside-placement", lambda: torch.nonzero(alone))
else:
    torch.nonzero(alone)

x = gt.distribute(torch.arange(12.0).reshape(4, 3), p, S(0))
gt.set_check(True)
expect("check-plain-tensor", lambda: x + torch.full((4, 3), float(me)))     # a "broadcast" mask that differs
expect("check-different-steps", lambda: x.to_global(sbp=B) if me == 1 else x * 2)
gt.set_check(False)

# DTensor conversions (every rank calls them: DeviceMesh creation is collective)
descending = gt.distribute(torch.arange(12.0).reshape(4, 3), gt.placement("cpu", [1, 0]), S(0))
expect("dtensor-mesh-not-ascending", lambda: descending.to_dtensor())
expect("to-dtensor-mesh-differs", lambda: x.to_dtensor(mesh=DeviceMesh("cpu", [[0, 1]])))
expect("from-dtensor-placement",
       lambda: gt.from_dtensor(DTensor.from_local(torch.ones(2, 3), DeviceMesh("cpu", [0, 1]), [Partial("max")],
                                                  run_check=False)))
# dim 0 cut over mesh dim 1 first, then mesh dim 0 (a shard order DTensor's redistribute can produce)
if ShardOrderEntry is not None:
    reordered = DTensorSpec(DeviceMesh("cpu", [[0, 1]]), (Shard(0), Shard(0)),
                            TensorMeta(torch.Size([4, 3]), (3, 1), torch.float32),
                            shard_order=(ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),))
    expect("from-dtensor-shard-order",
           lambda: gt.from_dtensor(DTensor(torch.ones(2, 3), reordered, requires_grad=False)))

# a cuda placement on a node with fewer GPUs than processes (none at all without CUDA)
if me >= (torch.cuda.device_count() if torch.cuda.is_available() else 0):
    expect("process-cuda-devices", lambda: gt.zeros(4, placement=gt.placement("cuda", [0, 1]), sbp=S(0)))

gt.set_timeout(3)
if me == 0:
    expect("collective-did-not-arrive", lambda: x.numpy())    # rank 1 never calls it
else:
    time.sleep(5)
