"""torch.compile on global tensors in a process world (2 gloo processes): the GPT's forward and backward
compile into one graph whose collectives are torch's functional collectives (``_c10d_functional``
ops, which Inductor can reorder), and equal the eager global run in float64 -- data parallel,
Megatron tensor parallel, Megatron-SP (its activation entries traced), and the sequence split with one head (ring attention: its key/value
blocks move as functional all-to-alls, plain and head-tail) -- and a conversion between placements,
whose send / recv is one functional all-to-all over its peers. Every rank compiles and runs the
same program."""
from __future__ import annotations

SCRIPT = r"""
import sys
import torch
import globaltensor as gt
import globaltensor.nn as gnn
from torch._functorch.aot_autograd import aot_module_simplified
sys.path.insert(0, EXAMPLES)
from gpt import GPT, GPTConfig, TENSOR_PARALLEL, make_batch

torch.set_default_dtype(torch.float64)
S, B = gt.sbp.split, gt.sbp.broadcast
CONFIGS = {"dp": GPTConfig(n_layer=1), "tp": GPTConfig(n_layer=1), "sp": GPTConfig(n_layer=1),
           "cp": GPTConfig(n_layer=1, n_head=1), "cp_ht": GPTConfig(n_layer=1, n_head=1)}
BATCH = {"dp": S(0), "tp": B, "sp": S(1), "cp": S(1), "cp_ht": S(1, order="head_tail")}
PLANS = {"tp": lambda: gnn.megatron_plan(**TENSOR_PARALLEL),
         "sp": lambda: gnn.megatron_plan(**TENSOR_PARALLEL, sequence_parallel=True)}
p = gt.placement("cpu", list(range(gt.world_size())))
targets = []

def backend(gm, example_inputs):
    def keep(g, _):
        targets.extend(str(n.target) for n in g.graph.nodes if n.op == "call_function")
        return g.forward
    return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

for layout, cfg in CONFIGS.items():
    torch.manual_seed(0)
    base = GPT(cfg)
    idx, tgt = make_batch(cfg, 8, 16, torch.Generator().manual_seed(1))
    models = []
    for _ in range(2):
        m = GPT(cfg)
        m.load_state_dict(base.state_dict())
        gnn.distribute_module(m, p, PLANS[layout]() if layout in PLANS else None)
        models.append(m)
    sbp = BATCH[layout]
    i, t = gt.distribute(idx, p, sbp), gt.distribute(tgt, p, sbp)
    targets.clear()
    want = models[0].loss(i, t)
    got = torch.compile(models[1].loss, fullgraph=True, backend=backend)(i, t)   # one graph, or it raises
    want.backward()
    got.backward()
    assert torch.equal(got.full_tensor(), want.full_tensor()), (layout, got.full_tensor(), want.full_tensor())
    for a, b in zip(models[1].parameters(), models[0].parameters()):
        diff = (a.grad.full_tensor() - b.grad.full_tensor()).abs().max().item()
        assert diff <= 1e-14, (layout, diff)
    functional = [x for x in targets if "_c10d_functional" in x]
    assert functional, (layout, sorted(set(targets)))
    print(f"ok {layout} {gt.rank()} collectives {sorted(set(functional))}")

# a conversion between placements moves pieces by send / recv: traced as a functional all-to-all
reversed_p = gt.placement("cpu", list(range(gt.world_size()))[::-1])
x, s0 = gt.distribute(torch.arange(24.0).reshape(8, 3), p, S(0)), S(0)
targets.clear()
moved = torch.compile(lambda x: x.to_global(placement=reversed_p, sbp=s0) * 2, fullgraph=True, backend=backend)(x)
assert moved.placement == reversed_p and torch.equal(moved.full_tensor(), torch.arange(24.0).reshape(8, 3) * 2)
assert any("all_to_all_single" in x for x in targets), sorted(set(targets))
print(f"ok across {gt.rank()}")
"""


def test_gpt_compiles_with_functional_collectives_on_two_processes(launch):
    import os
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
    job = launch(SCRIPT.replace("EXAMPLES", repr(examples)), 2, timeout=600)
    for layout in ("dp", "tp", "sp", "cp", "cp_ht", "across"):
        assert job.stdout.count(f"ok {layout} ") == 2, job.describe()
    # cp, cp_ht: the ring; sp: its reduce-scatters (an all-to-all and a local sum: comm/functional.py)
    assert job.stdout.count("_c10d_functional.all_to_all_single") == 6, job.describe()
