"""Global tensors to DTensor and back on launched gloo processes (2 or 4; tests/multiprocess/test_dtensor.py).

Every rank checks its own pieces against slices of a seeded float64 logical tensor, cut the
way each library cuts (balanced here, torch.chunk in DTensor, as DTensor's own
``distribute_tensor`` gives); a failed check raises, the launcher ends the job and the test
shows the output. Rank 0 prints ``DONE {json}`` with the number of checks run. The one argument
is a directory for checkpoints.

Layouts: every S(0)/S(1)/B/P on all ranks (shapes even and uneven: 6 rows over 4 ranks differ
between the styles), on a sub-mesh (ranks [1, 3] of 4, [1] of 2; 3x2), and on a 4-process world
every pair on the 2x2 mesh (6x5).
Then: storage shared where the styles agree, gradients through both conversions, a module
distributed by ``parallelize_module`` taken over by globaltensor and handed back, and DCP
checkpoints written by either library loaded by the other.
"""
import itertools
import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import globaltensor as gt
from launched_values import logical
from globaltensor.interop.chunk_layout import layouts_agree, piece_box
from globaltensor.interop.dtensor import mesh_of_placement

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
SBPS = [S(0), S(1), B, P]
SHAPES = [(8, 4), (6, 5), (3, 2)]
checks = 0


def check(ok, what):
    global checks
    checks += 1
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def block(x, placement, nd, style):
    """This rank's block of ``x`` cut in ``style`` (None outside the placement)."""
    if dist.get_rank() not in placement.rank_list():
        return None
    for d, (start, length) in enumerate(piece_box(tuple(x.shape), placement.hierarchy, nd,
                                                  placement.coord(dist.get_rank()), style)):
        x = x.narrow(d, start, length)
    return x


def dtensor_placements(nd):
    return [Shard(v.dim) if v.is_split else Replicate() if v.is_broadcast else Partial() for v in nd]


def round_trip(placement, nd, shape):
    x_full = logical(shape, dtype=torch.float64)
    tag = f"{placement} {nd} {shape}"
    # partial axes: one rank of each holds the value, the others zeros (B boxed to P)
    x = gt.distribute(x_full, placement, tuple(B if v.is_partial else v for v in nd)).to_global(sbp=nd)
    d = x.to_dtensor()
    member = dist.get_rank() in placement.rank_list()
    check(isinstance(d, DTensor) and list(d.placements) == dtensor_placements(nd), f"{tag}: placements {d.placements}")
    check(d.shape == x.shape and d.device_mesh.mesh.tolist() == placement.ranks.tolist(), f"{tag}: meta")
    if member:
        check(torch.equal(d.full_tensor(), x_full), f"{tag}: DTensor full_tensor")
        if not any(v.is_partial for v in nd):
            want = block(x_full, placement, nd, "chunk")
            theirs = distribute_tensor(x_full, d.device_mesh, dtensor_placements(nd)).to_local()
            check(torch.equal(d.to_local(), want) and torch.equal(theirs, want), f"{tag}: chunk-style piece")
        if layouts_agree(shape, placement.hierarchy, nd) and d.to_local().numel():
            check(d.to_local().data_ptr() == x.to_local().data_ptr(), f"{tag}: the piece is shared")
    y = gt.from_dtensor(d)
    check(y.placement == placement and y.sbp == nd and y.shape == x.shape, f"{tag}: from_dtensor meta {y.sbp}")
    if member:
        check(torch.equal(y.to_local(), x.to_local()), f"{tag}: round trip piece")
    check(torch.equal(y.full_tensor(), x_full), f"{tag}: round trip value")
    if member and not any(v.is_partial for v in nd):
        z = gt.from_dtensor(distribute_tensor(x_full, d.device_mesh, dtensor_placements(nd)))
        check(torch.equal(z.to_local(), block(x_full, placement, nd, "balanced")), f"{tag}: from distribute_tensor")


def given_mesh(placement):
    """``to_dtensor(mesh=)`` uses the user's mesh, and a mesh of other ranks is refused naming both."""
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", placement.ranks.tolist())
    x = gt.distribute(logical((6, 5), dtype=torch.float64), placement, S(0))
    check(x.to_dtensor(mesh=mesh).device_mesh is mesh, "to_dtensor(mesh=) uses that mesh")
    other = gt.distribute(logical((6, 5), dtype=torch.float64), gt.placement("cpu", [0]), B)
    try:
        other.to_dtensor(mesh=mesh)
        check(False, "a mesh of other ranks is accepted")
    except ValueError as e:
        check("they must be the same ranks" in str(e), f"the error names both: {e}")


def gradients(placement):
    """Uneven S(0) both ways: the gradient moves back through both repartitions."""
    x = gt.distribute(logical((6, 5), dtype=torch.float64), placement, S(0)).requires_grad_()
    weight = torch.arange(30.0, dtype=torch.float64).reshape(6, 5)
    (gt.from_dtensor(x.to_dtensor() * 2) * weight).sum().backward()
    check(torch.equal(x.grad.full_tensor(), 2 * weight), "gradient through to_dtensor and from_dtensor")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(5, 8, dtype=torch.float64)      # even: DTensor's own uneven TP breaks (from_local infers sizes)
        self.down = nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def module_takeover(placement):
    mesh = mesh_of_placement(placement)
    ref = MLP()
    model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = ref(x)
    check(torch.allclose(model(x), want, rtol=1e-12, atol=1e-12), "parallelize_module's model")
    gt.nn.from_dtensor_module(model)
    check(model.up.weight.sbp == (S(0),) and model.down.weight.sbp == (S(1),), "taken-over layouts")
    check(not model.up._forward_pre_hooks and not model.down._forward_hooks, "DTensor's hooks are off")
    out = model(gt.distribute(x, placement, B))
    check(torch.allclose(out.full_tensor(), want, rtol=1e-12, atol=1e-12), "globaltensor runs the model")
    out.sum().backward()
    ref(x).sum().backward()
    check(torch.allclose(model.up.weight.grad.full_tensor(), ref.up.weight.grad, rtol=1e-12, atol=1e-12),
          "its gradients")
    gt.nn.to_dtensor_module(model)
    check(isinstance(model.up.weight, DTensor) and model.up.weight.placements == (Shard(0),), "handed back")
    check(torch.allclose(model(x), want, rtol=1e-12, atol=1e-12), "DTensor runs it again, with its hooks")


def checkpoints_across_libraries(placement, path):
    """DCP writes both libraries' pieces by offset: a DTensor checkpoint (chunk-style offsets) loads
    into global tensors (balanced) and the other way round."""
    x_full = logical((6, 5), dtype=torch.float64)
    mesh = mesh_of_placement(placement)
    dcp.save({"w": distribute_tensor(x_full, mesh, [Shard(0)])}, checkpoint_id=f"{path}/from_dtensor")
    g = gt.zeros(6, 5, dtype=torch.float64, placement=placement, sbp=S(1))
    dcp.load({"w": g}, checkpoint_id=f"{path}/from_dtensor")
    check(torch.equal(g.full_tensor(), x_full), "a DTensor checkpoint loaded into a global tensor")
    dcp.save({"w": gt.distribute(x_full, placement, S(0))}, checkpoint_id=f"{path}/from_global")
    d = distribute_tensor(torch.zeros(6, 5, dtype=torch.float64), mesh, [Shard(0)])
    dcp.load({"w": d}, checkpoint_id=f"{path}/from_global")
    check(torch.equal(d.full_tensor(), x_full), "a globaltensor checkpoint loaded into a DTensor")


def main():
    n = dist.get_world_size()
    placements = [gt.placement("cpu", list(range(n))), gt.placement("cpu", [1, 3] if n == 4 else [1])]
    if n == 4:
        placements.append(gt.placement("cpu", [[0, 1], [2, 3]]))
    try:
        gt.zeros(4, placement=gt.placement("cpu", [1, 0]), sbp=S(0)).to_dtensor()
        check(False, "a mesh whose ranks do not ascend converts")
    except ValueError as e:
        check("do not ascend along mesh dim 0" in str(e), f"the error names the mesh dim: {e}")
    for placement, shapes in zip(placements, [SHAPES, SHAPES[-1:], SHAPES[1:2]]):
        for nd, shape in itertools.product(itertools.product(*[SBPS] * placement.ndim), shapes):
            round_trip(placement, nd, shape)
    given_mesh(placements[0])
    gradients(placements[0])
    module_takeover(placements[0])
    checkpoints_across_libraries(placements[0], sys.argv[1])
    if dist.get_rank() == 0:
        print("DONE " + json.dumps({"checks": checks, "ranks": n}), flush=True)


if __name__ == "__main__":
    gt.get_world()          # the process world: joins the launcher's process group
    main()
